"""Pretraining: the workers' loop (:func:`run_worker`), a Ray Train (V2 ``TorchTrainer``) run of it (:func:`fit_run`,
also a Tune trial's of several workers), its run in this process (:func:`train_here`) and the pretraining job
(:func:`pretrain`), which trains in this process when Ray Train would add nothing but its cost (:func:`in_process`).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import torch

from pipeline.config.base import ParamsError
from pipeline.config.names import pretrain_label
from pipeline.config.params import Params
from pipeline.config.ray import torch_threads
from pipeline.core.plan import HeadPlan
from pipeline.data.prepared import load_prepared, prepared_nbytes
from pipeline.data.storage import (
    PLACEMENT_FILE,
    STATUS_FILE,
    clear_status,
    fetch_prepared,
    is_uri,
    read_json,
    write_json,
)
from pipeline.evaluation.health import is_health_key
from pipeline.host import use_threads
from pipeline.io import load_torch
from pipeline.runs import tracking as trk
from pipeline.runs.cluster import TRAIN_CONSOLE_LEVEL, address_of, with_worker_cpus
from pipeline.runs.job import TRAINING, Job, WorkerSpec, error_reason, fail_job, flat_sections, open_job, say
from pipeline.runs.tracking_process import tracker
from pipeline.runs.undocumented import (
    CHECKPOINT_PREFIX,
    checkpoint_dirs,
    poll_reports_fast,
    run_torn_down,
    torn_snapshot,
)
from pipeline.training.loop import EpochMetrics, PretrainLoop, data_budget, epoch_metrics
from pipeline.training.step import NonFiniteLossError

if TYPE_CHECKING:
    import ray.train

# a checkpoint is two files: the state that resumes the run, and its record, readable without torch
STATE_FILE = "state.pt"  # PretrainLoop.state_dict(): model, optimizer, schedule, epoch, history, head plan
RECORD_FILE = "record.json"  # {"epoch", "history": every epoch's metrics, "workers": where each rank ran}
Epoch = dict[str, float]  # one epoch's metrics (pipeline.training.loop.EpochMetrics.as_dict)


class Worker(TypedDict):
    """Where one rank ran: provenance for the outputs."""

    rank: int
    node_id: str
    host: str
    pid: int
    device: str
    gpu_ids: list[str]


@dataclass(frozen=True)
class TrainedState:
    """What a run's (or a trial's) final checkpoint holds, read once at the edge."""

    model: dict[str, torch.Tensor]  # the state_dict
    history: list[Epoch]  # every epoch's metrics up to it
    epoch: int
    workers: list[Worker]
    head_plan: HeadPlan | None = None
    path: str | None = None  # the checkpoint it was read from (a path or a URI), None: from the loop itself

    @classmethod
    def of(cls, state: Mapping[str, object], workers: list[Worker], path: str | None = None) -> TrainedState:
        plan = state.get("head_plan")
        return cls(model=state["model"], history=list(state["history"]), epoch=int(state["epoch"]),
                   workers=list(workers), head_plan=HeadPlan(**plan) if isinstance(plan, dict) else None, path=path)


class CheckpointRecord(TypedDict):
    """A checkpoint's :data:`RECORD_FILE`."""

    epoch: int
    history: list[Epoch]
    workers: list[Worker]


def checkpoint_record(path: str) -> CheckpointRecord | None:
    """The :data:`RECORD_FILE` of the checkpoint at ``path`` (a local path or a URI), or None where it has none."""
    return read_json(path, RECORD_FILE)


def epoch_metric_names(history: Sequence[Mapping[str, object]]) -> tuple[str, ...]:
    """The per-epoch metrics MLflow gets: :func:`~pipeline.training.loop.epoch_metrics` and the health keys of
    ``history``'s last epoch."""
    return epoch_metrics() + tuple(k for k in (history[-1] if history else {}) if is_health_key(k))


class PretrainError(RuntimeError):
    """Training stopped (non-finite loss, failed workers); the last good checkpoint is kept."""


def node_name(in_ray: bool = True) -> str:
    """``node 1a2b3c4d5e6f (host)``: where this worker runs, for its errors (``in_ray``: a Ray process's)."""
    if not in_ray:
        return f"this process ({socket.gethostname()})"
    import ray

    return f"node {ray.get_runtime_context().get_node_id()[:12]} ({socket.gethostname()})"


def _placement(rank: int, world: int, device: torch.device, in_ray: bool = True) -> list[Worker]:
    """Where every rank runs, gathered on all ranks (outside Ray: ``node_id`` "")."""
    if in_ray:
        import ray

        node_id, gpu_ids = ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()]
    else:
        node_id, gpu_ids = "", [str(device.index or 0)] if device.type == "cuda" else []
    me: Worker = {"rank": rank, "node_id": node_id, "host": socket.gethostname(), "pid": os.getpid(),
                  "device": str(device), "gpu_ids": gpu_ids}
    if world == 1 or not torch.distributed.is_initialized():
        return [me]
    everyone: list[Worker] = [me] * world
    torch.distributed.all_gather_object(everyone, me)
    return everyone


