"""The pretraining loop, pure torch (+ torch.distributed): data shards, views, steps, kNN monitor.

Ray-free on purpose: the Ray Train worker (``pipeline.runs.train``) and the benchmarks run this same loop.
All randomness derives from ``(train.seed, epoch, step, rank)``: the epoch's permutation of the training
set is the same on every worker, each worker augments its shard with its own generator, and a run
resumed from a checkpoint draws exactly the numbers an uninterrupted run would have drawn.

Several workers (``world_size > 1``): BatchNorm becomes global BatchNorm (``pipeline.core.batchnorm``: statistics
over the whole global batch, running statistics identical on every rank), and rank 0's parameters and
buffers are broadcast to every rank at start, so ranks never start apart whatever their seeds.

Where the training set lives (:func:`data_budget`): within ``train.data_budget_mb`` (default: a quarter of the
device's memory) it is put on the device once and indexed there by the epoch's permutation (moved to the device
once per epoch; indexing a pinned host tensor would give pageable memory and a synchronous copy). Beyond it, it
stays where it is on the host (a memory-mapped file: ``load_prepared(mmap=True)``) and each step reads only this
worker's rows of the global batch (:meth:`PretrainLoop.rows`), pinned and copied without blocking on CUDA; the
same permutation picks the same rows in the same order, so both paths give the same numbers. On CUDA
the step's loss and the view noise stay 0-d device tensors and are synced once per epoch, where the
non-finite check then happens (``defer_sync``), before the epoch is reported or checkpointed. On CPU the
loss is checked at every step, as before; ``defer_sync=True`` selects the deferred path on CPU too (tests).

Callbacks (:class:`Callback`, passed to :meth:`PretrainLoop.fit`) look into the loop on every rank: at its start, before
each step (where they may replace the step's inputs) and after each epoch's report.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipeline.config.params import Params
from pipeline.core.batchnorm import convert_batchnorm
from pipeline.core.losses import make_loss
from pipeline.core.model import ABC_LOSSES, Rows, build_model, memory_format
from pipeline.core.optim import build_optimizer, warmup_cosine
from pipeline.core.plan import HeadPlan, budget_bytes, plan_head
from pipeline.data.augment import BatchAugment, view_noise
from pipeline.data.prepared import gather_rows
from pipeline.data.split import to_float
from pipeline.data.types import Dataset
from pipeline.evaluation.health import (
    QKAffinity,
    block_stats,
    flat,
    health_line,
    is_health_key,
    kernel_health,
    read_health,
)
from pipeline.evaluation.knn import knn_accuracy
from pipeline.host import device_memory
from pipeline.training.precision import for_device
from pipeline.training.step import GlobalBatchStep, NonFiniteLossError, broadcast_from_rank0

KNN_BANK, KNN_QUERIES = 5000, 2000
DATA_BUDGET_SHARE = 0.25  # train.data_budget_mb: null -> this share of the device's memory (device_memory)


def data_budget(budget_mb: float | None, device: torch.device) -> int:
    """Bytes the training set may take on ``device`` (``train.data_budget_mb`` in MiB; None: ``DATA_BUDGET_SHARE``
    of :func:`device_memory`). A larger training set is streamed."""
    if budget_mb is not None:
        return int(budget_mb * 2**20)
    return int(DATA_BUDGET_SHARE * device_memory(device))


def head_plan(params: Params, model: torch.nn.Module, world: int, device: torch.device,
              autocast: torch.dtype | None) -> HeadPlan:
    """The head's path on each worker (``pipeline.core.plan``): sharded over ``world``, dense or tiled within
    ``train.head_budget_mb`` (None: a share of the device's memory). ABC's head is not planned: every worker runs it
    dense on all 2B rows (``pipeline.training.step``; its additive similarity tiles itself), so its plan is one worker's
    dense path, whose estimate counts the loss's (2B, 2B) buffers only, not the SABs'."""
    head = model.head
    itemsize = torch.finfo(autocast).bits // 8 if autocast is not None else 4
    if getattr(model, "method", "transfusion") == "abc":
        n = 2 * params.train.batch_size
        return plan_head(n, 1, 0, model.head_dim, budget_bytes(params.train.head_budget_mb, device_memory(device)),
                         itemsize=itemsize, tile=n)
    return plan_head(2 * params.train.batch_size, world, head.depth - int(head.truncate_last), model.head_dim,
                     budget_bytes(params.train.head_budget_mb, device_memory(device)), itemsize=itemsize,
                     pairwise_loss=params.loss.name != "barlow_twins")


def _view_noise_tensor(v1: torch.Tensor, v2: torch.Tensor) -> torch.Tensor:
    """:func:`pipeline.data.augment.view_noise` as a 0-d float64 tensor on the views' device (no host sync).

    ``eps = 1 - (1/B) Σ_i cos(flatten(v1_i), flatten(v2_i))``; v1, v2 (B, ...).
    """
    a, b = v1.reshape(v1.shape[0], -1).double(), v2.reshape(v2.shape[0], -1).double()  # (B, D)
    return 1.0 - F.cosine_similarity(a, b, dim=1, eps=1e-12).clamp(-1.0, 1.0).mean()


def _seed(*parts: int) -> int:
    h = 0
    for p in parts:
        h = (h * 1_000_003 + int(p) + 1) % (2**62)
    return h


class Callback:
    """Hooks into :meth:`PretrainLoop.fit`, called on every rank; subclass it and override the ones you need (each does
    nothing here). ``loop`` is the :class:`PretrainLoop` (its ``params``, ``rank``, ``model``, ``epoch``, ...); epochs
    and steps count from 1."""

    def on_train_start(self, loop: PretrainLoop) -> None:
        """Before the first epoch that this call of ``fit`` trains (after a resume: the first remaining one)."""

    def on_step_start(self, loop: PretrainLoop, epoch: int, step: int, x: torch.Tensor) -> torch.Tensor | None:
        """Before the views of step ``step`` of ``epoch``: this rank's inputs ``x`` (b, ...) float32 on the device.
        Returns the inputs the step uses instead, or None to keep ``x``."""

    def on_epoch_end(self, loop: PretrainLoop, metrics: EpochMetrics) -> None:
        """After epoch ``metrics.epoch`` was reported (and, on a checkpoint epoch, checkpointed). Raising here stops
        the training with that error."""


@dataclass
class EpochMetrics:
    epoch: int
    loss: float
    lr: float
    samples_per_s: float
    view_noise: float
    knn_acc: float | None  # the online checks' epochs only (train.knn_every, and the last): None between them
    seconds: float
    ended_at: float  # wall clock (time.time()) when the epoch's steps ended, before any evaluation
    health: dict[str, float | None] = field(default_factory=dict)  # "block_1.positive", ... (evaluation.health); {}
    # between the online checks, at depth 0 and on ranks but 0

    def as_dict(self) -> dict[str, Any]:
        """The fields, with the health numbers as top-level keys."""
        out = {k: v for k, v in self.__dict__.items() if k != "health"}
        return {**out, **self.health}

    def line(self, epochs: int) -> str:
        """The console's line of this epoch: ``"epoch 2/6 loss 1.29541 knn 0.7472 eps 0.0123 1,234 samples/s | ..."``
        (the blocks' health: :func:`pipeline.evaluation.health.health_line`)."""
        knn = f" knn {self.knn_acc:.4f}" if self.knn_acc is not None else ""
        return (f"epoch {self.epoch}/{epochs} loss {self.loss:.5f}{knn} eps {self.view_noise:.4f} "
                f"{self.samples_per_s:,.0f} samples/s{health_line(self.health)}")


NOT_METRICS = ("epoch", "ended_at", "health")  # EpochMetrics' fields that are not a per-epoch metric of their own


def epoch_metrics() -> tuple[str, ...]:
    """The per-epoch metrics of :class:`EpochMetrics`, in its field order: every field but the epoch, the wall clock
    it ended at and the health dict (whose keys flow by their prefix, ``pipeline.evaluation.health.is_health_key``).
    The one list every consumer reads (MLflow, Tune's reports, the pretrain CSV, the sweep's results and curves, the
    tables' curves), at call time: a field added to the record reaches them all."""
    return tuple(f.name for f in fields(EpochMetrics) if f.name not in NOT_METRICS)


def epoch_record(epoch: Mapping[str, Any]) -> dict[str, Any]:
    """One epoch of a history (:meth:`EpochMetrics.as_dict`) as it is kept: its epoch, :func:`epoch_metrics` and the
    health keys, in that order."""
    names = ("epoch", *epoch_metrics())
    return {**{k: epoch[k] for k in names if k in epoch}, **{k: v for k, v in epoch.items() if is_health_key(k)}}


class PretrainLoop:
    """Owns the model, optimizer, schedule and data of one worker. ``fit`` runs the remaining epochs."""

    def __init__(self, params: Params, data: Dataset, device: torch.device, rank: int = 0, world_size: int = 1,
                 defer_sync: bool | None = None, budget: int | None = None):
        """``budget``: bytes the training set may take on ``device`` (None: :func:`data_budget` of the params)."""
        t = params.train
        self.params, self.data, self.device, self.rank, self.world = params, data, device, rank, world_size
        self.batch = t.batch_size  # global images per step
        self.local = t.batch_size // world_size
        n = len(data.train.y)
        if t.batch_size > n:
            raise ValueError(f"train.batch_size ({t.batch_size}) exceeds the training set ({n} samples)")
        self.steps_per_epoch = n // t.batch_size  # drop the last partial batch: the fused batch size is fixed
        torch.manual_seed(t.seed)
        self.memory_format = memory_format(t.memory_format, data.input_shape)
        self.model = build_model(params.model, data.input_shape).to(device, memory_format=self.memory_format)
        if world_size > 1:
            convert_batchnorm(self.model)  # global BN: same parameters, buffers and state_dict keys
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                broadcast_from_rank0(self.model)
        self.optimizer = build_optimizer(t.optimizer, self.model, lr=t.lr, weight_decay=t.weight_decay,
                                         head_lr_scale=t.head_lr_scale)
        self.scheduler = warmup_cosine(self.optimizer, total_steps=t.epochs * self.steps_per_epoch,
                                       warmup_steps=t.warmup_epochs * self.steps_per_epoch)
        self.augment = BatchAugment(params.augment.preset, params.augment.strength)
        if params.loss.name in ABC_LOSSES:  # ABC's: f(out, ids, rows=...) on the head's output (model.method: abc)
            loss_fn = ABC_LOSSES[params.loss.name](params.loss.pos_weight)
        else:
            loss_fn = make_loss(params.loss.name, temperature=params.loss.temperature,
                                barlow_lambda=params.loss.barlow_lambda, power=params.loss.power)
        cuda = device.type == "cuda"
        self.precision = for_device(t.precision, device)  # bf16 / fp16 + scaler / fp32 by device (precision.py)
        self.head_plan = head_plan(params, self.model, world_size, device, self.precision.autocast)
        self.step = GlobalBatchStep(self.model, loss_fn, grad_cache_chunk=t.grad_cache_chunk,
                                    autocast_dtype=self.precision.autocast,
                                    layout="two_view" if t.mode == "self_supervised" else "labels",
                                    tile=self.head_plan.tile)
        self.scaler = self.step.scaler = self.precision.grad_scaler(device)  # fp16 only
        self.defer_sync = cuda if defer_sync is None else defer_sync
        self.y_train = data.train.y  # (N,) on the host: the kNN monitor's labels
        self.data_budget = data_budget(t.data_budget_mb, device) if budget is None else budget  # bytes
        self.streaming = data.train.x.numel() * data.train.x.element_size() > self.data_budget
        # (N, ...) on the device within the budget (on CUDA: the steps index it there); streamed: None, see rows()
        self.x_dev = None if self.streaming else data.train.x.to(device)
        self.y_dev = data.train.y.to(device)  # (N,)
        self.epoch = 0  # completed epochs
        self.history: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ checkpoint state
    def data_line(self) -> str:
        """Where this worker's training set lives: ``"training set 0.4 MiB on cpu (data budget 3,968 MiB)"``, or
        ``"... streamed from memory-mapped files, each step reading its rows (data budget 0 MiB)"``."""
        x = self.data.train.x
        where = (f"on {self.device}" if not self.streaming
                 else "streamed from memory-mapped files, each step reading its rows")
        return (f"training set {x.numel() * x.element_size() / 2**20:,.1f} MiB {where} "
                f"(data budget {self.data_budget / 2**20:,.0f} MiB)")

    def state_dict(self) -> dict[str, Any]:
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "scheduler": self.scheduler.state_dict(), "epoch": self.epoch, "history": self.history,
                 "head_plan": self.head_plan.as_dict()}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.epoch = int(state["epoch"])
        self.history = list(state["history"])
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])

    # ------------------------------------------------------------------ one epoch
    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Training inputs ``index`` (b,) -> (b, ...) on the device, stored dtype, in ``index``'s order.

        Indexed on the device copy within the budget; streamed, read from the host source (only these rows, in
        ascending order: :func:`pipeline.data.prepared.gather_rows`), pinned and copied without blocking on CUDA.
        """
        if self.x_dev is not None:
            return self.x_dev[index.to(self.device)]
        return self._from_host(self.data.train.x, index)

    def _from_host(self, source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``source[index]`` (b, ...) read on the host, then on the device: pinned and not blocking on CUDA."""
        cuda = self.device.type == "cuda"
        return gather_rows(source, index, pin=cuda).to(self.device, non_blocking=cuda)

    def _local_batch(self, perm: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """perm (N,) -> this worker's inputs x (b, ...) float32 and ids (b,), on the device.

        ``perm`` is on the device when the training set is, on the host when it is streamed (the rows are read
        there); either way this worker's rows are the same ones, in the same order.
        """
        idx = perm[step * self.batch : (step + 1) * self.batch]  # (B,) the global batch
        mine = idx[self.rank * self.local : (self.rank + 1) * self.local]  # (b,) this worker's shard
        x = to_float(self.rows(mine))  # (b, ...)
        if self.params.train.mode == "self_supervised":  # positive = the other view of the same image
            ids = torch.arange(self.rank * self.local, (self.rank + 1) * self.local, device=self.device)
        else:  # positive = same label
            ids = self.y_dev[mine] if self.x_dev is not None else self._from_host(self.y_train, mine)
        return x, ids

    def train_epoch(self, callbacks: Sequence[Callback] = ()) -> EpochMetrics:
        """One epoch; each step's inputs pass through ``callbacks``' :meth:`Callback.on_step_start` first."""
        t = self.params.train
        epoch = self.epoch
        self.model.train()
        # drawn on the host (the same permutation on every device), moved once per epoch
        perm = torch.randperm(len(self.y_train), generator=torch.Generator().manual_seed(_seed(t.seed, epoch)))
        if not self.streaming:  # streamed: the rows are read on the host
            perm = perm.to(self.device)  # (N,)
        gen = torch.Generator(self.device).manual_seed(_seed(t.seed, epoch, self.rank, 7))
        losses, noises = [], []  # floats, or 0-d device tensors with defer_sync
        start = time.perf_counter()
        for s in range(self.steps_per_epoch):
            x, ids = self._local_batch(perm, s)
            for callback in callbacks:
                replaced = callback.on_step_start(self, epoch + 1, s + 1, x)
                x = x if replaced is None else replaced
            with torch.no_grad():
                v1, v2 = self.augment(x, gen), self.augment(x, gen)
            views = torch.cat([v1, v2]).contiguous(memory_format=self.memory_format)  # (2b, ...)
            if self.defer_sync:
                losses.append(self.step.lazy(views, torch.cat([ids, ids])))
                noises.append(_view_noise_tensor(v1, v2))
            else:
                losses.append(self.step(views, torch.cat([ids, ids])))
                noises.append(view_noise(v1, v2))
            if self.scaler is None:
                self.optimizer.step()
            else:  # fp16: unscale, skip the step on inf/NaN gradients (same on every rank: they are all-reduced)
                self.scaler.step(self.optimizer)
                self.scaler.update()
            self.scheduler.step()
        if self.defer_sync:  # the epoch's one host sync; the check the per-step path makes, before any report
            losses, noises = torch.stack(losses).tolist(), torch.stack(noises).tolist()
            bad = [i for i, v in enumerate(losses) if not math.isfinite(v)]
            if bad:
                raise NonFiniteLossError(f"non-finite loss ({losses[bad[0]]}) at epoch {epoch + 1}, step {bad[0] + 1}"
                                         f" ({len(bad)} of {len(losses)} steps); the epoch was not reported")
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        ended_at = time.time()
        self.epoch += 1
        every = t.knn_every  # the online checks, kNN and health, on rank 0: every `every` epochs and after the last
        checked = self.rank == 0 and (self.epoch == t.epochs or (every > 0 and self.epoch % every == 0))
        return EpochMetrics(
            epoch=self.epoch, loss=sum(losses) / len(losses), lr=self.optimizer.param_groups[0]["lr"],
            samples_per_s=self.steps_per_epoch * self.batch / seconds, view_noise=sum(noises) / len(noises),
            knn_acc=self.knn() if checked else None, seconds=seconds, ended_at=ended_at,
            health=self.health() if checked else {},
        )

    @torch.no_grad()
    def health(self, chunk: int = 512) -> dict[str, float | None]:
        """Per-block health (``evaluation.health``) on a fixed global batch of the training set, two views as in
        training, model in eval mode: ``{"block_1.positive": ..., ...}`` ({} at depth 0). ABC (``model.method: abc``):
        its kernel's statistics on that batch instead, by class, ``{"kernel.same_class": ..., "kernel.other": ...,
        "kernel.above_half": ...}`` (:func:`pipeline.evaluation.health.kernel_health`).

        ``other_view`` is None where the other view is not in the fused batch (``fusion_scope: per_view``).

        In bounded memory at any batch size: images are loaded, augmented and embedded ``chunk`` at a time (the backbone
        in eval mode is row-wise), the head fuses the (2b, m) embeddings in one piece as in training but without a
        graph, and each block's numbers are taken as soon as its affinity exists (``on_affinity``), in row slices, so
        one block's (2b, 2b) affinity is alive at a time. Where one worker holding all 2b rows would tile the head
        (``head_plan`` with one worker), so does this: the blocks run over column tiles and each block's affinity is
        computed a row slice at a time from its queries and keys (``QKAffinity``), never whole. A batch within one chunk
        is computed exactly as one forward of the two views.
        """
        abc = self.model.method == "abc"
        if not abc and self.model.head.depth == 0:
            return {}
        seed = self.params.train.seed
        b = min(self.batch, len(self.y_train))
        idx = torch.randperm(len(self.y_train), generator=torch.Generator().manual_seed(_seed(seed, 11)))[:b]
        gen = torch.Generator(self.device).manual_seed(_seed(seed, 13))
        self.model.eval()
        z1, z2 = [], []
        for part in idx.split(chunk):
            x = to_float(self.rows(part))  # (c, ...)
            v1, v2 = self.augment(x, gen), self.augment(x, gen)
            z = self.model.encode(torch.cat([v1, v2]).contiguous(memory_format=self.memory_format))  # (2c, m)
            z1.append(z[: len(part)])
            z2.append(z[len(part):])
            del x, v1, v2, z
        z = torch.cat(z1 + z2)  # (2b, m): [view 1; view 2]
        del z1, z2
        y = self.data.train.y[idx].to(self.device)
        labels, other = torch.cat([y, y]), torch.cat([torch.arange(b, 2 * b), torch.arange(b)]).to(self.device)
        if abc:  # ABC: its kernel on the 2b rows as in training (no blocks that could die), by class
            kappa = self.model.head(z).kernel  # (2b, 2b)
            self.model.train()
            return flat(read_health(kernel_health(kappa, labels)))
        blocks = {}

        def take(i: int, a: torch.Tensor | QKAffinity) -> None:  # (2b, 2b) fused jointly, or (2, b, b) per view
            blocks[f"block_{i + 1}"] = block_stats(a, labels.reshape(a.shape[:-1]), None if a.ndim == 3 else other)

        head = self.model.head
        # rank 0 fuses all 2b rows alone here: the plan of one worker holding them, not the training's per-worker one
        tile = self.head_plan.tile if self.world == 1 else head_plan(self.params, self.model, 1, self.device,
                                                                      self.precision.autocast).tile
        if tile is None:
            head(z, views=2, on_affinity=take)
        else:  # the dense (2b, 2b) would not fit: the blocks over tiles, each affinity a row slice at a time
            groups = 2 if head.fusion_scope == "per_view" else 1

            def take_qk(i: int, q: torch.Tensor, k: torch.Tensor) -> None:  # (2b, m) each
                act = head.blocks[i].activation
                take(i, QKAffinity(q.reshape(groups, -1, q.shape[-1]), k.reshape(groups, -1, k.shape[-1]), act))

            head.forward_rows(z, Rows.whole(len(z), z.device), views=2, tile=tile, on_block=take_qk)
        self.model.train()
        return flat(read_health(blocks))  # the one read of the numbers (0-d device tensors until here)

    @torch.no_grad()
    def embed(self, x: torch.Tensor, chunk: int = 512, index: torch.Tensor | None = None) -> torch.Tensor:
        """Backbone embeddings (the representation probes use), batched: x (N, ...) -> (N, m); with ``index``
        (n,) of the rows ``x[index]`` -> (n, m), read ``chunk`` rows at a time (a memory-mapped x is never read
        whole)."""
        self.model.eval()
        parts = x.split(chunk) if index is None else (gather_rows(x, i) for i in index.split(chunk))
        fmt = self.memory_format
        out = [self.model.backbone(to_float(c.to(self.device)).contiguous(memory_format=fmt)).float().cpu()
               for c in parts]
        self.model.train()
        return torch.cat(out)

    def knn(self) -> float:
        """Online kNN accuracy (cosine, k = train.knn_k) of backbone embeddings: a train bank vs the validation
        split (``data.val_size``), never the test split: Tune's metric, a sweep's best and a study's choices read
        this number, and only the final probes read the test images."""
        g = torch.Generator().manual_seed(0)
        bank = torch.randperm(len(self.y_train), generator=g)[:KNN_BANK]
        val = self.data.val
        queries = torch.randperm(len(val.y), generator=g)[:KNN_QUERIES]
        zb, zq = self.embed(self.data.train.x, index=bank), self.embed(val.x, index=queries)
        return knn_accuracy(zb, self.y_train[bank], zq, val.y[queries], k=self.params.train.knn_k)

    # ------------------------------------------------------------------ the loop
    def fit(self, report: Callable[[EpochMetrics, bool], None], callbacks: Sequence[Callback] = ()) -> None:
        """Run the remaining epochs; ``report(metrics, checkpoint_now)`` after each (on every rank), then the
        ``callbacks``' :meth:`Callback.on_epoch_end`.

        Raises :class:`NonFiniteLossError` (on every rank alike) when the loss stops being finite.
        """
        t = self.params.train
        for callback in callbacks:
            callback.on_train_start(self)
        while self.epoch < t.epochs:
            m = self.train_epoch(callbacks)
            if not math.isfinite(m.loss):
                raise NonFiniteLossError(f"non-finite mean loss at epoch {m.epoch}")
            self.history.append(m.as_dict())
            ckpt = self.epoch % t.checkpoint_every == 0 or self.epoch == t.epochs
            report(m, ckpt)
            for callback in callbacks:
                callback.on_epoch_end(self, m)
