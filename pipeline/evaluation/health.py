"""Is the fused head alive? Per-block health of TransFusion attention.

A ReLU block (eq. 3) whose affinity ``R = ReLU(Q Kᵀ)`` is 0 for every pair falls back, through Appendix E's
``(R + ε) / Σ_j (R + ε)``, to uniform attention 1/n: it adds the batch mean of V to its input and fuses
nothing. Its gradient through R is then 0 as well, so such a block rarely comes back. These numbers say how
alive each block is. For one block, R (n, n) with a zero diagonal, attention weights
``W = (R + ε) / Σ_j (R + ε)`` and, when known, labels y (n,) and the index of each row's other view π (n,):

    positive     = #{(i, j), i ≠ j : R_ij > 0} / (n (n − 1))     pairs with a positive affinity
    uniform_rows = #{i : R_ij = 0 for all j ≠ i} / n               rows attending uniformly (no positive pair)
    entropy      = (1/n) Σ_i H(W_i) / log n                        1 = uniform attention, 0 = one partner
    same_class   = (1/n) Σ_i Σ_{j ≠ i, y_j = y_i} W_ij            attention share to the same class
    other_view   = (1/n) Σ_i W_{i π(i)}                            share to the sample's own other view

``same_class_chance`` is what uniform attention gives, ``(1/n) Σ_i (n_{y_i} − 1) / n``; ``other_view``'s
chance is ``1/n``. A block is *dead* below :data:`DEAD_POSITIVE` positive pairs and *mostly uniform* above
:data:`MOSTLY_UNIFORM` uniform rows. Batched affinities (g, n, n), one per group of a per-view fused batch,
give the mean over the groups. A number that cannot be computed (no labels, no other view in the batch) is
``None``: reported as "n/a", never as a number.

ABC (``model.method: abc``) has no such blocks: its softmax attention always sums to 1 over positive weights and
cannot die, so it gets no dead-block warnings. Its health is its kernel's (:func:`kernel_health`,
:func:`pipeline.core.abc.kernel_stats`): the mean κ over same-class pairs and over the other pairs, and the share
of pairs with κ > 0.5 (i ≠ j), reported as ``kernel.same_class``, ``kernel.other``, ``kernel.above_half``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from pipeline.config.model import AFFINITY_EPS as EPS
from pipeline.core.abc import kernel_stats
from pipeline.core.attention import activate

DEAD_POSITIVE = 0.01  # a block with fewer positive pairs than this is dead
MOSTLY_UNIFORM = 0.5  # a block with more uniform rows than this is mostly uniform
KEYS = ("positive", "uniform_rows", "entropy", "same_class", "other_view")  # per-epoch metrics, per block
KERNEL = "kernel"  # ABC's health: one "block" named kernel, with these numbers
KERNEL_KEYS = ("same_class", "other", "above_half")


def is_health_key(key: str) -> bool:
    """A per-epoch metric that is health: ``block_<i>.<k>`` (TransFusion) or ``kernel.<k>`` (ABC)."""
    return key.startswith(("block_", KERNEL + "."))


def kernel_health(kappa: Tensor, labels: Tensor) -> dict[str, dict[str, Tensor]]:
    """ABC's health: ``{"kernel": kernel_stats(κ, labels)}`` as 0-d tensors, for :func:`read_health` and
    :func:`flat` (with ``KERNEL_KEYS``). kappa (n, n), labels (n,)."""
    return {KERNEL: kernel_stats(kappa, labels)}


def attention_weights(raw: Tensor) -> Tensor:
    """Appendix E's row normalisation of a raw affinity with a zero diagonal. (..., n, n) -> (..., n, n)."""
    raw = raw.double()
    return (raw + EPS) / (raw + EPS).sum(dim=-1, keepdim=True)


ROWS = 128  # rows per slice of the fp64 statistics: (ROWS, n) temporaries instead of (n, n)


