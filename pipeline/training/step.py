"""One training step with global-batch fusion, optional gradient caching.

TransFusion lets the samples of a batch attend to each other, so with W workers the head and the loss
must see the *global* batch, not each worker's shard. Each worker:

1. embeds its own views with the backbone and the projector (``model.encode``; row-wise): z_w (2b, m);
2. runs the head on *its own rows* of the global batch, laid out ``[view 1 of all B images; view 2 of all B
   images]`` (2B rows): each block all-gathers the keys and values of every row with a differentiable all-gather and
   computes only this worker's rows (``TransFusionHead.forward_rows``; the head's compute falls as 1/W, and over
   column tiles when ``tile`` is set its memory grows with 2B, not (2B)²: ``pipeline.core.plan``). One process with
   no tile runs the plain dense head on the whole batch instead, as it always did;
3. gathers the head's last embeddings (2B, d) for the loss and computes the loss of its own rows only:
   ``L_w = Σ_{i ∈ rows(w)} ℓ_i / 2B``, so that ``Σ_w L_w = L`` (the full loss);
4. back-propagates ``L_w``. Each all-gather's backward sums, into the rows' owner, the gradients of every
   worker's share; summing the parameter gradients over workers then gives exactly ``∂L/∂θ`` of one
   process on the concatenated batch. The sum travels in buckets that start as soon as their gradients are
   ready, during the backward (``pipeline.training.comm.GradReducer``); gradient caching sums once after its last
   backward (:func:`allreduce_grads`, one coalesced all-reduce).

The gathers run in the compute dtype (bf16 under bf16 autocast: half the bytes of fp32); the loss upcasts after.

No DistributedDataParallel: its gradient *averaging* and forward hooks fit a per-sample loss, not a loss
over the gathered batch; explicit sums are simpler and exact.

The differentiable all-gather is our own (:class:`_AllGatherRows`): ``torch.distributed.nn.functional.all_gather``
is deprecated in torch 2.14 (FutureWarning, "use torch.distributed._functional_collectives.all_gather_single").
Forward: ``all_gather_single`` (``all_gather_into_tensor`` on torch < 2.14, where the former is missing), W × (2b, m)
-> (2bW, m) rank-major. Backward, g (2bW, m) -> (2b, m), the sum over ranks of each rank's gradient of this
rank's rows: ``reduce_scatter_single`` on NCCL; on gloo an all-reduce of g and this rank's slice (older gloo
has no reduce-scatter).

ABC (``model.method: abc``, :class:`pipeline.core.model.ABCModel`) takes a simpler exact route: each worker
all-gathers the backbone embeddings of every row (one differentiable all-gather of (2B, m), the same as step 2's
gather of a block's keys and values) and runs ABC's head, which is small, on the whole gathered batch, replicated on
every worker; then computes the BCE of its own rows only, ``L_w = Σ_{i ∈ rows(w)} Σ_j ℓ_ij / (2B)²``
(:meth:`pipeline.core.abc.ABCOutput.scores` of those rows: disjoint row slices sum to the full loss), so that
``Σ_w L_w = L`` and steps 4's sums give ``∂L/∂θ`` exactly as above. Cost: the SABs are not sharded, each worker
computes them on all 2B rows (one process's head compute and memory, O((2B)²·width) for the attention); only the
similarity and the loss fall to (2B/W, 2B) per worker. Communication: one all-gather of (2B, m) forward and its
reduction backward, whatever the number of blocks. ``tile`` does not apply (ABC's additive similarity tiles itself).

BatchNorm backbones: with several workers their BN must be global (``pipeline.core.batchnorm``), which
``PretrainLoop`` arranges. Gradient caching is refused with BatchNorm (ValueError here, exit 2 in the params
check): chunks would put the two views of an image in different BN batches and the running statistics
would be updated in both passes.

Host syncs: ``__call__`` returns the loss as a float after checking it (one sync per step); :meth:`lazy`
returns it as a 0-d tensor without a sync and without the check, for a caller that checks once per epoch. With a
``layout`` (``core.losses``) nothing inside a lazy step syncs (``tests/training/test_host_syncs.py`` counts it): the
losses' positive pairs are fixed per batch size, the ids are checked once per batch size, and in the two-view
layout they are not even gathered after that. The lazy loss's sum over workers rides in a gradient bucket.

Gradient caching (Gao et al., 2021) for batches larger than memory: embed in chunks without a graph,
compute the loss and ∂L/∂z on the full (global) batch, then re-embed chunk by chunk with a graph and
back-propagate the cached ∂L/∂z. Peak activation memory grows with the chunk, not the batch; gradients
equal the plain path (the backbone must be deterministic: no dropout, no batch statistics).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from pipeline.core.batchnorm import has_batchnorm
from pipeline.core.model import ABCModel, Rows, TransFusion
from pipeline.core.targets import LAYOUTS, check_layout, self_supervised_ids
from pipeline.training.comm import GradReducer

LossFn = Callable[..., Tensor]


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN or inf; the step was not applied."""


