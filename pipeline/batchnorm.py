"""Global BatchNorm: batch statistics over the whole global batch of every worker, exact gradients.

With W workers each holding ``n_w`` rows (both views of its images), plain BatchNorm normalises every
worker's rows by that worker's statistics: embeddings then depend on how the batch is split, the two
views of an image share one small BN batch (the information leak SimCLR removed with global BN), and the
running statistics differ per rank. :class:`GlobalBatchNorm` normalises by the statistics of all
``N = Σ_w n_w · Π spatial`` values of each channel, exactly what one process would compute on the
concatenated batch.

Forward, for input x (n, C, *) on each rank w, per channel (one all-gather of a (2C + 1,) vector per rank):

    n_w = n · Π spatial,   μ_w = mean_w x,   M2_w = Σ_w (x − μ_w)²  (centred, this rank's values)
    N = Σ_w n_w,   μ = Σ_w n_w μ_w / N,   σ² = (Σ_w M2_w + Σ_w n_w (μ_w − μ)²) / N   (biased; Chan et al.)
    x̂ = (x − μ) / sqrt(σ² + eps),   y = γ x̂ + β                 # (n, C, *)

This equals the sums form (an all-reduce of Σx, Σx², count; σ² = Σx²/N − μ²) in exact arithmetic, but the
sums form cancels catastrophically in fp32/bf16 when |μ| ≫ σ (post-ReLU activations); the centred per-rank
moments do not (torch's SyncBatchNorm also gathers per-rank moments). The gathered vector is tiny: W (2C + 1).

Backward, with g = ∂L/∂y on this rank (one all-reduce of a (2C,) vector: the two gradient sums):

    Σ_all g,  Σ_all g·x̂                                            (all-reduced sum)
    ∂L/∂x = γ / sqrt(σ² + eps) · (g − Σ_all g / N − x̂ · Σ_all g·x̂ / N)
    ∂L/∂γ = Σ_local g·x̂,  ∂L/∂β = Σ_local g                         (local shares)

The parameter gradients are this rank's shares on purpose: the training step sums parameter gradients
over workers with one all-reduce (``pipeline.step.allreduce_grads``), which completes them. ``g`` must be
the gradient of the *total* loss w.r.t. this rank's outputs, which the step's all-gather backward gives.

Running statistics (training, ``track_running_stats``) are updated with the global μ and the global
unbiased variance σ²·N/(N−1), so they are identical on every rank; momentum ``None`` gives the cumulative
average as in ``nn.BatchNorm``. In eval mode, or when torch.distributed is not initialised or has one
process, the module is exactly ``nn.BatchNorm`` (same code path, ``F.batch_norm``).

Statistics are accumulated in float32 at least (bf16 autocast inputs are upcast for the sums); the output
has the input's dtype. Works with every backend that all-reduces (gloo on CPU, NCCL on CUDA).

Why not ``torch.nn.SyncBatchNorm``: in torch 2.14 its ``forward`` raises
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
        y, mean, var, count = GlobalBatchNormFn.apply(input, self.weight, self.bias, self.eps, self.process_group)
        n = int(count.item()) if not input.is_cuda else None  # CUDA: no host sync; N>1 is checked on CPU only
        if n is not None and n <= 1:
            raise ValueError(f"expected more than 1 value per channel over all ranks when training, got {n}")
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
                unbiased = var * (count / (count - 1))  # (C,)
                self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
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