@dataclass(frozen=True)
class QKAffinity:
    """A block's raw affinity ``act(q kᵀ)`` with a zero diagonal, never held whole: :func:`block_stats` asks for
    ``ROWS`` rows at a time (``TransFusionHead.forward_rows``'s ``on_block`` gives q and k; the tiled path).

    q, k: (g, n, m) unit queries and keys of g fusion groups (g = 1: joint; the affinity then reads as (n, n)).
    """

    q: Tensor
    k: Tensor
    activation: str

    @property
    def shape(self) -> tuple[int, ...]:
        g, n, _ = self.q.shape
        return (n, n) if g == 1 else (g, n, n)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def rows(self, group: int, start: int, stop: int) -> Tensor:
        """Rows ``start:stop`` of group ``group``'s affinity: (stop - start, n), the diagonal 0."""
        raw = activate(self.q[group, start:stop] @ self.k[group].T, self.activation)  # (r, n)
        local = torch.arange(stop - start, device=raw.device)
        return raw.index_put((local, start + local), raw.new_zeros(()))


def block_stats(raw: Tensor | QKAffinity, labels: Tensor | None = None, other: Tensor | None = None,
                rows: int = ROWS) -> dict[str, Tensor | None]:
    """The health numbers of one block (module docstring) as 0-d fp64 tensors on ``raw``'s device, read by nobody:
    no host sync (on a GPU the epoch's health costs one read at the end, :func:`read_health`).

    raw: (n, n) or (g, n, n) raw affinity act(QKᵀ) with a zero diagonal, or a :class:`QKAffinity` that computes
    its rows on demand; labels: (n,) or (g, n) class ids or None; other: (n,) or (g, n) the index, within the same
    group, of each row's other view, or None.

    Every number is a mean over rows, so they are computed ``rows`` rows at a time, in fp64: the temporaries are
    (rows, n) whatever the batch, never an fp64 copy of the whole (n, n) affinity (nor, from a
    :class:`QKAffinity`, the affinity itself).
    """
    if raw.ndim == 2:
        labels = None if labels is None else labels[None]
        other = None if other is None else other[None]
    if isinstance(raw, QKAffinity):
        g, n = raw.q.shape[:2]
        device, part = raw.q.device, raw.rows
    else:
        raw = raw.detach()
        raw = raw[None] if raw.ndim == 2 else raw  # (g, n, n)
        g, n, _ = raw.shape
        device = raw.device

        def part(gi: int, start: int, stop: int) -> Tensor:
            return raw[gi, start:stop]
    if n < 2:
        raise ValueError(f"block_health needs at least 2 rows, got {n}")
    y = None if labels is None else labels.to(device).reshape(g, n)
    pi = None if other is None else other.to(device).reshape(g, n, 1).long()
    # 0-d counts (int64) and sums (fp64) on the device, added to in place: 6 tensors
    positive, uniform, same_pairs = (torch.zeros((), dtype=torch.int64, device=device) for _ in range(3))
    entropy, same_class, other_view = (torch.zeros((), dtype=torch.float64, device=device) for _ in range(3))
    for gi in range(g):
        for start in range(0, n, rows):
            stop = min(start + rows, n)
            r = part(gi, start, stop).double()  # (r, n)
            local = torch.arange(stop - start, device=device)
            off = torch.ones_like(r, dtype=torch.bool)
            off[local, start + local] = False  # (r, n): the diagonal of these rows
            pos = (r > 0) & off
            positive += pos.sum()
            uniform += (~pos.any(-1)).sum()
            w = attention_weights(r)  # (r, n)
            entropy += -(w * w.clamp_min(1e-300).log()).sum()
            if y is not None:
                same = (y[gi, start:stop, None] == y[gi, None, :]) & off  # (r, n)
                same_class += (w * same).sum()
                same_pairs += same.sum()
            if pi is not None:
                other_view += w.gather(-1, pi[gi, start:stop]).sum()
    rows_total = g * n
    return {
        "positive": positive.double() / (g * n * (n - 1)),
        "uniform_rows": uniform.double() / rows_total,
        "entropy": entropy / math.log(n) / rows_total,
        "same_class": None if y is None else same_class / rows_total,
        "same_class_chance": None if y is None else same_pairs.double() / rows_total / n,
        "other_view": None if pi is None else other_view / rows_total,
    }


