"""A job on Ray (pretraining, the sweep, the tables): opened by :func:`open_job` (cheapest checks first), closed by
:func:`close_job` (or :func:`fail_job`), the whole of it inside :func:`ending_runs`, which ends a job's MLflow run that
an error or Ctrl-C leaves open. Its identity (:func:`job_name`) is stable over everything that determines its result,
so an interrupted job resumes and a changed one starts afresh.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.config.base import ParamsError, flatten
from pipeline.config.names import stable_name
from pipeline.config.params import Params
from pipeline.data.storage import check_storage, is_uri, join, stage_prepared
from pipeline.runs import tracking as trk
from pipeline.runs.cluster import check_here, connect, wait_for_workers
from pipeline.runs.tracking_process import tracker
from pipeline.runs.undocumented import failure_causes
from pipeline.training.loop import Callback

if TYPE_CHECKING:
    import torch

STATE_DIR = ".transfusion"  # the driver's own state of a job under the project root (its MLflow run id)
CALLBACKS_ENV = "TRANSFUSION_CALLBACKS"  # loop callbacks for every run and trial: "module:attr,module:attr"
Manifest = dict[str, object]  # the prepared data's manifest.json (pipeline.data.prepared)
TRAINING = ("model", "loss", "augment", "train")  # the sections pretraining reads


@dataclass
class WorkerSpec:
    """Everything the workers of a Ray run need, shipped by Ray (a trial's: its own ``params`` and ``name``)."""

    params: Params
    data_dir: str  # the prepared data as staged on the run storage (pipeline.data.storage.stage_prepared)
    manifest: Manifest  # the manifest the driver saw: each worker checks its copy against it
    storage: str  # the run storage (storage_location: a path or a URI)
    name: str  # the Ray run's name, its directory on the storage (a trial's: trial-<id>)
    use_gpu: bool
    quiet: bool = False  # no per-epoch progress lines (trials: the driver prints them)
    resume_dir: str | None = None  # a checkpoint to start from when Ray knows none (pipeline.runs.train.recover)
    callbacks: list[Callback] = field(default_factory=list)  # the loop's, on every rank (load_callbacks)

    @property
    def run_dir(self) -> str:
        """The Ray run directory on the storage."""
        return join(self.storage, self.name)


@dataclass(frozen=True)
class Tracked:
    """A job's MLflow run."""

    uri: str
    experiment_id: str
    run_id: str


_OPEN: list[Tracked] = []  # this process's job runs that are RUNNING: from open_job to close_job or fail_job


def run_opened(run: Tracked) -> None:
    """Record ``run`` as RUNNING (open_job), so that :func:`ending_runs` ends it if the job stops on an error."""
    _OPEN.append(run)


def run_ended(run: Tracked) -> None:
    """Record ``run`` as ended (close_job, fail_job): :func:`ending_runs` leaves its status alone."""
    if run in _OPEN:
        _OPEN.remove(run)


def open_runs() -> tuple[Tracked, ...]:
    """This process's job runs that are RUNNING, oldest first."""
    return tuple(_OPEN)


@dataclass
class Job:
    stage: str  # pretrain | sweep | tables
    params: Params  # as the job runs them (``ray.cpus_per_worker`` made a number)
    root: Path  # the project root
    gpu: bool  # the workers train on GPUs
    totals: dict[str, float]  # the cluster's resources when the job opened
    spec: WorkerSpec  # what every worker gets; ``spec.name`` is the job's identity
    run: Tracked | None  # its MLflow run (None: --no-tracking)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def run_dir(self) -> str:
        return self.spec.run_dir

    @property
    def state_dir(self) -> Path:
        """The driver's own state of the job (its MLflow run id, its trials' record)."""
        return self.root / STATE_DIR / self.name


class SweepError(RuntimeError):
    """A Tune job did not finish (interrupted, or every trial failed); rerunning the stage resumes it."""


class TrialFailed(RuntimeError):
    """A trial's training ended with an error its worker reported; the message is the one-line reason."""


def say(line: str) -> None:
    """A progress line, flushed at once (a worker's reaches the driver's console through Ray's log stream)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def read_manifest(data_dir: Path) -> Manifest:
    return json.loads((data_dir / "manifest.json").read_text())


def job_name(stage: str, params: Params, manifest: Manifest) -> str:
    """A job's stable name (``pretrain-<digest>``): its sections (a sweep's: ``sweep_keyed``), workers, data."""
    from pipeline.config.space import sweep_keyed

    sections = {"pretrain": TRAINING, "tables": (*TRAINING, "probe", "tables")}
    keyed = (sweep_keyed(params) if stage == "sweep" else {s: getattr(params, s).model_dump() for s in sections[stage]})
    keyed["ray"] = {"num_workers": params.ray.num_workers}
    return stable_name(stage, keyed, manifest)


def flat_sections(params: Params | Mapping[str, object], sections: tuple[str, ...],
                  keys: tuple[str, ...] = ()) -> dict[str, object]:
    """The flat params (``{"model.depth": 1}``) of ``sections`` and the ``keys``: what a job's MLflow run logs."""
    return {k: v for k, v in flatten(params).items() if k.split(".")[0] in sections or k in keys}


