"""The Ray Tune machinery of the jobs whose trials pretrain, the sweep (``pipeline.runs.sweep``) and the paper's
tables (``pipeline.runs.tables``): a library both use, knowing neither.

- **A trial** (:func:`fit_trial`) runs the pretraining worker loop (``pipeline.runs.train.run_worker``) on the job's
  :class:`pipeline.runs.train.WorkerSpec` (shipped once to every trial by :func:`trainable`) with its own params. One
  worker (:func:`inline`) trains in the trial itself, reporting epochs and checkpoints to Tune (:class:`TuneSession`):
  a Ray Train run's start-up (about 25 s on 2 cores) would cost more than a small trial's training. Several workers
  are a ``TorchTrainer`` run named after the trial id, so that a restored job resumes each trial's own run;
  ``TuneReportCallback`` passes rank 0's metrics to Tune. A diverged trial raises ``TrialFailed``, and
  ``pipeline.runs.train.error_reason`` is the one line a failed trial's row and MLflow run show.
- **Resources**: a trial holds ``TRIAL_CPU`` and its workers' bundles (:func:`trial_placement`); :func:`max_concurrent`
  starts as many at once as the cluster's limiting resource holds; Tune and Ray Train hold the rest pending.
- **Tracking and progress**: :class:`TrialTracker`, the driver-side Tune callback each job subclasses: a line per
  trial event, MLflow from the driver only (the job's ``pipeline.runs.train.mlflow_run``, a child per trial), so
  trials never contend for the sqlite store.
- **The job**: :func:`tune_job` runs it, or restores an interrupted one (finished trials kept, unfinished ones
  resumed from their checkpoints, the same MLflow runs continued); :func:`checkpoint_history` reads a trial's epochs
  back from its last checkpoint; :func:`finish_tracking` and ``pipeline.runs.train.cleanup`` end it.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ray import tune

from pipeline.config.names import point_label
from pipeline.config.params import Params
from pipeline.config.ray import TRIAL_CPU
from pipeline.config.resources import TrialShape, trials_at_once
from pipeline.config.space import describe, point_of
from pipeline.runs import tracking as trk
from pipeline.runs.cluster import TRIAL_CONSOLE_LEVEL
from pipeline.runs.storage import STATUS_FILE, clear_status, is_uri, join, read_json
from pipeline.runs.train import (
    HISTORY_FILE,
    Session,
    TrialFailed,
    WorkerSpec,
    epoch_metric_names,
    error_reason,
    fit_run,
    recover_run_snapshot,
    run_worker,
    say,
    status_reason,
    worker_device,
)


class SweepError(RuntimeError):
    """A Tune job (the sweep, the tables) did not finish (interrupted, or every trial failed); rerunning the stage
    resumes it."""


# ------------------------------------------------------------------------------------------------- params
def max_concurrent(fixed: int | None, shape: TrialShape, totals: dict[str, float], n_trials: int) -> int:
    """``fixed`` (``sweep.max_concurrent_trials``, ``tables.max_concurrent_trials``) if set, else as many trials of
    ``shape`` as the cluster's resources now (``totals``) hold by their limiting resource
    (``pipeline.config.resources.trials_at_once``), never more than the trials there are, at least 1. Set it on a
    cluster that autoscales: it grows for the trials Tune starts."""
    return fixed if fixed is not None else trials_at_once(totals, shape, cap=max(1, n_trials))


def at_once(tracker: TrialTracker, concurrent: int) -> str:
    """``"up to 2 training at once (2 allowed)"``: what ran at once against what the job allowed."""
    return f"up to {tracker.peak_at_once()} training at once ({concurrent} allowed)"


# ------------------------------------------------------------------------------------------------- trial
@dataclass
class TrialRun:
    state: dict[str, Any]  # the final checkpoint's state (model, history, epoch, ...)
    checkpoint_path: str | None  # where that checkpoint is stored (None: a trial trained inside Tune)
    seconds: float  # wall time of the training: what its workers (and their GPUs) were held for


def trial_name(trial_id: str) -> str:
    """A trial's Ray Train run, and its directory on the storage: its checkpoints, status and placement."""
    return f"trial-{trial_id}"


def inline(params: Params) -> bool:
    """A trial of one worker trains inside the Tune trial itself (:class:`TuneSession`): the same loop, checkpoints
    and resume, without a Ray Train run's start-up (about 25 s per trial on 2 cores). Several workers need Ray
    Train (one process per worker, torch.distributed between them)."""
    return params.ray.num_workers == 1