def worker_device(use_gpu: bool, backend: str, *, ray_train: bool = True) -> torch.device:
    """The device a worker trains on: its GPU when it was scheduled on one, CUDA sees it and the backend is a GPU one,
    else the CPU (``ray_train``: a Ray Train worker's, else a one-worker trial's). ``ray.backend: gloo`` trains on the
    CPU (collectives on CUDA tensors over gloo would each go through the host), also on a GPU that CUDA cannot see (a
    node that only declares GPUs, as rehearsals do); with another backend that is an error, not a silent fall-back."""
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
    """Where a worker's checkpoint comes from and its reports go: :class:`TrainSession`, ``tune.TuneSession`` or, in
    this process, :class:`LocalSession`. ``scratch``: where a checkpoint is written before :meth:`report` takes it
    (None: the system's temp dir)."""

    in_ray = True  # the worker is a Ray process
    scratch: str | None = None

    def get_checkpoint(self) -> ray.train.Checkpoint | LocalCheckpoint | None:  # Tune's is Ray Train's class
        raise NotImplementedError

    def report(self, metrics: Epoch, checkpoint_dir: str | None) -> None:
        """Report one epoch; ``checkpoint_dir`` (a temp directory the session deletes) holds its checkpoint, if any."""
        raise NotImplementedError


class TrainSession(Session):
    """Ray Train's: rank 0's checkpoint uploads in the background, so that a slow storage does not stall the
    workers (a worker that dies during an upload loses that checkpoint: the run resumes from the one before)."""

    def get_checkpoint(self) -> ray.train.Checkpoint | None:
        import ray.train

        return ray.train.get_checkpoint()

    def report(self, metrics: Epoch, checkpoint_dir: str | None) -> None:
        import ray.train

        if checkpoint_dir is None:
            ray.train.report(metrics)
            return
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(checkpoint_dir),
                         checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC,
                         delete_local_checkpoint_after_upload=True)


@dataclass(frozen=True)
class LocalCheckpoint:
    """A checkpoint folder of a run in this process (as Ray's ``Checkpoint`` is read)."""

    path: str

    @contextlib.contextmanager
    def as_directory(self) -> Iterator[str]:
        yield self.path


class LocalSession(Session):
    """A run in this process: each checkpoint becomes the folder ``checkpoint_<epoch>`` of ``run_dir`` whole (written
    beside it, then renamed: a crash leaves the one before), the ``keep`` newest kept; every epoch goes to ``log``."""

    in_ray = False

    def __init__(self, run_dir: str, keep: int, log: Callable[[Epoch], None] | None = None) -> None:
        self.run_dir, self.keep, self.log = run_dir, keep, log
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        for torn in Path(run_dir).glob(".transfusion-ckpt-*"):  # a checkpoint an interruption left half-written
            shutil.rmtree(torn, ignore_errors=True)
        self.scratch = run_dir

    def get_checkpoint(self) -> LocalCheckpoint | None:
        found = checkpoint_dirs(self.run_dir)  # newest first
        return LocalCheckpoint(found[0]) if found else None

    def report(self, metrics: Epoch, checkpoint_dir: str | None) -> None:
        if checkpoint_dir is not None:
            final = Path(self.run_dir, f"{CHECKPOINT_PREFIX}{int(metrics['epoch']):06d}")
            shutil.rmtree(final, ignore_errors=True)
            os.replace(checkpoint_dir, final)
            for old in checkpoint_dirs(self.run_dir)[self.keep:]:
                shutil.rmtree(old, ignore_errors=True)
        if self.log is not None:
            self.log(metrics)


