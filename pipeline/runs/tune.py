"""The Ray Tune machinery of the jobs whose trials pretrain, the sweep (``pipeline.runs.sweep``) and the paper's
tables (``pipeline.runs.tables``): a library both use, knowing neither.

- **A trial** (:func:`fit_trial`) runs the pretraining worker loop (``pipeline.runs.train.run_worker``) on the job's
  :class:`pipeline.runs.job.WorkerSpec` (shipped once to every trial by :func:`trainable`) with its own params. One
  worker (:func:`inline`) trains in the trial itself, reporting epochs and checkpoints to Tune (:class:`TuneSession`):
  a Ray Train run's start and stop (docs/results.md measures them) would cost more than a small trial's training.
  Several workers are a ``TorchTrainer`` run named after the trial id, so that a restored job resumes each trial's own
  run; ``TuneReportCallback`` passes rank 0's metrics to Tune. A diverged trial raises ``TrialFailed``.
- **Resources**: a trial holds ``TRIAL_CPU`` and its workers' bundles (:func:`trial_placement`); as many start at
  once as the cluster's limiting resource holds (``pipeline.config.resources.max_concurrent``).
- **Tracking and progress**: :class:`TrialTracker`, the driver-side Tune callback each job subclasses: a line per
  trial event, MLflow from the driver only (a child of the job's run per trial, found again by its tags), so
  trials never contend for the sqlite store. It keeps no state of its own: what the driver needs after the job (each
  trial's last status, when it trained) it writes to the driver's state of the job (:data:`TRACKER_FILE`), so the
  copy of it that a restored job unpickles works as the first did.
- **The job**: :func:`tune_job` runs it, or restores an interrupted one (finished trials kept, unfinished ones
  resumed from their checkpoints, the same MLflow runs continued); :func:`outcomes` turns its results into a typed
  :class:`Outcome` per trial, its epochs read back from its checkpoints.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from ray import tune

from pipeline.config.names import point_label
from pipeline.config.params import Params
from pipeline.config.ray import TRIAL_CPU
from pipeline.config.resources import TrialShape
from pipeline.config.space import describe, point_of
from pipeline.data.storage import (
    PLACEMENT_FILE,
    STATUS_FILE,
    clear_status,
    join,
    read_json,
)
from pipeline.evaluation.health import is_health_key
from pipeline.io import write_json
from pipeline.runs import tracking as trk
from pipeline.runs.cluster import TRIAL_CONSOLE_LEVEL
from pipeline.runs.job import Job, SweepError, Tracked, TrialFailed, WorkerSpec, close_job, error_reason, fail_job, say
from pipeline.runs.train import (
    EPOCH_METRICS,
    HISTORY_FILE,
    WORKERS_FILE,
    Epoch,
    Session,
    TrainedState,
    Worker,
    epoch_metric_names,
    fit_run,
    recover,
    run_worker,
    status_reason,
    worker_device,
)
from pipeline.runs.undocumented import checkpoint_dirs, trial_error

Config = dict[str, object]  # a trial's config: its point, or its row
Result = dict[str, object]  # one result a trial reported to Tune
TRACKER_FILE = "trials.json"  # the tracker's record of the trials, in the driver's state of the job (Job.state_dir)


# ------------------------------------------------------------------------------------------------- trial
@dataclass
class TrialRun:
    state: TrainedState  # the final checkpoint's
    checkpoint_path: str | None  # where that checkpoint is stored (None: a trial trained inside Tune)
    seconds: float  # wall time of the training: what its workers (and their GPUs) were held for


def trial_name(trial_id: str) -> str:
    """A trial's Ray Train run, and its directory on the storage: its checkpoints, status and placement."""
    return f"trial-{trial_id}"


def inline(params: Params) -> bool:
    """A trial of one worker trains inside the Tune trial itself (:class:`TuneSession`): the same loop, checkpoints
    and resume, without a Ray Train run's start and stop. Several workers need Ray Train (one process per worker,
    torch.distributed between them)."""
    return params.ray.num_workers == 1