def _upcast(t: Tensor) -> Tensor:
    """fp16/bf16 (autocast) -> fp32; fp32/fp64 unchanged."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _identity(t: Tensor) -> Tensor:
    return t


def _distributed() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


# torch 2.14 deprecates all_gather_into_tensor / reduce_scatter_tensor in favour of the *_single names
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def reduce_scatter_works(t: Tensor) -> bool:
    """Use a reduce-scatter in the gather's backward: NCCL with CUDA tensors (gloo: all-reduce + slice)."""
    return t.is_cuda and "nccl" in str(dist.get_backend())


class _AllGatherRows(torch.autograd.Function):
    """Differentiable all-gather along dim 0: z (n, ...) on each of W ranks -> (W n, ...) rank-major."""

    @staticmethod
    def forward(ctx, z: Tensor, reduce_scatter: bool) -> Tensor:
        world, rank = dist.get_world_size(), dist.get_rank()
        z = z.contiguous()
        out = z.new_empty((world * z.shape[0], *z.shape[1:]))  # (W n, ...)
        _all_gather_single(out, z)
        ctx.world, ctx.rank, ctx.n, ctx.reduce_scatter = world, rank, z.shape[0], reduce_scatter
        return out

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor, None]:
        # ∂L/∂z_rank = Σ_ranks g_r[rows of this rank]: every rank's loss share depends on these rows
        if ctx.reduce_scatter:
            g = g.contiguous()
            dz = g.new_empty((ctx.n, *g.shape[1:]))  # (n, ...)
            _reduce_scatter_single(dz, g)
            return dz, None
        total = g.clone(memory_format=torch.contiguous_format)  # (W n, ...), all_reduce works in place
        dist.all_reduce(total)
        return total[ctx.rank * ctx.n : (ctx.rank + 1) * ctx.n], None


def all_gather_rows(z: Tensor, reduce_scatter: bool | None = None) -> Tensor:
    """Differentiable all-gather over the default group. z (n, ...) -> (W n, ...), rank r's rows at [r n, (r+1) n).

    ``reduce_scatter``: the backward's collective; None chooses (reduce-scatter on NCCL, else all-reduce + slice).
    """
    rs = reduce_scatter_works(z) if reduce_scatter is None else reduce_scatter
    return _AllGatherRows.apply(z, rs)


def gather_views(z: Tensor, world_size: int) -> Tensor:
    """Differentiable all-gather of local two-view rows into the global two-view layout.

    z: (2b, ...) local rows ``[view1 (b); view2 (b)]`` -> (2bW, ...) ``[view1 of all ranks; view2 of all ranks]``.
    """
    if world_size == 1:
        return z
    b = z.shape[0] // 2
    parts = all_gather_rows(z)  # (W 2b, ...) rank-major, gradients flow back
    parts = parts.view(world_size, 2, b, *z.shape[1:])  # (W, 2, b, ...)
    return parts.transpose(0, 1).reshape(2 * world_size * b, *z.shape[1:])  # (2 W b, ...) view-major