class TuneSession(Session):
    """A one-worker trial's: checkpoints are Tune's (``tune.get_checkpoint`` / ``tune.report``), kept under the
    trial's directory on the storage; a restored sweep resumes the trial from its last one."""

    def __init__(self) -> None:
        # Tune's session logs every persisted checkpoint at INFO (from the ray.train package): the driver's progress
        # lines already say it all
        logging.getLogger("ray.train").setLevel(logging.WARNING)

    def get_checkpoint(self) -> Any:
        return tune.get_checkpoint()

    def report(self, metrics: dict[str, Any], checkpoint_dir: str | None) -> None:
        if checkpoint_dir is None:
            tune.report(metrics)
            return
        try:  # Tune's function API has no background upload: the checkpoint is persisted when this returns
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(checkpoint_dir))
        finally:
            shutil.rmtree(checkpoint_dir, ignore_errors=True)


def trial_placement(params: Params, gpu: bool) -> tune.PlacementGroupFactory:
    """What a trial on ``params`` (a trial's: ``ray.cpus_per_worker`` is the sweep's) holds: its own ``TRIAL_CPU``
    and ``ray.num_workers`` worker bundles (``pipeline.config.resources.TrialShape``, which ``max_concurrent`` packs).
    A Ray Train trial asks for its workers' bundles itself; an inline trial reserves its one worker's bundle and
    trains in it (the GPU, if any, is its own)."""
    if not inline(params):
        return tune.PlacementGroupFactory([{"CPU": TRIAL_CPU}])
    worker = TrialShape(1, params.ray.cpus_per_worker, gpu).worker
    return tune.PlacementGroupFactory([worker, {"CPU": TRIAL_CPU}])


def fit_trial(job: WorkerSpec, params: Params) -> TrialRun:
    """Inside a Tune trial: the pretraining loop on ``params``, its rank-0 metrics passed to Tune per epoch, in this
    process (one worker, :func:`inline`) or as a Ray Train run (:func:`trial_name` on the storage). Raises
    :class:`TrialFailed` with the reason when the loss became non-finite (the last good checkpoint is kept).

    ``job``: what every trial of the job shares (staged data, manifest, storage, use_gpu, callbacks).
    """
    spec = replace(job, params=params.model_dump(), name=trial_name(tune.get_context().get_trial_id()), quiet=True)
    run_dir = spec.run_dir
    start = time.time()
    if inline(params):
        clear_status(run_dir)
        device = worker_device(spec.use_gpu, params.ray.backend, ray_train=False)
        loop = run_worker(spec, TuneSession(), device=device)
        state, path = (loop.state_dict() if loop else None), None
    else:
        from ray.tune.integration.ray_train import TuneReportCallback

        spec.resume_dir = recover_run_snapshot(None if is_uri(run_dir) else run_dir)
        state, path = fit_run(spec, params, [TuneReportCallback()], keep=1, console_level=TRIAL_CONSOLE_LEVEL)
    seconds = time.time() - start
    status = read_json(run_dir, STATUS_FILE)  # kept with the run: a restored trial whose run had diverged fails again
    if status:
        raise TrialFailed(status_reason(status))
    if state is None:
        raise TrialFailed("the trial's training finished without a checkpoint")
    return TrialRun(state=state, checkpoint_path=path, seconds=seconds)


def trainable(trial: Any, job: WorkerSpec, placement: Any) -> Any:
    """The Tune trainable of a job's trial function ``trial(config, job)``: ``job`` (what every trial shares) shipped
    once; each trial holds ``placement`` (a ``PlacementGroupFactory``, or a function of the trial's config returning
    one)."""
    return tune.with_resources(tune.with_parameters(trial, job=job), placement)


def _trial_error(trial) -> BaseException | None:
    """The error Tune recorded for a trial: its pickle in the trial's local directory (written before the callbacks
    run; the copy on the storage comes later), else the storage's."""
    import cloudpickle

    path = trial.pickled_error_file
    try:
        if path and os.path.exists(path):
            with open(path, "rb") as f:
                return cloudpickle.load(f)
        return trial.get_pickled_error()
    except Exception:  # an error that cannot be unpickled here: Tune's text, whose last line is the exception
        lines = Path(trial.error_file).read_text().strip().splitlines() if trial.error_file else []
        return RuntimeError(lines[-1] if lines else "unknown error")


# ------------------------------------------------------------------------------------ progress, tracking
_LIVE: dict[str, TrialTracker] = {}  # the driver's tracker of each job, by the job's path (TrialTracker.attach)


