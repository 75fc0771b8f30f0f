"""The public API, ``from pipeline import ...``: what it exports, that each name is its defining module's object, and
that the exports load lazily (a config import pulls in neither torch nor the model)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import pipeline
from tests.conftest import ROOT

# the API, name -> the module that defines it: changing what users import is a decision, made here too
API = {
    **dict.fromkeys(("TransFusionBlock", "TransFusionHead", "HeadOutput", "TransFusion", "build_model", "ABCModel"),
                    "pipeline.core.model"),
    "fuse_rows": "pipeline.core.attention",
    **dict.fromkeys(("make_loss", "LOSS_NAMES", "jsd", "jsd_appendix_e", "kl_softmax", "kl_relu", "kl_squared",
                     "infonce", "supcon", "dcl", "barlow_twins"), "pipeline.core.losses"),
    **dict.fromkeys(("ABCHead", "bce"), "pipeline.core.abc"),
    **dict.fromkeys(("cluster_kernel", "eigengap_k", "cluster"), "pipeline.core.clustering"),
    **dict.fromkeys(("target_affinity", "self_supervised_ids"), "pipeline.core.targets"),
    **dict.fromkeys(("GlobalBatchStep", "NonFiniteLossError", "broadcast_from_rank0"), "pipeline.training.step"),
    "Callback": "pipeline.training.loop",
    **dict.fromkeys(("Params", "load_params", "validate_params"), "pipeline.config.params"),
    "ParamsError": "pipeline.config.base",
    **dict.fromkeys(("DataConfig", "SyntheticConfig"), "pipeline.config.data"),
    **dict.fromkeys(("ModelConfig", "AbcConfig"), "pipeline.config.model"),
    "LossConfig": "pipeline.config.loss", "AugmentConfig": "pipeline.config.augment",
    "TrainConfig": "pipeline.config.train", "ProbeConfig": "pipeline.config.probe", "RayConfig": "pipeline.config.ray",
    "SweepConfig": "pipeline.config.sweep", "TheoryConfig": "pipeline.config.theory",
    "TablesConfig": "pipeline.config.tables", "SetsConfig": "pipeline.config.sets",
}


def test_all_is_the_api_without_duplicates():
    assert len(pipeline.__all__) == len(set(pipeline.__all__))
    assert set(pipeline.__all__) == set(API)
    assert set(pipeline.__all__) <= set(dir(pipeline))


@pytest.mark.parametrize("name", sorted(API))
def test_each_name_is_the_object_of_its_defining_module(name):
    value = getattr(pipeline, name)
    assert value is getattr(importlib.import_module(API[name]), name)
    if hasattr(value, "__qualname__"):  # a class or function: defined there, not imported there from elsewhere
        assert value.__module__ == API[name]
    assert getattr(pipeline, name) is value  # kept after the first access


def test_star_import_gives_the_api():
    namespace: dict[str, object] = {}
    exec("from pipeline import *", namespace)  # noqa: S102 - the statement under test
    assert set(namespace) - {"__builtins__"} == set(API)


def test_every_loss_is_exported_by_its_name():
    assert set(pipeline.LOSS_NAMES) <= set(pipeline.__all__)
    for name in pipeline.LOSS_NAMES:
        assert pipeline.make_loss(name).func is getattr(pipeline, name)


def test_every_section_of_params_is_exported():
    sections = {field.annotation for field in pipeline.Params.model_fields.values()}
    assert sections <= {getattr(pipeline, n) for n in pipeline.__all__}, sections


def test_an_unknown_name_is_an_attribute_error_naming_the_module():
    with pytest.raises(AttributeError, match=r"^module 'pipeline' has no attribute 'TransFusionHeadd'$"):
        pipeline.TransFusionHeadd  # noqa: B018 - the access under test
    with pytest.raises(ImportError, match="cannot import name 'nope' from 'pipeline'"):
        exec("from pipeline import nope", {})  # noqa: S102
    assert not hasattr(pipeline, "_private")


def test_subpackages_still_import_through_the_package():
    from pipeline import core, training

    assert core is importlib.import_module("pipeline.core")
    assert pipeline.GlobalBatchStep is training.step.GlobalBatchStep  # the export imports the module first


LAZY = """
import sys
import pipeline.config.data
assert 'torch' not in sys.modules, 'import pipeline.config.data imported torch'
from pipeline import Params, ModelConfig, LossConfig, TrainConfig, DataConfig, load_params
assert 'torch' not in sys.modules, 'the configs imported torch'
assert 'pipeline.core.model' not in sys.modules
params = load_params(sys.argv[1])
assert isinstance(params, Params) and isinstance(params.model, ModelConfig)
import pipeline
head = pipeline.TransFusionHead(8, depth=1)
assert 'pipeline.core.model' in sys.modules and 'pipeline.training.step' not in sys.modules
print(sorted({m.split('.')[0] for m in sys.modules} & {'ray', 'mlflow', 'dvc', 'click'}))
"""


@pytest.mark.slow
def test_exports_load_lazily_in_a_fresh_interpreter():
    out = subprocess.run([sys.executable, "-c", LAZY, str(ROOT / "params.yaml")], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