def read_health(stats: Mapping[str, Mapping[str, Tensor | None]]) -> dict[str, dict[str, float | None]]:
    """``{"block_1": {name: tensor or None}, ...}`` (:func:`block_stats`) -> the same with floats, read in one
    transfer (one host sync on a GPU, whatever the number of blocks)."""
    names = [(block, k) for block, h in stats.items() for k, v in h.items() if v is not None]
    values = torch.stack([stats[b][k].double() for b, k in names]).cpu().tolist() if names else []
    out: dict[str, dict[str, float | None]] = {block: dict.fromkeys(h) for block, h in stats.items()}
    for (block, k), v in zip(names, values, strict=True):
        out[block][k] = v
    return out


def block_health(raw: Tensor, labels: Tensor | None = None, other: Tensor | None = None,
                 rows: int = ROWS) -> dict[str, float | None]:
    """The health numbers of one block (module docstring) as floats: :func:`block_stats`, read once."""
    return read_health({"block": block_stats(raw, labels, other, rows)})["block"]


def verdict(h: Mapping[str, Any]) -> str | None:
    """"dead", "mostly uniform" or None (alive) for one block's health."""
    if h["positive"] < DEAD_POSITIVE:
        return "dead"
    if h["uniform_rows"] > MOSTLY_UNIFORM:
        return "mostly uniform"
    return None


def head_health(affinities: Sequence[Tensor], labels: Tensor | None = None,
                other: Tensor | None = None) -> dict[str, dict[str, float | None]]:
    """``{"block_1": block_health(...), ...}`` for the affinities a head collected (see ``HeadOutput``), read once."""
    return read_health({f"block_{i + 1}": block_stats(a, labels, other) for i, a in enumerate(affinities)})


def flat(health: Mapping[str, Mapping[str, float | None]], keys: Sequence[str] = KEYS) -> dict[str, float | None]:
    """``{"block_1.positive": ..., ...}`` (``{"kernel.same_class": ...}`` for ABC's): the per-epoch metric names."""
    return {f"{block}.{k}": h.get(k) for block, h in health.items()
            for k in (KERNEL_KEYS if block == KERNEL else keys)}


def unflat(metrics: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Inverse of :func:`flat` for the ``block_*`` (and ABC's ``kernel.*``) keys of a metrics dict (other keys are
    ignored)."""
    out: dict[str, dict[str, Any]] = {}
    for key, v in metrics.items():
        block, dot, k = key.partition(".")
        if dot and ((block.startswith("block_") and k in KEYS) or (block == KERNEL and k in KERNEL_KEYS)):
            out.setdefault(block, {})[k] = v
    return dict(sorted(out.items(), key=lambda kv: -1 if kv[0] == KERNEL else int(kv[0].split("_")[1])))


def warnings_for(health: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """One plain-words line per dead or mostly uniform block; [] when every block is alive (and for ABC's kernel)."""
    lines = []
    for block, h in health.items():
        if block == KERNEL:
            continue
        v = verdict(h)
        name = block.replace("_", " ")
        if v == "dead":
            lines.append(f"{name} is dead: {h['positive']:.1%} of its pairs have a positive affinity, so its "
                         "attention is uniform and it only adds the batch mean to its input (no fusion)")
        elif v == "mostly uniform":
            lines.append(f"{name} is mostly uniform: {h['uniform_rows']:.0%} of its rows have no positive pair "
                         "and attend to the whole batch alike")
    return lines


def dead_blocks(health: Mapping[str, Mapping[str, Any]]) -> list[str]:
    return [b for b, h in health.items() if b != KERNEL and verdict(h) == "dead"]


def health_line(health: dict[str, Any]) -> str:
    """The console's health of the blocks: " | positive pairs: b1 12.7% b2 0.0%" ("" at depth 0); ABC's kernel:
    " | kernel: same class 0.81, other 0.07, > 0.5 12.3%"."""
    blocks = unflat(health)
    if KERNEL in blocks:
        h = blocks[KERNEL]
        return (f" | kernel: same class {h['same_class']:.2f}, other {h['other']:.2f}, "
                f"> 0.5 {h['above_half']:.1%}")
    if not blocks:
        return ""
    return " | positive pairs: " + " ".join(f"b{b.split('_')[1]} {h['positive']:.1%}" for b, h in blocks.items())