def gather_ids(ids: Tensor, world_size: int) -> Tensor:
    """Non-differentiable version of :func:`gather_views` for the ids. (2b,) -> (2bW,)."""
    if world_size == 1:
        return ids
    parts = [torch.empty_like(ids) for _ in range(world_size)]
    dist.all_gather(parts, ids.contiguous())
    b = ids.shape[0] // 2
    return torch.cat([p[:b] for p in parts] + [p[b:] for p in parts])


def local_rows(rank: int, b: int, world_size: int) -> tuple[slice, slice]:
    """The global rows (views 1 and 2) that worker ``rank`` with ``b`` images owns."""
    big_b = b * world_size
    return slice(rank * b, (rank + 1) * b), slice(big_b + rank * b, big_b + (rank + 1) * b)


def allreduce_grads(params: Sequence[torch.nn.Parameter]) -> None:
    """Sum the gradients over workers in one coalesced all-reduce."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        g.copy_(reduced)


def broadcast_from_rank0(module: nn.Module) -> None:
    """Copy rank 0's parameters and buffers into every rank, in place (one broadcast per dtype)."""
    tensors = [*module.parameters(), *module.buffers()]
    by_dtype: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for group in by_dtype.values():
            flat = _flatten_dense_tensors([t.detach() for t in group])
            dist.broadcast(flat, src=0)
            for t, value in zip(group, _unflatten_dense_tensors(flat, group), strict=True):
                t.copy_(value)


