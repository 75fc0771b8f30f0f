"""Gradient sums over workers that overlap the backward pass: buckets all-reduced as their gradients become ready.

The training step (``pipeline.training.step``) needs ``Σ_w ∂L_w/∂θ`` on every worker. One coalesced all-reduce after
``backward()`` leaves the network idle for the whole backward and the GPU idle for the whole all-reduce
(about 45 MB of fp32 for ResNet-18). :class:`GradReducer` instead groups the trainable parameters into buckets of
about ``bucket_mb`` in the reverse of their registration order (the order backward produces their gradients,
as DDP does), counts each bucket's gradients down with ``Tensor.register_post_accumulate_grad_hook``, and starts
an asynchronous all-reduce (sum) of a bucket once its last gradient is accumulated; :meth:`finish` waits for
them and copies the sums back into ``.grad``. The backward of the earlier layers runs while later buckets travel.

One fixed launch order: collectives must be issued in the same order on every rank, and the order in which the
hooks fire is only the same while autograd schedules the graph alike on every rank. So, as DDP does, the buckets
are launched in their index order on every rank: a bucket whose gradients are all there waits until every bucket
before it has been launched (:attr:`GradReducer.launched` records the order of the last step).

Unused parameters: a parameter that gets no gradient (``model.head: truncated`` leaves the last block's value
projection out of the graph) would keep its bucket, and with the fixed order every later bucket, waiting until
:meth:`finish`. The first step finds them: after it, the parameters that got no gradient are dropped from the
buckets for good (the buckets are rebuilt from the others, on every rank alike). This assumes the graph is the same
on every rank and in every step (the step's graph depends only on the model's configuration). If it changes: a
dropped parameter that gets a gradient later raises ``RuntimeError`` in its hook (on every rank alike, as the graph
is the same on every rank) rather than being silently left out of the sum; a kept parameter that gets no
gradient in some step is left out of its bucket's sum, whose launch then waits until :meth:`finish`.

Exactness: every element is summed over the same ranks whatever bucket it travels in; with 2 workers the sum of
two numbers does not depend on the order, so the result is bit-identical to one coalesced all-reduce (tested on
gloo).

A 0-d ``extra`` tensor given to :meth:`start` (the step's loss share) is summed in place in the first bucket that
starts, so the global loss costs no collective of its own.

Use: ``start()`` before the backward, ``finish()`` after; one accumulation per parameter and step (gradient caching,
which back-propagates several times into the same ``.grad``, sums after its last backward instead). Pure
torch.distributed; no Ray.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

BUCKET_MB = 25.0  # DDP's default bucket size


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    left: int = 0  # gradients still to come in this step
    flat: torch.Tensor | None = None
    grads: list[torch.Tensor] = field(default_factory=list)
    work: dist.Work | None = None
    early: bool = False  # launched from a hook, i.e. during the backward
    extra: torch.Tensor | None = None  # a 0-d tensor summed along with this bucket (the step's loss)


def buckets_of(params: Sequence[nn.Parameter], bucket_mb: float = BUCKET_MB) -> list[list[nn.Parameter]]:
    """The parameters in buckets of about ``bucket_mb`` MB each, in reverse order, one dtype and device per bucket."""
    limit = bucket_mb * 2**20
    out: list[list[nn.Parameter]] = []
    size, key = 0.0, None
    for p in reversed(list(params)):
        k = (p.dtype, p.device)
        if not out or size >= limit or k != key:
            out.append([])
            size, key = 0.0, k
        out[-1].append(p)
        size += p.numel() * p.element_size()
    return out


class GradReducer:
    """Sum ``params``' gradients over the default process group in buckets launched during the backward, in one
    fixed order; parameters that got no gradient in the first step are dropped from the buckets after it."""

    def __init__(self, params: Sequence[nn.Parameter], bucket_mb: float = BUCKET_MB) -> None:
        self.bucket_mb = bucket_mb
        self._build([p for p in params if p.requires_grad])
        self.unused: list[nn.Parameter] = []  # dropped after the first step: they got no gradient in it
        self._dropped: set[int] = set()
        self._steps = 0
        self._active = False
        self._extra: torch.Tensor | None = None
        self._next = 0  # the next bucket to launch, in index order
        self.launched: list[int] = []  # the buckets of the last step (indices), in the order they were launched
        self.launched_early = 0  # buckets of the last step whose all-reduce started during the backward
        self._handles = [p.register_post_accumulate_grad_hook(self._ready) for b in self.buckets for p in b.params]

    def _build(self, params: list[nn.Parameter]) -> None:
        self.buckets = [_Bucket(b) for b in buckets_of(params, self.bucket_mb)]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}

    def start(self, extra: torch.Tensor | None = None) -> None:
        """Arm the hooks for one backward. ``extra``: a 0-d tensor to sum over workers as well, in place, riding in
        the first bucket of its dtype that starts (no collective of its own; e.g. the step's loss)."""
        for b in self.buckets:
            b.left, b.flat, b.grads, b.work, b.early, b.extra = len(b.params), None, [], None, False, None
        self._extra = extra
        self._next = 0
        self.launched = []
        self._active = True

    def _ready(self, p: nn.Parameter) -> None:
        if not self._active:
            return
        if id(p) in self._dropped:
            raise RuntimeError(
                f"a parameter of shape {tuple(p.shape)} got a gradient, but got none in the first step, so it was "
                "dropped from the gradient buckets: the step's graph changed (GradReducer assumes one graph on "
                "every rank and step; make a new GradReducer for the new graph)")
        b = self._bucket_of[id(p)]
        b.left -= 1
        if b.left == 0:
            self._launch_in_order(early=True)

    def _launch_in_order(self, early: bool) -> None:
        """Launch the buckets that are complete, in index order, up to the first one that is not."""
        while self._next < len(self.buckets) and self.buckets[self._next].left == 0:
            self._launch(self._next, early)

    def _launch(self, i: int, early: bool) -> None:
        b = self.buckets[i]
        self._next = i + 1
        self.launched.append(i)
        b.grads = [p.grad for p in b.params if p.grad is not None]
        if self._extra is not None and b.grads and b.grads[0].dtype == self._extra.dtype:
            b.extra, self._extra = self._extra, None
        if not b.grads:
            return
        b.flat = _flatten_dense_tensors(b.grads + ([] if b.extra is None else [b.extra.reshape(1)]))
        b.work = dist.all_reduce(b.flat, async_op=True)
        b.early = early

    def finish(self) -> None:
        """Start what the backward did not complete (parameters without a gradient), wait for every bucket and put
        the sums into ``.grad``."""
        self._active = False
        while self._next < len(self.buckets):  # the rest, in order: buckets with a parameter that got no gradient
            self._launch(self._next, early=False)
        if self._extra is not None:  # no bucket of its dtype: on its own
            dist.all_reduce(self._extra)
            self._extra = None
        self.launched_early = sum(b.early for b in self.buckets)
        for b in self.buckets:
            if b.work is None:
                continue
            b.work.wait()
            n = sum(g.numel() for g in b.grads)
            for g, reduced in zip(b.grads, _unflatten_dense_tensors(b.flat[:n], b.grads), strict=True):
                g.copy_(reduced)
            if b.extra is not None:
                b.extra.copy_(b.flat[n].reshape(b.extra.shape))
            b.flat, b.grads, b.work, b.extra = None, [], None, None
        self._steps += 1
        if self._steps == 1:
            self._drop_unused()

    def _drop_unused(self) -> None:
        """After the first step: rebuild the buckets without the parameters that got no gradient in it."""
        params = [p for b in self.buckets for p in b.params][::-1]  # registration order, as given
        self.unused = [p for p in params if p.grad is None]
        if self.unused:
            self._dropped = {id(p) for p in self.unused}
            self._build([p for p in params if p.grad is not None])

    def remove(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []
