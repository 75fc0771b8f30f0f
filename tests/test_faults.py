"""The pipeline's public callback setting (``$TRANSFUSION_CALLBACKS``, ``pipeline.runs.job.load_callbacks``) with the
tests' fault plans (``tests.faults``): none installed without it, the callback made where the stage runs and reaching
a process that cannot import the tests, a reference that does not resolve named. What each fault does is seen where
it is used: the stages' tests (tests/stages/test_console.py, test_faults.py, test_sweep.py, test_pretrain.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pipeline.runs.job import CALLBACKS_ENV, load_callbacks
from tests import faults
from tests.conftest import ROOT
from tests.faults import FaultPlan


def test_without_the_setting_no_callback_is_installed(monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    monkeypatch.delenv(CALLBACKS_ENV, raising=False)
    assert load_callbacks() == [] and load_callbacks(" , ") == []
    with pytest.raises(ValueError, match=r"unknown keys \['crash_at'\]"):  # a plan the tests mistype is refused
        faults.environment(crash_at=2)


@pytest.mark.slow
def test_the_callback_is_made_in_the_driver_and_reaches_a_process_without_the_tests(monkeypatch, tmp_path):
    """``load_callbacks`` makes ``tests.faults:Faults`` where the stage runs (the plan read from its environment) and
    ships its module by value: a process that cannot import ``tests`` (a Ray worker on another node) still runs it."""
    import ray.cloudpickle

    for var, value in faults.environment(crash_at_epoch=2, trial={"train.batch_size": 32}).items():
        monkeypatch.setenv(var, value)
    (callback,) = load_callbacks()
    assert type(callback).__name__ == "Faults" and callback.plan == FaultPlan(crash_at_epoch=2,
                                                                              trial={"train.batch_size": 32})
    monkeypatch.delenv(faults.ENV)  # the plan now travels inside the callback, not in the environment
    (tmp_path / "callback.pkl").write_bytes(ray.cloudpickle.dumps(callback))
    script = f"""
import pickle, sys
sys.modules["tests"] = None  # as on a node without this repository's tests
from types import SimpleNamespace
from pipeline.config.params import load_params
from pipeline.training.loop import EpochMetrics
callback = pickle.loads(open({str(tmp_path / 'callback.pkl')!r}, "rb").read())
loop = SimpleNamespace(params=load_params({str(ROOT / 'params.yaml')!r}, ["train.batch_size=32"]), rank=0)
try:
    callback.on_epoch_end(loop, EpochMetrics(2, 1.0, 0.1, 1.0, 0.1, None, 1.0, 0.0))
except RuntimeError as exc:
    print(exc)
"""
    env = {k: v for k, v in os.environ.items() if k not in (faults.ENV, CALLBACKS_ENV)}
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == "injected crash after epoch 2 (tests.faults)", out.stderr[-2000:]


@pytest.mark.parametrize(("ref", "error"), [("tests.nope:Faults", "ModuleNotFoundError"),
                                             ("tests.faults:Nope", "AttributeError"),
                                             ("tests.faults:FaultPlan", "not a Callback subclass or instance")])
def test_a_callback_that_does_not_resolve_is_named(ref, error):
    from pipeline.config.base import ParamsError

    with pytest.raises(ParamsError, match=rf"^TRANSFUSION_CALLBACKS: '{ref}' .*{error}"):
        load_callbacks(f"{faults.REF}, {ref}")