class GlobalBatchStep:
    """Computes the gradient of the global-batch loss into ``model``'s ``.grad`` and returns the loss.

    ``__call__(x, ids)``: x (2b, ...) this worker's two views ``[view1; view2]``, ids (2b,) their ids
    (image index for self-supervised, label for supervised). Returns the global loss (a float, equal on
    every worker). Raises :class:`NonFiniteLossError` (on every worker alike) before touching ``.grad``
    if the loss is not finite. :meth:`lazy` does the same step but returns the loss as a 0-d tensor on
    the device, without a host sync and without the check (the caller checks, e.g. once per epoch).

    Raises ValueError at construction for ``grad_cache_chunk`` with a BatchNorm model (see the module doc).

    ``scaler``: an fp16 ``torch.amp.GradScaler`` (``training.precision``) that scales the loss before its backward;
    None (bf16, fp32) back-propagates the loss as it is.
    """

    scaler: torch.amp.GradScaler | None = None
    reducer: GradReducer | None = None  # with several workers: made by the first step (pipeline.training.comm)
    overlap: bool = True  # False: one coalesced all-reduce after the backward instead (a baseline for benchmarks)

    def __init__(
        self,
        model: TransFusion | ABCModel,
        loss_fn: LossFn,
        *,
        grad_cache_chunk: int | None = None,
        autocast_dtype: torch.dtype | None = None,
        layout: str | None = None,
        tile: int | None = None,
    ) -> None:
        """``layout``: what the gathered ids (2B,) are, passed on to ``loss_fn`` (``pipeline.core.losses``, *Layouts
        and host syncs*): ``"two_view"`` (self-supervised: the image index of ``[view 1; view 2]``) or
        ``"labels"`` (supervised). Then the loss has no host sync, and the ids are checked against the layout
        once, on the first step of each global batch size (:func:`pipeline.core.losses.check_layout`; a host sync),
        not at every step. None: ``loss_fn`` is called without it and reads (and validates) the ids itself."""
        if layout is not None and layout not in LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}; allowed: None, {', '.join(map(repr, LAYOUTS))}")
        self.layout = layout
        self.tile = tile  # column tile of the head's attention and the loss (pipeline.core.plan); None: dense
        self._rows_cache: dict[tuple, Rows] = {}
        self._layout_checked: set[int] = set()  # global batch sizes whose ids were checked against the layout
        self.model = model
        self.loss_fn = loss_fn
        if grad_cache_chunk is not None and has_batchnorm(model):
            raise ValueError(
                f"grad_cache_chunk={grad_cache_chunk} with a BatchNorm model: gradient caching would put the two "
                "views of an image in different BatchNorm batches and update the running statistics twice; "
                "use a backbone without BatchNorm or no gradient caching"
            )
        self.chunk = grad_cache_chunk
        self.autocast_dtype = autocast_dtype
        self.params = [p for p in model.parameters() if p.requires_grad]

    def _autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.autocast_dtype)

    def _global_ids(self, ids: Tensor, world_size: int) -> Tensor:
        """The global batch's ids (2B,). Gathered, except for the two-view layout once its first step of this batch
        size was checked: its ids are then fixed, ``[0..B-1; 0..B-1]``, and the losses do not read them anyway."""
        n = ids.shape[0] * world_size
        if self.layout == "two_view" and n in self._layout_checked:
            return self_supervised_ids(n // 2, device=ids.device)
        ids_all = gather_ids(ids, world_size)  # (2B,)
        if self.layout is not None and n not in self._layout_checked:
            check_layout(ids_all, self.layout)  # once per batch size (host syncs), not at every step
            self._layout_checked.add(n)
        return ids_all

    def _rows(self, z_local: Tensor, world_size: int, rank: int) -> Rows:
        """This worker's rows of the global two-view batch and the gather that shows it every row (cached)."""
        key = (z_local.shape[0], world_size, rank, z_local.device)
        if key not in self._rows_cache:
            b, dev = z_local.shape[0] // 2, z_local.device
            v1, v2 = local_rows(rank, b, world_size)
            index = torch.cat([torch.arange(v.start, v.stop, device=dev) for v in (v1, v2)])  # (2b,)
            if world_size == 1:
                gather = _identity
            else:
                def gather(t: Tensor) -> Tensor:
                    return gather_views(t, world_size)
            self._rows_cache[key] = Rows(index, 2 * b * world_size, gather)
        return self._rows_cache[key]

    def _head_loss(self, z_local: Tensor, ids: Tensor, world_size: int, rank: int) -> Tensor:
        ids_all = self._global_ids(ids, world_size)  # (2B,)
        b = z_local.shape[0] // 2
        if getattr(self.model, "method", "transfusion") == "abc":
            return self._abc_loss(z_local, ids_all, world_size, rank)
        if world_size == 1 and self.tile is None:  # one process, dense: the head on the whole batch
            with self._autocast(z_local.device):
                out = self.model.head(_upcast(z_local), views=2)  # rows [view 1; view 2]
            q, k = _upcast(out.q), _upcast(out.k)  # the loss in full precision whatever the autocast
        else:  # row-sharded (and tiled with a tile): this worker's rows of every block, keys and values gathered
            rows = self._rows(z_local, world_size, rank)
            with self._autocast(z_local.device):
                out = self.model.head.forward_rows(z_local, rows, views=2, tile=self.tile)
                # the loss's keys: every row, gathered in the compute dtype (bf16 under autocast), then upcast
                if out.q is out.k:
                    q = k = _upcast(rows.gather(out.q))  # (2B, d)
                else:
                    q, k = _upcast(rows.gather(torch.cat([out.q, out.k], dim=1))).chunk(2, dim=1)
        hint = {} if self.layout is None else {"layout": self.layout}
        if self.tile is not None:
            hint["tile"] = self.tile
        return sum(self.loss_fn(q, k, ids_all, rows=r, **hint) for r in local_rows(rank, b, world_size))

    def _abc_loss(self, z_local: Tensor, ids_all: Tensor, world_size: int, rank: int) -> Tensor:
        """ABC's share of this worker (module doc): the head on every row, gathered, the loss on this worker's rows.
        ``loss_fn(out, ids, rows=...)``: :func:`pipeline.core.model.bce_loss`."""
        rows = self._rows(z_local, world_size, rank)
        with self._autocast(z_local.device):
            out = self.model.head(rows.gather(z_local))  # on (2B, m): every row, [view 1; view 2] of the global batch
        out = dataclasses.replace(out, q=_upcast(out.q), k=_upcast(out.k))  # the similarity and loss in full precision
        if world_size == 1:
            return self.loss_fn(out, ids_all)
        b = z_local.shape[0] // 2
        return sum(self.loss_fn(out, ids_all, rows=r) for r in local_rows(rank, b, world_size))

    def __call__(self, x: Tensor, ids: Tensor) -> float:
        return float(self._run(x, ids, check=True))

    def lazy(self, x: Tensor, ids: Tensor) -> Tensor:
        """The step without a host sync: the global loss as a detached 0-d tensor, not checked for finiteness."""
        return self._run(x, ids, check=False)

    def _run(self, x: Tensor, ids: Tensor, check: bool) -> Tensor:
        world_size, rank = _distributed()
        if x.shape[0] % 2 or ids.shape[0] != x.shape[0]:
            raise ValueError(f"expected two views [view1; view2] and matching ids, got {x.shape[0]} rows")
        for p in self.params:
            p.grad = None
        if self.chunk is None or self.chunk >= x.shape[0]:
            with self._autocast(x.device):
                z = self.model.encode(x)  # (2b, m)
            loss = self._head_loss(z, ids, world_size, rank)
            if world_size == 1 or not self.overlap:
                total = self._total(loss, world_size, check)
                self._backward(loss)
                if world_size > 1:
                    allreduce_grads(self.params)
                return total
            reducer = self._overlapping_reducer()
            # checked: the sum first (before .grad is touched); lazy: this rank's share rides in a gradient bucket
            total = self._total(loss, world_size, check) if check else loss.detach().clone()
            reducer.start(extra=None if check else total)
            self._backward(loss)  # buckets of gradients are summed over workers while the backward goes on
            reducer.finish()  # lazy: total is now the sum of the shares
            return total
        else:
            with torch.no_grad(), self._autocast(x.device):
                z = _upcast(torch.cat([self.model.encode(c) for c in x.split(self.chunk)]))
            z.requires_grad_(True)
            loss = self._head_loss(z, ids, world_size, rank)
            total = self._total(loss, world_size, check)
            self._backward(loss)  # head grads and ∂L/∂z (summed over workers by the all-gather), scaled with fp16
            dz = z.grad
            for c, g in zip(x.split(self.chunk), dz.split(self.chunk), strict=True):
                with self._autocast(x.device):
                    zc = self.model.encode(c)
                _upcast(zc).backward(g)
        if world_size > 1:
            allreduce_grads(self.params)
        return total

    def _overlapping_reducer(self) -> GradReducer:
        """The bucketed all-reduce of the gradients that overlaps the backward (``training.comm``), made once."""
        if self.reducer is None:
            self.reducer = GradReducer(self.params)
        return self.reducer

    def _backward(self, loss: Tensor) -> None:
        """``loss.backward()``, through the fp16 gradient scaler when there is one (:attr:`scaler`): the gradients
        are then scaled, and the loop's ``scaler.step`` unscales them (after the all-reduce, so on every rank alike)."""
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    @staticmethod
    def _total(loss: Tensor, world_size: int, check: bool) -> Tensor:
        """The global loss (sum of the workers' shares), 0-d; with ``check`` raise if it is not finite."""
        total = loss.detach().clone()
        if world_size > 1:
            dist.all_reduce(total)
        if check:
            value = float(total)
            if not math.isfinite(value):
                raise NonFiniteLossError(f"non-finite loss ({value}); the step was not applied")
        return total
