"""The tests' fault plans (``tests.faults``) on their own: each fault's effect, a plan confined to the runs of some
params, a plan with an unknown key refused, and the plan reaching the processes a launch starts through the pipeline's
public callback setting (``$TRANSFUSION_CALLBACKS``, ``pipeline.runs.job.load_callbacks``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from pipeline.config.params import load_params
from pipeline.runs.job import CALLBACKS_ENV, load_callbacks
from pipeline.training.loop import EpochMetrics
from tests import faults
from tests.conftest import ROOT
from tests.faults import FaultPlan, Faults

POINT = ["model.depth=1", "train.batch_size=32", "augment.strength=0.0"]


def run(*overrides: str, rank: int = 0) -> SimpleNamespace:
    """What a fault reads of a loop: its params and its rank."""
    return SimpleNamespace(params=load_params(ROOT / "params.yaml", [*POINT, *overrides]), rank=rank)


def metrics(epoch: int) -> EpochMetrics:
    return EpochMetrics(epoch=epoch, loss=1.0, lr=0.1, samples_per_s=1.0, view_noise=0.1, knn_acc=None, seconds=1.0,
                        ended_at=0.0)


def nan_at(plan: FaultPlan, loop: SimpleNamespace, epoch: int, step: int) -> bool:
    """Whether the plan feeds that step NaN inputs (else it keeps them: None)."""
    out = Faults(plan).on_step_start(loop, epoch, step, torch.ones(2, 3))
    assert out is None or out.shape == (2, 3)
    return out is not None and bool(torch.isnan(out).all())


def crashes(plan: FaultPlan, loop: SimpleNamespace, epoch: int) -> bool:
    try:
        Faults(plan).on_epoch_end(loop, metrics(epoch))
    except RuntimeError as exc:
        assert str(exc) == f"injected crash after epoch {epoch} (tests.faults)"
        return True
    return False


def test_without_a_plan_nothing_is_injected_and_no_callback_is_installed(monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    monkeypatch.delenv(CALLBACKS_ENV, raising=False)
    assert load_callbacks() == [] and load_callbacks(" , ") == []
    inert, loop = Faults(), run()
    assert inert.plan == FaultPlan()
    assert not any(nan_at(inert.plan, loop, e, s) for e in (1, 2) for s in (1, 2)) and not crashes(inert.plan, loop, 1)


def test_each_fault_on_its_epoch_step_and_rank():
    plan = FaultPlan(crash_at_epoch=2, nan_at_epoch=3)
    assert [nan_at(plan, run(rank=r), e, 1) for e in (2, 3) for r in (0, 1)] == [False, False, True, True]
    assert [crashes(plan, run(rank=r), e) for e in (1, 2) for r in (0, 1)] == [False, False, True, False]  # rank 0
    one_step = FaultPlan(nan_at_step=(2, 3))
    assert [(e, s) for e in (1, 2) for s in (1, 2, 3, 4) if nan_at(one_step, run(), e, s)] == [(2, 3)]


def test_a_plan_with_an_unknown_key_is_refused():
    with pytest.raises(ValueError, match=r"unknown keys \['crash_at'\]"):
        faults.environment(crash_at=2)
    with pytest.raises(ValueError, match=r"unknown keys \['nan'\]"):
        faults.environment(also=[{"nan": 2}])
    env = faults.environment(nan_at_step=(2, 3))
    assert json.loads(env[faults.ENV]) == {"nan_at_step": [2, 3]} and env[CALLBACKS_ENV] == faults.REF
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)


def test_a_plan_selects_the_runs_whose_params_it_names():
    def fault(plan: dict, *overrides: str) -> str | None:
        """The fault that fires in a run of these params: "nan@2", "crash@1" or None."""
        p, loop = FaultPlan.from_dict(plan), run(*overrides)
        return "nan@2" if nan_at(p, loop, 2, 1) else "crash@1" if crashes(p, loop, 1) else None

    assert fault({}) is None
    assert fault({"nan_at_epoch": 2}) == "nan@2"
    assert fault({"nan_at_epoch": 2, "trial": {"train.batch_size": 32}}) == "nan@2"
    assert fault({"nan_at_epoch": 2, "trial": {"train.batch_size": 64}}) is None
    assert fault({"nan_at_epoch": 2, "trial": {"train.batch_size": 32, "augment.strength": 1.0}}) is None
    supcon = {"crash_at_epoch": 1, "trial": {"loss.name": "supcon", "train.mode": "supervised"}}  # a tables row's
    assert fault(supcon, "loss.name=supcon", "train.mode=supervised") == "crash@1" and fault(supcon) is None


def test_a_slow_rank_sleeps_and_an_abort_aborts(monkeypatch):
    import time

    slept, aborted = [], []
    monkeypatch.setattr(time, "sleep", slept.append)
    monkeypatch.setattr(os, "abort", lambda: aborted.append(1))
    plan = FaultPlan.from_dict({"slow_rank": [1, 0.25], "abort_at": [2, 3, 0], "trial": {"augment.strength": 1.0}})
    assert not nan_at(plan, run(rank=1), 1, 1) and slept == []  # out of scope: strength 0.0
    for epoch, step, rank in [(1, 1, 0), (1, 1, 1), (2, 3, 1), (2, 3, 0)]:
        assert not nan_at(plan, run("augment.strength=1.0", rank=rank), epoch, step)
    assert slept == [0.25, 0.25] and aborted == [1]  # rank 1 at each step; rank 0 at epoch 2, step 3
    assert json.loads(faults.environment(abort_at=(2, 3, 0))[faults.ENV]) == {"abort_at": [2, 3, 0]}


def test_a_hold_writes_its_pid_then_sleeps_once_and_needs_a_file(monkeypatch, tmp_path):
    """Outside Ray there is no checkpoint to wait for; the pid file appears whole, and a second pass (the restarted
    run) does not hold again."""
    import time

    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    pid_file = tmp_path / "held"
    plan = FaultPlan.from_dict({"hold_at": [3, 2, 0], "hold_file": str(pid_file)})
    with pytest.raises(AssertionError, match="never killed"):  # the sleep is patched out: nothing killed it
        nan_at(plan, run(), 3, 2)
    assert slept == [faults.HOLD_S] and pid_file.read_text() == f"{os.getpid()}\n"
    assert list(tmp_path.iterdir()) == [pid_file]  # no partial file left
    for epoch, step, rank in [(3, 2, 0), (3, 1, 0), (2, 2, 0)]:
        assert not nan_at(plan, run(rank=rank), epoch, step)
    assert slept == [faults.HOLD_S]  # held once
    assert not nan_at(FaultPlan(hold_at=(3, 2, 0), hold_file=str(pid_file)), run(rank=1), 3, 2)  # another rank
    with pytest.raises(ValueError, match="hold_at needs a hold_file"):
        faults.environment(hold_at=(3, 2, 0))


def test_also_confines_each_plan_to_its_own_runs(monkeypatch):
    """One sweep, two faults: the strength-1.0 trial slowed, the strength-0.0 one diverging at epoch 2."""
    import time

    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    plan = FaultPlan.from_dict({"slow_rank": [1, 0.25], "trial": {"augment.strength": 1.0},
                                "also": [{"nan_at_epoch": 2, "crash_at_epoch": 3, "trial": {"augment.strength": 0.0}}]})
    assert json.loads(plan.to_json())["also"] == [{"nan_at_epoch": 2, "crash_at_epoch": 3,
                                                   "trial": {"augment.strength": 0.0}}]
    slow, bad = "augment.strength=1.0", "augment.strength=0.0"
    assert [nan_at(plan, run(slow, rank=r), 2, 1) for r in (0, 1)] == [False, False] and slept == [0.25]
    assert not crashes(plan, run(slow), 3)
    assert [nan_at(plan, run(bad, rank=1), e, 1) for e in (1, 2)] == [False, True] and slept == [0.25]
    assert crashes(plan, run(bad), 3)


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