class TuneSession(Session):
    """A one-worker trial's: checkpoints are Tune's (``tune.get_checkpoint`` / ``tune.report``), kept under the
    trial's directory on the storage; a restored job resumes the trial from its last one."""

    def __init__(self) -> None:
        # Tune's session logs every persisted checkpoint at INFO (from the ray.train package): the driver's progress
        # lines already say it all
        logging.getLogger("ray.train").setLevel(logging.WARNING)

    def get_checkpoint(self) -> tune.Checkpoint | None:
        return tune.get_checkpoint()

    def report(self, metrics: Epoch, checkpoint_dir: str | None) -> None:
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
    spec = replace(job, params=params, name=trial_name(tune.get_context().get_trial_id()), quiet=True)
    run_dir = spec.run_dir
    start = time.time()
    if inline(params):
        clear_status(run_dir)
        loop = run_worker(spec, TuneSession(), device=worker_device(spec.use_gpu, params.ray.backend, ray_train=False))
        state, path = (TrainedState.of(loop.state_dict(), workers=[]) if loop else None), None
    else:
        from ray.tune.integration.ray_train import TuneReportCallback

        spec.resume_dir = recover(run_dir)
        state, path = fit_run(spec, [TuneReportCallback()], keep=1, console_level=TRIAL_CONSOLE_LEVEL)
    seconds = time.time() - start
    status = read_json(run_dir, STATUS_FILE)  # kept with the run: a restored trial whose run had diverged fails again
    if status:
        raise TrialFailed(status_reason(status))
    if state is None:
        raise TrialFailed("the trial's training finished without a checkpoint")
    return TrialRun(state=state, checkpoint_path=path, seconds=seconds)


def trainable(trial: Callable[[Config, WorkerSpec], None], job: WorkerSpec,
              placement: tune.PlacementGroupFactory | Callable[[Config], tune.PlacementGroupFactory]) -> type:
    """The Tune trainable of a job's trial function ``trial(config, job)``: ``job`` (what every trial shares) shipped
    once; each trial holds ``placement`` (or what a function of the trial's config returns)."""
    return tune.with_resources(tune.with_parameters(trial, job=job), placement)


