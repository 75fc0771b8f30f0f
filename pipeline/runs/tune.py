"""The Ray Tune machinery shared by the jobs whose trials pretrain: the sweep and the paper's tables.

A trial (:func:`fit_trial`) of one worker trains in the trial itself (:func:`inline`): a Ray Train run's start and
stop (docs/results.md) would cost more than a small trial's training; several workers are a ``TorchTrainer`` run
named after the trial id, so that a restored job resumes each trial's own run. :class:`TrialTracker` logs to MLflow
from the driver only, so trials never contend for the sqlite store. :func:`tune_job` runs or restores a job.
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
from pipeline.data.storage import PLACEMENT_FILE, STATUS_FILE, clear_status, join, read_json
from pipeline.io import write_json
from pipeline.runs import tracking as trk
from pipeline.runs.cluster import TRIAL_CONSOLE_LEVEL
from pipeline.runs.job import Job, SweepError, Tracked, TrialFailed, WorkerSpec, close_job, error_reason, fail_job, say
from pipeline.runs.train import (
    Epoch,
    Session,
    TrainedState,
    Worker,
    checkpoint_record,
    epoch_metric_names,
    fit_run,
    recover,
    run_worker,
    status_reason,
    worker_device,
)
from pipeline.runs.undocumented import checkpoint_dirs, trial_error
from pipeline.training.loop import epoch_record

Config = dict[str, object]  # a trial's config: its point, or its row
Trial = tune.experiment.Trial
Result = dict[str, object]  # one result a trial reported to Tune
TRACKER_FILE = "trials.json"  # the tracker's record of the trials, in the driver's state of the job (Job.state_dir)


# ------------------------------------------------------------------------------------------------- trial
@dataclass
class TrialRun:
    state: TrainedState  # the final checkpoint's
    seconds: float  # wall time of the training: what its workers (and their GPUs) were held for


def trial_name(trial_id: str) -> str:
    """A trial's Ray Train run and its directory on the storage."""
    return f"trial-{trial_id}"


def inline(params: Params) -> bool:
    """A trial of one worker trains inside the Tune trial itself (:class:`TuneSession`); several need Ray Train."""
    return params.ray.num_workers == 1


class TuneSession(Session):
    """A one-worker trial's: checkpoints are Tune's; a restored job resumes the trial from its last one."""

    def __init__(self) -> None:
        # Tune logs every persisted checkpoint at INFO (from ray.train): the driver's progress lines say it already
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
    """A trial's own ``TRIAL_CPU``, and an inline trial's worker bundle (a Ray Train run asks for its workers')."""
    worker = [TrialShape(1, params.ray.cpus_per_worker, gpu).worker] if inline(params) else []
    return tune.PlacementGroupFactory([*worker, {"CPU": TRIAL_CPU}])


def fit_trial(job: WorkerSpec, params: Params) -> TrialRun:
    """Inside a Tune trial: pretraining on ``params``, rank 0's metrics to Tune; :class:`TrialFailed` if it fails."""
    spec = replace(job, params=params, name=trial_name(tune.get_context().get_trial_id()), quiet=True)
    run_dir = spec.run_dir
    start = time.time()
    if inline(params):
        clear_status(run_dir)
        loop = run_worker(spec, TuneSession(), device=worker_device(spec.use_gpu, params.ray.backend, ray_train=False))
        state = TrainedState.of(loop.state_dict(), workers=[]) if loop else None
    else:
        from ray.tune.integration.ray_train import TuneReportCallback

        spec.resume_dir = recover(run_dir)
        state = fit_run(spec, [TuneReportCallback()], keep=1, console_level=TRIAL_CONSOLE_LEVEL)
    seconds = time.time() - start
    status = read_json(run_dir, STATUS_FILE)  # kept with the run: a restored trial whose run had diverged fails again
    if status:
        raise TrialFailed(status_reason(status))
    if state is None:
        raise TrialFailed("the trial's training finished without a checkpoint")
    return TrialRun(state=state, seconds=seconds)


def trainable(trial: Callable[[Config, WorkerSpec], None], job: WorkerSpec,
              placement: tune.PlacementGroupFactory | Callable[[Config], tune.PlacementGroupFactory]) -> type:
    """The Tune trainable of ``trial(config, job)``: ``job`` shipped once; each trial holds ``placement(config)``."""
    return tune.with_resources(tune.with_parameters(trial, job=job), placement)


