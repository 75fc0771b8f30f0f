"""Distributed pretraining on Ray Train (V2 ``TorchTrainer``): orchestration only.

The driver (:func:`pretrain`) validates and fails fast (data, tracking store), names the Ray run after
everything that determines its result (so an interrupted run resumes, and a changed one starts afresh),
launches ``ray.num_workers`` workers running :class:`pipeline.training.loop.PretrainLoop` on the global batch,
and turns the final checkpoint into the stage's outputs. Rank 0 writes checkpoints (``train.checkpoint_every``)
through Ray's checkpoint API and reports per-epoch metrics, which Ray Train's controller (on the driver's node)
logs to MLflow (``pipeline.runs.tracking.epoch_logger``); ``ray.max_failures``
restarts a failed worker group from the last one. After a successful run the Ray run directory is
removed (:func:`cleanup`), so a later forced rerun trains again instead of returning the old result.

Also what the Tune jobs (``pipeline.runs.tune``) share with it: the spec their workers get (:class:`WorkerSpec`, a
job's trials each with their own params and name), the loop callbacks named in ``$TRANSFUSION_CALLBACKS``
(:func:`load_callbacks`), the MLflow run kept across resumes (:func:`mlflow_run`), the one-line failure reason
(:func:`error_reason`), progress lines (:func:`say`) and :func:`cleanup`.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeline.config.base import ParamsError, flatten
from pipeline.config.names import pretrain_label, stable_name
from pipeline.config.params import Params
from pipeline.config.ray import torch_threads
from pipeline.core.plan import HeadPlan
from pipeline.data.prepared import load_prepared, prepared_nbytes
from pipeline.evaluation.health import is_health_key
from pipeline.host import use_threads
from pipeline.io import load_torch
from pipeline.runs import tracking as trk
from pipeline.runs.cluster import TRAIN_CONSOLE_LEVEL, connect, train_logging, wait_for_workers, with_worker_cpus
from pipeline.runs.storage import (
    PLACEMENT_FILE,
    STATUS_FILE,
    check_storage,
    clear_status,
    fetch_prepared,
    is_uri,
    join,
    read_json,
    stage_prepared,
    write_json,
)
from pipeline.training.loop import Callback, EpochMetrics, PretrainLoop, data_budget
from pipeline.training.step import NonFiniteLossError

EPOCH_METRICS = ("loss", "lr", "samples_per_s", "view_noise", "knn_acc", "seconds")  # per-epoch, in MLflow
STATE_FILE = "state.pt"
HISTORY_FILE = "history.json"  # per-epoch metrics up to the checkpoint, beside STATE_FILE
WORKERS_FILE = "workers.json"  # where each rank ran (node, host, device, Ray's GPU ids), beside STATE_FILE
STATE_DIR = ".transfusion"  # the driver's own state of a run or job under the project root (its MLflow run id)
CALLBACKS_ENV = "TRANSFUSION_CALLBACKS"  # loop callbacks for every run and trial: "module:attr,module:attr"


def epoch_metric_names(history: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
    """The per-epoch metrics MLflow gets, of a pretraining run and of a trial: :data:`EPOCH_METRICS` and the blocks'
    health that the last epoch of ``history`` holds (``block_1.positive``, ...; ABC's kernel: ``kernel.same_class``)."""
    return EPOCH_METRICS + tuple(k for k in (history[-1] if history else {}) if is_health_key(k))


class PretrainError(RuntimeError):
    """Training stopped (non-finite loss, failed workers); the last good checkpoint is kept."""


class TrialFailed(RuntimeError):
    """A trial's training ended with an error its worker reported (e.g. a non-finite loss): the message is the
    one-line reason. Raised from the trial function, so that Tune marks the trial ERROR (MLflow: FAILED)."""


@dataclass
class WorkerSpec:
    """Everything the workers of a Ray run need, shipped by Ray: a pretraining run's, or a Tune job's, whose trials
    each train on their own ``params`` (the job's base with their point applied) under their own ``name``."""

    params: dict[str, Any]  # Params.model_dump()
    data_dir: str  # the prepared data as staged on the run storage (pipeline.runs.storage.stage_prepared)
    manifest: dict[str, Any]  # the manifest the driver saw: each worker checks its copy against it
    storage: str  # the run storage (storage_location: a path or a URI)
    name: str  # the Ray run's name, its directory on the storage (a trial's: trial-<id>)
    use_gpu: bool
    quiet: bool = False  # no per-epoch progress lines (trials: the driver prints them)
    resume_dir: str | None = None  # a checkpoint to start from when Ray knows none (see recover_run_snapshot)
    callbacks: list[Callback] = field(default_factory=list)  # the loop's, on every rank (load_callbacks)

    @property
    def run_dir(self) -> str:
        """The Ray run directory on the storage: the workers' status and placement go there."""
        return join(self.storage, self.name)


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


def say(line: str) -> None:
    """A progress line, flushed at once (a worker's reaches the driver's console through Ray's log stream)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _placement(rank: int, world: int, device: torch.device) -> list[dict[str, Any]]:
    """Where every rank runs (Ray node id, host, pid, device), gathered on all ranks: provenance for the outputs."""
    import socket

    import ray

    me = {"rank": rank, "node_id": ray.get_runtime_context().get_node_id(), "host": socket.gethostname(),
          "pid": os.getpid(), "device": str(device), "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}
    if world == 1 or not torch.distributed.is_initialized():
        return [me]
    everyone: list[Any] = [None] * world
    torch.distributed.all_gather_object(everyone, me)
    return everyone


def worker_device(use_gpu: bool, backend: str, *, ray_train: bool = True) -> torch.device:
    """The device a worker trains on: its GPU when it was scheduled on one, CUDA sees it and the backend is a GPU
    one; the CPU otherwise.

    ``ray.backend: gloo`` trains on the CPU, whether CUDA sees a GPU or not: gloo is the CPU backend, and the step's
    collectives (global BN's, the embeddings' gathers, the gradient buckets) on CUDA tensors over gloo would each go
    through the host. Where CUDA sees a GPU that is said once in the log (``ray.backend: auto`` or ``nccl`` trains on
    it). This is also what lets a worker scheduled on a GPU that CUDA cannot see (a node that declares GPUs it
    does not have, as the rehearsals of GPU presets do: ``ray start --num-gpus N``) train on the CPU. With another
    backend that worker is an error, not a silent fall-back to the CPU.
    ``ray_train``: inside a Ray Train worker (its device from Ray Train), else a one-worker trial (the first GPU).
    """
    if not use_gpu:
        return torch.device("cpu")
    if backend == "gloo":
        if torch.cuda.is_available():
            logging.getLogger(__name__).warning(
                "ray.backend: gloo trains on the CPU although CUDA sees %d GPU(s) here; set ray.backend: auto (or "
                "nccl) to train on them", torch.cuda.device_count())
        return torch.device("cpu")
    if torch.cuda.is_available():
        if ray_train:
            import ray.train.torch

            return ray.train.torch.get_device()
        return torch.device("cuda")
    import ray

    raise RuntimeError(f"this worker was scheduled on GPU {', '.join(map(str, ray.get_gpu_ids())) or '?'} but CUDA "
                       "sees no GPU here; fix the node's CUDA setup, or set ray.backend: gloo to train on its CPU "
                       "(a rehearsal on a node that only declares GPUs)")


class Session:
    """Where a worker's checkpoint comes from and where its per-epoch reports go.

    Two implementations: :class:`TrainSession` (a Ray Train worker, :func:`train_loop_per_worker`) and
    ``pipeline.runs.tune.TuneSession`` (a one-worker trial that trains inside the Tune trial itself).
    """

    def get_checkpoint(self) -> Any:  # a ``ray.train.Checkpoint`` (or Tune's, the same class) or None
        raise NotImplementedError

    def report(self, metrics: dict[str, Any], checkpoint_dir: str | None) -> None:
        """Report one epoch; ``checkpoint_dir`` (a temp directory, the session deletes it after the upload) holds
        its checkpoint, if any."""
        raise NotImplementedError


class TrainSession(Session):
    """Ray Train's: rank 0's checkpoint is uploaded in the background (``ASYNC``) while the next epoch trains, so
    that a slow storage (a bucket) does not stall the workers; Ray uploads what is pending before the run ends, so the
    final checkpoint is always there. The price: a worker that dies during an upload loses that checkpoint, and the
    run resumes from the one before it."""

    def get_checkpoint(self) -> Any:
        import ray.train

        return ray.train.get_checkpoint()

    def report(self, metrics: dict[str, Any], checkpoint_dir: str | None) -> None:
        import ray.train

        if checkpoint_dir is None:
            ray.train.report(metrics)
            return
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(checkpoint_dir),
                         checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC,
                         delete_local_checkpoint_after_upload=True)


def run_worker(spec: WorkerSpec, session: Session, rank: int = 0, world: int = 1,
               device: torch.device | None = None) -> PretrainLoop | None:
    """One worker's pretraining: resume from the session's checkpoint (or ``spec.resume_dir``), train the remaining
    epochs, report each through ``session`` with a checkpoint every ``train.checkpoint_every`` epochs (rank 0).

    Returns the loop, or None when the loss became non-finite: then rank 0 has written the error status
    (``pipeline.runs.storage.STATUS_FILE`` in ``spec.run_dir``) and the last good checkpoint is kept.
    """
    import ray.train

    params = Params.model_validate(spec.params, strict=False)
    use_threads(torch_threads(params.ray.cpus_per_worker))  # torch's and BLAS's (Ray set OMP_NUM_THREADS)
    device = device or torch.device("cpu")
    # the copy the driver staged, or a clear error; mapped, not read, when the loop will stream it (beyond the data
    # budget) or put it on a GPU (no host copy of what the device holds)
    budget = data_budget(params.train.data_budget_mb, device)
    data = fetch_prepared(spec.data_dir, spec.manifest,
                          mmap=device.type == "cuda" or prepared_nbytes(spec.manifest) > budget)
    loop = PretrainLoop(params, data, device, rank=rank, world_size=world, budget=budget)
    if rank == 0 and not spec.quiet:
        say(f"[pretrain] {loop.data_line()}")
        say(f"[pretrain] {loop.head_plan.describe()}")
    workers = _placement(rank, world, device)
    if rank == 0:
        write_json(spec.run_dir, PLACEMENT_FILE, workers)

    checkpoint = session.get_checkpoint()
    if checkpoint is None and spec.resume_dir:  # Ray's own record of the run was lost: ours is the checkpoint
        checkpoint = ray.train.Checkpoint.from_directory(spec.resume_dir)
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            restore(loop, Path(d))
        if rank == 0 and not spec.quiet:
            say(f"[pretrain] resumed from the checkpoint after epoch {loop.epoch}")

    def report(m: EpochMetrics, checkpoint_now: bool) -> None:
        metrics = {k: v for k, v in m.as_dict().items() if v is not None}
        if rank == 0 and not spec.quiet:
            say(f"[pretrain] {m.line(params.train.epochs)}")
        if checkpoint_now and rank == 0:
            d = tempfile.mkdtemp(prefix="transfusion-ckpt-")
            torch.save({**loop.state_dict(), "workers": workers}, Path(d) / STATE_FILE)
            Path(d, HISTORY_FILE).write_text(json.dumps(loop.history))  # readable without loading the model
            Path(d, WORKERS_FILE).write_text(json.dumps(workers))
            session.report(metrics, d)
        else:
            session.report(metrics, None)

    try:
        loop.fit(report, spec.callbacks)
    except NonFiniteLossError as exc:  # every rank sees the same all-reduced loss and stops alike
        if rank == 0:
            write_json(spec.run_dir, STATUS_FILE, {"error": "non_finite", "message": str(exc), "epoch": loop.epoch})
        return None
    return loop


def restore(loop: PretrainLoop, directory: Path) -> None:
    """Restore ``loop`` from the checkpoint in ``directory`` (its ``STATE_FILE``), each tensor where its owner keeps it.

    Loaded on the host, not on the loop's device: the model's ``load_state_dict`` copies into its (device) tensors,
    the optimizer's moves its moment buffers to each parameter's device and keeps ``state["step"]`` where it was
    loaded (torch does, unless the optimizer is capturable or fused), which must be the host: non-capturable Adam
    reads every parameter's step with ``.item()``, one host sync per parameter and step had it been loaded on a GPU
    (tests/runs/test_resume.py counts them at 0).
    """
    loop.load_state_dict(torch.load(directory / STATE_FILE, map_location="cpu", weights_only=True))


def status_reason(status: dict[str, Any]) -> str:
    """One line from a worker's error status: ``"<kind>: <message> (last good epoch N)"``."""
    reason = " ".join(str(status.get("message") or status).split())
    if status.get("error"):
        reason = f"{status['error']}: {reason}"
    if status.get("epoch") is not None:
        reason += f" (last good epoch {status['epoch']})"
    return reason


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train worker entry point."""
    import ray.train
    import ray.train.torch

    # Ray Train V2 logs every report at INFO and tees print() twice; keep the console to our progress lines. Its
    # per-report line ("Reporting training result ...") comes from a logger named after its file's path, which
    # propagates to the root logger, set to INFO in Ray Train's workers: WARNING and above from it
    logging.getLogger("ray.train").setLevel(logging.WARNING)
    logging.getLogger().setLevel(logging.WARNING)
    spec: WorkerSpec = config["spec"]
    ctx = ray.train.get_context()
    device = worker_device(spec.use_gpu, spec.params["ray"]["backend"])
    try:
        run_worker(spec, TrainSession(), ctx.get_world_rank(), ctx.get_world_size(), device)
    except ray.exceptions.ActorDiedError as exc:
        if not run_torn_down(exc):
            raise
        # the run is being torn down (ASHA stopped its trial, Ctrl-C): its controller ends it; no traceback here


def run_torn_down(exc: BaseException) -> bool:
    """``exc`` says that the run's own synchronization actor died because the run's placement group was removed:
    the controller tore the run down (a trial stopped by ASHA, an interrupted job), not a failure of this worker."""
    text = str(exc)
    return "SynchronizationActor" in text and "placement group was removed" in text


# ---------------------------------------------------------------------------------------------- driver
SNAPSHOT_FILE = "checkpoint_manager_snapshot.json"  # Ray Train V2's record of a run's checkpoints


def recover_run_snapshot(run_dir: str | None) -> str | None:
    """Make an interrupted run resumable even if Ray's run snapshot was torn by the interruption.

    Ray Train writes ``checkpoint_manager_snapshot.json`` in place; a driver killed during that write leaves it
    empty or truncated, and the next ``fit`` of the same run then dies in the controller's start-up. If the file
    is unreadable, it is moved aside (``.corrupt``) and the newest ``checkpoint_*`` directory whose state loads
    is returned, for the worker to start from. Returns None when nothing needs recovering (or for remote storage).
    """
    if not run_dir:
        return None
    snapshot = Path(run_dir, SNAPSHOT_FILE)
    if not snapshot.exists():
        return None
    try:
        json.loads(snapshot.read_text())
        return None
    except (ValueError, OSError, UnicodeDecodeError):
        snapshot.replace(snapshot.with_name(SNAPSHOT_FILE + ".corrupt"))
    for ckpt in sorted(Path(run_dir).glob("checkpoint_*"), reverse=True):  # names sort by time
        try:
            torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=True)
        except Exception:  # a torn checkpoint: try the one before
            continue
        say(f"[pretrain] Ray's run record {snapshot} was unreadable (torn by an interruption); "
            f"resuming from {ckpt.name}")
        return str(ckpt)
    say(f"[pretrain] Ray's run record {snapshot} was unreadable and no checkpoint loads; starting afresh")
    return None


def run_name(params: Params, manifest: dict[str, Any]) -> str:
    """A stable name from everything that determines the result: the params pretraining reads, the data."""
    keyed = {s: getattr(params, s).model_dump() for s in ("model", "loss", "augment", "train")}
    keyed["ray"] = {"num_workers": params.ray.num_workers}
    return stable_name("pretrain", keyed, manifest)


def storage_location(params: Params, root: Path) -> str:
    """``ray.storage_path`` as Ray wants it: a URI as is, a path made absolute against the project root."""
    path = params.ray.storage_path
    return path if is_uri(path) else str((root / path).resolve())


@dataclass
class PretrainResult:
    state: dict[str, Any]  # model state_dict, history, epoch, ...
    run_name: str
    mlflow_run_id: str | None
    input_shape: tuple[int, ...]
    n_classes: int
    fit_started: float = 0.0  # when Ray Train's run started (time.time())
    fit_seconds: float = 0.0  # its wall time: Ray Train's start and stop, the epochs and their reports


def pretrain(params: Params, data_dir: Path, root: Path, *, tracking: bool = True) -> PretrainResult:
    """Run (or resume) distributed pretraining; returns the final state.

    Raises :class:`ParamsError` (a request the cluster can never satisfy), :class:`ClusterError` (unreachable
    cluster, resources never free), :class:`PretrainError` (training failed or diverged).
    """
    callbacks = load_callbacks()  # a wrong name fails here, before Ray starts
    params = with_worker_cpus(params)
    data = load_prepared(data_dir, verify=True, mmap=True)  # a corrupt input fails here, before Ray starts
    manifest = json.loads((data_dir / "manifest.json").read_text())
    if params.train.batch_size > len(data.train.y):
        raise ParamsError(f"train.batch_size ({params.train.batch_size}) exceeds the training set "
                          f"({len(data.train.y)} samples in {data_dir}); lower it or prepare more data")
    name = run_name(params, manifest)
    storage = storage_location(params, root)
    check_storage(storage)
    run_dir = join(storage, name)
    clear_status(run_dir)
    gpu, _ = connect(params, root, tracking=tracking)
    wait_for_workers(params, gpu=gpu)
    uri = run_id = None
    if tracking:  # named by what it trains (``pretrain · cnn_small · depth 1 · jsd · b128 · s0``)
        flat = {k: v for k, v in flatten(params).items() if k.split(".")[0] in ("model", "loss", "augment", "train")
                or k in ("ray.num_workers", "ray.use_gpu")}
        uri, _, run_id = mlflow_run(root, name, stage="pretrain", title=pretrain_label(flat), logged=flat,
                                    manifest=manifest, data_dir=data_dir)
    spec = WorkerSpec(params=params.model_dump(), data_dir=stage_prepared(data_dir, storage), manifest=manifest,
                      storage=storage, name=name, use_gpu=gpu, callbacks=callbacks,
                      resume_dir=recover_run_snapshot(None if is_uri(run_dir) else run_dir))
    system = trk.SystemMetrics(uri, run_id) if run_id else None  # the driver's node while Ray trains
    fit_started, fit_start = time.time(), time.perf_counter()
    try:
        state, _ = fit_run(spec, params, [trk.epoch_logger(uri, run_id)] if run_id else [], keep=2,
                           max_failures=params.ray.max_failures)
    except Exception as exc:
        trk.end_run(uri, run_id, "FAILED")
        message = error_reason(exc)
        if "prepared data" not in message:  # a worker that cannot read the data has nothing to resume
            message += f"; rerun the stage to resume from the last checkpoint in {run_dir}"
        raise PretrainError(f"pretraining failed: {message}") from exc
    finally:
        if system:
            system.stop()
    fit_seconds = time.perf_counter() - fit_start
    status = read_json(run_dir, STATUS_FILE)
    if status:
        trk.end_run(uri, run_id, "FAILED")
        raise PretrainError(f"pretraining stopped: {status['message']}; the last good checkpoint is kept in "
                            f"{run_dir} (lower train.lr, or check the data for NaN)")
    if state is None:
        raise PretrainError("pretraining finished without a checkpoint")
    if run_id:  # epochs checkpointed before an interruption but never logged: the run shows every epoch once
        trk.log_missing_epochs(uri, run_id, state["history"], epoch_metric_names(state["history"]))
        if "head_plan" in state:  # the head's path on the workers (pipeline.core.plan): dense|tiled, sharded
            trk.set_tags(run_id, HeadPlan(**state["head_plan"]).tags(), uri=uri)
    return PretrainResult(state=state, run_name=name, mlflow_run_id=run_id, input_shape=data.input_shape,
                          n_classes=len(data.classes), fit_started=fit_started, fit_seconds=fit_seconds)


def fit_run(spec: WorkerSpec, params: Params, callbacks: list[Any], keep: int, max_failures: int = 0,
            console_level: str = TRAIN_CONSOLE_LEVEL) -> tuple[dict[str, Any] | None, str | None]:
    """Ray Train's run of ``spec``'s workers (``params.ray``: how many, their CPUs, the backend) with the Ray Train
    ``callbacks``, keeping ``keep`` checkpoints, restarting a failed worker group ``max_failures`` times, Ray Train's
    console at ``console_level`` (a trial's: ``pipeline.runs.cluster.TRIAL_CONSOLE_LEVEL``). Returns
    the state in its final checkpoint and where that is (None, None without one)."""
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    # the controller collects each report when it polls (default every 2 s) and a worker's next report
    # waits for that: with short epochs that idles the workers, so poll faster (propagated by Ray Train)
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
    result = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"spec": spec},
        # auto: Ray's own choice (backend None: nccl on GPUs, gloo otherwise)
        torch_config=TorchConfig(backend=None if params.ray.backend == "auto" else params.ray.backend),
        scaling_config=ray.train.ScalingConfig(num_workers=params.ray.num_workers, use_gpu=spec.use_gpu,
                                               resources_per_worker={"CPU": params.ray.cpus_per_worker}),
        run_config=ray.train.RunConfig(name=spec.name, storage_path=spec.storage, callbacks=callbacks,
                                       failure_config=ray.train.FailureConfig(max_failures=max_failures),
                                       checkpoint_config=ray.train.CheckpointConfig(num_to_keep=keep),
                                       logging_config=train_logging(console_level)),
    ).fit()
    if result.checkpoint is None:
        return None, None
    with result.checkpoint.as_directory() as d:
        return load_torch(Path(d) / STATE_FILE), result.checkpoint.path


def mlflow_run(root: Path, name: str, *, stage: str, title: str, logged: Mapping[str, Any], manifest: dict[str, Any],
               data_dir: Path, tags: Mapping[str, str] | None = None) -> tuple[str, str, str]:
    """(uri, experiment id, run id): the MLflow run of the pretraining run or Tune job ``name``, created once and
    continued (RUNNING again) when it resumes, by the id kept in ``<root>/.transfusion/<name>/``. Named ``title``;
    tagged ``stage``, ``tags`` and the identity ``name``; params ``logged``; the prepared data (``manifest``, in
    ``data_dir``) its dataset input, which a job's children inherit."""
    uri = trk.tracking_uri(root)
    exp = trk.experiment_id(uri, root)
    id_file = root / STATE_DIR / name / "mlflow_run_id"
    if id_file.exists():
        run_id = id_file.read_text().strip()
        trk.resume_run(uri, run_id)
        return uri, exp, run_id
    data = trk.dataset_input(manifest, data_dir if data_dir.is_absolute() else root / data_dir)
    run_id = trk.create_run(uri, root, title, {**trk.stage_tags(stage, root), **(tags or {}), trk.IDENTITY_TAG: name},
                            logged, inputs=[data])
    id_file.parent.mkdir(parents=True, exist_ok=True)
    id_file.write_text(run_id)
    return uri, exp, run_id


def error_reason(error: BaseException | None) -> str:
    """One line saying why a run or a trial failed ("" without an error): a :class:`TrialFailed`'s message; a Ray
    Train failure's failed ranks, each with its own reason (``rank 0: ...; rank 1: ...``); else the innermost error
    through Ray's wrappers (``RayTaskError.cause``, a controller's failure, ``__cause__``): its first line, after its
    type unless the error is one of ``pipeline``'s own (a message written for the user)."""
    if error is None:
        return ""
    seen = error
    for _ in range(8):
        if type(seen) is TrialFailed:  # not Ray's copy of it (``as_instanceof_cause``), whose text is a traceback
            return " ".join(str(seen).split())[:500]
        failures = getattr(seen, "worker_failures", None)
        if isinstance(failures, dict) and failures:
            return "; ".join(f"rank {rank}: {error_reason(e)}" for rank, e in sorted(failures.items()))[:2000]
        inner = getattr(seen, "cause", None) or getattr(seen, "controller_failure", None) or seen.__cause__
        if not isinstance(inner, BaseException):
            break
        seen = inner
    lines = [ln.strip() for ln in str(seen).splitlines() if ln.strip()]
    first = lines[0] if lines else ""
    if type(seen).__module__.startswith("pipeline."):  # ours (e.g. DatasetError): written for the user, said as is
        return first[:500]
    return f"{type(seen).__name__}: {first}"[:500]


def cleanup(params: Params, root: Path, name: str, runs: Iterable[str] = ()) -> None:
    """Forget the finished run or Tune job ``name`` (its directory on a local run storage, the driver's state) and the
    Ray Train runs ``runs`` beside it (a job's trials of several workers), so that a forced rerun trains afresh
    instead of Ray returning the old result."""
    storage = storage_location(params, root)
    if not is_uri(storage):
        for run in (name, *runs):
            shutil.rmtree(os.path.join(storage, run), ignore_errors=True)
    shutil.rmtree(root / STATE_DIR / name, ignore_errors=True)