def _live_tracker(job: str, cls: type, state: dict[str, Any]) -> TrialTracker:
    """The driver's tracker of ``job`` if this process runs that job (a restored job's), else a copy (``state``)."""
    tracker = _LIVE.get(job)
    if tracker is None:  # e.g. unpickled in another process
        tracker = cls.__new__(cls)
        tracker.__dict__.update(state)
    return tracker


class TrialTracker(tune.Callback):
    """Driver-side: one progress line per trial event, live MLflow runs, and the trials' final statuses.

    MLflow (when ``uri``): ``parent_id`` is the job's run; each trial gets a child run (tags
    ``mlflow.parentRunId``, ``trial_id``; params = its labels) found again by those tags when a restored job
    restarts the trial; per-epoch metrics are logged with step = epoch; the child ends FINISHED (tag
    ``stopped_early`` when ASHA cut it) or FAILED (tag ``error``: the one-line reason).

    Each job subclasses it (``pipeline.runs.sweep.SweepTracker``, ``pipeline.runs.tables.TablesTracker``): ``PREFIX``
    of the progress lines, ``STAGE`` tag of the children, :meth:`labels` (what identifies a trial: its params in
    MLflow; by default its point).
    """

    PREFIX: str  # "[sweep]": the job's progress lines
    STAGE: str  # "sweep-trial": the children's stage tag
    job = ""  # the job's path (:meth:`attach`)

    def attach(self, job: str) -> None:
        """Make this the driver's tracker of the job at ``job`` (its path): what a pickled tracker of it becomes."""
        self.job = job
        _LIVE[job] = self

    def __reduce__(self):
        """Pickled as a reference to the driver's tracker of the job: Tune pickles the run config, this callback with
        it, into the job's directory, and a restored job (``Tuner.restore``) unpickles it, so that this run's tracker,
        not a copy of the first run's, gets the restored job's events. Elsewhere it unpickles to a copy."""
        return _live_tracker, (self.job, type(self), self.__dict__)

    def labels(self, config: dict[str, Any]) -> dict[str, Any]:
        """What identifies a trial (its MLflow params, its progress line): its point."""
        return point_of(config)

    def epochs_of(self, trial) -> int:
        return self.epochs

    def __init__(self, epochs: int, uri: str | None = None, experiment_id: str | None = None,
                 parent_id: str | None = None) -> None:
        self.epochs, self.uri, self.experiment_id, self.parent_id = epochs, uri, experiment_id, parent_id
        self.status: dict[str, str] = {}
        self.total = 0
        self.children: dict[str, str] = {}
        self.last_epoch: dict[str, int] = {}
        self.training: dict[str, list[float]] = {}  # trial id -> [first result, end] (time.monotonic())

    def setup(self, **info) -> None:
        self.total = int(info.get("total_num_samples") or 0)

    def _child(self, trial) -> str | None:
        if not self.uri:
            return None
        tid = trial.trial_id
        if tid not in self.children:
            self.children[tid] = trk.child_run(self.uri, self.experiment_id, self.parent_id,
                                               self.child_name(trial.config), match={"trial_id": tid},
                                               tags={"stage": self.STAGE}, params=self.labels(trial.config))
        return self.children[tid]

    def child_name(self, config: dict[str, Any]) -> str:
        """A trial's MLflow run name: its point (``depth 1 · b16 · strength 1.0``); its id is the tag ``trial_id``."""
        return point_label(point_of(config))

    def _done(self, trials, ending=None) -> str:
        """``"3/8"``: the trials that have ended, ``ending`` included (Tune calls ``on_trial_complete`` and
        ``on_trial_error`` before it marks the trial so)."""
        finished = sum(t.status in ("TERMINATED", "ERROR") or t is ending for t in trials)
        return f"{finished}/{max(self.total, len(trials))}"

    def peak_at_once(self) -> int:
        """The most trials that were training at the same moment (from each one's first result to its end): what
        the cluster really ran at once, to compare with the computed ``max_concurrent_trials``."""
        # +1 at a start, -1 at an end; sorted by time, an end before a start at the same instant
        events = sorted((t, -1 if i else 1) for span in self.training.values() for i, t in enumerate(span))
        return max(itertools.accumulate(step for _, step in events), default=0)

    def on_step_end(self, iteration, trials, **info) -> None:
        # statuses as the control loop left them: after an interruption Tune's cleanup marks the stopped trials
        # TERMINATED (on_experiment_end sees that), but the saved experiment state, and a restore, see them unfinished
        self.status = {t.trial_id: t.status for t in trials}

    def on_experiment_end(self, trials, **info) -> None:
        if not self.status:  # the loop never stepped (a restored sweep that had already ended, or an early Ctrl-C)
            self.status = {t.trial_id: t.status for t in trials}

    def unfinished(self) -> list[str]:
        """Trial ids that did not end, plus placeholders for trials never created (``total`` from Tune)."""
        ids = [tid for tid, st in self.status.items() if st not in ("TERMINATED", "ERROR")]
        return ids + ["(not started)"] * max(0, self.total - len(self.status))

    def on_trial_start(self, iteration, trials, trial, **info) -> None:
        say(f"{self.PREFIX} {self._done(trials)} done; trial {trial.trial_id} started: "
            f"{describe(self.labels(trial.config))}")
        self._child(trial)

    def on_trial_result(self, iteration, trials, trial, result, **info) -> None:
        epoch = int(result.get("epoch", 0))
        self.last_epoch[trial.trial_id] = epoch
        self.training.setdefault(trial.trial_id, [time.monotonic()])
        knn = result.get("knn_acc")
        say(f"{self.PREFIX} trial {trial.trial_id} epoch {epoch}/{self.epochs_of(trial)}: "
            f"loss {result.get('loss', math.nan):.4f}"
            + (f" knn {knn:.4f}" if knn is not None else "")
            + f" eps {result.get('view_noise', math.nan):.4f}")
        child = self._child(trial)
        if child:
            trk.log_metrics_batch(self.uri, child, [result], epoch_metric_names([result]))

    def _end(self, trials, trial, status: str) -> None:
        epoch = self.last_epoch.get(trial.trial_id, 0)
        early = status == "FINISHED" and epoch < self.epochs_of(trial)
        reason = error_reason(_trial_error(trial)) if status == "FAILED" else ""
        what = f"failed: {reason}" if status == "FAILED" else f"stopped early at epoch {epoch}" if early else "finished"
        span = self.training.get(trial.trial_id)
        if span is not None and len(span) == 1:
            span.append(time.monotonic())
        say(f"{self.PREFIX} trial {trial.trial_id} {what} ({self._done(trials, trial)} done)")
        child = self._child(trial)
        if child:
            # epochs a resumed trial checkpointed before an interruption but never reported to Tune: from the
            # checkpoint's history, so that the run shows every epoch once
            history = checkpoint_history(last_checkpoint_path(trial.last_result, trial)) or []
            trk.log_missing_epochs(self.uri, child, history, epoch_metric_names(history))
            trk.end_run(self.uri, child, status, tags={"stopped_early": early, **({"error": reason} if reason else {})})

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        self._end(trials, trial, "FINISHED")

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        self._end(trials, trial, "FAILED")

    def kill_unfinished(self) -> None:
        """After an interruption: the children of trials that did not finish are KILLED (a rerun revives them)."""
        for tid in self.unfinished():
            if tid in self.children:
                trk.end_run(self.uri, self.children[tid], "KILLED")


