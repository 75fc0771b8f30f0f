"""The test-fault seam (``pipeline.faults``) on its own: inert without a plan, each hook's effect under one, a trial's
labels selecting its faults, and the plan crossing into the processes a launch starts."""

from __future__ import annotations

import json
import os

import pytest

from pipeline import faults

POINTS = {"trial_start": {"trial_id": "t", "labels": {}}, "step": {"epoch": 1, "step": 1, "rank": 0},
          "checkpoint": {"epoch": 1, "rank": 0}, "epoch_end": {"epoch": 1, "rank": 0}}


def test_without_a_plan_every_hook_is_inert(monkeypatch, tmp_path):
    monkeypatch.delenv(faults.ENV, raising=False)
    assert all(faults.hit(point, **where) is False for point, where in POINTS.items())
    assert faults.hit("no such hook") is False  # not even looked up: one dict lookup, nothing else
    assert faults.installed() is None and faults.carried() == {}
    assert faults.ENV not in os.environ  # trial_start wrote nothing


def test_each_hook_under_a_plan(install_faults):
    install_faults(crash_at_epoch=2, nan_at_epoch=3)
    assert [faults.hit("step", epoch=e, step=1, rank=r) for e in (2, 3) for r in (0, 1)] == [False, False, True, True]
    assert [faults.hit("checkpoint", epoch=e, rank=r) for e in (1, 2) for r in (0, 1)] == [False, False, True, False]
    assert faults.hit("epoch_end", epoch=1, rank=0) is False and faults.hit("epoch_end", epoch=2, rank=1) is False
    with pytest.raises(RuntimeError, match=r"^injected crash after epoch 2 \(TRANSFUSION_FAULT\)$"):
        faults.hit("epoch_end", epoch=2, rank=0)  # rank 0 only
    install_faults(nan_at_step=[2, 3])
    assert [s for e in (1, 2) for s in (1, 2, 3, 4) if faults.hit("step", epoch=e, step=s, rank=0)] == [3]
    with pytest.raises(ValueError, match="no fault hook 'nope'"):
        faults.hit("nope")


def test_a_plan_with_an_unknown_key_is_refused():
    with pytest.raises(ValueError, match=r"unknown keys \['crash_at'\]"):
        faults.environment(crash_at=2)
    assert json.loads(faults.environment(nan_at_step=(2, 3))[faults.ENV]) == {"nan_at_step": [2, 3]}


def test_trial_start_counts_and_scopes_the_trial_and_the_plan_crosses_processes(install_faults, tmp_path):
    log = tmp_path / "trials.log"
    install_faults(count_file=str(log), crash_at_epoch=1, trial={"row": "SupCon"})
    launched = faults.carried()  # what a driver hands its trials: the plan, no trial's labels yet
    assert faults.hit("checkpoint", epoch=1, rank=0) is False  # outside a trial: a scoped plan injects nothing
    faults.hit("trial_start", trial_id="a_00000", labels={"table": 2, "row": "SupCon"})
    assert faults.hit("checkpoint", epoch=1, rank=0) is True
    workers = faults.carried()  # what the trial hands its Ray Train workers: with its labels
    faults.adopt(launched)  # the next trial in the same process starts from the driver's plan
    faults.hit("trial_start", trial_id="a_00001", labels={"table": 1, "row": "SimCLR"})
    assert faults.hit("checkpoint", epoch=1, rank=0) is False
    faults.adopt(workers)
    assert faults.hit("checkpoint", epoch=1, rank=0) is True and faults.installed().labels["row"] == "SupCon"
    faults.adopt({})
    assert faults.installed() is None
    assert [line.split(" ", 1) for line in log.read_text().splitlines()] == [
        ["a_00000", '{"row": "SupCon", "table": 2}'], ["a_00001", '{"row": "SimCLR", "table": 1}']]


def test_a_slow_rank_sleeps_and_an_abort_aborts(install_faults, monkeypatch):
    import time

    slept, aborted = [], []
    monkeypatch.setattr(time, "sleep", slept.append)
    monkeypatch.setattr(os, "abort", lambda: aborted.append(1))
    install_faults(slow_rank=[1, 0.25], abort_at=[2, 3, 0], trial={"augment.strength": 1.0})
    assert faults.hit("step", epoch=1, step=1, rank=1) is False and slept == []  # out of scope: outside a trial
    faults.hit("trial_start", trial_id="t", labels={"augment.strength": 1.0})
    for epoch, step, rank in [(1, 1, 0), (1, 1, 1), (2, 3, 1), (2, 3, 0)]:
        assert faults.hit("step", epoch=epoch, step=step, rank=rank) is False
    assert slept == [0.25, 0.25] and aborted == [1]  # rank 1 at each step; rank 0 at epoch 2, step 3
    assert json.loads(faults.environment(abort_at=(2, 3, 0))[faults.ENV]) == {"abort_at": [2, 3, 0]}


def test_also_confines_each_plan_to_its_own_trial(install_faults, monkeypatch):
    """One sweep, two faults: the strength-1.0 trial slowed, the strength-0.0 one diverging at epoch 2."""
    import time

    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    install_faults(slow_rank=[1, 0.25], trial={"augment.strength": 1.0},
                   also=[{"nan_at_epoch": 2, "crash_at_epoch": 3, "trial": {"augment.strength": 0.0}}])
    launched = faults.carried()
    assert json.loads(launched[faults.ENV])["also"] == [
        {"nan_at_epoch": 2, "crash_at_epoch": 3, "trial": {"augment.strength": 0.0}}]
    assert not any(faults.hit("step", epoch=2, step=1, rank=r) for r in (0, 1)) and slept == []  # outside a trial
    faults.hit("trial_start", trial_id="slow", labels={"augment.strength": 1.0})
    assert [faults.hit("step", epoch=2, step=1, rank=r) for r in (0, 1)] == [False, False] and slept == [0.25]
    assert faults.hit("checkpoint", epoch=3, rank=0) is False
    faults.adopt(launched)
    faults.hit("trial_start", trial_id="bad", labels={"augment.strength": 0.0})
    assert [faults.hit("step", epoch=e, step=1, rank=1) for e in (1, 2)] == [False, True] and slept == [0.25]
    assert faults.hit("checkpoint", epoch=3, rank=0) is True
    with pytest.raises(ValueError, match=r"unknown keys \['nan'\]"):
        faults.environment(also=[{"nan": 2}])
