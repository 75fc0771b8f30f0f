"""One training step with global-batch fusion, optional gradient caching.

TransFusion lets the samples of a batch attend to each other, so with W workers the head and the loss
must see the *global* batch, not each worker's shard. Each worker:

1. embeds its own views with the backbone: z_w (2b, m);
2. all-gathers the embeddings with a differentiable all-gather into the global batch laid out
   ``[view 1 of all B images; view 2 of all B images]`` (2B, m), and the ids likewise;
3. runs the head on the global batch (replicated; it is cheap next to the backbone) and computes the loss
   for *its own rows* only: ``L_w = Σ_{i ∈ rows(w)} ℓ_i / 2B``, so that ``Σ_w L_w = L`` (the full loss);
4. back-propagates ``L_w``. The all-gather's backward sums, into each z_w, the gradients of every
   worker's share; summing the parameter gradients over workers (one all-reduce) then gives exactly
   ``∂L/∂θ`` of one process on the concatenated batch.

No DistributedDataParallel: its gradient *averaging* and forward hooks fit a per-sample loss, not a loss
over the gathered batch; one explicit coalesced all-reduce (sum) is simpler and exact.

Gradient caching (Gao et al., 2021) for batches larger than memory: embed in chunks without a graph,
compute the loss and ∂L/∂z on the full (global) batch, then re-embed chunk by chunk with a graph and
back-propagate the cached ∂L/∂z. Peak activation memory grows with the chunk, not the batch; gradients
equal the plain path (the backbone must be deterministic: no dropout, no batch statistics).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from pipeline.model import TransFusion

LossFn = Callable[..., Tensor]


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN or inf; the step was not applied."""


def _upcast(t: Tensor) -> Tensor:
    """fp16/bf16 (autocast) -> fp32; fp32/fp64 unchanged."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _distributed() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def gather_views(z: Tensor, world_size: int) -> Tensor:
    """Differentiable all-gather of local two-view rows into the global two-view layout.

    z: (2b, ...) local rows ``[view1 (b); view2 (b)]`` -> (2bW, ...) ``[view1 of all ranks; view2 of all ranks]``.
    """
    if world_size == 1:
        return z
    parts = dist_fn.all_gather(z)  # W x (2b, ...), gradients flow back
    b = z.shape[0] // 2
    return torch.cat([p[:b] for p in parts] + [p[b:] for p in parts])


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


class GlobalBatchStep:
    """Computes the gradient of the global-batch loss into ``model``'s ``.grad`` and returns the loss.

    ``__call__(x, ids)``: x (2b, ...) this worker's two views ``[view1; view2]``, ids (2b,) their ids
    (image index for self-supervised, label for supervised). Returns the global loss (a float, equal on
    every worker). Raises :class:`NonFiniteLossError` (on every worker alike) before touching ``.grad``
    if the loss is not finite.
    """

    def __init__(
        self,
        model: TransFusion,
        loss_fn: LossFn,
        *,
        grad_cache_chunk: int | None = None,
        autocast_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.chunk = grad_cache_chunk
        self.autocast_dtype = autocast_dtype
        self.params = [p for p in model.parameters() if p.requires_grad]

    def _autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.autocast_dtype)

    def _head_loss(self, z_local: Tensor, ids: Tensor, world_size: int, rank: int) -> Tensor:
        z_all = gather_views(z_local, world_size)  # (2B, m)
        ids_all = gather_ids(ids, world_size)  # (2B,)
        with self._autocast(z_local.device):
            out = self.model.head(z_all)
        q, k = _upcast(out.q), _upcast(out.k)  # the loss in full precision whatever the autocast
        b = z_local.shape[0] // 2
        return sum(self.loss_fn(q, k, ids_all, rows=r) for r in local_rows(rank, b, world_size))

    def __call__(self, x: Tensor, ids: Tensor) -> float:
        world_size, rank = _distributed()
        if x.shape[0] % 2 or ids.shape[0] != x.shape[0]:
            raise ValueError(f"expected two views [view1; view2] and matching ids, got {x.shape[0]} rows")
        for p in self.params:
            p.grad = None
        if self.chunk is None or self.chunk >= x.shape[0]:
            with self._autocast(x.device):
                z = self.model.backbone(x)  # (2b, m)
            loss = self._head_loss(_upcast(z), ids, world_size, rank)
            total = self._check(loss, world_size)
            loss.backward()
        else:
            with torch.no_grad(), self._autocast(x.device):
                z = _upcast(torch.cat([self.model.backbone(c) for c in x.split(self.chunk)]))
            z.requires_grad_(True)
            loss = self._head_loss(z, ids, world_size, rank)
            total = self._check(loss, world_size)
            loss.backward()  # head grads and ∂L/∂z (summed over workers by the all-gather)
            dz = z.grad
            for c, g in zip(x.split(self.chunk), dz.split(self.chunk), strict=True):
                with self._autocast(x.device):
                    zc = self.model.backbone(c)
                _upcast(zc).backward(g)
        if world_size > 1:
            allreduce_grads(self.params)
        return total

    @staticmethod
    def _check(loss: Tensor, world_size: int) -> float:
        total = loss.detach().clone()
        if world_size > 1:
            dist.all_reduce(total)
        value = float(total)
        if not math.isfinite(value):
            raise NonFiniteLossError(f"non-finite loss ({value}); the step was not applied")
        return value
