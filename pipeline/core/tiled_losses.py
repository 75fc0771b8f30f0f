"""The pairwise losses of :mod:`pipeline.core.losses`, one implementation each: over column tiles, the dense path
being a tile as wide as the batch.

Two autograd Functions with the analytic gradient, one per family: :class:`NormalizedAffinityLoss` (``jsd``,
``jsd_appendix_e``, ``kl_relu``, ``kl_squared``) and :class:`SoftmaxAffinityLoss` (``kl_softmax``, ``infonce``,
``supcon``, ``dcl``). Inputs: qn (r, d) and kn (n, d) unit rows (the r rows ``rows`` = start..stop-1 against all n
columns), the positives, ``start``, n, the kind, ``tile`` (and τ); output the scalar ``sum_{i in rows} L_i / n``.
Both write each row's loss through per-row reductions over the columns j (row sums, a log-sum-exp) and sums over
the row's positives P(i), so the columns are visited a tile C = [c, c + T) at a time, as Inf-CL (Cheng et al., 2024)
does for InfoNCE: the block A_C = qn kn[C]ᵀ (r, T) is built, reduced into (r,) accumulators and, unless it is the
only tile, dropped; backward turns each block into ∂L/∂A_C (r, T) and accumulates ∂qn += ∂L/∂A_C kn[C] (r, d) and
∂kn[C] = ∂L/∂A_Cᵀ qn (T, d).

- ``tile`` None or >= n: one tile, the dense path. Its block (r, n) is kept for backward, which adds one more
  (r, n) buffer, ∂L/∂A: three r×n×d products (A; ∂qn, ∂kn).
- ``tile`` T < n: nothing (r, n) is held: O((r + n) d + r T) memory (at r = n = 4096, d = 128, T = 256, fp32:
  forward + backward peaks of 8-15 MiB against 132-136 MiB, ``test_tiled_peak_memory`` in
  tests/core/test_tiled_losses.py). Backward recomputes the blocks: four products, five where the forward makes two
  passes (the JSD / KL family with a :class:`~pipeline.core.targets.LabelMask`); those layouts also evaluate the
  per-positive terms (logs) on every entry of a tile. Time, tiled / dense, same sizes, one CPU thread, fastest
  rounds (``python benchmarks/bench_loss.py --n 4096 --tile 256 --threads 1 [--layout two_view]``): jsd 0.9x
  (two_view) and 1.7x (None), infonce 0.9x and 1.1x.

Positives (:func:`pipeline.core.targets.positives`), by ``layout``; never read on the host inside a Function:

- :class:`~pipeline.core.targets.Pairs` (``"two_view"``, and None when dense): P index pairs (i, j). The values
  at the positives are (P,) vectors, taken from each block (0 for the pairs outside it), and their gradient P
  sparse additions to each block's ∂L/∂A_C. Memory O(n + P).
- :class:`~pipeline.core.targets.LabelMask` (``"labels"``, and None when tiled): per tile, the (r, T) bool mask
  ``ids[rows][:, None] == ids[None, C]`` with the diagonal (i, start + i) cleared, and the counts |P(i)|, summed over
  the tiles of the first pass (each from the tile's sorted ids, no (r, T) buffer). A sum over the positives is a
  masked row sum.

Tiled values and gradients equal the dense path's up to rounding (summation order).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from pipeline.config.model import AFFINITY_EPS
from pipeline.core.targets import LabelMask, Pairs, check_inputs, positives, row_range

__all__ = ["EPS", "NormalizedAffinityLoss", "SoftmaxAffinityLoss", "pairwise_loss", "use_tiles"]

EPS = AFFINITY_EPS  # ε, the normalisation epsilon of Appendix E
_LOG2 = math.log(2.0)
_NEG_INF = float("-inf")


def use_tiles(tile: int | None, n: int) -> bool:
    """Whether a loss with ``tile`` runs tiled: ``tile`` is None (dense) or an int >= 1; tiled iff tile < n."""
    if tile is None:
        return False
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
        raise ValueError(f"tile must be None or an int >= 1 (columns per tile), got {tile!r}")
    return tile < n


def pairwise_loss(
    kind: str,
    q: Tensor,
    k: Tensor,
    ids: Tensor,
    rows: slice | None,
    layout: str | None,
    tile: int | None,
    temperature: float | None = None,
    power: float = 2.0,
) -> Tensor:
    """The loss ``kind`` (a scalar) of q, k (n, d) and ids (n,) over ``rows``, as :mod:`pipeline.core.losses`
    documents; ``temperature`` None: the JSD / KL family (``power``: f(a) = |a|^power but for kl_relu), else the
    softmax family."""
    n = check_inputs(q, k, ids)
    start, stop = row_range(rows, n)
    pos = positives(ids, start, stop, layout, use_tiles(tile, n))
    qn = F.normalize(q[start:stop], dim=1)  # (r, d)
    kn = F.normalize(k, dim=1)  # (n, d)
    if temperature is None:
        return NormalizedAffinityLoss.apply(qn, kn, pos, start, n, kind, tile, power)
    return SoftmaxAffinityLoss.apply(qn, kn, pos, start, n, kind, tile, temperature)


def _tiles(n: int, tile: int | None) -> list[tuple[int, int]]:
    width = n if tile is None else min(tile, n)
    return [(c, min(c + width, n)) for c in range(0, n, width)]


def _block(qn: Tensor, kn: Tensor, start: int, c0: int, c1: int, diag_value: float) -> Tensor:
    """A_C = qn kn[c0:c1]ᵀ (r, T), a fresh buffer, with ``diag_value`` at the diagonal entries (i, start + i)."""
    a = qn @ kn[c0:c1].T  # (r, T)
    a.diagonal(offset=start - c0).fill_(diag_value)
    return a


def _npos(pos: Pairs | LabelMask, r: int, device: torch.device) -> Tensor:
    """(r,) int64 |P(i)|: the pairs', else zeros that the first pass adds each tile's counts to."""
    return pos.npos if isinstance(pos, Pairs) else torch.zeros(r, dtype=torch.int64, device=device)


def _sum_grads(ctx, tiles: list[tuple[int, int]], qn: Tensor, kn: Tensor, grad_of):
    """∂qn = sum_C G_C kn[C] (r, d) and ∂kn[C] = G_Cᵀ qn (T, d), with G_C = grad_of(c0, c1) (r, T) = ∂L/∂(qn kn[C]ᵀ)
    (each made after the last is dropped); None where the input needs no gradient."""
    grad_q = grad_k = None  # (r, d), (n, d): made after the first G_C, so that its temporaries are gone by then
    for c0, c1 in tiles:
        grad = grad_of(c0, c1)
        if ctx.needs_input_grad[0]:
            grad_q = grad @ kn[c0:c1] if grad_q is None else grad_q.addmm_(grad, kn[c0:c1])
        if ctx.needs_input_grad[1]:
            grad_k = torch.empty_like(kn) if grad_k is None else grad_k  # every row set below
            torch.mm(grad.T, qn, out=grad_k[c0:c1])
        del grad
    return grad_q, grad_k


# --------------------------------------------------------------------------------------------------
# JSD and KL losses on a normalised affinity
# --------------------------------------------------------------------------------------------------


def _affinity(relu: bool, qn: Tensor, kn: Tensor, start: int, c0: int, c1: int) -> Tensor:
    """The block A_C (r, T), 0 on the diagonal; ``kl_relu``: max(A_C, 0) (every use below needs only f(A) and f'(A),
    the same of A as of max(A, 0))."""
    a = _block(qn, kn, start, c0, c1, 0.0)
    return a.clamp_min_(0.0) if relu else a


def _f(relu: bool, power: float, a: Tensor) -> Tensor:
    """f(A) in place: max(A, 0) (``kl_relu``), else |A|^power (A² at the paper's power 2)."""
    if relu:
        return a.clamp_min_(0.0)
    return a.square_() if power == 2 else a.abs_().pow_(power)


def _f_row_sum(relu: bool, power: float, a: Tensor) -> Tensor:
    """(r,) sum_j f(A_ij) of a block a (r, T), which stays as it is."""
    if relu:
        return a.sum(dim=1)
    if power == 2:
        return torch.linalg.vector_norm(a, dim=1).square()
    return torch.linalg.vector_norm(a, ord=power, dim=1).pow(power)


def _fprime(relu: bool, power: float, a: Tensor) -> Tensor:
    """f'(A) / c in place, c = 1 (``kl_relu``) or power: [A > 0] for A >= 0 (clamp_min's gradient), else
    sign(A) |A|^(power - 1) (A at power 2)."""
    if relu:
        return a.sign_()
    if power == 2:
        return a
    sign = torch.sign(a)
    return a.abs_().pow_(power - 1.0).mul_(sign)


def _p(relu: bool, power: float, a: Tensor, total: Tensor) -> Tensor:
    """P_ij = (f(A_ij) + ε) / T_i, in place in ``a``; ``total`` T_i broadcast to ``a``'s shape ((r, 1) or (P,))."""
    return _f(relu, power, a).add_(EPS).div_(total)


def _g(kind: str, p: Tensor, y: Tensor) -> Tensor:
    """g_ij = ∂L_i/∂P_ij at a positive, in place in ``p``; ``y`` Ŷ_ij broadcast to its shape. (log, not log1p: the
    CPU's log1p is ~6x slower, measured on 4096 x 256 fp32, and every entry of a masked tile goes through here.)"""
    if kind == "jsd":  # log(2P / (P + Ŷ)) = log(2 / (1 + Ŷ/P))
        return p.reciprocal_().mul_(y).add_(1.0).reciprocal_().mul_(2.0).log_()
    if kind == "jsd_appendix_e":  # log(P / (1 + P)) = log(1 / (1 + 1/P))
        return p.reciprocal_().add_(1.0).reciprocal_().log_()
    return p.reciprocal_().mul_(-y)  # kl_*: -Ŷ / P


def _positive_sums(kind: str, p: Tensor, y: Tensor, off: Tensor | None, row_sum) -> Tensor:
    """(3, r): the sums over the positives of the loss term, of P and of P g, from P and Ŷ at the positives (p, y:
    (P,), or (r, T) and (r, 1) with ``off`` (r, T) bool True off the positives; ``row_sum``: (P,) or (r, T) ->
    (r,)). Overwrites ``p``; one more buffer of its size."""
    g = _g(kind, p.clone(), y)
    if off is not None:
        p.masked_fill_(off, 0.0)
    pg = g.mul_(p)  # P g, 0 off the positives
    sum_p, sum_pg = row_sum(p), row_sum(pg)
    del g, pg
    if kind == "jsd":  # the term is Ŷ log(2Ŷ/(P+Ŷ)) + P g, Ŷ log(2Ŷ/(P+Ŷ)) = Ŷ log(2 / (1 + P/Ŷ))
        term = p.div_(y).add_(1.0).reciprocal_().mul_(2.0).log_().mul_(y)
    elif kind == "jsd_appendix_e":  # -log(1 + P) + P g
        term = p.add_(1.0).log_().neg_()
    else:  # kl_*: Ŷ log(Ŷ/P)
        term = p.reciprocal_().mul_(y).log_().mul_(y)
    if off is not None:
        term.masked_fill_(off, 0.0)
    sum_term = row_sum(term) + (sum_pg if kind in ("jsd", "jsd_appendix_e") else 0.0)
    return torch.stack([sum_term, sum_p, sum_pg])


def _sum_rows(x: Tensor) -> Tensor:
    return x.sum(dim=1)


def _positive_part(kind: str, relu: bool, power: float, a: Tensor, t: Tensor, y: Tensor) -> Tensor:
    """(g - g_neg) / T_i from A at the positives, in place in ``a``; t, y: T_i, Ŷ broadcast to its shape."""
    return _g(kind, _p(relu, power, a, t), y).sub_(_LOG2 if kind == "jsd" else 0.0).div_(t)


class NormalizedAffinityLoss(torch.autograd.Function):
    """``jsd``, ``jsd_appendix_e``, ``kl_squared`` and ``kl_relu``, over column tiles of ``tile`` (None: one).

    With A = qn knᵀ (r, n), its diagonal (i, start + i) set to 0, f(a) = |a|^p with p = ``power`` (2, a², for
    every loss but ``jsd``, where it is an option; ``kl_relu``: max(a, 0)), ε = 1e-10 and,
    for each row i::

        S_ij = f(A_ij) + ε  (j != i),  T_i = sum_{j != i} S_ij + δ ε,  P_ij = S_ij / T_i

    (δ = 1 for ``jsd_appendix_e``, whose S'_ii = ε / T_i stays in the row; δ = 0 otherwise). Every one of these
    losses depends on a negative j (Y_ij = 0, j != i) only through the row sum T_i, so it is computed from T (one
    reduction over A) and the positives alone. With Ŷ_ij = 1/|P(i)| on the positives::

        jsd:            L_i = sum_pos [Ŷ log(2Ŷ/(P+Ŷ)) + P log(2P/(P+Ŷ))] + log 2 · (1 - sum_pos P)
        jsd_appendix_e: L_i = sum_pos [-log(1+P) + P log(P/(1+P))]      (the Y log Y/(S'+Y) + S' log S'/(S'+Y)
                                                                        of Appendix E; 0 where Y = 0)
        kl_*:           L_i = sum_pos Ŷ log(Ŷ/P)

    (the negatives of jsd each give P log(P/M) = P log 2 with M = P/2). Rows without a positive give 0.

    Gradient (derived by hand, checked by gradcheck). Write g_ij = ∂L_i/∂P_ij with the row-sum dependence of P
    held apart::

        jsd:            g = log(2P/(P+Ŷ)) on positives, log 2 on negatives   (the ±(Ŷ+P)/2M terms cancel)
        jsd_appendix_e: g = log(P/(1+P)) on positives, 0 elsewhere (the diagonal's S'_ii included)
        kl_*:           g = -Ŷ/P on positives, 0 elsewhere

    Through P_ij = S_ij / T_i: ∂L_i/∂S_ij = (g_ij - ḡ_i) / T_i with ḡ_i = sum_l P_il g_il, and through S::

        ∂L/∂A_ij = w_i f'(A_ij) (g_ij - ḡ_i) / T_i     (j != i; 0 on the diagonal)
                 = w_i f'(A_ij) c_i + [j positive] w_i f'(A_ij) (g_ij - g_neg) / T_i,  c_i = (g_neg - ḡ_i) / T_i

    with w_i = ∂out/n (0 for rows without a positive), g_neg the negatives' constant g (log 2 or 0), f'(a) =
    p sign(a) |a|^(p-1) (2a at p = 2; ``kl_relu``: [a > 0], as clamp_min's gradient),
    ḡ_i = g_neg (1 - sum_pos P) + sum_pos P g.

    Forward: pass 1 over the tiles, T_i = sum_C sum_{j in C} f(A_ij) + (n - 1 + δ) ε (and, with a
    :class:`~pipeline.core.targets.LabelMask`, |P(i)| = sum_C |P(i) ∩ C|); then, with T and Ŷ known, the (r,) sums
    over the positives of the loss term, of P and of P g: from the (P,) values of A taken in pass 1 (pairs), or per
    tile in a second pass (masks; dense: on a copy of the kept block). Saved: T_i, c_i, Ŷ_i (r,), the pairs'
    f'(A) (g - g_neg) / T_i (P,) and, dense, the block. Backward, per tile: ∂L/∂A_C = w f'(A_C) c_i plus the
    pairs' P sparse terms, or w f'(A_C) (c_i + the masked positive term). Temporaries: two (r, T) buffers and a
    bool mask.
    """

    @staticmethod
    def forward(ctx, qn, kn, pos, start, n, kind, tile, power):  # noqa: D102
        relu, r, pairs, tiles = kind == "kl_relu", qn.shape[0], isinstance(pos, Pairs), _tiles(n, tile)
        affinity = functools.partial(_affinity, relu, qn, kn, start)
        row_sum = qn.new_zeros(r)  # (r,) sum_j f(A_ij)
        npos = _npos(pos, r, qn.device)  # (r,) |P(i)|
        a_pos = qn.new_zeros(pos.row.shape) if pairs else None  # (P,) A at the pairs
        kept = None
        for c0, c1 in tiles:  # pass 1: the row sums (and the pairs' values, or the counts |P(i)|)
            a = affinity(c0, c1)  # (r, T)
            row_sum += _f_row_sum(relu, power, a)
            if pairs:
                a_pos += pos.take(a, c0)
            else:
                npos += pos.count(c0, c1)
            if len(tiles) == 1:
                kept = a  # the dense path keeps its block for backward
            del a  # before the next tile's block is made (here and below: one block alive, not two)
        total = row_sum + (n - 1 + (kind == "jsd_appendix_e")) * EPS  # (r,) T_i
        y_hat = 1.0 / npos.clamp_min(1).to(qn.dtype)  # (r,) Ŷ on the row's positives
        corr = None
        if pairs:  # and the pairs' (P,) f'(A) (g - g_neg) / T_i, for backward
            t, y = pos.spread(total), pos.spread(y_hat)  # (P,)
            sums = _positive_sums(kind, _p(relu, power, a_pos.clone(), t), y, None, pos.row_sum)  # (3, r)
            corr = _positive_part(kind, relu, power, a_pos.clone(), t, y).mul_(
                _fprime(relu, power, a_pos).mul_(1.0 if relu else power))
            del a_pos, t, y
        else:  # pass 2: the sums over the positives of each tile
            sums = qn.new_zeros(3, r)
            for c0, c1 in tiles:
                p = _p(relu, power, kept.clone() if kept is not None else affinity(c0, c1), total[:, None])  # (r, T)
                sums += _positive_sums(kind, p, y_hat[:, None], pos.mask(c0, c1).logical_not_(), _sum_rows)
                del p
        sum_terms, sum_p, sum_pg = sums
        g_neg = _LOG2 if kind == "jsd" else 0.0
        per_row = sum_terms + g_neg * (1.0 - sum_p)  # (the log 2 of jsd's negatives; 0 otherwise)
        g_bar = g_neg * (1.0 - sum_p) + sum_pg  # (r,) ḡ_i
        has_pos = npos > 0
        per_row = torch.where(has_pos, per_row, torch.zeros_like(per_row))
        coef = torch.where(has_pos, (g_neg - g_bar) / total, torch.zeros_like(total))  # (r,) c_i
        ctx.save_for_backward(qn, kn, total, coef, y_hat, corr, kept)
        ctx.pos, ctx.start, ctx.n, ctx.kind, ctx.tile, ctx.power = pos, start, n, kind, tile, power
        return per_row.sum() / n

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):  # noqa: D102
        qn, kn, total, coef, y_hat, corr, kept = ctx.saved_tensors
        pos, kind, relu, power = ctx.pos, ctx.kind, ctx.kind == "kl_relu", ctx.power
        w = grad_out / ctx.n
        w2 = w if relu else power * w  # with the c of f'(a) = c f'(a) / c, for the factors below

        def times_fprime(a: Tensor, factor: Tensor) -> Tensor:  # f'(A) / c factor, in place unless kept
            if not relu and power == 2:
                return torch.mul(a, factor) if a is kept else a.mul_(factor)
            return _fprime(relu, power, a.clone() if a is kept else a).mul_(factor)

        def grad_of(c0: int, c1: int) -> Tensor:  # ∂L/∂A_C (r, T)
            a = kept if kept is not None else _affinity(relu, qn, kn, ctx.start, c0, c1)
            if corr is not None:  # pairs: w f'(A) c_i everywhere, and the P terms w f'(A) (g - g_neg) / T_i
                grad = times_fprime(a, (w2 * coef)[:, None])
                pos.add_(grad, corr * w, c0)
                return grad
            off = pos.mask(c0, c1).logical_not_()  # (r, T) bool
            part = _positive_part(kind, relu, power, a.clone(), total[:, None], y_hat[:, None]).masked_fill_(off, 0.0)
            return times_fprime(a, part.add_(coef[:, None]).mul_(w2))

        grad_q, grad_k = _sum_grads(ctx, _tiles(ctx.n, ctx.tile), qn, kn, grad_of)
        return grad_q, grad_k, None, None, None, None, None, None