def storage_location(params: Params, root: Path) -> str:
    """``ray.storage_path`` as Ray wants it: a URI as is, a path made absolute against the project root."""
    path = params.ray.storage_path
    return path if is_uri(path) else str((root / path).resolve())


def load_callbacks(refs: str | None = None) -> list[Callback]:
    """The loop callbacks named by ``refs`` (default ``$TRANSFUSION_CALLBACKS``): ``module:attr,...``, each a
    ``Callback`` subclass or instance. Made in the driver (it may read its environment) and shipped to the workers,
    their modules pickled by value, so that a worker needs no copy. Raises :class:`ParamsError` for a bad name."""
    refs = os.environ.get(CALLBACKS_ENV, "") if refs is None else refs
    callbacks = []
    for ref in (r.strip() for r in refs.split(",") if r.strip()):
        module_name, _, attr = ref.partition(":")
        try:
            module = importlib.import_module(module_name)
            found = getattr(module, attr)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ParamsError(f"{CALLBACKS_ENV}: {ref!r} does not resolve ({type(exc).__name__}: {exc}); name each "
                              "callback as module:attr, its module importable here (PYTHONPATH)") from None
        callback = found() if isinstance(found, type) and issubclass(found, Callback) else found
        if not isinstance(callback, Callback):
            raise ParamsError(f"{CALLBACKS_ENV}: {ref!r} is a {type(found).__name__}, not a Callback subclass or "
                              "instance (pipeline.training.loop.Callback)")
        import ray.cloudpickle  # only with callbacks: a run in this process imports no Ray

        ray.cloudpickle.register_pickle_by_value(module)
        callbacks.append(callback)
    return callbacks


def open_job(stage: str, params: Params, data_dir: Path, root: Path, *, tracking: bool, title: str,
             logged: Mapping[str, object], worker_params: Params | None = None, cpus_per_worker: float | None = None,
             trial_cpu: float = 0.0, what: str = "pretraining", here: bool = False) -> Job:
    """Open (or resume) the job ``stage`` on ``data_dir``: its MLflow run ``title`` logs ``logged``, its workers get
    ``worker_params`` (default ``params``); ``cpus_per_worker``, ``trial_cpu``, ``what``: a Tune job's request;
    ``here``: its one worker runs in this process (no Ray), on ``data_dir`` as it is."""
    callbacks = load_callbacks()  # a wrong name fails here, before Ray starts
    manifest = read_manifest(data_dir)
    name = job_name(stage, params, manifest)
    storage = storage_location(params, root)
    check_storage(storage)
    if here:
        capacity = check_here(params, root, tracking=tracking)
    else:
        capacity = connect(params, root, tracking=tracking, cpus_per_worker=cpus_per_worker, trial_cpu=trial_cpu,
                           what=what)
        wait_for_workers(params, gpu=capacity.gpu, cpus_per_worker=cpus_per_worker, trial_cpu=trial_cpu)
    gpu, totals = capacity.gpu, capacity.totals
    run = mlflow_run(root, name, stage=stage, title=title, logged=logged, manifest=manifest,
                     data_dir=data_dir) if tracking else None  # only once the cluster can serve the job
    if run:
        run_opened(run)  # from here on, ending_runs ends it if anything fails
    staged = str(data_dir.resolve()) if here else stage_prepared(data_dir, storage)
    spec = WorkerSpec(params=worker_params or params, data_dir=staged, manifest=manifest,
                      storage=storage, name=name, use_gpu=gpu, callbacks=callbacks)
    return Job(stage=stage, params=params, root=root, gpu=gpu, totals=totals, spec=spec, run=run)