def run_worker(spec: WorkerSpec, session: Session, rank: int = 0, world: int = 1,
               device: torch.device | None = None) -> PretrainLoop | None:
    """One worker's pretraining: resume from the session's checkpoint (or ``spec.resume_dir``), train the remaining
    epochs, report each through ``session`` (rank 0: with a checkpoint every ``train.checkpoint_every`` epochs).
    Returns the loop, or None when the loss became non-finite (rank 0 wrote ``STATUS_FILE`` in ``spec.run_dir``)."""
    params = spec.params
    use_threads(torch_threads(params.ray.cpus_per_worker))  # torch's and BLAS's (Ray set OMP_NUM_THREADS)
    device = device or torch.device("cpu")
    # mapped, not read, when the loop will stream it (beyond the data budget) or put it on a GPU
    budget = data_budget(params.train.data_budget_mb, device)
    data = fetch_prepared(spec.data_dir, spec.manifest, where=node_name(session.in_ray),
                          mmap=device.type == "cuda" or prepared_nbytes(spec.manifest) > budget)
    loop = PretrainLoop(params, data, device, rank=rank, world_size=world, budget=budget)
    if rank == 0 and not spec.quiet:
        say(f"[pretrain] {loop.data_line()}")
        say(f"[pretrain] {loop.head_plan.describe()}")
    workers = _placement(rank, world, device, session.in_ray)
    if rank == 0:
        write_json(spec.run_dir, PLACEMENT_FILE, workers)

    checkpoint = session.get_checkpoint()
    if checkpoint is None and spec.resume_dir:  # Ray's own record of the run was lost: ours is the checkpoint
        checkpoint = LocalCheckpoint(spec.resume_dir)
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
            d = tempfile.mkdtemp(prefix=".transfusion-ckpt-", dir=session.scratch)
            torch.save(loop.state_dict(), Path(d) / STATE_FILE)
            record: CheckpointRecord = {"epoch": loop.epoch, "history": loop.history, "workers": workers}
            Path(d, RECORD_FILE).write_text(json.dumps(record))
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
    """Restore ``loop`` from the checkpoint in ``directory``, loaded on the host: the model and the optimizer's
    moments move to their device, but the optimizer keeps ``state["step"]`` where it was loaded, and non-capturable
    Adam reads it with ``.item()``: on a GPU, a host sync per parameter and step (tests/runs/test_resume.py)."""
    loop.load_state_dict(torch.load(directory / STATE_FILE, map_location="cpu", weights_only=True))


def status_reason(status: Mapping[str, object]) -> str:
    """One line from a worker's error status: ``"<kind>: <message> (last good epoch N)"``."""
    reason = " ".join(str(status.get("message") or status).split())
    if status.get("error"):
        reason = f"{status['error']}: {reason}"
    if status.get("epoch") is not None:
        reason += f" (last good epoch {status['epoch']})"
    return reason


def train_loop_per_worker(config: dict[str, WorkerSpec]) -> None:
    """Ray Train worker entry point."""
    import ray.train
    import ray.train.torch

    # Ray Train V2 logs every report at INFO, also from a logger named after its file's path that propagates to the
    # root logger (INFO in its workers): the console keeps our progress lines
    logging.getLogger("ray.train").setLevel(logging.WARNING)
    logging.getLogger().setLevel(logging.WARNING)
    spec: WorkerSpec = config["spec"]
    ctx = ray.train.get_context()
    device = worker_device(spec.use_gpu, spec.params.ray.backend)
    try:
        run_worker(spec, TrainSession(), ctx.get_world_rank(), ctx.get_world_size(), device)
    except ray.exceptions.ActorDiedError as exc:
        if not run_torn_down(exc):
            raise
        # the run is being torn down (ASHA stopped its trial, Ctrl-C): its controller ends it; no traceback here


# ---------------------------------------------------------------------------------------------- driver
def in_process(params: Params) -> bool:
    """Whether pretraining runs in this process instead of on Ray Train: one worker, no cluster (``ray.address``,
    ``RAY_ADDRESS``), no restarts asked for (``ray.max_failures``: 0; a rerun resumes) and a local storage. Ray Train
    would add only its start and stop and a report per epoch through its controller (docs/design.md: where it runs)."""
    return (params.ray.num_workers == 1 and address_of(params) is None and params.ray.max_failures == 0
            and not is_uri(params.ray.storage_path))


def train_here(spec: WorkerSpec, log: Callable[[Epoch], None] | None, keep: int) -> TrainedState | None:
    """Train ``spec``'s one worker in this process (resuming from its last checkpoint in ``spec.run_dir``, keeping the
    ``keep`` newest), each epoch to ``log``; returns the final checkpoint's state (None without one)."""
    session = LocalSession(spec.run_dir, keep, log)
    device = worker_device(spec.use_gpu, spec.params.ray.backend, ray_train=False)
    run_worker(spec, session, device=device)
    found = session.get_checkpoint()
    if found is None:
        return None
    record = json.loads(Path(found.path, RECORD_FILE).read_text())
    return TrainedState.of(load_torch(Path(found.path) / STATE_FILE), record["workers"], found.path)


def recover(run_dir: str | None) -> str | None:
    """When an interruption tore Ray's run record in a local ``run_dir``: the newest checkpoint that loads, or None."""
    if not run_dir or is_uri(run_dir) or not torn_snapshot(run_dir):
        return None
    for ckpt in checkpoint_dirs(run_dir):
        try:
            torch.load(Path(ckpt, STATE_FILE), map_location="cpu", weights_only=True)
        except Exception:  # a torn checkpoint: try the one before
            continue
        say(f"[pretrain] Ray's run record in {run_dir} was unreadable (torn by an interruption); "
            f"resuming from {Path(ckpt).name}")
        return ckpt
    say(f"[pretrain] Ray's run record in {run_dir} was unreadable and no checkpoint loads; starting afresh")
    return None