# --------------------------------------------------------------------------------------------------
# softmax losses (KL-Softmax, InfoNCE, SupCon, DCL)
# --------------------------------------------------------------------------------------------------


def _mask(pos: Pairs | LabelMask, c0: int, c1: int) -> Tensor | None:
    """The (r, T) bool mask of the positives in columns c0..c1-1; None for pairs."""
    return None if isinstance(pos, Pairs) else pos.mask(c0, c1)


def _drop_positives(z: Tensor, pos: Pairs | LabelMask, mask: Tensor | None, c0: int) -> None:
    """``dcl``'s denominator set: the block z (r, T) at column c0 set to -inf at the positives."""
    if mask is None:
        pos.add_(z, z.new_full(pos.row.shape, _NEG_INF), c0)  # z + (-inf) = -inf
    else:
        z.masked_fill_(mask, _NEG_INF)


class SoftmaxAffinityLoss(torch.autograd.Function):
    """``kl_softmax``, ``infonce``, ``supcon`` and ``dcl``, over column tiles of ``tile`` (None: one).

    Inputs as :class:`NormalizedAffinityLoss` plus τ. With logits Z = (qn/τ) knᵀ (r, n), the denominator set
    D(i) = {j != i} (``dcl``: the negatives only, j != i and j not in P(i)) and Ŷ_ij = 1/|P(i)| on the positives::

        lse_i = log sum_{j in D(i)} exp(Z_ij)
        L_i   = lse_i - sum_pos Ŷ_ij Z_ij  (+ sum_pos Ŷ log Ŷ = -log|P(i)| for ``kl_softmax``)

    which is eq. (9) / eq. (10) / DCL / D(Ŷ_i || σ(Z_i)); rows without a positive give 0, a row with an empty D(i)
    (``dcl`` on a batch of one id) NaN. Gradient::

        ∂L/∂Z_ij = w_i (σ_ij - Ŷ_ij),   σ_ij = exp(Z_ij - lse_i) for j in D(i), 0 elsewhere

    with w_i = ∂out/n (0 without a positive); ∂qn = (∂L/∂Z) kn / τ, ∂kn = (∂L/∂Z)ᵀ qn / τ.

    Forward: one pass over the tiles C with the running max m_i and s_i = sum_{j in D(i) seen} exp(Z_ij - m_i) (on
    a new tile m'_i = max(m_i, max_{j in C ∩ D(i)} Z_ij), s_i <- s_i exp(m_i - m'_i) + sum_{j in C ∩ D(i)}
    exp(Z_ij - m'_i)), lse_i = m_i + log s_i, and the linear sums sum_pos Z_ij (and |P(i)|). Each block turns in
    place into E_C = exp(Z_C - m_i) (0 outside D(i)), so σ = E / s. Saved: m_i, s_i, Ŷ_i (r,) and, dense, E.
    Backward: per tile, ∂L/∂Z_C / τ = E_C w / (τ s) minus w Ŷ / τ at the positives (E_C recomputed when tiled).
    Temporaries: at most two (r, T) buffers and a (r, T) bool mask.
    """

    @staticmethod
    def forward(ctx, qn, kn, pos, start, n, kind, tile, temperature):  # noqa: D102
        r, qs, tiles = qn.shape[0], qn / temperature, _tiles(n, tile)  # qs (r, d)
        run_max = qn.new_full((r,), _NEG_INF)  # (r,) m_i
        sum_exp = qn.new_zeros(r)  # (r,) s_i
        pos_sum = qn.new_zeros(r)  # (r,) sum_pos Z_ij
        npos = _npos(pos, r, qn.device)
        kept = None
        for c0, c1 in tiles:
            z, mask = _block(qs, kn, start, c0, c1, _NEG_INF), _mask(pos, c0, c1)  # (r, T) logits, -inf on the diagonal
            if mask is None:
                pos_sum += pos.row_sum(pos.take(z, c0))
            else:
                pos_sum += torch.where(mask, z, 0.0).sum(dim=1)
                npos += pos.count(c0, c1)
            if kind == "dcl":
                _drop_positives(z, pos, mask, c0)
            new_max = torch.maximum(run_max, z.amax(dim=1))  # (r,)
            shift = torch.where(torch.isinf(new_max), 0.0, new_max)  # finite while no entry of D(i) is seen
            sum_exp = sum_exp * torch.exp(run_max - shift) + z.sub_(shift[:, None]).exp_().sum(dim=1)
            run_max = new_max
            if len(tiles) == 1:
                kept = z  # the dense path keeps E for backward
            del z, mask
        lse = torch.where(sum_exp > 0, run_max + torch.log(sum_exp), float("nan"))  # (r,)
        has_pos = npos > 0
        y_hat = 1.0 / npos.clamp_min(1).to(qn.dtype)  # (r,)
        per_row = lse - pos_sum * y_hat
        if kind == "kl_softmax":
            per_row = per_row + torch.log(y_hat)
        per_row = torch.where(has_pos, per_row, torch.zeros_like(per_row))
        ctx.save_for_backward(qn, kn, torch.where(torch.isinf(run_max), 0.0, run_max), sum_exp, has_pos, y_hat, kept)
        ctx.pos, ctx.start, ctx.n, ctx.kind, ctx.tile, ctx.temperature = pos, start, n, kind, tile, temperature
        return per_row.sum() / n

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):  # noqa: D102
        qn, kn, shift, sum_exp, has_pos, y_hat, kept = ctx.saved_tensors
        pos, qs = ctx.pos, None if kept is not None else qn / ctx.temperature  # qs (r, d), to recompute Z
        scale = torch.where(has_pos, grad_out / (ctx.n * ctx.temperature), torch.zeros_like(sum_exp))  # (r,) w_i / τ
        sigma_scale = (scale / sum_exp)[:, None]  # (r, 1): σ w / τ = E w / (τ s)
        corr = -(scale * y_hat)  # (r,) at the positives

        def grad_of(c0: int, c1: int) -> Tensor:  # ∂L/∂Z_C / τ (r, T)
            mask = _mask(pos, c0, c1)
            if kept is not None:
                grad = torch.mul(kept, sigma_scale)
            else:
                z = _block(qs, kn, ctx.start, c0, c1, _NEG_INF)
                if ctx.kind == "dcl":
                    _drop_positives(z, pos, mask, c0)
                grad = z.sub_(shift[:, None]).exp_().mul_(sigma_scale)  # E_C in place, then scaled
            if mask is None:
                pos.add_(grad, pos.spread(corr), c0)
            else:
                grad.add_(torch.where(mask, corr[:, None], 0.0))
            return grad

        grad_q, grad_k = _sum_grads(ctx, _tiles(ctx.n, ctx.tile), qn, kn, grad_of)
        return grad_q, grad_k, None, None, None, None, None, None
