"""Global BatchNorm: batch statistics over the whole global batch of every worker, exact gradients.

With W workers each holding ``n_w`` rows (both views of its images), plain BatchNorm normalises every
worker's rows by that worker's statistics: embeddings then depend on how the batch is split, the two
views of an image share one small BN batch (the information leak SimCLR removed with global BN), and the
running statistics differ per rank. :class:`GlobalBatchNorm` normalises by the statistics of all
``N = Σ_w n_w · Π spatial`` values of each channel, exactly what one process would compute on the
concatenated batch. Both paths below compute the same function; they differ in kernels, not in semantics.

Semantics (x (n, C, *) on rank w, per channel, g = ∂L/∂y on this rank):

    n_w = n · Π spatial,   μ_w = mean_w x,   M2_w = Σ_w (x − μ_w)²  (centred, this rank's values)
    N = Σ_w n_w,   μ = Σ_w n_w μ_w / N,   σ² = (Σ_w M2_w + Σ_w n_w (μ_w − μ)²) / N   (biased; Chan et al.)
    x̂ = (x − μ) / sqrt(σ² + eps),   y = γ x̂ + β                                  # (n, C, *)
    ∂L/∂x = γ / sqrt(σ² + eps) · (g − Σ_all g / N − x̂ · Σ_all g·x̂ / N)          # (n, C, *)
    ∂L/∂γ = Σ_local g·x̂,  ∂L/∂β = Σ_local g                                       # (C,), local shares

Centred per-rank moments, not the sums form (an all-reduce of Σx, Σx², count; σ² = Σx²/N − μ²): equal in exact
arithmetic, but the sums form cancels catastrophically in fp32/bf16 when |μ| ≫ σ (post-ReLU activations). The
parameter gradients are this rank's shares on purpose: the training step sums parameter gradients over workers with
one all-reduce (``pipeline.training.step.allreduce_grads``), which completes them. ``g`` must be the gradient of the
*total* loss w.r.t. this rank's outputs, which the step's all-gather backward gives. Running statistics (training,
``track_running_stats``) are updated with the global μ and the global unbiased variance σ²·N/(N−1), so they are
identical on every rank; momentum ``None`` gives the cumulative average as in ``nn.BatchNorm``, its factor
1/num_batches_tracked a device tensor (no host read of the count). In eval mode, or when torch.distributed is not
initialised or has one process, the module is exactly ``nn.BatchNorm`` (same code path, ``F.batch_norm``). Output
dtype = input dtype. One collective per layer and direction on both paths: forward one all-gather of a (2C + 1,)
vector per rank (W (2C + 1) values in all), backward one all-reduce of a (2C,) vector; any backend with both
collectives works (gloo on CPU, NCCL on CUDA).

**Fused path** (CUDA tensors, :func:`use_fused_kernels`; :class:`FusedGlobalBatchNormFn`): torch's
SyncBatchNorm kernels, statistics in the accumulation type (fp32 for fp16/bf16, else the input's), never a
full-size fp32 copy of bf16 activations:

    (μ_w, ι_w) = batch_norm_stats(x, eps)           ι_w = 1/sqrt(σ²_w + eps)      read x             (C,), (C,)
    all-gather [μ_w, ι_w, n_w]                                                                    (W, 2C + 1)
    (μ, ι) = batch_norm_gather_stats_with_counts    σ²_w = ι_w⁻² − eps, Chan merge over w in rank
             (also updates running_mean / running_var in place with μ and M2/(N − 1))             (C,), (C,)
    y = batch_norm_elemt(x, γ, β, μ, ι) = (x − μ) ι γ + β                          read x, write y  (n, C, *)
  backward:
    (Σg, Σg(x−μ), ∂γ, ∂β) = batch_norm_backward_reduce(g, x, μ, ι, γ)             read g, x        4 × (C,)
    all-reduce [Σg, Σg(x−μ)]                                                                      (2C,)
    ∂x = batch_norm_backward_elemt = γι (g − Σg/N − (x−μ) ι² Σg(x−μ)/N)     read g, x, write ∂x   (n, C, *)

(∂γ = ι Σ_local g(x−μ), ∂β = Σ_local g: local shares as above; N = Σ_w n_w from the gathered counts, as int32
for the backward kernel; without an input gradient the all-reduce and the elementwise kernel are skipped, on
every rank alike.) Recovering σ²_w from ι_w loses relative precision only when σ²_w ≪ eps (the
normalisation is then dominated by eps anyway); torch's SyncBatchNorm has the same property. Running
buffers whose dtype is not the accumulation type (a bf16 model) are updated through accumulation-type
copies of the (C,) buffers, since the kernel reads the counts in the running buffers' dtype.

**Exact path** (every other device, i.e. gloo on CPU; :class:`GlobalBatchNormFn`): the equations above
written with ``torch.var_mean`` and elementwise ops in the statistics dtype (fp32 at least: bf16 input is
upcast, full fp32 copies of x forward and of x and g backward), the gathered vector is [n_w, μ_w, M2_w].
torch 2.14 has no CPU (nor Meta) kernel for the five fused ops (``NotImplementedError``), so CPU keeps this
path, unchanged: CPU results are bit for bit those from before the fused path existed.

Passes over the activations, measured by tests/core/test_batchnorm_passes.py (a TorchDispatchMode records every
non-view aten op in the layer's forward, resp. backward, that reads or writes a tensor with the input's numel;
"kernels" = such ops, "traversals" = activation-sized tensors read + written, summed over them, "bytes" = their
bytes in units of the input's; the same for (n, C) and (n, C, H, W)):

    path (input dtype)        forward kernels / traversals / bytes     backward kernels / traversals / bytes
    fused (any)               2 / 3 / 3                                2 / 5 / 5
    exact (fp32, fp64)        4 / 7 / 7                                9 / 18 / 18
    exact (bf16)              6 / 11 / 20  (2 casts)                   12 / 24 / 45  (3 casts)

Before the fused path existed, CUDA ran the exact path (the last two rows). Five traversals is the floor
for a backward that cannot hold the activations on chip: the all-reduce sits between the reduction over
(g, x) and the elementwise pass over (g, x), so both are read twice and ∂x written once (torch's
SyncBatchNorm runs the same two kernels). The fused path is tested on CPU with reference CPU kernels for the
five ops, registered by the tests only, that follow the CUDA kernels' semantics and dtype checks (as in
torch's CUDA source); they also reproduce torch's own SyncBatchNorm autograd Function.

Why not ``torch.nn.SyncBatchNorm`` itself: in torch 2.14 its ``forward`` raises
``ValueError("SyncBatchNorm expected input tensor to be on GPU or XPU ...")`` for CPU input in training
mode whenever a process group is initialised, so it cannot run (nor be tested) under gloo on CPU.

:func:`convert_batchnorm` swaps every ``nn.BatchNorm1d/2d/3d`` in place for a :class:`GlobalBatchNorm`
that holds the *same* parameter and buffer tensors under the same names, so state_dict keys are unchanged
and a checkpoint loads into a plain (unconverted) model for evaluation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

PLAIN_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
# torch 2.14 deprecates all_gather_into_tensor in favour of all_gather_single
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _stat_dtype(x: Tensor) -> torch.dtype:
    """Accumulation dtype of the statistics: float32 for half types, else the input's."""
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def _channel_shape(x: Tensor) -> list[int]:
    """(C,) statistics broadcast against x (n, C, *): shape [1, C, 1, ...]."""
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


