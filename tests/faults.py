"""The tests' fault plans: a loop callback (``pipeline.training.loop.Callback``) that injects faults into real training,
installed through the pipeline's public callback setting, ``$TRANSFUSION_CALLBACKS`` (``tests.faults:Faults``).

A test installs a plan with :func:`environment` (a subprocess's environment) or ``tests/conftest.py``'s
``install_faults`` fixture (this process's): the plan as JSON in :data:`ENV`, and :data:`REF` as the callback. The
stage's driver makes the callback (``pipeline.runs.job.load_callbacks``), which reads its plan there, and ships it to
every Ray Train worker and Tune trial with the run's spec; nothing of it is in ``pipeline/``.

What a plan does (every field optional; epochs and steps count from 1):

=================  ====================================================================================================
``crash_at_epoch``  rank 0 raises ``RuntimeError("injected crash after epoch E (tests.faults)")`` after that epoch's
                    report, once its checkpoint is persisted (Ray Train uploads it in the background)
``nan_at_epoch``    every step of that epoch gets NaN inputs (the non-finite guard)
``nan_at_step``     ``(epoch, step)``: that one step gets NaN inputs
``slow_rank``       ``(rank, seconds)``: that rank sleeps before each step (the others wait in the collectives)
``abort_at``        ``(epoch, step, rank)``: that rank calls ``os.abort()`` before that step: a worker dying by SIGABRT
                    mid-epoch, with its native dump, as one killed in a collective
``hold_at``         ``(epoch, step, rank)``: once the checkpoint of the epoch before is persisted, that rank writes its
                    pid to ``hold_file`` (atomically) and sleeps before that step until something kills it: a kill
                    from outside that lands mid-run for certain, at a known place. Not again once ``hold_file``
                    exists (the restarted run passes the same step); the epoch before must be a checkpointed one
``hold_file``       where ``hold_at`` writes the held process's pid
``trial``           ``{"train.batch_size": 32}``: the faults above only in the runs and trials whose params have these
                    values (compared as text)
``count_file``      rank 0 appends ``<trial id> <epochs done> <pid>`` when training starts (a pretraining run: its Ray
                    run name; the epochs a resumed run restored; its process)
``also``            more plans, each confined by its own ``trial``: one sweep with a slowed trial and a diverging one
=================  ====================================================================================================
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from pipeline.config.base import flatten
from pipeline.io import atomic_path
from pipeline.runs.job import CALLBACKS_ENV
from pipeline.runs.train import RECORD_FILE
from pipeline.training.loop import Callback, EpochMetrics, PretrainLoop

ENV = "TRANSFUSION_TEST_FAULTS"  # the plan, as JSON (FaultPlan's fields)
REF = "tests.faults:Faults"  # the callback, as $TRANSFUSION_CALLBACKS names it
ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT_WAIT_S = 600.0  # Ray runs its workers at nice 15 (worker_niceness): a loaded machine starves them
HOLD_S = 600.0  # a held rank that nothing killed by then fails its run


@dataclass(frozen=True)
class FaultPlan:
    """What to inject; every field optional (None: nothing of that kind). See the module's table."""

    crash_at_epoch: int | None = None
    nan_at_epoch: int | None = None
    nan_at_step: tuple[int, int] | None = None
    slow_rank: tuple[int, float] | None = None
    abort_at: tuple[int, int, int] | None = None
    hold_at: tuple[int, int, int] | None = None
    hold_file: str | None = None
    trial: dict[str, Any] | None = None
    count_file: str | None = None
    also: tuple[FaultPlan, ...] | None = None  # their count_file and also are not read

    @classmethod
    def from_dict(cls, plan: dict[str, Any]) -> FaultPlan:
        """The plan of ``plan`` (JSON's values); a key it does not know is a ``ValueError`` naming it."""
        if not isinstance(plan, dict):
            raise ValueError(f"{ENV}: a fault plan is a JSON object, not {plan!r}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(plan) - set(known))
        if unknown:
            raise ValueError(f"{ENV}: unknown keys {unknown}; a fault plan has {known}")
        step, slow, also = plan.get("nan_at_step"), plan.get("slow_rank"), plan.get("also")
        if plan.get("hold_at") is not None and not plan.get("hold_file"):
            raise ValueError(f"{ENV}: hold_at needs a hold_file")
        return cls(**{**plan, "nan_at_step": None if step is None else (int(step[0]), int(step[1])),
                      "slow_rank": None if slow is None else (int(slow[0]), float(slow[1])),
                      **{k: None if plan.get(k) is None else tuple(int(v) for v in plan[k])
                         for k in ("abort_at", "hold_at")},
                      "also": None if also is None else tuple(cls.from_dict(a) for a in also)})

    def to_json(self) -> str:
        return json.dumps(_dense(asdict(self)), sort_keys=True)

    def in_scope(self, params: dict[str, Any]) -> bool:
        """Whether its faults apply to a run of ``params`` (flat: ``{"train.batch_size": 32, ...}``)."""
        return all(str(params.get(k)) == str(v) for k, v in (self.trial or {}).items())


def _dense(plan: dict[str, Any]) -> dict[str, Any]:
    """A plan's fields as JSON keeps them: without the unset ones, also in its ``also`` plans."""
    return {k: [_dense(a) for a in v] if k == "also" else v for k, v in plan.items() if v is not None}


class Faults(Callback):
    """The plan of :data:`ENV` (read where the callback is made: the driver), injected on every rank."""

    def __init__(self, plan: FaultPlan | None = None) -> None:
        raw = os.environ.get(ENV)
        self.plan = plan if plan is not None else FaultPlan.from_dict(json.loads(raw)) if raw else FaultPlan()
        self._scoped: tuple[int, list[FaultPlan]] | None = None  # (id of the loop's params, the plans in scope)

    def active(self, loop: PretrainLoop) -> list[FaultPlan]:
        """This plan and each of ``also`` whose ``trial`` the loop's params match."""
        if self._scoped is None or self._scoped[0] != id(loop.params):
            params = flatten(loop.params)
            self._scoped = (id(loop.params), [p for p in (self.plan, *(self.plan.also or ())) if p.in_scope(params)])
        return self._scoped[1]

    def on_train_start(self, loop: PretrainLoop) -> None:
        if self.plan.count_file and loop.rank == 0:
            with open(self.plan.count_file, "a") as f:
                f.write(f"{run_id()} {loop.epoch} {os.getpid()}\n")

    def on_step_start(self, loop: PretrainLoop, epoch: int, step: int, x: torch.Tensor) -> torch.Tensor | None:
        nan = False
        for p in self.active(loop):
            if p.slow_rank is not None and p.slow_rank[0] == loop.rank:
                time.sleep(p.slow_rank[1])
            if p.abort_at == (epoch, step, loop.rank):
                os.abort()
            if p.hold_at == (epoch, step, loop.rank) and not Path(p.hold_file).exists():
                hold(epoch - 1, Path(p.hold_file))
            nan = nan or p.nan_at_epoch == epoch or p.nan_at_step == (epoch, step)
        return x * float("nan") if nan else None

    def on_epoch_end(self, loop: PretrainLoop, metrics: EpochMetrics) -> None:
        if loop.rank == 0 and any(p.crash_at_epoch == metrics.epoch for p in self.active(loop)):
            wait_for_checkpoint(metrics.epoch)
            raise RuntimeError(f"injected crash after epoch {metrics.epoch} (tests.faults)")


def run_id() -> str:
    """The Tune trial this runs in (its id), or the Ray Train run (its name; a trial's ``trial-<id>``: the id)."""
    import warnings

    from ray import tune

    with warnings.catch_warnings():  # Ray warns when asked outside a Tune trial, and answers None
        warnings.simplefilter("ignore")
        trial = tune.get_context().get_trial_id()
    if trial:
        return trial
    import ray.train

    try:
        return ray.train.get_context().get_experiment_name().removeprefix("trial-")
    except RuntimeError:  # no Ray at all
        return "-"


def wait_for_checkpoint(epoch: int) -> None:
    """In a Ray Train worker: until Ray's latest reported checkpoint holds ``epoch`` (rank 0's checkpoints upload in the
    background), so that a crash follows a persisted checkpoint. Elsewhere (a Tune trial persists its checkpoint
    before ``report`` returns; no Ray at all) nothing to wait for."""
    import ray.train

    try:
        ray.train.get_context()
    except (RuntimeError, DeprecationWarning):  # not a Ray Train worker
        return
    deadline = time.monotonic() + CHECKPOINT_WAIT_S
    while time.monotonic() < deadline:
        checkpoint = ray.train.get_checkpoint()
        if checkpoint is not None:
            with checkpoint.as_directory() as d:
                record = json.loads(Path(d, RECORD_FILE).read_text())
            if int(record["epoch"]) >= epoch:
                return
        time.sleep(0.05)
    raise AssertionError(f"the checkpoint of epoch {epoch} was not persisted in {CHECKPOINT_WAIT_S:.0f} s")


def hold(checkpointed: int, pid_file: Path) -> None:
    """After the checkpoint of epoch ``checkpointed`` is persisted: this process's pid to ``pid_file`` (atomically),
    then sleep until killed."""
    wait_for_checkpoint(checkpointed)
    with atomic_path(pid_file) as part:
        part.write_text(f"{os.getpid()}\n")
    time.sleep(HOLD_S)
    raise AssertionError(f"held for {HOLD_S:.0f} s before the step and never killed (tests.faults hold_at)")


def environment(**plan: Any) -> dict[str, str]:
    """The environment that installs ``plan`` (:class:`FaultPlan`'s fields, checked) in a stage started with it: the
    plan, the callback, and this repository on ``PYTHONPATH`` (the stage's driver imports ``tests.faults``)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {ENV: FaultPlan.from_dict(plan).to_json(), CALLBACKS_ENV: REF, "PYTHONPATH": path}