def mlflow_run(root: Path, name: str, *, stage: str, title: str, logged: Mapping[str, object], manifest: Manifest,
               data_dir: Path) -> Tracked:
    """The MLflow run of the job ``name``: created once, continued by the id kept in its state dir when it resumes
    (through this process's tracker: its tracking process, when the stage started one)."""
    via = tracker()
    uri = trk.tracking_uri(root)
    exp = via.experiment_id(uri, root)
    id_file = root / STATE_DIR / name / "mlflow_run_id"  # Job.state_dir
    if id_file.exists():
        run_id = id_file.read_text().strip()
        via.resume_run(uri, run_id)
        return Tracked(uri, exp, run_id)
    tags = {**trk.stage_tags(stage, root), stage: name, trk.IDENTITY_TAG: name}
    run_id = via.create_job_run(uri, root, title, tags, logged, manifest,
                                data_dir if data_dir.is_absolute() else root / data_dir)
    id_file.parent.mkdir(parents=True, exist_ok=True)
    id_file.write_text(run_id)
    return Tracked(uri, exp, run_id)


def close_job(job: Job, files: Iterable[Path], *, metrics: Mapping[str, float] | None = None,
              tags: Mapping[str, object] | None = None, model: torch.nn.Module | None = None,
              runs: Iterable[str] = ()) -> None:
    """The job's MLflow run gets ``metrics`` (step 0), ``tags``, ``files``, ``model``, ends FINISHED; then cleanup."""
    if job.run:
        uri, run_id, via = job.run.uri, job.run.run_id, tracker()
        if metrics:
            via.log_metrics_batch(uri, run_id, [{"epoch": 0, **metrics}], tuple(metrics))
        via.set_tags(run_id, tags or {}, uri=uri)
        if model is not None:
            via.log_pytorch_model(uri, run_id, model, [f for f in files if f.is_file()])
        else:
            via.log_artifacts(uri, run_id, list(files))
            via.end_run(uri, run_id, "FINISHED")
        run_ended(job.run)
    cleanup(job.params, job.root, job.name, runs)


def fail_job(job: Job, status: str = "FAILED", error: str = "") -> None:
    """End the job's MLflow run ``status`` (FAILED, KILLED), tagged ``error`` (one line) when given; a rerun
    continues it."""
    if job.run:
        tracker().end_run(job.run.uri, job.run.run_id, status, {"error": error} if error else None)
        run_ended(job.run)


@contextlib.contextmanager
def ending_runs() -> Iterator[None]:
    """The block in which a stage runs a job, writes its outputs and closes it (:func:`close_job`). A job opened in
    the block whose MLflow run is still RUNNING when the block raises is ended there: FAILED, tagged ``error`` (the
    exception's one line, :func:`error_reason`), or KILLED on Ctrl-C. A run already ended (:func:`fail_job`, a
    sweep's interruption) keeps its status; a store that cannot end it is one warning line, the error stays."""
    before = open_runs()
    try:
        yield
    except BaseException as exc:
        interrupted = isinstance(exc, KeyboardInterrupt)
        for run in [r for r in open_runs() if r not in before]:
            try:
                tracker().end_run(run.uri, run.run_id, "KILLED" if interrupted else "FAILED",
                            None if interrupted else {"error": error_reason(exc) or type(exc).__name__})
            except Exception as end_exc:  # the store itself may be what failed: the job's error is the one to see
                sys.stderr.write(f"warning: could not end MLflow run {run.run_id} in {run.uri} ({end_exc})\n")
            run_ended(run)
        raise


def cleanup(params: Params, root: Path, name: str, runs: Iterable[str] = ()) -> None:
    """Forget the finished job ``name`` and the Ray Train ``runs`` beside it (on a local storage) and the driver's
    state, so that a forced rerun trains afresh instead of Ray returning the old result."""
    storage = storage_location(params, root)
    if not is_uri(storage):
        for run in (name, *runs):
            shutil.rmtree(os.path.join(storage, run), ignore_errors=True)
    shutil.rmtree(root / STATE_DIR / name, ignore_errors=True)


def error_reason(error: BaseException | None) -> str:
    """One line saying why a run or a trial failed ("" without an error): a :class:`TrialFailed`'s message; the
    failed ranks' reasons (``rank 0: ...; rank 1: ...``); else the innermost error's first line, after its type
    unless it is one of ``pipeline``'s own (written for the user)."""
    if error is None:
        return ""
    seen = error
    for _ in range(8):
        if type(seen) is TrialFailed:  # not Ray's copy of it (``as_instanceof_cause``), whose text is a traceback
            return " ".join(str(seen).split())[:500]
        failures, inner = failure_causes(seen)
        if failures:
            return "; ".join(f"rank {rank}: {error_reason(e)}" for rank, e in sorted(failures.items()))[:2000]
        if inner is None:
            break
        seen = inner
    lines = [ln.strip() for ln in str(seen).splitlines() if ln.strip()]
    first = lines[0] if lines else ""
    if type(seen).__module__.startswith("pipeline."):  # ours (e.g. DatasetError): written for the user, said as is
        return first[:500]
    return f"{type(seen).__name__}: {first}"[:500]
