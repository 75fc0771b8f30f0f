"""The fused pairwise losses of :mod:`pipeline.core.losses`, exact, in column tiles: nothing (r, n) is ever held.

The fused ``_NormalizedAffinityLoss`` / ``_SoftmaxAffinityLoss`` build A = qn knᵀ (r, n) for the r rows ``rows``
against all n columns, keep it for backward and allocate one more (r, n) buffer there. Both write each row's loss
through per-row reductions over j (row sums, a logsumexp) and sums over the row's positives P(i) only, so the
columns can be visited T at a time, as Inf-CL (Cheng et al., 2024) does for InfoNCE: for a tile C = [c, c + T)
the block A_C = qn kn[C]ᵀ (r, T) is built, reduced into (r,) accumulators and dropped. Backward recomputes each
tile's block, turns it into ∂L/∂A_C (r, T) and accumulates ∂qn += ∂L/∂A_C kn[C] (r, d) and ∂kn[C] = ∂L/∂A_Cᵀ qn
(T, d); only (r,) vectors are saved. Memory: O((r + n) d + r T) instead of O(r n) (at r = n = 4096, d = 128,
T = 256, fp32: forward + backward peaks of 10-15 MB against 132 MB, ``test_tiled_peak_memory`` in
tests/core/test_tiled_losses.py). Compute: the fused path makes three r×n×d products (A; ∂qn, ∂kn), the tiled
one four (the softmax losses, and the others in "two_view": backward recomputes A) or five (two forward passes),
and the "labels" / None layouts evaluate the per-positive terms (logs) on every entry of a tile. Time, tiled /
fused, same sizes, one CPU thread (``python benchmarks/bench_loss.py --n 4096 --tile 256 --threads 1 [--layout
two_view]``): jsd 0.9x (two_view) and 2.1x (None), infonce 1.0x and 1.1x.

Positives, by ``layout`` (never read on the host):

- ``"two_view"`` (n = 2B): row i's only positive is column ``p_i = (start + i + B) mod n``; ``ids`` are not read,
  |P(i)| = 1 and the r values A_{i p_i} = qn_i · kn[p_i] are computed directly (r, d), so the per-positive terms
  are (r,) vectors and their gradient r row updates (``index_add_``); a tile needs a (r, T) bool mask only for
  ``dcl``, whose denominator leaves the positive out.
- ``"labels"`` and None: per tile, the (r, T) bool mask ``ids[rows][:, None] == ids[None, C]`` with the diagonal
  (i, start + i) cleared. The counts |P(i)|, needed up front for Ŷ_ij = 1/|P(i)|, are summed over the tiles of
  the first pass, each from the tile's sorted ids (:meth:`TilePositives.count`, no (r, T) buffer).

No host sync in either (no ``.item()``, ``bool()``, ``nonzero``, ``unique``, boolean-mask indexing); the None
layout's validation (``infonce``, ``dcl``) happens in :mod:`pipeline.core.losses` before dispatching here.
Values and gradients equal the fused path's up to rounding (summation order).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from pipeline.config.model import AFFINITY_EPS
from pipeline.core.targets import check_layout_name

__all__ = ["TilePositives", "TiledNormalizedAffinityLoss", "TiledSoftmaxAffinityLoss", "tile_positives", "use_tiles"]

EPS = AFFINITY_EPS  # the normalisation epsilon of Appendix E
_LOG2 = math.log(2.0)


def use_tiles(tile: int | None, n: int) -> bool:
    """Whether a loss with ``tile`` runs tiled: ``tile`` is None (fused) or an int >= 1; tiled iff tile < n."""
    if tile is None:
        return False
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
        raise ValueError(f"tile must be None or an int >= 1 (columns per tile), got {tile!r}")
    return tile < n


class TilePositives(NamedTuple):
    """The positives of rows start..stop-1 (r of n rows), by layout (module docstring)."""

    start: int
    partner: Tensor | None  # (r,) int64, "two_view": the column (start + i + B) mod n of row i's one positive
    row_ids: Tensor | None  # (r,) ids[start:stop], "labels" / None
    ids: Tensor | None  # (n,) the ids, "labels" / None

    def mask(self, c0: int, c1: int) -> Tensor:
        """(r, T) bool: Y[rows, c0:c1] > 0 of eq. (1), the positives within columns c0..c1-1."""
        if self.partner is not None:
            return self.partner[:, None] == torch.arange(c0, c1, device=self.partner.device)[None, :]
        same = self.row_ids[:, None] == self.ids[None, c0:c1]  # (r, T)
        same.diagonal(offset=self.start - c0).fill_(False)
        return same

    def count(self, c0: int, c1: int) -> Tensor:
        """(r,) int64 |P(i) ∩ [c0, c1)| ("labels" / None) without a (r, T) buffer: each row's id searched in the
        tile's sorted ids, less the row itself where its diagonal (i, start + i) lies in the tile."""
        tile_ids = self.ids[c0:c1].sort().values  # (T,)
        same = torch.searchsorted(tile_ids, self.row_ids, right=True) - torch.searchsorted(tile_ids, self.row_ids)
        rows = torch.arange(self.start, self.start + self.row_ids.shape[0], device=self.ids.device)  # (r,)
        return same - ((rows >= c0) & (rows < c1)).long()

    def values(self, qn: Tensor, kn: Tensor) -> Tensor:
        """"two_view": (r, 1) A_{i p_i} = qn_i · kn[p_i], the affinity at each row's positive."""
        return torch.linalg.vecdot(qn, kn[self.partner], dim=1)[:, None]