# ------------------------------------------------------------------------------------ progress, tracking
class TrialTracker(tune.Callback):
    """Driver-side: one progress line per trial event, live MLflow runs, and the trials' statuses for the driver.

    MLflow (when ``run``): each trial gets a child of the job's run (tags ``mlflow.parentRunId``, ``trial_id``;
    params = its labels), found again by those tags (a restored job's trial continues its child); per-epoch metrics
    with step = epoch; the child ends FINISHED (tag ``stopped_early`` when ASHA cut it) or FAILED (tag ``error``).

    Its fields are settings; what the driver needs after the job goes to :data:`TRACKER_FILE` in ``record_dir``, a
    folder of the driver's own (:meth:`record`; not the job's directory on the run storage, which Tune syncs from its
    own copy when it restores a job). Each job subclasses it: ``PREFIX`` of the progress lines, ``STAGE`` tag of the
    children, :meth:`labels` (what identifies a trial: its params in MLflow; by default its point).
    """

    PREFIX: str  # "[sweep]": the job's progress lines
    STAGE: str  # "sweep-trial": the children's stage tag

    def __init__(self, epochs: int, record_dir: str, run: Tracked | None = None) -> None:
        self.epochs, self.record_dir, self.run = epochs, record_dir, run
        self.total = 0
        self.children: dict[str, str] = {}  # a cache of child_run's answers
        self.statuses: dict[str, str] = {}  # the last statuses recorded

    def labels(self, config: Config) -> dict[str, object]:
        """What identifies a trial (its MLflow params, its progress line): its point."""
        return point_of(config)

    def child_name(self, config: Config) -> str:
        """A trial's MLflow run name: its point (``depth 1 · b16 · strength 1.0``); its id is the tag ``trial_id``."""
        return point_label(point_of(config))

    def epochs_of(self, trial: tune.experiment.Trial) -> int:
        return self.epochs

    def setup(self, **info: object) -> None:
        self.total = int(info.get("total_num_samples") or 0)

    def record(self, update: Callable[[dict[str, dict[str, object]]], None]) -> None:
        """Apply ``update`` to the record of the trials in :data:`TRACKER_FILE` (``{trial id: {"status", "start",
        "end", "epoch"}}`` and ``total``)."""
        trials = Record.read(self.record_dir).trials
        update(trials)
        write_json(Path(self.record_dir, TRACKER_FILE), {"total": self.total, "trials": trials})

    def _child(self, trial: tune.experiment.Trial) -> str | None:
        if not self.run:
            return None
        tid = trial.trial_id
        if tid not in self.children:
            self.children[tid] = trk.child_run(self.run.uri, self.run.experiment_id, self.run.run_id,
                                               self.child_name(trial.config), match={"trial_id": tid},
                                               tags={"stage": self.STAGE}, params=self.labels(trial.config))
        return self.children[tid]

    def _done(self, trials: list[tune.experiment.Trial], ending: tune.experiment.Trial | None = None) -> str:
        """``"3/8"``: the trials that have ended, ``ending`` included (Tune calls ``on_trial_complete`` and
        ``on_trial_error`` before it marks the trial so)."""
        finished = sum(t.status in ("TERMINATED", "ERROR") or t is ending for t in trials)
        return f"{finished}/{max(self.total, len(trials))}"

    def on_step_end(self, iteration: int, trials: list[tune.experiment.Trial], **info: object) -> None:
        # statuses as the control loop left them: after an interruption Tune's cleanup marks the stopped trials
        # TERMINATED, but the saved experiment state, and a restore, see them unfinished
        statuses = {t.trial_id: t.status for t in trials}
        if statuses != self.statuses:
            self.statuses = statuses
            self.record(lambda r: [r.setdefault(tid, {}).update(status=st) for tid, st in statuses.items()])

    def on_trial_start(self, iteration: int, trials: list[tune.experiment.Trial], trial: tune.experiment.Trial,
                       **info: object) -> None:
        say(f"{self.PREFIX} {self._done(trials)} done; trial {trial.trial_id} started: "
            f"{describe(self.labels(trial.config))}")
        self._child(trial)

    def on_trial_result(self, iteration: int, trials: list[tune.experiment.Trial], trial: tune.experiment.Trial,
                        result: Result, **info: object) -> None:
        epoch = int(result.get("epoch", 0))
        self.record(lambda r: r.setdefault(trial.trial_id, {}).update(
            epoch=epoch, start=r.get(trial.trial_id, {}).get("start") or time.time()))
        knn = result.get("knn_acc")
        say(f"{self.PREFIX} trial {trial.trial_id} epoch {epoch}/{self.epochs_of(trial)}: "
            f"loss {result.get('loss', math.nan):.4f}"
            + (f" knn {knn:.4f}" if knn is not None else "")
            + f" eps {result.get('view_noise', math.nan):.4f}")
        child = self._child(trial)
        if child:
            trk.log_metrics_batch(self.run.uri, child, [result], epoch_metric_names([result]))

    def _end(self, trials: list[tune.experiment.Trial], trial: tune.experiment.Trial, status: str) -> None:
        seen = Record.read(self.record_dir).trials.get(trial.trial_id, {})
        epoch = int(seen.get("epoch", 0))
        early = status == "FINISHED" and epoch < self.epochs_of(trial)
        reason = error_reason(trial_error(trial)) if status == "FAILED" else ""
        what = f"failed: {reason}" if status == "FAILED" else f"stopped early at epoch {epoch}" if early else "finished"
        if seen.get("start"):
            self.record(lambda r: r[trial.trial_id].setdefault("end", time.time()))
        say(f"{self.PREFIX} trial {trial.trial_id} {what} ({self._done(trials, trial)} done)")
        child = self._child(trial)
        if child:
            # epochs a resumed trial checkpointed before an interruption but never reported to Tune: from the
            # checkpoint's history, so that the run shows every epoch once
            path = last_checkpoint_path(trial.last_result, trial)
            history = (read_json(path, HISTORY_FILE) if path else None) or []
            trk.log_missing_epochs(self.run.uri, child, history, epoch_metric_names(history))
            trk.end_run(self.run.uri, child, status,
                        tags={"stopped_early": early, **({"error": reason} if reason else {})})

    def on_trial_complete(self, iteration: int, trials: list[tune.experiment.Trial], trial: tune.experiment.Trial,
                          **info: object) -> None:
        self._end(trials, trial, "FINISHED")

    def on_trial_error(self, iteration: int, trials: list[tune.experiment.Trial], trial: tune.experiment.Trial,
                       **info: object) -> None:
        self._end(trials, trial, "FAILED")


