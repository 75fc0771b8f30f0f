"""Optimisers and the learning-rate schedule of the pretraining loop (pure torch, no external dependency).

- :class:`LARS`: layer-wise adaptive rate scaling (You et al. 2017, "Large Batch Training of Convolutional
  Networks") in the form used by SimCLR / BYOL / Barlow Twins: momentum SGD whose step for every weight tensor
  is rescaled by the trust ratio ``eta * ||p|| / ||g||``; biases and normalisation parameters are excluded.
- :func:`build_optimizer`: ``adam`` / ``sgd`` / ``lars`` by name, with the usual "no weight decay on 1-d
  parameters" grouping for the momentum optimisers.
- :func:`warmup_cosine`: per-step linear warmup followed by a cosine decay, as a :class:`LambdaLR` whose
  ``state_dict`` round-trips through a checkpoint.

Schedulers are stepped once per optimiser step (not per epoch)::

    opt = build_optimizer("lars", model, lr=0.3, weight_decay=1e-6)
    sched = warmup_cosine(opt, total_steps=epochs * steps_per_epoch, warmup_steps=10 * steps_per_epoch)
    for batch in loader:
        loss(batch).backward(); opt.step(); opt.zero_grad(); sched.step()
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

__all__ = ["LARS", "OPTIMIZERS", "build_optimizer", "split_decay_params", "warmup_cosine"]

OPTIMIZERS = ("adam", "sgd", "lars")


class LARS(Optimizer):
    """Momentum SGD with layer-wise adaptive rate scaling (LARS, You et al. 2017).

    For every parameter tensor ``p`` (any shape) with gradient ``g``, in a group with learning rate ``lr``,
    momentum ``mu``, weight decay ``wd`` and trust coefficient ``eta``::

        g     <- g + wd * p                                              (L2 weight decay)
        trust  = eta * ||p|| / ||g||   if ||p|| > 0 and ||g|| > 0, else 1  (local learning-rate ratio)
        v     <- mu * v + lr * trust * g                                 (v starts at 0)
        p     <- p - v

    Norms are Frobenius norms of the whole tensor. In a group with ``lars_exclude=True`` (biases and
    normalisation parameters, see :func:`build_optimizer`) both the weight decay and the trust ratio are
    skipped, i.e. ``g`` is left as is and ``trust = 1``: plain momentum SGD. Parameters whose ``grad`` is
    ``None`` are left untouched (and get no momentum state).

    Args:
        params: parameters or parameter groups. Per-group keys: ``lr``, ``momentum``, ``weight_decay``,
            ``trust_coefficient``, ``lars_exclude``.
        lr: learning rate (>= 0).
        momentum: ``mu`` (>= 0).
        weight_decay: ``wd`` (>= 0).
        trust_coefficient: ``eta`` (> 0), 1e-3 in the paper.
        lars_exclude: default of the per-group flag above.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict],
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 1e-3,
        lars_exclude: bool = False,
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"LARS: lr must be >= 0, got {lr}")
        if momentum < 0.0:
            raise ValueError(f"LARS: momentum must be >= 0, got {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"LARS: weight_decay must be >= 0, got {weight_decay}")
        if trust_coefficient <= 0.0:
            raise ValueError(f"LARS: trust_coefficient must be > 0, got {trust_coefficient}")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            trust_coefficient=trust_coefficient,
            lars_exclude=lars_exclude,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        """Apply one LARS update to every parameter that has a gradient (equations in the class docstring).

        Args:
            closure: optional callable that re-evaluates the model and returns the loss.

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        for group in self.param_groups:
            lr = group["lr"]
            mu = group["momentum"]
            wd = group["weight_decay"]
            eta = group["trust_coefficient"]
            exclude = group["lars_exclude"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("LARS does not support sparse gradients")
                g = p.grad  # same shape as p
                if not exclude:
                    if wd != 0.0:
                        g = g.add(p, alpha=wd)
                    p_norm = torch.linalg.vector_norm(p)  # () scalar
                    g_norm = torch.linalg.vector_norm(g)  # ()
                    # torch.where instead of a python `if` avoids a host-device sync per tensor; the discarded
                    # branch may hold inf / nan (0 / 0), which is harmless under no_grad.
                    trust = torch.where((p_norm > 0) & (g_norm > 0), eta * p_norm / g_norm, torch.ones_like(p_norm))
                    g = g * trust
                state = self.state[p]
                buf = state.get("momentum_buffer")
                if buf is None:
                    buf = torch.zeros_like(p)
                    state["momentum_buffer"] = buf
                buf.mul_(mu).add_(g, alpha=lr)  # v <- mu v + lr * trust * g
                p.sub_(buf)  # p <- p - v
        return loss


def _trainable(params_or_model: nn.Module | Iterable[Tensor]) -> list[Tensor]:
    """The parameters with ``requires_grad=True`` of a module or an iterable of parameters, in order."""
    params = params_or_model.parameters() if isinstance(params_or_model, nn.Module) else params_or_model
    out: list[Tensor] = []
    for p in params:
        if isinstance(p, dict):
            raise TypeError("build_optimizer takes a model or an iterable of parameters, not parameter groups")
        if p.requires_grad:
            out.append(p)
    return out


def split_decay_params(params_or_model: nn.Module | Iterable[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
    """Split trainable parameters into (decayed, not decayed) = (ndim >= 2, ndim <= 1).

    Weight matrices / conv kernels get weight decay (and, for LARS, the trust ratio); biases and normalisation
    scales / shifts (ndim <= 1) do not. Parameters with ``requires_grad=False`` are dropped; order is kept.

    Args:
        params_or_model: an ``nn.Module`` or an iterable of parameters.

    Returns:
        ``(decay, no_decay)`` lists of parameters.
    """
    params = _trainable(params_or_model)
    return [p for p in params if p.ndim >= 2], [p for p in params if p.ndim <= 1]


def build_optimizer(
    name: str,
    params_or_model: nn.Module | Iterable[Tensor],
    *,
    lr: float,
    weight_decay: float = 0.0,
    momentum: float = 0.9,
    head_lr_scale: float = 1.0,
) -> Optimizer:
    """Build an optimiser by name (one of :data:`OPTIMIZERS`, case-insensitive).

    - ``adam``: ``torch.optim.Adam(params, lr, weight_decay)``, one group, default betas (``momentum`` is not
      used); weight decay is Adam's coupled L2 term on every parameter.
    - ``sgd``: ``torch.optim.SGD(momentum=momentum, nesterov=False)`` with two groups:
      ``[{ndim >= 2, weight_decay}, {ndim <= 1, weight_decay=0}]``.
    - ``lars``: :class:`LARS` with the same two groups, the second one flagged ``lars_exclude=True`` (no weight
      decay and no trust ratio for biases / normalisation parameters).

    Empty groups are left out; parameters with ``requires_grad=False`` are skipped. With ``head_lr_scale != 1``
    and a model that has a ``head`` (a TransFusion model), the head's parameters get their own groups with
    ``lr * head_lr_scale`` (ours, ``train.head_lr_scale``); the schedule scales every group alike. The projector
    (``model.projector``: the model's ``projector``, not part of its ``head``) trains at ``lr`` with the backbone, so
    that every loss's projector learns alike; ``head_lr_scale`` slows only the TransFusion blocks.

    Args:
        name: optimiser name.
        params_or_model: an ``nn.Module`` or an iterable of parameters.
        lr: (peak) learning rate.
        weight_decay: weight decay for the decayed parameters.
        momentum: momentum for ``sgd`` and ``lars``.
        head_lr_scale: the head's learning rate as a multiple of ``lr``.

    Returns:
        The optimiser.

    Raises:
        ValueError: unknown name, or no trainable parameter.
    """
    key = name.lower()
    if key not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; expected one of {', '.join(OPTIMIZERS)}")
    params = _trainable(params_or_model)
    if not params:
        raise ValueError("build_optimizer: no trainable parameters")
    parts = [(params, lr)]  # (parameters, their lr)
    head = getattr(params_or_model, "head", None)
    if head_lr_scale != 1.0 and isinstance(head, nn.Module):
        ids = {id(p) for p in head.parameters()}
        parts = [([p for p in params if id(p) not in ids], lr), ([p for p in params if id(p) in ids],
                                                                   lr * head_lr_scale)]

    if key == "adam":
        if len(parts) == 1:
            return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
        return torch.optim.Adam([{"params": ps, "lr": r} for ps, r in parts if ps], lr=lr, weight_decay=weight_decay)

    groups = []
    for ps, r in parts:
        decay, no_decay = split_decay_params(ps)
        if key == "sgd":
            groups += [{"params": decay, "weight_decay": weight_decay, "lr": r},
                       {"params": no_decay, "weight_decay": 0.0, "lr": r}]
        else:
            groups += [{"params": decay, "weight_decay": weight_decay, "lars_exclude": False, "lr": r},
                       {"params": no_decay, "weight_decay": 0.0, "lars_exclude": True, "lr": r}]
    groups = [g for g in groups if g["params"]]
    if key == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=False)
    return LARS(groups, lr=lr, momentum=momentum)


@dataclass
class _WarmupCosine:
    """Multiplicative lr factor of :func:`warmup_cosine` as a picklable callable.

    ``LambdaLR.state_dict`` stores the ``__dict__`` of callable objects (not of plain functions), so the schedule's
    hyper-parameters travel with a checkpoint.
    """

    total_steps: int
    warmup_steps: int
    min_lr_ratio: float

    def __call__(self, step: int) -> float:
        w, t, m = self.warmup_steps, self.total_steps, self.min_lr_ratio
        if step < w:
            return (step + 1) / w
        if step >= t:
            return m
        span = t - w - 1  # number of cosine intervals between step w (factor 1) and step t-1 (factor m)
        if span <= 0:  # a single post-warmup step: the cosine has no room to decay
            return 1.0
        progress = (step - w) / span  # in [0, 1]
        return m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine(
    optimizer: Optimizer,
    *,
    total_steps: int,
    warmup_steps: int,
    min_lr_ratio: float = 0.0,
) -> LambdaLR:
    """Per-step linear warmup then cosine decay, as a ``LambdaLR`` multiplying each group's base lr by ``f(s)``.

    With ``W = warmup_steps``, ``T = total_steps``, ``m = min_lr_ratio`` and ``s`` the 0-based index of the
    optimiser step about to be taken (the scheduler's ``last_epoch``)::

        f(s) = (s + 1) / W                                               for 0 <= s < W
        f(s) = m + (1 - m) * (1 + cos(pi * (s - W) / (T - W - 1))) / 2   for W <= s < T   (if T - W >= 2)
        f(s) = 1                                                         for s = W = T - 1
        f(s) = m                                                         for s >= T

    so warmup climbs 1/W, 2/W, ..., 1 (the first step never has lr 0), the cosine runs from 1 at step W to m at
    the last step T - 1, and stepping past the end keeps m. ``W = 0`` is a pure cosine. Nothing divides by zero.

    ``state_dict()`` / ``load_state_dict()`` round-trip (with the optimiser's own state dict restoring the
    current lr): after resuming, the next lr equals the uninterrupted run's.

    Args:
        optimizer: the optimiser; its groups' current ``lr`` become the peak lrs.
        total_steps: ``T`` >= 1, number of optimiser steps of the whole run.
        warmup_steps: ``W`` in [0, T].
        min_lr_ratio: ``m`` in [0, 1], final lr as a fraction of the peak.

    Returns:
        The scheduler (call ``.step()`` after every ``optimizer.step()``).
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"warmup_steps must be in [0, total_steps={total_steps}], got {warmup_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    return LambdaLR(optimizer, _WarmupCosine(int(total_steps), int(warmup_steps), float(min_lr_ratio)))