class GlobalBatchNormFn(torch.autograd.Function):
    """y = γ (x − μ_global) / sqrt(σ²_global + eps) + β with exact gradients (see the module docstring)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, group) -> tuple:
        dims = [0, *range(2, x.dim())]
        c = x.shape[1]
        sdt = _stat_dtype(x)
        xs = x.to(sdt)  # (n, C, *), a no-op for fp32/fp64
        var_w, mean_w = torch.var_mean(xs, dims, correction=0)  # (C,), (C,) this rank's, centred (accurate)
        n_w = torch.full((1,), x.numel() // c, dtype=sdt, device=x.device)  # (1,)
        local = torch.cat([n_w, mean_w, var_w * n_w])  # (2C + 1,): n_w, μ_w, M2_w
        every = local.new_empty(dist.get_world_size(group) * (2 * c + 1))  # (W (2C + 1),)
        _all_gather_single(every, local, group=group)
        every = every.view(-1, 2 * c + 1)  # (W, 2C + 1)
        counts, means, m2s = every[:, :1], every[:, 1 : c + 1], every[:, c + 1 :]  # (W, 1), (W, C), (W, C)
        count = counts.sum()  # 0-d: N, values per channel over all ranks
        mean = (counts * means).sum(0) / count  # (C,)
        var = (m2s.sum(0) + (counts * (means - mean) ** 2).sum(0)) / count  # (C,) biased
        invstd = torch.rsqrt(var + eps)  # (C,)
        shape = _channel_shape(x)
        scale = invstd if weight is None else invstd * weight.to(sdt)  # (C,)
        y = (xs - mean.view(shape)) * scale.view(shape)  # (n, C, *), centred first: no cancellation
        if bias is not None:
            y = y + bias.to(sdt).view(shape)
        y = y.to(x.dtype)
        ctx.save_for_backward(x, weight, mean, invstd, count)
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.mark_non_differentiable(mean, var, count)
        return y, mean, var, count

    @staticmethod
    @once_differentiable
    def backward(ctx, g: Tensor, *_unused: Tensor) -> tuple:
        x, weight, mean, invstd, count = ctx.saved_tensors
        shape, dims, c = _channel_shape(x), [0, *range(2, x.dim())], x.shape[1]
        sdt = mean.dtype
        gs = g.to(sdt)  # (n, C, *)
        xhat = (x.to(sdt) - mean.view(shape)) * invstd.view(shape)  # (n, C, *)
        sum_g, sum_gx = gs.sum(dims), (gs * xhat).sum(dims)  # (C,) this rank's shares
        total = torch.cat([sum_g, sum_gx])  # (2C,)
        dist.all_reduce(total, group=ctx.group)  # global sums
        mean_g, mean_gx = total[:c] / count, total[c:] / count  # (C,)
        k = invstd if weight is None else invstd * weight.to(sdt)  # (C,)
        dx = (k.view(shape) * (gs - mean_g.view(shape) - xhat * mean_gx.view(shape))).to(x.dtype)  # (n, C, *)
        dw = sum_gx.to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        db = sum_g.to(weight.dtype) if weight is not None and ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None


def use_fused_kernels(x: Tensor) -> bool:
    """True where torch has the fused SyncBatchNorm kernels: CUDA (torch 2.14 has no CPU or Meta kernel)."""
    return x.is_cuda


def _memory_format(x: Tensor) -> torch.memory_format:
    """The layout the fused kernels keep (channels-last stays channels-last, anything else contiguous)."""
    for fmt in (torch.channels_last, torch.channels_last_3d):
        if x.is_contiguous(memory_format=fmt):
            return fmt
    return torch.contiguous_format


def _gather_buffers(x: Tensor, running_mean: Tensor | None, running_var: Tensor | None,
                    sdt: torch.dtype) -> tuple[Tensor | None, Tensor | None]:
    """Running buffers for ``batch_norm_gather_stats_with_counts`` in the statistics dtype ``sdt``.

    The kernel reads the counts and the running buffers in the running buffers' dtype (the input's without
    them) and the gathered moments in that dtype's accumulation type; with buffers in ``sdt`` all of them
    are ``sdt``. (C,)-sized copies where the module's buffers (or, without buffers, the input) differ.
    """
    if running_mean is None:
        if x.dtype == sdt:
            return None, None
        c = x.shape[1]
        return torch.zeros(c, dtype=sdt, device=x.device), torch.ones(c, dtype=sdt, device=x.device)
    if running_mean.dtype == sdt and running_var.dtype == sdt:
        return running_mean, running_var
    return running_mean.to(sdt), running_var.to(sdt)


class FusedGlobalBatchNormFn(torch.autograd.Function):
    """The fused path (see the module docstring): 2 kernels forward, 2 backward, one collective each way.

    ``running_mean`` / ``running_var`` (or None) are updated in place with ``momentum`` (the averaging factor,
    already resolved for momentum None); the parameter gradients are this rank's local shares.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor | None, bias: Tensor | None, running_mean: Tensor | None,
                running_var: Tensor | None, momentum: float, eps: float, group) -> Tensor:
        x = x.contiguous(memory_format=_memory_format(x))  # no-op unless x is strided oddly
        c = x.shape[1]
        mean_w, invstd_w = torch.batch_norm_stats(x, eps)  # (C,), (C,) this rank's, accumulation dtype
        if weight is not None and weight.dtype not in (x.dtype, mean_w.dtype):  # the kernels take these two only
            weight, bias = weight.to(mean_w.dtype), None if bias is None else bias.to(mean_w.dtype)
        n_w = torch.full((1,), x.numel() // c, dtype=mean_w.dtype, device=x.device)  # (1,)
        local = torch.cat([mean_w, invstd_w, n_w])  # (2C + 1,): μ_w, ι_w, n_w
        every = local.new_empty(dist.get_world_size(group) * (2 * c + 1))  # (W (2C + 1),)
        _all_gather_single(every, local, group=group)
        every = every.view(-1, 2 * c + 1)  # (W, 2C + 1)
        means, invstds, counts = every[:, :c], every[:, c : 2 * c], every[:, 2 * c]  # (W, C), (W, C), (W,)
        if x.numel() // c <= 1:  # only then can all ranks have <= 1 value: the one case that reads (syncs) N
            n = int(counts.sum().item())
            if n <= 1:
                raise ValueError(f"expected more than 1 value per channel over all ranks when training, got {n}")
        rm, rv = _gather_buffers(x, running_mean, running_var, mean_w.dtype)
        counts = counts if rm is None else counts.to(rm.dtype)  # (W,), the kernel's dtype for counts
        mean, invstd = torch.batch_norm_gather_stats_with_counts(x, means, invstds, rm, rv, momentum, eps, counts)
        if running_mean is not None and rm is not running_mean:  # accumulation-dtype copies: write back
            running_mean.copy_(rm)
            running_var.copy_(rv)
        y = torch.batch_norm_elemt(x, weight, bias, mean, invstd, eps)  # (n, C, *), x's dtype
        ctx.save_for_backward(x, weight, mean, invstd, counts.to(torch.int32))
        ctx.group, ctx.has_bias = group, bias is not None
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, g: Tensor) -> tuple:
        x, weight, mean, invstd, counts = ctx.saved_tensors
        g = g.contiguous(memory_format=_memory_format(x))  # the kernels want g laid out like x
        need_x = ctx.needs_input_grad[0]
        need_w = weight is not None and ctx.needs_input_grad[1]
        need_b = weight is not None and ctx.has_bias and ctx.needs_input_grad[2]
        sum_g, sum_gxmu, dw, db = torch.batch_norm_backward_reduce(g, x, mean, invstd, weight, need_x, need_w, need_b)
        dx = None
        if need_x:  # the same on every rank (same model), so every rank joins the collective or none does
            c = x.shape[1]
            total = torch.cat([sum_g, sum_gxmu])  # (2C,) this rank's shares of Σg, Σg(x − μ)
            dist.all_reduce(total, group=ctx.group)  # global sums
            w = weight if weight is None or weight.dtype == mean.dtype else weight.to(mean.dtype)
            dx = torch.batch_norm_backward_elemt(g, x, mean, invstd, w, total[:c], total[c:], counts)
        return dx, dw, db, None, None, None, None, None