# ------------------------------------------------------------------------------------ progress, tracking
class TrialTracker(tune.Callback):
    """Driver-side: a progress line per trial event, and (when ``run``) a child MLflow run per trial (tag
    ``trial_id``: a restored job's trial continues it), per-epoch metrics with step = epoch. No state of its own, so
    that the copy a restored job unpickles works as the first: the record goes to ``record_dir``, the driver's own
    folder (Tune overwrites the job's directory on the storage when it restores). Subclasses set the class fields."""

    PREFIX: str  # "[sweep]": the job's progress lines
    STAGE: str  # "sweep-trial": the children's stage tag

    def __init__(self, epochs: int, record_dir: str, run: Tracked | None = None) -> None:
        self.epochs, self.record_dir, self.run = epochs, record_dir, run
        self.total = 0
        self.children: dict[str, str] = {}  # a cache of child_run's answers
        self.statuses: dict[str, str] = {}  # the last statuses recorded

    def labels(self, config: Config) -> dict[str, object]:
        """What identifies a trial (its MLflow params, its progress line)."""
        return point_of(config)

    def child_name(self, config: Config) -> str:
        """A trial's MLflow run name: ``depth 1 · b16 · strength 1.0``."""
        return point_label(point_of(config))

    def epochs_of(self, trial: Trial) -> int:
        return self.epochs

    def setup(self, **info: object) -> None:
        self.total = int(info.get("total_num_samples") or 0)

    def record(self, update: Callable[[dict[str, dict[str, object]]], None]) -> None:
        """Apply ``update`` to the trials' record (``{trial id: {"status", "start", "end", "epoch"}}``)."""
        trials = Record.read(self.record_dir).trials
        update(trials)
        write_json(Path(self.record_dir, TRACKER_FILE), {"total": self.total, "trials": trials})

    def child_tags(self) -> dict[str, str]:
        """The tags of a trial's child run besides its trial id."""
        return {"stage": self.STAGE}

    def _child(self, trial: Trial) -> str | None:
        if not self.run:
            return None
        tid = trial.trial_id
        if tid not in self.children:
            self.children[tid] = trk.child_run(self.run.uri, self.run.experiment_id, self.run.run_id,
                                               self.child_name(trial.config), match={"trial_id": tid},
                                               tags=self.child_tags(), params=self.labels(trial.config))
        return self.children[tid]

    def _done(self, trials: list[Trial], ending: Trial | None = None) -> str:
        """``"3/8"``: the trials that have ended, ``ending`` included (Tune marks it after the callback)."""
        finished = sum(t.status in ("TERMINATED", "ERROR") or t is ending for t in trials)
        return f"{finished}/{max(self.total, len(trials))}"

    def on_step_end(self, iteration: int, trials: list[Trial], **info: object) -> None:
        # as the control loop left them: after an interruption Tune's cleanup marks the stopped trials TERMINATED,
        # but a restore sees them unfinished
        statuses = {t.trial_id: t.status for t in trials}
        if statuses != self.statuses:
            self.statuses = statuses
            self.record(lambda r: [r.setdefault(tid, {}).update(status=st) for tid, st in statuses.items()])

    def on_trial_start(self, iteration: int, trials: list[Trial], trial: Trial, **info: object) -> None:
        say(f"{self.PREFIX} {self._done(trials)} done; trial {trial.trial_id} started: "
            f"{describe(self.labels(trial.config))}")
        self._child(trial)

    def on_trial_result(self, iteration: int, trials: list[Trial], trial: Trial, result: Result,
                        **info: object) -> None:
        epoch = int(result.get("epoch", 0))
        self.record(lambda r: r.setdefault(trial.trial_id, {}).update(
            epoch=epoch, start=r.get(trial.trial_id, {}).get("start") or time.time()))
        knn = result.get("knn_acc")
        say(f"{self.PREFIX} trial {trial.trial_id} epoch {epoch}/{self.epochs_of(trial)}: loss "
            f"{result.get('loss', math.nan):.4f}" + (f" knn {knn:.4f}" if knn is not None else "")
            + f" eps {result.get('view_noise', math.nan):.4f}")
        child = self._child(trial)
        if child:
            trk.log_metrics_batch(self.run.uri, child, [result], epoch_metric_names([result]))

    def _end(self, trials: list[Trial], trial: Trial, status: str) -> None:
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
            # epochs checkpointed before an interruption but never reported: the run shows every epoch once
            path = last_checkpoint_path(trial.last_result, trial)
            history = ((checkpoint_record(path) if path else None) or {}).get("history", [])
            trk.log_missing_epochs(self.run.uri, child, history, epoch_metric_names(history))
            trk.end_run(self.run.uri, child, status,
                        tags={"stopped_early": early, **({"error": reason} if reason else {})})

    def on_trial_complete(self, iteration: int, trials: list[Trial], trial: Trial, **info: object) -> None:
        self._end(trials, trial, "FINISHED")

    def on_trial_error(self, iteration: int, trials: list[Trial], trial: Trial, **info: object) -> None:
        self._end(trials, trial, "FAILED")


@dataclass
class Record:
    """The tracker's record of a job's trials (:data:`TRACKER_FILE`)."""

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
        """The most trials training at once (first result to end), to compare with ``max_concurrent_trials``."""
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
    tuning: list[dict[str, object]] = field(default_factory=list)  # tables: the tuning phase's trials, one record each
    unit: str = "worker-hours"  # what its hours count: GPU-hours on GPU workers

    def trial_runs(self) -> list[str]:
        """The Ray Train runs its trials may have left on the storage."""
        return [trial_name(o.trial_id) for o in self.outcomes]

    def summary(self) -> str:
        """``"8 trials in 95 s, up to 2 training at once (2 allowed)"``."""
        return (f"{len(self.outcomes)} trials in {self.seconds:.0f} s, up to {self.peak} training at once "
                f"({self.concurrent} allowed)")


