"""A job on Ray, as pretraining, the sweep and the tables each run one: opened by :func:`open_job`, closed by
:func:`close_job` (or :func:`fail_job`).

Opening, cheapest check first: the loop callbacks named in ``$TRANSFUSION_CALLBACKS`` resolve; the run storage can be
written; the cluster answers and can hold the job's runs (``pipeline.runs.cluster.connect``) and has their resources
free (``wait_for_workers``); then the job's MLflow run (created once, continued when the job resumes) and the prepared
data staged on the run storage. The result, a :class:`Job`, carries what its runs need: the :class:`WorkerSpec` every
worker gets, the job's identity (:func:`job_name`: a stable name from everything that determines its result, so an
interrupted job resumes and a changed one starts afresh) and its MLflow run.

Closing: the MLflow run gets the job's summary, tags and output files (a pretraining run also its model) and ends
FINISHED; the job's Ray directories and the driver's state are removed, so that a forced rerun trains afresh.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.config.base import ParamsError
from pipeline.config.names import stable_name
from pipeline.config.params import Params
from pipeline.data.storage import check_storage, is_uri, join, stage_prepared
from pipeline.runs import tracking as trk
from pipeline.runs.cluster import connect, wait_for_workers
from pipeline.runs.undocumented import failure_causes
from pipeline.training.loop import Callback

if TYPE_CHECKING:
    import torch

STATE_DIR = ".transfusion"  # the driver's own state of a job under the project root (its MLflow run id)
CALLBACKS_ENV = "TRANSFUSION_CALLBACKS"  # loop callbacks for every run and trial: "module:attr,module:attr"
Manifest = dict[str, object]  # the prepared data's manifest.json (pipeline.data.prepared)


@dataclass
class WorkerSpec:
    """Everything the workers of a Ray run need, shipped by Ray: a pretraining run's, or a Tune job's, whose trials
    each train on their own ``params`` (the job's base with their point applied) under their own ``name``."""

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
        """The Ray run directory on the storage: the workers' status and placement go there."""
        return join(self.storage, self.name)


@dataclass(frozen=True)
class Tracked:
    """A job's MLflow run."""

    uri: str
    experiment_id: str
    run_id: str


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
        """The driver's own state of the job (its MLflow run id, its trials' record), until :func:`close_job`."""
        return self.root / STATE_DIR / self.name


class SweepError(RuntimeError):
    """A Tune job (the sweep, the tables) did not finish (interrupted, or every trial failed); rerunning the stage
    resumes it."""


class TrialFailed(RuntimeError):
    """A trial's training ended with an error its worker reported (e.g. a non-finite loss): the message is the
    one-line reason. Raised from the trial function, so that Tune marks the trial ERROR (MLflow: FAILED)."""


def say(line: str) -> None:
    """A progress line, flushed at once (a worker's reaches the driver's console through Ray's log stream)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def read_manifest(data_dir: Path) -> Manifest:
    return json.loads((data_dir / "manifest.json").read_text())


def job_name(stage: str, params: Params, manifest: Manifest) -> str:
    """A job's stable name (``pretrain-<digest>``, ``sweep-…``, ``tables-…``) from everything that determines its
    result: the sections it reads, the workers, the data. A sweep's trials' base without the swept keys (their base
    value never reaches a trial): ``pipeline.config.space.sweep_keyed``."""
    from pipeline.config.space import sweep_keyed

    sections = {"pretrain": ("model", "loss", "augment", "train"),
                "tables": ("model", "loss", "augment", "train", "probe", "tables")}
    keyed = (sweep_keyed(params) if stage == "sweep" else {s: getattr(params, s).model_dump() for s in sections[stage]})
    keyed["ray"] = {"num_workers": params.ray.num_workers}
    return stable_name(stage, keyed, manifest)


def storage_location(params: Params, root: Path) -> str:
    """``ray.storage_path`` as Ray wants it: a URI as is, a path made absolute against the project root."""
    path = params.ray.storage_path
    return path if is_uri(path) else str((root / path).resolve())


def load_callbacks(refs: str | None = None) -> list[Callback]:
    """The loop callbacks named by ``refs`` (default: ``$TRANSFUSION_CALLBACKS``; none when unset): comma-separated
    ``module:attr``, each a :class:`pipeline.training.loop.Callback` subclass (made without arguments) or instance.

    Made here, in the driver (a callback may read its settings from the driver's environment then), and shipped to the
    workers inside the :class:`WorkerSpec`; each named module goes by value (cloudpickle), so a Ray worker needs no
    copy of it, only what it imports. Raises :class:`ParamsError` naming a reference that does not resolve.
    """
    import ray.cloudpickle

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
        ray.cloudpickle.register_pickle_by_value(module)
        callbacks.append(callback)
    return callbacks


def open_job(stage: str, params: Params, data_dir: Path, root: Path, *, tracking: bool, title: str,
             logged: Mapping[str, object], worker_params: Params | None = None, cpus_per_worker: float | None = None,
             trial_cpu: float = 0.0, what: str = "pretraining") -> Job:
    """Open (or resume) the job ``stage`` of ``params`` on the prepared data in ``data_dir``: checks, the cluster,
    the MLflow run named ``title`` with params ``logged``, the staged data, the workers' spec (their params
    ``worker_params``, default ``params``). ``cpus_per_worker``, ``trial_cpu``, ``what``: a Tune job's request (the
    sweep's CPUs per worker, a trial's own CPU, the word in a refusal)."""
    callbacks = load_callbacks()  # a wrong name fails here, before Ray starts
    manifest = read_manifest(data_dir)
    name = job_name(stage, params, manifest)
    storage = storage_location(params, root)
    check_storage(storage)
    gpu, totals = connect(params, root, tracking=tracking, cpus_per_worker=cpus_per_worker, trial_cpu=trial_cpu,
                          what=what)
    wait_for_workers(params, gpu=gpu, cpus_per_worker=cpus_per_worker, trial_cpu=trial_cpu)
    run = mlflow_run(root, name, stage=stage, title=title, logged=logged, manifest=manifest,
                     data_dir=data_dir) if tracking else None  # only once the cluster can serve the job
    spec = WorkerSpec(params=worker_params or params, data_dir=stage_prepared(data_dir, storage), manifest=manifest,
                      storage=storage, name=name, use_gpu=gpu, callbacks=callbacks)
    return Job(stage=stage, params=params, root=root, gpu=gpu, totals=totals, spec=spec, run=run)


def mlflow_run(root: Path, name: str, *, stage: str, title: str, logged: Mapping[str, object], manifest: Manifest,
               data_dir: Path) -> Tracked:
    """The MLflow run of the job ``name``, created once and continued (RUNNING again) when it resumes, by the id
    kept in ``<root>/.transfusion/<name>/``. Named ``title``; tagged ``stage``, ``<stage>: name`` and the identity
    ``name``; params ``logged``; the prepared data (``manifest``, in ``data_dir``) its dataset input, which a job's
    children inherit."""
    uri = trk.tracking_uri(root)
    exp = trk.experiment_id(uri, root)
    id_file = root / STATE_DIR / name / "mlflow_run_id"  # Job.state_dir
    if id_file.exists():
        run_id = id_file.read_text().strip()
        trk.resume_run(uri, run_id)
        return Tracked(uri, exp, run_id)
    data = trk.dataset_input(manifest, data_dir if data_dir.is_absolute() else root / data_dir)
    tags = {**trk.stage_tags(stage, root), stage: name, trk.IDENTITY_TAG: name}
    run_id = trk.create_run(uri, root, title, tags, logged, inputs=[data])
    id_file.parent.mkdir(parents=True, exist_ok=True)
    id_file.write_text(run_id)
    return Tracked(uri, exp, run_id)


def close_job(job: Job, files: Iterable[Path], *, metrics: Mapping[str, float] | None = None,
              tags: Mapping[str, object] | None = None, model: torch.nn.Module | None = None,
              runs: Iterable[str] = ()) -> None:
    """The job's MLflow run gets ``metrics`` (step 0: the job's summary), ``tags``, the existing ``files`` and the
    ``model`` (MLflow's pytorch flavour), and ends FINISHED; then :func:`cleanup` (``runs``: the Ray Train runs of
    the job's trials)."""
    if job.run:
        uri, run_id = job.run.uri, job.run.run_id
        if metrics:
            trk.log_metrics_batch(uri, run_id, [{"epoch": 0, **metrics}], tuple(metrics))
        trk.set_tags(run_id, tags or {}, uri=uri)
        if model is not None:
            trk.log_pytorch_model(uri, run_id, model, [f for f in files if f.is_file()])
        else:
            trk.log_artifacts(uri, run_id, list(files))
            trk.end_run(uri, run_id, "FINISHED")
    cleanup(job.params, job.root, job.name, runs)


def fail_job(job: Job, status: str = "FAILED") -> None:
    """End the job's MLflow run ``status`` (FAILED, KILLED); a rerun continues it."""
    if job.run:
        trk.end_run(job.run.uri, job.run.run_id, status)


def cleanup(params: Params, root: Path, name: str, runs: Iterable[str] = ()) -> None:
    """Forget the finished job ``name`` (its directory on a local run storage, the driver's state) and the Ray Train
    runs ``runs`` beside it (a job's trials of several workers), so that a forced rerun trains afresh instead of Ray
    returning the old result."""
    storage = storage_location(params, root)
    if not is_uri(storage):
        for run in (name, *runs):
            shutil.rmtree(os.path.join(storage, run), ignore_errors=True)
    shutil.rmtree(root / STATE_DIR / name, ignore_errors=True)


def error_reason(error: BaseException | None) -> str:
    """One line saying why a run or a trial failed ("" without an error): a :class:`TrialFailed`'s message; a Ray
    Train failure's failed ranks, each with its own reason (``rank 0: ...; rank 1: ...``); else the innermost error
    through Ray's wrappers (``pipeline.runs.undocumented.failure_causes``): its first line, after its type unless the
    error is one of ``pipeline``'s own (a message written for the user)."""
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