@dataclass
class Record:
    """The tracker's record of a job's trials, read by the driver after the job (:data:`TRACKER_FILE`)."""

    total: int
    trials: dict[str, dict[str, object]]

    @classmethod
    def read(cls, record_dir: str) -> Record:
        path = Path(record_dir, TRACKER_FILE)
        saved = json.loads(path.read_text()) if path.is_file() else {}
        return cls(int(saved.get("total", 0)), dict(saved.get("trials", {})))

    def unfinished(self) -> list[str]:
        """Trial ids that did not end, plus placeholders for trials never created (``total`` from Tune)."""
        ids = [tid for tid, t in self.trials.items() if t.get("status") not in ("TERMINATED", "ERROR")]
        return ids + ["(not started)"] * max(0, self.total - len(self.trials))

    def peak_at_once(self) -> int:
        """The most trials that were training at the same moment (from each one's first result to its end): what
        the cluster really ran at once, to compare with the computed ``max_concurrent_trials``."""
        # +1 at a start, -1 at an end; sorted by time, an end before a start at the same instant
        events = sorted((t[k], -1 if k == "end" else 1) for t in self.trials.values() for k in ("start", "end")
                        if isinstance(t.get(k), float))
        return max(itertools.accumulate(step for _, step in events), default=0)


# ------------------------------------------------------------------------------------------------ driver
@dataclass
class JobResult:  # a Tune job's outcome: the sweep's, the tables'
    job: Job
    outcomes: list[Outcome]
    seconds: float = 0.0  # Ray Tune's run of the trials
    resumed: bool = False
    started: float = 0.0  # when that run started (time.time())
    concurrent: int = 0  # the trials at once it allowed (max_concurrent_trials, computed from the cluster)
    peak: int = 0  # the most trials that trained at the same moment (Record.peak_at_once)
    rows: list[dict[str, object]] = field(default_factory=list)  # the job's rows (sweep: per trial; tables: records)

    def trial_runs(self) -> list[str]:
        """The Ray Train runs its trials may have left on the storage (``pipeline.runs.job.cleanup`` removes them)."""
        return [trial_name(o.trial_id) for o in self.outcomes]

    def summary(self) -> str:
        """``"8 trials in 95 s, up to 2 training at once (2 allowed)"``."""
        return (f"{len(self.outcomes)} trials in {self.seconds:.0f} s, up to {self.peak} training at once "
                f"({self.concurrent} allowed)")


def last_checkpoint_path(reported: Mapping[str, object] | str | None, trial: object) -> str | None:
    """Where a trial's last checkpoint is: the path a Ray Train trial reported (``reported``: its metrics, or their
    ``checkpoint_path``), else that of the Tune checkpoint an inline trial reported (``trial``: Tune's ``Trial`` or
    ``Result``, both have ``.checkpoint``)."""
    path = reported.get("checkpoint_path") if isinstance(reported, Mapping) else reported
    if isinstance(path, str) and path:
        return path
    return getattr(getattr(trial, "checkpoint", None), "path", None)


@dataclass
class Outcome:
    """One trial of a Tune job, read once from its results and checkpoints."""

    trial_id: str
    config: Config
    last: Result  # its last result (a tables row's: its evaluation)
    history: list[Epoch]  # every epoch, from its newest complete checkpoint and Tune's results after it
    workers: list[Worker]  # where each rank ran
    error: str  # why it failed ("" if it did not)


def outcomes(grid: tune.ResultGrid, storage: str | None = None) -> list[Outcome]:
    """An :class:`Outcome` per trial of ``grid``. Where each rank ran comes from the trial's Ray Train run directory
    under ``storage`` (its ``PLACEMENT_FILE``), else from its checkpoints. The history comes from the trial's newest
    complete checkpoint, which holds every epoch up to it also across a resume (Tune's own table of a restored trial
    starts at the resumed epoch), and Tune's results after it."""
    keep = ("epoch", *EPOCH_METRICS)
    out = []
    for result in grid:
        df = result.metrics_dataframe
        reported = [] if df is None else df.to_dict("records")
        evaluated = [h for h in reported if h.get("evaluated") == 1]  # a tables row's: also when an epoch came later
        last = evaluated[-1] if evaluated else (reported[-1] if reported else dict(result.metrics or {}))
        paths = [h.get("checkpoint_path") for h in reported if isinstance(h.get("checkpoint_path"), str)]
        trial_id = Path(result.path).name.removeprefix("trial-")
        run_dir = join(storage, trial_name(trial_id)) if storage else None
        # newest first: the last reported checkpoint, the ones reported before it, then those in the trial's run dir
        newest = [p for p in dict.fromkeys([last_checkpoint_path(paths[-1] if paths else None, result),
                                            *reversed(paths), *(checkpoint_dirs(run_dir) if run_dir else [])]) if p]
        # where each rank ran, from the run dir, else the newest checkpoint that has it: a trial stopped (ASHA) while
        # its last checkpoint was still uploading has it in the one before
        placed = read_json(run_dir, PLACEMENT_FILE) if run_dir else None
        found = (read_json(path, WORKERS_FILE) for path in newest)
        workers = sorted(placed or next((w for w in found if w), []), key=lambda w: w["rank"])
        history = next((h for h in (read_json(path, HISTORY_FILE) for path in newest) if h), [])
        seen = int(history[-1]["epoch"]) if history else 0
        history = [*history, *(h for h in reported if int(h.get("epoch", 0) or 0) > seen)]
        history = [{k: v for k, v in h.items() if k in keep or is_health_key(k)} for h in history]
        out.append(Outcome(trial_id, dict(result.config), last, history, workers, error_reason(result.error)))
    return out