def last_checkpoint_path(reported: Mapping[str, object] | str | None, trial: object) -> str | None:
    """Where a trial's last checkpoint is: the ``checkpoint_path`` a Ray Train trial reported (``reported``: its
    metrics, or that path), else that of an inline trial's Tune checkpoint (``trial``: a Tune Trial or Result)."""
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

    def ending(self, ok: bool, why: str = "") -> dict[str, object]:
        """The last fields of its row in every job: ``status``, ``error`` (its own, else ``why``) and ``history``."""
        return {"status": "TERMINATED" if ok else "ERROR", "error": self.error or why, "history": self.history}


def outcomes(grid: tune.ResultGrid, storage: str | None = None) -> list[Outcome]:
    """An :class:`Outcome` per trial of ``grid``. Its history: the newest complete checkpoint's (every epoch across a
    resume; Tune's table of a restored trial starts at the resumed epoch), then Tune's results after it."""
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
        # where each rank ran: the run dir's, else the newest checkpoint's with it (ASHA may stop a trial mid-upload)
        records = [r for r in map(checkpoint_record, newest) if r]  # newest first
        placed = read_json(run_dir, PLACEMENT_FILE) if run_dir else None
        workers = sorted(placed or next((r["workers"] for r in records if r["workers"]), []), key=lambda w: w["rank"])
        history = next((r["history"] for r in records if r["history"]), [])
        seen = int(history[-1]["epoch"]) if history else 0
        history = [*history, *(h for h in reported if int(h.get("epoch", 0) or 0) > seen)]
        history = [epoch_record(h) for h in history]
        out.append(Outcome(trial_id, dict(result.config), last, history, workers, error_reason(result.error)))
    return out


def tune_job(job: Job, trainable: type, space: Config, *, tracker: TrialTracker, concurrent: int, announce: str,
             scheduler: tune.schedulers.TrialScheduler | None = None, num_samples: int = 1,
             reuse_actors: bool = True, metric: str | None = "knn_acc") -> JobResult:
    """Run, or resume, one Tune job of Train trials under ``<storage>/<name>``. ``metric``: what the scheduler ranks
    by (then required in every result). ``reuse_actors``: only for :func:`inline` trials (a trial of several workers
    waits in ``TorchTrainer.fit``, which cannot end in the 2 s Tune gives a reset: a reused process would hold the
    stopped run's workers for 600 s). Raises :class:`SweepError` if interrupted or every trial failed."""
    path = job.run_dir
    resumed = tune.Tuner.can_restore(path)
    if resumed:
        say(f"{tracker.PREFIX} resuming {path}")
        tuner = tune.Tuner.restore(path, trainable=trainable, resume_errored=True, param_space=space)
    else:
        say(announce)
        tune_config = tune.TuneConfig(metric=metric, mode="max" if metric else None, scheduler=scheduler,
                                      num_samples=num_samples, max_concurrent_trials=concurrent,
                                      reuse_actors=reuse_actors, trial_dirname_creator=lambda t: trial_name(t.trial_id))
        run_config = tune.RunConfig(name=job.name, storage_path=job.spec.storage, verbose=0, callbacks=[tracker])
        tuner = tune.Tuner(trainable, param_space=space, tune_config=tune_config, run_config=run_config)
    start = time.time()
    # Tune's own lines (Ctrl-C's "Resume experiment with ...", a failed trial's traceback) repeat what the tracker and
    # the stage say in one line; Ray's session logs keep them
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
                trk.end_run(job.run.uri, child, "KILLED")  # nothing without a child
        fail_job(job, "KILLED")
        total = max(record.total, len(record.trials))
        raise SweepError(f"the {what} was interrupted with {len(unfinished)} of {total} trials unfinished; rerun "
                         f"the stage to resume it from {path}")
    if all(r.error for r in grid):
        failed = SweepError(f"every trial of the {what} failed: "
                            + "; ".join(error_reason(r.error) for r in grid)[:2000])
        fail_job(job, error=str(failed))
        raise failed
    result = JobResult(job=job, outcomes=outcomes(grid, job.spec.storage), seconds=seconds, resumed=resumed,
                       started=start, concurrent=concurrent, peak=record.peak_at_once())
    say(f"{tracker.PREFIX} {result.summary()}")
    return result


def close_tune_job(result: JobResult, files: list[Path], best: Mapping[str, object] | None = None) -> None:
    """Close the job: its MLflow run gets the trials' counts, the ``best`` row's metrics and point, the ``files``."""
    metrics: dict[str, float] = {"trials": len(result.outcomes),
                                 "trials_failed": sum(bool(o.error) for o in result.outcomes)}
    tags: dict[str, object] = {}
    if best:
        metrics |= {f"best.{k}": best[k] for k in ("knn_acc", "best_knn_acc", "view_noise")}  # finite ones logged
        tags = {**{f"best.{k}": v for k, v in point_of(best).items()}, "best.trial_id": best["trial_id"]}
    close_job(result.job, files, metrics=metrics, tags=tags, runs=result.trial_runs())
