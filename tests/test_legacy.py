"""Models pickled before ``pipeline/`` had floors (MLflow's ``log_model`` pickles the model) still load."""

from __future__ import annotations

import importlib
import pickle
import subprocess
import sys

import pytest
import torch

from pipeline import legacy
from pipeline.config.model import ModelConfig
from pipeline.core import backbones, batchnorm, model
from tests.conftest import ROOT

OLD = {model: "pipeline.model", backbones: "pipeline.backbones", batchnorm: "pipeline.batchnorm"}


def test_each_old_path_is_the_module_that_now_holds_its_code():
    for old, new in legacy.OLD_PATHS.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("pipeline.no_such_module")


@pytest.mark.slow  # a fresh interpreter
def test_a_model_pickled_under_the_old_paths_loads_in_a_fresh_interpreter(tmp_path):
    """The model's classes are pickled under their old module paths (as before the move: ``__module__`` set back
    for the dump), then loaded by a new interpreter that knows only the new layout and ``import pipeline``."""
    net = batchnorm.convert_batchnorm(model.build_model(ModelConfig(backbone="resnet18_cifar", depth=2), (3, 8, 8)))
    classes = {c for m in net.modules() for c in type(m).__mro__ if c.__module__ in {k.__name__ for k in OLD}}
    assert {"TransFusion", "TransFusionHead", "TransFusionBlock"} <= {c.__name__ for c in classes}
    saved = {c: c.__module__ for c in classes}
    try:
        for c in classes:
            c.__module__ = next(v for k, v in OLD.items() if k.__name__ == saved[c])
        blob = pickle.dumps(net)
    finally:
        for c, name in saved.items():
            c.__module__ = name
    assert b"pipeline.model" in blob and b"pipeline.core.model" not in blob
    (tmp_path / "old.pkl").write_bytes(blob)
    torch.save(net.state_dict(), tmp_path / "state.pt")
    probe = ("import pickle, sys, torch\n"
             f"net = pickle.loads(open({str(tmp_path / 'old.pkl')!r}, 'rb').read())\n"
             f"want = torch.load({str(tmp_path / 'state.pt')!r}, weights_only=True)\n"
             "got = net.state_dict()\n"
             "assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)\n"
             "print(type(net).__module__)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "pipeline.core.model"