def tune_job(job: Job, trainable: type, space: Config, *, tracker: TrialTracker, concurrent: int, announce: str,
             scheduler: tune.schedulers.TrialScheduler | None = None, num_samples: int = 1,
             reuse_actors: bool = True, metric: str | None = "knn_acc") -> JobResult:
    """Run, or resume, one Tune job of Train trials (the sweep, the paper's tables) under ``<storage>/<name>``.

    ``metric``: what the scheduler ranks trials by (ASHA's online kNN accuracy); every result must then carry it
    (Tune's strict check), so a job without a scheduler passes None (the tables: kNN every ``train.knn_every``
    epochs). ``reuse_actors``: Tune runs the next trial in a finished trial's process; only for trials that train
    in that process (one worker, :func:`inline`). A trial of several workers waits in ``TorchTrainer.fit`` for its Ray
    Train run: when ASHA stops it, that wait cannot end in the 2 s Tune gives a reset, and a reused process would keep
    the stopped run's workers, and their resources, for Tune's 600 s clean-up timeout.

    Raises :class:`SweepError` (the job's MLflow run KILLED, unfinished children KILLED) if the job was interrupted,
    and (the run FAILED) if every trial failed.
    """
    path = job.run_dir
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
            run_config=tune.RunConfig(name=job.name, storage_path=job.spec.storage, verbose=0, callbacks=[tracker]),
        )
    start = time.time()
    # Tune's own lines: on Ctrl-C "Stop signal received ...", "Resume experiment with: Tuner.restore(...)" (the stage
    # ends with its one line saying how to resume); a failed trial's traceback and "Trials did not complete" (the
    # tracker prints the trial's one-line reason, the stage the job's). Ray's session logs keep them.
    logging.getLogger("ray.tune").setLevel(logging.CRITICAL)
    grid = tuner.fit()
    seconds = time.time() - start
    record = Record.read(str(job.state_dir))
    unfinished = record.unfinished()
    what = "tables job" if job.stage == "tables" else job.stage
    if unfinished or not record.trials:
        if job.run:  # the children of trials that did not finish are KILLED (a rerun revives them)
            for tid in unfinished:
                child = trk.find_child(job.run.uri, job.run.experiment_id, job.run.run_id, {"trial_id": tid})
                if child:
                    trk.end_run(job.run.uri, child, "KILLED")
        fail_job(job, "KILLED")
        total = max(record.total, len(record.trials))
        raise SweepError(f"the {what} was interrupted with {len(unfinished)} of {total} trials unfinished; rerun "
                         f"the stage to resume it from {path}")
    if all(r.error for r in grid):
        fail_job(job)
        raise SweepError(f"every trial of the {what} failed: " + "; ".join(error_reason(r.error) for r in grid)[:2000])
    return JobResult(job=job, outcomes=outcomes(grid, job.spec.storage), seconds=seconds, resumed=resumed,
                     started=start, concurrent=concurrent, peak=record.peak_at_once())


def close_tune_job(result: JobResult, files: list[Path], best: Mapping[str, object] | None = None) -> None:
    """Close the job (``pipeline.runs.job.close_job``): its MLflow run gets the trials' counts, the best trial's
    metrics and point (``best``: its row, or None) and the output files; its trials' Ray Train runs are removed."""
    metrics: dict[str, float] = {"trials": len(result.outcomes),
                                 "trials_failed": sum(bool(o.error) for o in result.outcomes)}
    tags: dict[str, object] = {}
    if best:
        metrics |= {f"best.{k}": best[k] for k in ("knn_acc", "best_knn_acc", "view_noise")}  # finite ones logged
        tags = {**{f"best.{k}": v for k, v in point_of(best).items()}, "best.trial_id": best["trial_id"]}
    close_job(result.job, files, metrics=metrics, tags=tags, runs=result.trial_runs())