# ------------------------------------------------------------------------------------------------ driver
@dataclass
class SweepResult:  # a Tune job's outcome: the sweep's, the tables'
    rows: list[dict[str, Any]]  # one per trial: point, final metrics, epochs, status, per-epoch history
    name: str
    mlflow_run_id: str | None = None
    seconds: float = 0.0  # Ray Tune's run of the trials
    resumed: bool = False
    started: float = 0.0  # when that run started (time.time())
    concurrent: int = 0  # the trials at once it allowed (max_concurrent_trials, computed from the cluster)
    peak: int = 0  # the most trials that trained at the same moment (TrialTracker.peak_at_once)

    def trial_runs(self) -> list[str]:
        """The Ray Train runs its trials may have left on the storage (``pipeline.runs.train.cleanup`` removes them)."""
        return [trial_name(r["trial_id"]) for r in self.rows]


def last_checkpoint_path(reported: Any, trial: Any) -> str | None:
    """Where a trial's last checkpoint is: the path a Ray Train trial reported (``reported``: its metrics, or their
    ``checkpoint_path``), else that of the Tune checkpoint an inline trial reported (``trial``: Tune's ``Trial`` or
    ``Result``, both have ``.checkpoint``)."""
    path = reported.get("checkpoint_path") if isinstance(reported, dict) else reported
    if isinstance(path, str) and path:
        return path
    return getattr(getattr(trial, "checkpoint", None), "path", None)


def checkpoint_history(checkpoint_path: Any, name: str = HISTORY_FILE) -> list[dict[str, Any]] | None:
    """The per-epoch history saved beside the trial's last Train checkpoint (local or remote storage), if any; with
    ``name`` :data:`pipeline.runs.train.WORKERS_FILE`, where each rank ran."""
    if not isinstance(checkpoint_path, str) or not checkpoint_path:
        return None
    return read_json(checkpoint_path, name)