def tile_positives(ids: Tensor, start: int, stop: int, layout: str | None) -> TilePositives:
    """The positives of rows start..stop-1 for the tiled losses (module docstring); no host sync."""
    check_layout_name(layout)
    n = ids.shape[0]
    if layout == "two_view":
        if n % 2:
            raise ValueError(f"layout='two_view' needs an even number of rows, got {n}")
        return TilePositives(start, (torch.arange(start, stop, device=ids.device) + n // 2) % n, None, None)
    return TilePositives(start, None, ids[start:stop], ids)


def _tiles(n: int, tile: int) -> list[tuple[int, int]]:
    return [(c, min(c + tile, n)) for c in range(0, n, tile)]


def _block(qn: Tensor, kn: Tensor, start: int, c0: int, c1: int, diag_value: float) -> Tensor:
    """A_C = qn kn[c0:c1]ᵀ (r, T), a fresh buffer, with ``diag_value`` at the diagonal entries (i, start + i)."""
    a = qn @ kn[c0:c1].T  # (r, T)
    a.diagonal(offset=start - c0).fill_(diag_value)
    return a


def _npos(pos: TilePositives, r: int, device: torch.device) -> Tensor:
    """(r,) int64 |P(i)|: 1 in "two_view", else zeros that the first pass adds each tile's counts to."""
    return torch.full((r,), int(pos.partner is not None), dtype=torch.int64, device=device)


def _p(relu: bool, a: Tensor, total: Tensor) -> Tensor:
    """P_ij = (f(A_ij) + ε) / T_i, in place in ``a`` (r, T)."""
    return (a.clamp_min_(0.0) if relu else a.square_()).add_(EPS).div_(total[:, None])


def _g(kind: str, p: Tensor, y_hat: Tensor) -> Tensor:
    """g_ij = ∂L_i/∂P_ij at a positive, in place in ``p`` (r, T); y_hat (r,) Ŷ_i. (log, not log1p: the CPU's
    log1p is ~6x slower, measured on 4096 x 256 fp32, and every entry of a tile goes through here.)"""
    y = y_hat[:, None]
    if kind == "jsd":  # log(2P / (P + Ŷ)) = log(2 / (1 + Ŷ/P))
        return p.reciprocal_().mul_(y).add_(1.0).reciprocal_().mul_(2.0).log_()
    if kind == "jsd_appendix_e":  # log(P / (1 + P)) = log(1 / (1 + 1/P))
        return p.reciprocal_().add_(1.0).reciprocal_().log_()
    return p.reciprocal_().mul_(-y)  # kl_*: -Ŷ / P


def _positive_sums(kind: str, p: Tensor, off: Tensor | None, y_hat: Tensor) -> Tensor:
    """(3, r): the sums over the positives of the loss term, of P and of P g, from P (r, T) (``off`` (r, T) bool
    True off the positives, or None when every entry is a positive). Overwrites ``p``; two (r, T) buffers."""
    y = y_hat[:, None]
    g = _g(kind, p.clone(), y_hat)
    if off is not None:
        p.masked_fill_(off, 0.0)
    pg = g.mul_(p)  # P g, 0 off the positives
    sum_p, sum_pg = p.sum(dim=1), pg.sum(dim=1)
    del g, pg
    if kind == "jsd":  # the term is Ŷ log(2Ŷ/(P+Ŷ)) + P g, Ŷ log(2Ŷ/(P+Ŷ)) = Ŷ log(2 / (1 + P/Ŷ))
        term = p.div_(y).add_(1.0).reciprocal_().mul_(2.0).log_().mul_(y)
    elif kind == "jsd_appendix_e":  # -log(1 + P) + P g
        term = p.add_(1.0).log_().neg_()
    else:  # kl_*: Ŷ log(Ŷ/P)
        term = p.reciprocal_().mul_(y).log_().mul_(y)
    if off is not None:
        term.masked_fill_(off, 0.0)
    sum_term = term.sum(dim=1) + (sum_pg if kind in ("jsd", "jsd_appendix_e") else 0.0)
    return torch.stack([sum_term, sum_p, sum_pg])


class TiledNormalizedAffinityLoss(torch.autograd.Function):
    """``jsd``, ``jsd_appendix_e``, ``kl_squared`` and ``kl_relu`` in column tiles of ``tile`` columns.

    Inputs: qn (r, d), kn (n, d), the :class:`TilePositives`, n, the kind and ``tile``; output the scalar
    ``sum_{i in rows} L_i / n``, equal to ``_NormalizedAffinityLoss``'s. Its docstring writes every loss through
    the row sum T_i and the positives alone (f(a) = a², ``kl_relu``: max(a, 0); δ = 1 for ``jsd_appendix_e``)::

        S_ij = f(A_ij) + ε (j != i),  T_i = sum_{j != i} S_ij + δ ε,  P_ij = S_ij / T_i
        jsd:            L_i = sum_pos [Ŷ log(2Ŷ/(P+Ŷ)) + P log(2P/(P+Ŷ))] + log 2 · (1 - sum_pos P)
        jsd_appendix_e: L_i = sum_pos [-log(1+P) + P log(P/(1+P))]
        kl_*:           L_i = sum_pos Ŷ log(Ŷ/P)

    so the forward makes two passes over the tiles C: (1) T_i = sum_C sum_{j in C} f(A_ij) + (n - 1 + δ) ε and
    |P(i)| = sum_C |P(i) ∩ C|; (2) with T and Ŷ = 1/|P(i)| known, the (r,) sums over the positives of each tile:
    sum_pos [term], sum_pos P and sum_pos P g ("two_view": once, over the r values A_{i p_i}; no second pass).
    From them ḡ_i = g_neg (1 - sum_pos P) + sum_pos P g and the fused docstring's gradient, which tiles too::

        ∂L/∂A_ij = w_i f'(A_ij) c_i + [j positive] w_i f'(A_ij) (g_ij - g_neg) / T_i,  c_i = (g_neg - ḡ_i) / T_i

    (w_i = ∂out/n, 0 for rows without a positive). Only T_i, c_i, Ŷ_i (r,) are saved; backward recomputes each
    A_C (with its P and g at the positives) and accumulates ∂qn += ∂L/∂A_C kn[C], ∂kn[C] = ∂L/∂A_Cᵀ qn; in
    "two_view" the positives' term is added once as r row updates. Temporaries: two (r, T) buffers and a bool mask.
    """

    @staticmethod
    def forward(ctx, qn, kn, pos, n, kind, tile):  # noqa: D102
        relu, r, pairs = kind == "kl_relu", qn.shape[0], pos.partner is not None
        row_sum = qn.new_zeros(r)  # (r,) sum_j f(A_ij)
        npos = _npos(pos, r, qn.device)  # (r,) |P(i)|
        for c0, c1 in _tiles(n, tile):  # pass 1: the row sums (and the counts |P(i)|)
            a = _block(qn, kn, pos.start, c0, c1, 0.0)  # (r, T), 0 on the diagonal
            row_sum += a.clamp_min_(0.0).sum(dim=1) if relu else torch.linalg.vector_norm(a, dim=1).square()
            if not pairs:
                npos += pos.count(c0, c1)
            del a  # before the next tile's block is made (here and below: one block alive, not two)
        total = row_sum + (n - 1 + (kind == "jsd_appendix_e")) * EPS  # (r,) T_i
        y_hat = 1.0 / npos.clamp_min(1).to(qn.dtype)  # (r,) Ŷ on the row's positives
        if pairs:
            sums = _positive_sums(kind, _p(relu, pos.values(qn, kn), total), None, y_hat)  # (3, r)
        else:  # pass 2: the sums over the positives of each tile
            sums = qn.new_zeros(3, r)
            for c0, c1 in _tiles(n, tile):
                a = _block(qn, kn, pos.start, c0, c1, 0.0)
                sums += _positive_sums(kind, _p(relu, a, total), pos.mask(c0, c1).logical_not_(), y_hat)
                del a
        sum_terms, sum_p, sum_pg = sums
        g_neg = _LOG2 if kind == "jsd" else 0.0
        per_row = sum_terms + g_neg * (1.0 - sum_p)  # (the log 2 of jsd's negatives; 0 otherwise)
        g_bar = g_neg * (1.0 - sum_p) + sum_pg  # (r,) ḡ_i
        has_pos = npos > 0
        per_row = torch.where(has_pos, per_row, torch.zeros_like(per_row))
        coef = torch.where(has_pos, (g_neg - g_bar) / total, torch.zeros_like(total))  # (r,) c_i
        ctx.save_for_backward(qn, kn, total, coef, y_hat)
        ctx.pos, ctx.n, ctx.kind, ctx.tile = pos, n, kind, tile
        return per_row.sum() / n

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):  # noqa: D102
        qn, kn, total, coef, y_hat = ctx.saved_tensors
        pos, kind, relu, w = ctx.pos, ctx.kind, ctx.kind == "kl_relu", grad_out / ctx.n
        g_neg = _LOG2 if kind == "jsd" else 0.0
        grad_q, grad_k = torch.zeros_like(qn), torch.zeros_like(kn)  # (r, d), (n, d)

        def positive_part(a: Tensor) -> Tensor:
            """(g - g_neg) / T_i from A (r, T), to be taken at the positives only. Overwrites ``a``."""
            return _g(kind, _p(relu, a, total), y_hat).sub_(g_neg).div_(total[:, None])

        def fprime(a: Tensor) -> Tensor:  # f'(A) in place: [A > 0] (kl_relu, as clamp_min's gradient) or 2A
            return a.gt_(0.0) if relu else a.mul_(2.0)

        for c0, c1 in _tiles(ctx.n, ctx.tile):
            a = _block(qn, kn, pos.start, c0, c1, 0.0)  # (r, T)
            if pos.partner is None:  # c_i + [positive] (g - g_neg) / T_i
                off = pos.mask(c0, c1).logical_not_()  # (r, T) bool
                factor = positive_part(a.clone()).masked_fill_(off, 0.0).add_(coef[:, None])  # (r, T)
                del off
            else:
                factor = coef[:, None]  # (r, 1): the positives come after the loop
            grad = fprime(a).mul_(factor).mul_(w)  # (r, T) ∂L/∂A_C
            grad_q += grad @ kn[c0:c1]
            grad_k[c0:c1] = grad.T @ qn
            del a, factor, grad
        if pos.partner is not None:  # the positives (i, p_i): w f'(A) (g - g_neg) / T_i, r row updates
            a = pos.values(qn, kn)  # (r, 1)
            corr = positive_part(a.clone()).mul_(fprime(a)).mul_(w)  # (r, 1)
            grad_q += corr * kn[pos.partner]
            grad_k.index_add_(0, pos.partner, corr * qn)
        return grad_q, grad_k, None, None, None, None


class TiledSoftmaxAffinityLoss(torch.autograd.Function):
    """``kl_softmax``, ``infonce``, ``supcon`` and ``dcl`` in column tiles of ``tile`` columns.

    Inputs as :class:`TiledNormalizedAffinityLoss` plus τ; output equal to ``_SoftmaxAffinityLoss``'s. With the
    logits Z = (qn/τ) knᵀ and the denominator set D(i) (j != i; ``dcl``: also j not in P(i)), its docstring's::

        lse_i = log sum_{j in D(i)} exp(Z_ij)
        L_i   = lse_i - sum_pos Ŷ_ij Z_ij  (+ sum_pos Ŷ log Ŷ = -log|P(i)| for ``kl_softmax``)

    needs only per-row reductions, so the forward is one pass over the tiles C: the running max m_i and
    s_i = sum_{j in D(i) seen} exp(Z_ij - m_i) (on a new tile m'_i = max(m_i, max_{j in C ∩ D(i)} Z_ij) and
    s_i <- s_i exp(m_i - m'_i) + sum_{j in C ∩ D(i)} exp(Z_ij - m'_i)), lse_i = m_i + log s_i, and the linear
    sums sum_pos Z_ij and |P(i)| ("two_view": Z_{i p_i} directly). A row with an empty D(i) (``dcl`` on a batch
    of one id) gives NaN, as the fused path does. The gradient tiles the same way::

        ∂L/∂Z_ij = w_i (σ_ij - Ŷ_ij),   σ_ij = exp(Z_ij - lse_i) on D(i), 0 elsewhere

    Only lse_i and Ŷ_i (r,) are saved; backward recomputes each Z_C and accumulates ∂qn += ∂L/∂Z_C kn[C] / τ,
    ∂kn[C] = ∂L/∂Z_Cᵀ qn / τ ("two_view": the -w_i Ŷ_i at (i, p_i) as r row updates). Temporaries: at most two
    (r, T) buffers and a (r, T) bool mask.
    """

    @staticmethod
    def forward(ctx, qn, kn, pos, n, kind, tile, temperature):  # noqa: D102
        r, qs, pairs = qn.shape[0], qn / temperature, pos.partner is not None  # qs (r, d)
        run_max = qn.new_full((r,), float("-inf"))  # (r,) m_i
        sum_exp = qn.new_zeros(r)  # (r,) s_i
        pos_sum = pos.values(qs, kn)[:, 0] if pairs else qn.new_zeros(r)  # (r,) sum_pos Z_ij
        npos = _npos(pos, r, qn.device)
        for c0, c1 in _tiles(n, tile):
            z = _block(qs, kn, pos.start, c0, c1, float("-inf"))  # (r, T) logits, -inf on the diagonal
            mask = pos.mask(c0, c1) if kind == "dcl" or not pairs else None
            if not pairs:
                pos_sum += torch.where(mask, z, 0.0).sum(dim=1)
                npos += pos.count(c0, c1)
            if kind == "dcl":
                z.masked_fill_(mask, float("-inf"))
            new_max = torch.maximum(run_max, z.amax(dim=1))  # (r,)
            shift = torch.where(torch.isinf(new_max), 0.0, new_max)  # finite while no entry of D(i) is seen
            sum_exp = sum_exp * torch.exp(run_max - shift) + z.sub_(shift[:, None]).exp_().sum(dim=1)
            run_max = new_max
            del z, mask
        lse = torch.where(sum_exp > 0, run_max + torch.log(sum_exp), float("nan"))  # (r,)
        has_pos = npos > 0
        y_hat = 1.0 / npos.clamp_min(1).to(qn.dtype)  # (r,)
        per_row = lse - pos_sum * y_hat
        if kind == "kl_softmax":
            per_row = per_row + torch.log(y_hat)
        per_row = torch.where(has_pos, per_row, torch.zeros_like(per_row))
        ctx.save_for_backward(qn, kn, lse, has_pos, y_hat)
        ctx.pos, ctx.n, ctx.kind, ctx.tile, ctx.temperature = pos, n, kind, tile, temperature
        return per_row.sum() / n

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):  # noqa: D102
        qn, kn, lse, has_pos, y_hat = ctx.saved_tensors
        pos, pairs, qs = ctx.pos, ctx.pos.partner is not None, qn / ctx.temperature
        scale = torch.where(has_pos, grad_out / (ctx.n * ctx.temperature), torch.zeros_like(lse))  # (r,) w_i / τ
        grad_q, grad_k = torch.zeros_like(qn), torch.zeros_like(kn)  # (r, d), (n, d)
        for c0, c1 in _tiles(ctx.n, ctx.tile):
            z = _block(qs, kn, pos.start, c0, c1, float("-inf"))  # (r, T)
            mask = pos.mask(c0, c1) if ctx.kind == "dcl" or not pairs else None
            if ctx.kind == "dcl":
                z.masked_fill_(mask, float("-inf"))
            grad = z.sub_(lse[:, None]).exp_()  # (r, T) σ, 0 outside D(i)
            if not pairs:
                grad.sub_(torch.where(mask, y_hat[:, None], 0.0))
            grad.mul_(scale[:, None])  # ∂L/∂Z_C / τ
            grad_q += grad @ kn[c0:c1]
            grad_k[c0:c1] = grad.T @ qn
            del z, mask, grad
        if pairs:  # -w_i Ŷ_i / τ at (i, p_i)
            corr = -(scale * y_hat)[:, None]  # (r, 1)
            grad_q += corr * kn[pos.partner]
            grad_k.index_add_(0, pos.partner, corr * qn)
        return grad_q, grad_k, None, None, None, None, None