def world_size(group) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


class GlobalBatchNorm(_BatchNorm):
    """BatchNorm over the global batch of all ranks in training; ``nn.BatchNorm`` otherwise.

    Input (n, C, *) -> output (n, C, *). ``process_group`` None = the default (world) group.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group=None, device=None, dtype=None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_group = process_group

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: Tensor) -> Tensor:
        if not self.training or world_size(self.process_group) == 1:
            return super().forward(input)  # exactly nn.BatchNorm
        self._check_input_dim(input)
        if use_fused_kernels(input):
            return self._fused_forward(input)
        y, mean, var, count = GlobalBatchNormFn.apply(input, self.weight, self.bias, self.eps, self.process_group)
        # N > 1 is sure when this rank has 2 values a channel; only below that is N read (a host sync)
        n = int(count.item()) if input.numel() // input.shape[1] <= 1 else None
        if n is not None and n <= 1:
            raise ValueError(f"expected more than 1 value per channel over all ranks when training, got {n}")
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                unbiased = var * (count / (count - 1))  # (C,)
                if self.momentum is None:  # the cumulative average, its factor a device tensor: no host read
                    self._average(mean, unbiased)
                else:
                    factor = self.momentum
                    self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
                    self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        return y

    def _average(self, mean: Tensor, unbiased: Tensor) -> None:
        """Momentum None, after the count's increment: running ← running + (batch − running) / num_batches_tracked,
        i.e. (1 − f) running + f batch with f = 1 / num_batches_tracked, a 0-d tensor on the buffers' device
        (``nn.BatchNorm`` reads the count on the host: ``float(num_batches_tracked)``, a sync per layer and step).
        mean, unbiased: (C,) the batch's mean and unbiased variance."""
        for running, batch in ((self.running_mean, mean), (self.running_var, unbiased)):
            f = self.num_batches_tracked.to(running.dtype).reciprocal()  # 0-d
            running.mul_(1 - f).add_(batch.to(running.dtype) * f)

    def _fused_forward(self, input: Tensor) -> Tensor:
        """The fused path; the running statistics are updated by the gather kernel with the resolved factor."""
        factor, running_mean, running_var = 0.0, None, None
        if self.track_running_stats:
            running_mean, running_var = self.running_mean, self.running_var
            factor = self.momentum
            if self.momentum is None:  # the kernel takes a float: it writes the batch's statistics (factor 1) to
                # (C,) zeros, averaged in below with a device-tensor factor (no host read of the count)
                running_mean, running_var, factor = torch.zeros_like(running_mean), torch.zeros_like(running_var), 1.0
        y = FusedGlobalBatchNormFn.apply(input, self.weight, self.bias, running_mean, running_var, factor,
                                         self.eps, self.process_group)
        if self.track_running_stats:  # the count moves only once the step succeeded
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                with torch.no_grad():
                    self._average(running_mean, running_var)
        return y


def convert_batchnorm(module: nn.Module, process_group=None) -> nn.Module:
    """Replace every ``nn.BatchNorm1d/2d/3d`` in ``module`` by a :class:`GlobalBatchNorm`, in place.

    The new modules hold the very same parameter and buffer tensors (names, values, devices, dtypes,
    ``requires_grad``), so ``state_dict`` keys and values are unchanged and optimizers built before or after
    see the same parameters. Returns the module (a new one only if ``module`` itself is a BatchNorm).
    """
    if type(module) in PLAIN_BATCHNORMS:
        new = GlobalBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                              module.track_running_stats, process_group)
        new.weight, new.bias = module.weight, module.bias  # the same Parameters (or None)
        new.running_mean, new.running_var = module.running_mean, module.running_var
        new.num_batches_tracked = module.num_batches_tracked
        new.train(module.training)
        return new
    for name, child in module.named_children():
        new_child = convert_batchnorm(child, process_group)
        if new_child is not child:
            setattr(module, name, new_child)
    return module


def has_batchnorm(module: nn.Module) -> bool:
    """True if ``module`` contains any BatchNorm (plain, global or torch's SyncBatchNorm)."""
    return any(isinstance(m, _BatchNorm) for m in module.modules())