def tune_job(trainable, space: dict[str, Any], *, name: str, storage: str, tracker: TrialTracker, concurrent: int,
             announce: str, what: str = "sweep", scheduler=None, num_samples: int = 1, reuse_actors: bool = True,
             metric: str | None = "knn_acc"):
    """Run, or resume, one Tune job of Train trials (the sweep, the paper's tables) under ``<storage>/<name>``.

    ``metric``: what the scheduler ranks trials by (ASHA's online kNN accuracy); every result must then carry it
    (Tune's strict check), so a job without a scheduler passes None (the tables: kNN every ``train.knn_every``
    epochs). ``reuse_actors``: Tune runs the next trial in a finished trial's process; only for trials that train
    in that process (one worker, :func:`inline`). A trial of several workers waits in ``TorchTrainer.fit`` for its Ray
    Train run: when ASHA stops it, that wait cannot end in the 2 s Tune gives a reset, and a reused process would keep
    the stopped run's workers, and their resources, for Tune's 600 s clean-up timeout.

    Returns ``(ResultGrid, resumed, seconds)``. Raises :class:`SweepError` (the parent run KILLED, unfinished
    children KILLED) if the job was interrupted, and (the parent FAILED) if every trial failed.
    """
    path = join(storage, name)
    tracker.attach(path)  # what the Tuner's pickled run config refers to (TrialTracker.__reduce__)
    resumed = tune.Tuner.can_restore(path)
    if resumed:
        say(f"{tracker.PREFIX} resuming {path}")
        tuner = tune.Tuner.restore(path, trainable=trainable, resume_errored=True, param_space=space)
    else:
        say(announce)
        tuner = tune.Tuner(
            trainable,
            param_space=space,
            tune_config=tune.TuneConfig(metric=metric, mode="max" if metric else None, scheduler=scheduler,
                                        num_samples=num_samples,
                                        max_concurrent_trials=concurrent, reuse_actors=reuse_actors,
                                        trial_dirname_creator=lambda t: trial_name(t.trial_id)),
            run_config=tune.RunConfig(name=name, storage_path=storage, verbose=0, callbacks=[tracker]),
        )
    start = time.time()
    # Tune's own lines: on Ctrl-C "Stop signal received ...", "Resume experiment with: Tuner.restore(...)" (the stage
    # ends with its one line saying how to resume); a failed trial's traceback and "Trials did not complete" (the
    # tracker prints the trial's one-line reason, the stage the job's). Ray's session logs keep them.
    logging.getLogger("ray.tune").setLevel(logging.CRITICAL)
    grid = tuner.fit()
    unfinished = tracker.unfinished()
    if unfinished or not tracker.status:
        tracker.kill_unfinished()
        trk.end_run(tracker.uri, tracker.parent_id, "KILLED")
        total = max(tracker.total, len(tracker.status))
        raise SweepError(f"the {what} was interrupted with {len(unfinished)} of {total} trials unfinished; rerun "
                         f"the stage to resume it from {path}")
    if all(r.error for r in grid):
        trk.end_run(tracker.uri, tracker.parent_id, "FAILED")
        raise SweepError(f"every trial of the {what} failed: " + "; ".join(error_reason(r.error) for r in grid)[:2000])
    return grid, resumed, time.time() - start


def finish_tracking(root: Path, result: SweepResult, best: dict[str, Any] | None, files: list[Path]) -> None:
    """The parent run gets the best trial's metrics and point (``best``: its row, or None), the trials' counts, the
    output files, and ends FINISHED."""
    if not result.mlflow_run_id:
        return
    uri = trk.tracking_uri(root)
    pid = result.mlflow_run_id
    metrics, tags = {}, {}
    if best:
        metrics = {f"best.{k}": best.get(k) for k in ("knn_acc", "best_knn_acc", "view_noise")}  # finite ones logged
        tags = {**{f"best.{k}": v for k, v in point_of(best).items()}, "best.trial_id": best["trial_id"]}
    metrics["trials"] = len(result.rows)
    metrics["trials_failed"] = sum(r["status"] == "ERROR" for r in result.rows)
    trk.log_metrics_batch(uri, pid, [{"epoch": 0, **metrics}], tuple(metrics))  # step 0: the job's summary
    trk.set_tags(pid, tags, uri=uri)
    trk.log_artifacts(uri, pid, files)
    trk.end_run(uri, pid, "FINISHED")