@dataclass
class PretrainResult:
    state: TrainedState
    job: Job
    input_shape: tuple[int, ...]
    n_classes: int
    fit_started: float = 0.0  # when the run started (time.time())
    fit_seconds: float = 0.0  # its wall time: (Ray Train's start and stop,) the epochs and their reports
    in_ray: bool = True  # it ran on Ray Train (else in this process: in_process)


def pretrain(params: Params, data_dir: Path, root: Path, *, tracking: bool = True) -> PretrainResult:
    """Run (or resume) pretraining, in this process (:func:`in_process`) or on Ray Train; returns the final state.
    Raises ``ParamsError`` (a request the cluster can never satisfy), ``ClusterError`` (unreachable, resources never
    free), :class:`PretrainError`."""
    here = in_process(params)
    params = with_worker_cpus(params)
    data = load_prepared(data_dir, verify=True, mmap=True)  # a corrupt input fails here, before Ray starts
    if params.train.batch_size > len(data.train.y):
        raise ParamsError(f"train.batch_size ({params.train.batch_size}) exceeds the training set "
                          f"({len(data.train.y)} samples in {data_dir}); lower it or prepare more data")
    flat = flat_sections(params, TRAINING, ("ray.num_workers", "ray.use_gpu"))
    if here:  # torch builds its first optimizer by importing torch._dynamo (0.8 s of one core): begun now, beside the
        # wait for the MLflow run
        threading.Thread(target=importlib.import_module, args=("torch._dynamo",), daemon=True).start()
    job = open_job("pretrain", params, data_dir, root, tracking=tracking, title=pretrain_label(flat), logged=flat,
                   here=here)
    clear_status(job.run_dir)
    run = job.run
    if not here:
        job.spec.resume_dir = recover(job.run_dir)
    via = tracker()  # this process's MLflow calls: its tracking process, when the stage started one
    fit_started, fit_start = time.time(), time.perf_counter()
    try:  # the driver's node's system metrics while it trains
        with via.system_metrics(run.uri if run else None, run.run_id if run else None):
            if here:
                with via.EpochLog(run.uri, run.run_id) if run else contextlib.nullcontext() as log:
                    if run:  # the model's logging at the end imports torch there: now, beside the loop's start
                        via.prepare_model_logging()
                    state = train_here(job.spec, log, keep=2)
            else:
                state = fit_run(job.spec, [trk.epoch_logger(run.uri, run.run_id)] if run else [], keep=2,
                                   max_failures=params.ray.max_failures)
    except Exception as exc:
        message = error_reason(exc)
        if "prepared data" not in message:  # a worker that cannot read the data has nothing to resume
            message += f"; rerun the stage to resume from the last checkpoint in {job.run_dir}"
        failed = PretrainError(f"pretraining failed: {message}")
        fail_job(job, error=str(failed))
        raise failed from exc
    fit_seconds = time.perf_counter() - fit_start
    status = read_json(job.run_dir, STATUS_FILE)
    if status:
        failed = PretrainError(f"pretraining stopped: {status['message']}; the last good checkpoint is kept in "
                               f"{job.run_dir} (lower train.lr, or check the data for NaN)")
        fail_job(job, error=str(failed))
        raise failed
    if state is None:
        raise PretrainError("pretraining finished without a checkpoint")
    if run:  # epochs checkpointed before an interruption but never logged: the run shows every epoch once
        via.log_missing_epochs(run.uri, run.run_id, state.history, epoch_metric_names(state.history))
        if state.head_plan:  # the head's path on the workers (pipeline.core.plan): dense|tiled, sharded
            via.set_tags(run.run_id, state.head_plan.tags(), uri=run.uri)
    return PretrainResult(state=state, job=job, input_shape=data.input_shape, n_classes=len(data.classes),
                          fit_started=fit_started, fit_seconds=fit_seconds, in_ray=not here)


def fit_run(spec: WorkerSpec, callbacks: list[ray.train.UserCallback], keep: int, max_failures: int = 0,
            console_level: str = TRAIN_CONSOLE_LEVEL) -> TrainedState | None:
    """Ray Train's run of ``spec``'s workers (``keep`` checkpoints, ``max_failures`` restarts, its console at
    ``console_level``); returns its final checkpoint's state (None without one)."""
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    params = spec.params
    poll_reports_fast()
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
                                       logging_config=ray.train.LoggingConfig(log_level=console_level)),
    ).fit()
    if result.checkpoint is None:
        return None
    with result.checkpoint.as_directory() as d:
        record = json.loads(Path(d, RECORD_FILE).read_text())
        return TrainedState.of(load_torch(Path(d) / STATE_FILE), record["workers"], result.checkpoint.path)
