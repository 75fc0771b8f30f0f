"""Fault injection for tests: one seam, inert unless a test installs a plan.

The product calls named hook points, ``faults.hit(point, **where)``; a test installs a :class:`FaultPlan`, as JSON in
one environment variable, :data:`ENV`. With no plan installed a hook costs one dict lookup (``os.environ``) and
returns False, so the hooks can sit in the training step.

The hooks (where the product calls them; what they do under a plan):

=================  ===========================================  ===================================================
point              called by                                    under a plan
=================  ===========================================  ===================================================
``trial_start``    a Tune trial, before it trains               appends ``<trial_id> <labels as JSON>`` to
(trial_id,         (``pipeline.runs.tune.start_trial``)         ``count_file``; records the trial's ``labels`` (its
labels)                                                         point, or its row) in this process's plan, which its
                                                                Ray Train workers inherit
``step``           every rank, each step before the views       True, the caller feeds NaN inputs: every step of
(epoch, step,      (``pipeline.training.loop``)                 ``nan_at_epoch``, the step ``nan_at_step``; rank
rank)                                                           ``slow_rank[0]`` first sleeps ``slow_rank[1]`` s (the
                                                                other ranks wait for it inside the step's collectives);
                                                                at ``abort_at`` (epoch, step, rank) that rank calls
                                                                ``os.abort()``: a worker dying by SIGABRT mid-epoch,
                                                                with its native dump, as one killed in a collective
``checkpoint``     rank 0, before it reports an epoch with      True, the caller uploads the checkpoint before
(epoch, rank)      a checkpoint (``pipeline.runs.train``)       returning: a crash follows this epoch
``epoch_end``      every rank, after an epoch's report          rank 0 raises ``RuntimeError("injected crash after
(epoch, rank)      (``pipeline.training.loop``)                 epoch E (TRANSFUSION_FAULT)")`` at ``crash_at_epoch``
=================  ===========================================  ===================================================

Epochs and steps count from 1. A plan's ``trial`` (``{label: value}``) confines its training faults (NaN, crash) to
the Tune trials whose labels have those values (compared as text): ``{"train.batch_size": 32}`` in a sweep, ``{"row":
"SupCon"}`` in the tables job; outside a trial (``transfusion pretrain``) such a plan injects nothing. ``also`` holds
more plans, each confined by its own ``trial``: one sweep with a slowed trial and a diverging one.

Crossing processes: Ray starts its workers with the environment of its node, not the driver's, so a plan installed
in the driver travels with the work. :func:`carried` is what a launch passes on: the ``env_vars`` of a Ray Train
run's workers (``RunConfig.worker_runtime_env``), and the data every trial of a Tune job shares, which the trial
installs in its own process with :func:`adopt`. Tests install a plan with :func:`environment` (a subprocess's
environment, or ``monkeypatch.setenv`` through ``tests/conftest.py``'s ``install_faults`` fixture).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

ENV = "TRANSFUSION_FAULT"  # the plan, as JSON (FaultPlan's fields)


@dataclass(frozen=True)
class FaultPlan:
    """What to inject; every field optional (None: nothing of that kind)."""

    crash_at_epoch: int | None = None  # rank 0 raises after this epoch's report (its checkpoint uploaded first)
    nan_at_epoch: int | None = None  # every step of this epoch gets NaN inputs (the non-finite guard)
    nan_at_step: tuple[int, int] | None = None  # (epoch, step): that one step gets NaN inputs
    slow_rank: tuple[int, float] | None = None  # (rank, seconds): that rank sleeps before each step
    abort_at: tuple[int, int, int] | None = None  # (epoch, step, rank): that rank aborts (SIGABRT) before that step
    trial: dict[str, Any] | None = None  # the training faults only in the Tune trials with these labels
    count_file: str | None = None  # each trial start appends "<trial_id> <labels>" here
    labels: dict[str, Any] | None = None  # set by the trial_start hook: the labels of the trial running here
    also: tuple[FaultPlan, ...] | None = None  # more training faults, each plan with its own ``trial`` (one trial
    # slowed, another diverging, in one sweep); their count_file, labels and also are not read

    @classmethod
    def from_dict(cls, plan: dict[str, Any]) -> FaultPlan:
        """The plan of ``plan`` (JSON's values); a key it does not know is a ``ValueError`` naming it."""
        if not isinstance(plan, dict):
            raise ValueError(f"{ENV}: a fault plan is a JSON object, not {plan!r}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(plan) - set(known))
        if unknown:
            raise ValueError(f"{ENV}: unknown keys {unknown}; a fault plan has {known}")
        step, slow, abort = plan.get("nan_at_step"), plan.get("slow_rank"), plan.get("abort_at")
        also = plan.get("also")
        return cls(**{**plan, "nan_at_step": None if step is None else (int(step[0]), int(step[1])),
                      "slow_rank": None if slow is None else (int(slow[0]), float(slow[1])),
                      "abort_at": None if abort is None else (int(abort[0]), int(abort[1]), int(abort[2])),
                      "also": None if also is None else tuple(cls.from_dict(a) for a in also)})

    def to_json(self) -> str:
        return json.dumps(_dense(asdict(self)), sort_keys=True)

    def active(self) -> list[FaultPlan]:
        """The plans whose training faults apply in this process: this one and each of ``also`` in scope (with this
        plan's labels, the trial's)."""
        return [p for p in (self, *(replace(a, labels=self.labels) for a in self.also or ())) if p.in_scope()]

    def in_scope(self) -> bool:
        """Whether its training faults apply in this process: always without ``trial``; with it, in a trial whose
        recorded labels have every value it names."""
        if not self.trial:
            return True
        return self.labels is not None and all(str(self.labels.get(k)) == str(v) for k, v in self.trial.items())


_parsed: tuple[str, FaultPlan] | None = None  # the last plan read, by its JSON (hooks run once per training step)


def installed() -> FaultPlan | None:
    """The plan installed in this process, or None."""
    raw = os.environ.get(ENV)
    return _plan(raw) if raw else None


def _plan(raw: str) -> FaultPlan:
    global _parsed
    if _parsed is None or _parsed[0] != raw:
        _parsed = (raw, FaultPlan.from_dict(json.loads(raw)))
    return _parsed[1]


def hit(point: str, **where: Any) -> bool:
    """The hook ``point`` (see the module's table) with what identifies the moment (``epoch=3, rank=0``): whether
    the caller must inject its fault here. Without a plan: False, after one dict lookup."""
    raw = os.environ.get(ENV)
    if not raw:
        return False
    hook = _HOOKS.get(point)
    if hook is None:
        raise ValueError(f"no fault hook {point!r}; the hooks are {sorted(_HOOKS)}")
    return hook(_plan(raw), **where)


def _trial_start(plan: FaultPlan, *, trial_id: str, labels: dict[str, Any]) -> bool:
    if plan.count_file:
        with open(plan.count_file, "a") as f:
            f.write(f"{trial_id} {json.dumps(labels, sort_keys=True)}\n")
    os.environ[ENV] = replace(plan, labels=labels).to_json()  # this trial's, for its own hooks and its workers
    return False


def _dense(plan: dict[str, Any]) -> dict[str, Any]:
    """A plan's fields as JSON keeps them: without the unset ones, also in its ``also`` plans."""
    return {k: [_dense(a) for a in v] if k == "also" else v for k, v in plan.items() if v is not None}


def _step(plan: FaultPlan, *, epoch: int, step: int, rank: int) -> bool:
    nan = False
    for p in plan.active():
        if p.slow_rank is not None and p.slow_rank[0] == rank:
            time.sleep(p.slow_rank[1])
        if p.abort_at == (epoch, step, rank):
            os.abort()
        nan = nan or p.nan_at_epoch == epoch or p.nan_at_step == (epoch, step)
    return nan


def _checkpoint(plan: FaultPlan, *, epoch: int, rank: int) -> bool:
    return _crashes(plan, epoch, rank)


def _epoch_end(plan: FaultPlan, *, epoch: int, rank: int) -> bool:
    if _crashes(plan, epoch, rank):
        raise RuntimeError(f"injected crash after epoch {epoch} ({ENV})")
    return False


def _crashes(plan: FaultPlan, epoch: int, rank: int) -> bool:
    return rank == 0 and any(p.crash_at_epoch == epoch for p in plan.active())


_HOOKS = {"trial_start": _trial_start, "step": _step, "checkpoint": _checkpoint, "epoch_end": _epoch_end}


def carried() -> dict[str, str]:
    """What a launch carries to the processes it starts: ``{ENV: plan}``, or ``{}`` without a plan."""
    raw = os.environ.get(ENV)
    return {ENV: raw} if raw else {}


def adopt(env: dict[str, str]) -> None:
    """Install in this process what :func:`carried` returned in the launching one (``{}``: no plan here either)."""
    if env.get(ENV):
        os.environ[ENV] = env[ENV]
    else:
        os.environ.pop(ENV, None)


def environment(**plan: Any) -> dict[str, str]:
    """``{ENV: JSON}`` installing ``plan`` (:class:`FaultPlan`'s fields) in a process started with it; checked."""
    return {ENV: FaultPlan.from_dict(plan).to_json()}
