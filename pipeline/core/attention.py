"""One TransFusion block's fusion ``weights @ V`` for a subset of its query rows, dense or in column tiles.

For r of a block's n rows (unit queries ``q`` (r, h)) against the unit keys ``k`` (n, h) and values ``v`` (n, m) of
all n rows, with ``c(i)`` row i's own column (``diag``) and ε = ``AFFINITY_EPS`` = 1e-10 (Appendix E):

    a_ij   = q_i · k_j                                       # (r, n) scores
    raw_ij = act(a)_ij for j ≠ c(i),  raw_i,c(i) = 0         # act elementwise (relu, sigmoid, identity), or
                                                             # softmax over all n columns (diagonal included)
    out_i  = Σ_j (raw_ij + ε) v_j / Σ_j (raw_ij + ε) = (N_i + ε Σ_j v_j) / D_i,
    N_i    = Σ_j raw_ij v_j,   D_i = Σ_j raw_ij + nε.

:func:`fuse_rows` with ``tile=None`` is the dense path (one (r, n) score matrix, plain autograd; with r = n and
``diag=0`` the very ops of ``model.fuse`` before this module, so the same bits); with ``tile=T`` a
:class:`TiledFuse` that visits the keys and values T columns at a time, forward and backward, and so never holds
more than a few (r, T) tiles: its memory grows with r·T + (r + n)(h + m), not r·n. The row sharding of a head
(each worker its r rows against all n gathered keys and values) calls this. Measured at r = n = 4096, h = m = 64,
T = 256, fp32 relu, forward + backward on one CPU thread (``pytest -s -k tenth tests/core/test_attention.py``
prints it): peak 14.7 MB tiled vs 220 MB dense (0.067); time tiled / dense 0.49 - 0.66 over five runs on a busy
2-core machine (0.34 s vs 0.52 s, medians): fewer passes over memory than the dense path's (r, n) matrices.

Half precision (fp16, bf16 inputs, or fp32 inputs under a half autocast): the scores ``q kᵀ`` are one matmul in
the half dtype, as autocast would run it; everything after them (act, sums, N, D, the division, and the backward
from ``out`` to the scores) runs in fp32, and ``out`` comes back in the scores' dtype. This fixes the fp16 dead
row: a row with every score <= 0 has raw = 0 and D = nε = n·1e-10, which is 0 in fp16 (its smallest subnormal is
6e-8), so ``out`` was 0/0 and the gradient ``g / D`` overflowed.

:func:`fuse_rows_bytes` estimates one call's forward + backward peak, for choosing dense or tiled under a budget.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from pipeline.config.model import ACTIVATIONS, AFFINITY_EPS

__all__ = ["TiledFuse", "activate", "fuse_rows", "fuse_rows_bytes"]

EPS = AFFINITY_EPS
HALF = (torch.float16, torch.bfloat16)


def activate(a: Tensor, activation: str) -> Tensor:
    """``act(a)``: relu, sigmoid, identity elementwise; softmax over the last dim. Any shape -> the same shape."""
    if activation == "relu":
        return F.relu(a)
    if activation == "softmax":
        return torch.softmax(a, dim=-1)
    if activation == "sigmoid":
        return torch.sigmoid(a)
    if activation == "identity":
        return a
    raise ValueError(f"unknown activation {activation!r}; allowed: {', '.join(ACTIVATIONS)}")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the sums and divisions run in: fp32 for half scores, else the scores' own dtype."""
    return torch.float32 if dtype in HALF else dtype


def _diag_index(diag: Tensor | int, r: int, n: int, device: torch.device) -> Tensor:
    """``diag`` as a LongTensor (r,) of each query row's own column; an int ``start`` is columns start..start+r-1."""
    if isinstance(diag, Tensor):
        if diag.shape != (r,) or diag.dtype != torch.long:
            raise ValueError(f"diag must be a LongTensor of shape ({r},), got {tuple(diag.shape)} {diag.dtype}")
        return diag.to(device)
    if not 0 <= diag <= n - r:
        raise ValueError(f"diag start {diag} does not fit {r} rows in {n} columns")
    return torch.arange(diag, diag + r, device=device)


def _zero_diag_(raw: Tensor, diag: Tensor | int) -> None:
    """Set each row's own column of ``raw`` (..., r, n) to 0, in place (autograd sees a zero gradient there)."""
    if isinstance(diag, Tensor):
        raw[..., torch.arange(raw.shape[-2], device=raw.device), diag] = 0.0
    else:
        raw.diagonal(offset=diag, dim1=-2, dim2=-1).zero_()


def _check(q: Tensor, k: Tensor, v: Tensor, activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; allowed: {', '.join(ACTIVATIONS)}")
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: need (r, h), (n, h), (n, m)")


def _dense(q: Tensor, k: Tensor, v: Tensor, diag: Tensor | int, activation: str) -> tuple[Tensor, Tensor]:
    """The dense path, plain autograd: ``(out, raw)``, (..., r, m) and (..., r, n). Leading dims are separate
    batches (an int ``diag`` only). For fp32/fp64 these are ``model.fuse``'s ops before this module, one for one."""
    a = q @ k.transpose(-2, -1)  # (..., r, n), in the autocast dtype if one is on
    out_dtype, cd = a.dtype, _compute_dtype(a.dtype)
    with torch.autocast(a.device.type, enabled=False):
        a = a.to(cd)  # half scores: from here on fp32 (a no-op otherwise)
        if activation == "relu":
            raw = a.clamp_min(0.0)  # its backward needs a, not raw, so raw may be edited in place
        else:
            raw = activate(a, activation).clone()
        _zero_diag_(raw, diag if isinstance(diag, int) else diag.to(raw.device))
        v = v.to(cd)
        n = raw.shape[-1]
        denom = raw.sum(dim=-1, keepdim=True) + n * EPS  # (..., r, 1)
        out = (raw @ v + EPS * v.sum(dim=-2, keepdim=True)) / denom  # (..., r, m)
    return out.to(out_dtype), raw


def _scores(q: Tensor, k: Tensor, cd: torch.dtype) -> Tensor:
    """``q kᵀ`` for one tile of keys, in the inputs' dtype, then in the compute dtype. (r, h), (T, h) -> (r, T)."""
    return (q @ k.T).to(cd)


def _tile_raw_(a: Tensor, activation: str, stats: tuple[Tensor, Tensor] | None) -> Tensor:
    """``act(a)`` of one (r, T) tile, in place (``a`` is gone); softmax from the rows' max and Σ exp over all n
    columns (``stats``), so that the tile holds the exact p_ij of the row-wise softmax."""
    if activation == "relu":
        return a.clamp_min_(0.0)
    if activation == "sigmoid":
        return a.sigmoid_()
    if activation == "softmax":
        mx, total = stats
        return a.sub_(mx[:, None]).exp_().div_(total[:, None])
    return a  # identity


def _tile_zero_diag_(t: Tensor, diag: Tensor, j0: int) -> None:
    """Zero ``t[i, diag[i] - j0]`` for the rows whose own column lies in this tile (columns j0 .. j0+T-1), in
    place, without a host sync: the other rows get their own value written back."""
    width = t.shape[1]
    col = (diag - j0).clamp(0, width - 1)[:, None]  # (r, 1)
    inside = ((diag >= j0) & (diag < j0 + width))[:, None]
    t.scatter_(1, col, t.gather(1, col).masked_fill(inside, 0.0))


class TiledFuse(torch.autograd.Function):
    """``out = (raw V + ε Σ_j v_j) / (Σ_j raw_ij + nε)`` over column tiles of T keys/values (module docstring).

    Forward: (softmax only: a first pass over the tiles for each row's max μ_i and Σ_j exp(a_ij − μ_i)), then per
    tile of columns J: a_J = q k_Jᵀ, raw_J = act(a_J) with the own column 0, N += raw_J v_J, S += Σ_J raw.
    out = (N + ε Σ_j v_j) / D, D = S + nε. Saved: the inputs, ``out`` (r, m), D (r) (softmax: μ, Σ exp (r)).

    Backward, by hand (g_i = ∂L/∂out_i; out_i = N_i / D_i up to the ε Σ v term, which does not involve raw):

        ∂L/∂raw_ij = (g_i·v_j − g_i·out_i) / D_i                       = gD_i·v_j − b_i,
                     gD_i = g_i / D_i,  b_i = gD_i·out_i
        ∂L/∂v_j    = Σ_i raw_ij gD_i + ε Σ_i gD_i
        ∂L/∂a_ij   = act'(a_ij) ∂L/∂raw_ij, 0 at j = c(i)            (relu: 1[a > 0], as clamp_min's
                                                                        backward; sigmoid: s(1 − s); identity: 1)
        softmax:     ∂L/∂a_ij = p_ij (∂L/∂p_ij − ρ_i),  ∂L/∂p_ij = ∂L/∂raw_ij for j ≠ c(i), 0 at c(i),
                     ρ_i = Σ_j p_ij ∂L/∂p_ij = Σ_j raw_ij ∂L/∂raw_ij = gD_i·N_i − b_i S_i
                         = ε gD_i·(n out_i − Σ_j v_j)               (N_i = D_i out_i − ε Σ v, S_i = D_i − nε)
                     so no extra pass: the diagonal's a_ii gets −p_ii ρ_i, not 0.
        dq = dA k,  dk = dAᵀ q                                        (dA the (r, n) ∂L/∂a, one tile at a time)

    Each tile's scores are recomputed (as FlashAttention does); dq (r, h), dk (n, h), dv (n, m) accumulate.
    Shapes: q (r, h), k (n, h), v (n, m), diag LongTensor (r,) -> (r, m).
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, diag: Tensor, activation: str, tile: int) -> Tensor:
        n, r = k.shape[0], q.shape[0]
        cd = _compute_dtype(q.dtype)
        with torch.autocast(q.device.type, enabled=False):
            stats = None
            if activation == "softmax":  # pass 1: each row's max and Σ exp over all n columns, online
                mx = torch.full((r,), -torch.inf, dtype=cd, device=q.device)
                total = torch.zeros(r, dtype=cd, device=q.device)
                for j0 in range(0, n, tile):
                    a = _scores(q, k[j0:j0 + tile], cd)  # (r, T)
                    new = torch.maximum(mx, a.amax(dim=1))
                    total = total * torch.exp(mx - new) + a.sub_(new[:, None]).exp_().sum(dim=1)
                    mx = new
                stats = (mx, total)
            num = torch.zeros(r, v.shape[1], dtype=cd, device=q.device)  # N (r, m)
            rowsum = torch.zeros(r, dtype=cd, device=q.device)  # S (r,)
            for j0 in range(0, n, tile):
                raw = _tile_raw_(_scores(q, k[j0:j0 + tile], cd), activation, stats)  # (r, T)
                _tile_zero_diag_(raw, diag, j0)
                num.addmm_(raw, v[j0:j0 + tile].to(cd))
                rowsum += raw.sum(dim=1)
                del raw
            denom = rowsum + n * EPS  # (r,)
            out = (num + EPS * v.to(cd).sum(dim=0)) / denom[:, None]  # (r, m)
        ctx.activation, ctx.tile = activation, tile
        ctx.save_for_backward(q, k, v, diag, out, denom, *(stats or ()))
        return out.to(q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, diag, out, denom, *stats = ctx.saved_tensors
        activation, tile = ctx.activation, ctx.tile
        n, cd = k.shape[0], out.dtype
        with torch.autocast(q.device.type, enabled=False):
            gd = grad.to(cd) / denom[:, None]  # gD (r, m)
            b = (gd * out).sum(dim=1, keepdim=True)  # (r, 1)
            if activation == "softmax":
                rho = EPS * (gd * (n * out - v.to(cd).sum(dim=0))).sum(dim=1, keepdim=True)  # (r, 1)
            qc = q.to(cd)
            dq = torch.zeros_like(qc)  # (r, h)
            dk = torch.empty(k.shape, dtype=cd, device=k.device)  # (n, h)
            dv = (EPS * gd.sum(dim=0)).expand(n, -1).clone()  # (n, m): ε Σ_i gD_i in every row
            for j0 in range(0, n, tile):
                kj, vj = k[j0:j0 + tile], v[j0:j0 + tile].to(cd)  # (T, h), (T, m)
                raw = _tile_raw_(_scores(q, kj, cd), activation, stats or None)  # (r, T), own column not yet 0
                da = (gd @ vj.T).sub_(b)  # ∂L/∂raw (r, T), becomes ∂L/∂a in place
                if activation == "softmax":  # raw is p here, own column included
                    _tile_zero_diag_(da, diag, j0)  # ∂L/∂p: the own column does not reach out
                    da.sub_(rho).mul_(raw)
                else:
                    if activation == "relu":
                        da.masked_fill_(raw <= 0, 0.0)  # clamp_min's backward: 1[a > 0]
                    elif activation == "sigmoid":
                        da.mul_(raw).addcmul_(da, raw, value=-1.0)  # · s(1 − s), no third (r, T) tile
                    _tile_zero_diag_(da, diag, j0)
                _tile_zero_diag_(raw, diag, j0)
                dv[j0:j0 + tile].addmm_(raw.T, gd)
                dq.addmm_(da, kj.to(cd))
                torch.mm(da.T, qc, out=dk[j0:j0 + tile])
                del raw, da  # before the next tile's scores: two (r, T) tiles alive at most, not three
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def fuse_rows(q: Tensor, k: Tensor, v: Tensor, diag: Tensor | int = 0, activation: str = "relu",
              tile: int | None = None, *, return_raw: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """``out_i = Σ_j (raw_ij + ε) v_j / Σ_j (raw_ij + ε)`` for r query rows of a block (module docstring).

    q (r, h) unit queries, k (n, h) unit keys and v (n, m) values of all n rows -> (r, m). ``diag``: each query
    row's own column, a LongTensor (r,) (any columns, e.g. two separate slices) or an int ``start`` for columns
    start .. start+r-1 (an int is range-checked; a tensor's entries are not, which would cost a host sync).
    ``tile=None``: dense, one (r, n) score matrix, plain autograd (leading batch dims allowed
    with an int ``diag``: (..., r, h) etc.); ``return_raw=True`` then also returns ``raw`` (..., r, n) (fp32 for
    half scores), as ``model.fuse`` needs. ``tile=T``: :class:`TiledFuse`, T columns at a time (every activation;
    softmax with one more forward pass over the tiles), no ``raw`` to return.
    """
    _check(q, k, v, activation)
    if isinstance(diag, int):
        _diag_index(diag, q.shape[-2], k.shape[-2], q.device)  # the range check
    if tile is None:
        out, raw = _dense(q, k, v, diag, activation)
        return (out, raw) if return_raw else out
    if return_raw:
        raise ValueError("return_raw needs the dense path (tile=None): the tiled path never forms raw")
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
        raise ValueError(f"tile must be an int >= 1 or None, got {tile!r}")
    if q.dim() != 2 or k.dim() != 2 or v.dim() != 2:
        raise ValueError(f"the tiled path takes 2-D q, k, v, got {q.dim()}-D, {k.dim()}-D, {v.dim()}-D")
    if q.dtype != k.dtype:
        raise ValueError(f"q and k must share a dtype, got {q.dtype} and {k.dtype}")
    device = q.device.type
    if torch.is_autocast_enabled(device) and q.dtype == torch.float32:  # the scores' matmul as autocast runs it
        half = torch.get_autocast_dtype(device)
        q, k = q.to(half), k.to(half)
    return TiledFuse.apply(q, k, v, _diag_index(diag, q.shape[0], k.shape[0], q.device), activation, tile)


def fuse_rows_bytes(r: int, n: int, h: int, m: int, tile: int | None, itemsize: int) -> int:
    """Estimated peak bytes allocated by one :func:`fuse_rows` call's forward + backward (its inputs not counted),
    for relu, softmax and sigmoid (identity needs less): what a caller compares with a memory budget.

    With c = max(itemsize, 4) (half inputs compute in fp32 after the scores) and s = itemsize for half, else 0:

        dense (tile None):  3·r·n·c         + (r + n)(h + m)·(1.5·c + s/2)
        tiled (tile T):     r·T'·(2·c + 1)  + (r + n)(h + m)·(1.25·c + s/2),   T' = min(T, n)

    Dense: the saved scores and raw plus the gradient of raw, three (r, n) at the backward's peak. Tiled: two (r, T)
    tiles (raw and ∂L/∂a) and relu's bool mask, plus the (r, m) sums and the dq, dk, dv being accumulated.
    Calibrated with ``pipeline.training.measure.peak_bytes`` (CPU allocator, torch 2.14, one thread) of
    ``torch.autograd.grad(fuse_rows(q, k, v, 0, act, tile), (q, k, v), g)``, (r, n, h, m) in (512, 512, 64, 64),
    (256, 1024, 32, 16), (1024, 1024, 64, 64), T in (64, 256), fp64 / fp32 / fp16 and all four activations.
    Measured / estimate, for example (r = n = 1024, h = m = 64): fp32 relu dense 14.16 MB / 14.16 MB, softmax
    13.37 MB / 14.16 MB; fp32 relu T = 256: 3.69 MB / 3.67 MB, T = 64: 1.92 MB / 1.90 MB; fp16 relu dense
    13.89 MB / 14.42 MB, T = 256: 4.15 MB / 3.93 MB; fp64 relu T = 64: 3.76 MB / 3.74 MB. Every relu / softmax /
    sigmoid peak of that grid is 0.87 - 1.08 of its estimate; identity's dense peak 0.63 - 0.65 (no saved scores).
    ``tests/core/test_attention.py`` checks it at one size.
    """
    if tile is not None and tile < 1:
        raise ValueError(f"tile must be an int >= 1 or None, got {tile!r}")
    c = max(itemsize, 4)
    s = itemsize if itemsize < 4 else 0
    rows = (r + n) * (h + m)
    if tile is None:
        return int(3 * r * n * c + rows * (1.5 * c + s / 2))
    return int(r * min(tile, n) * (2 * c + 1) + rows * (1.25 * c + s / 2))
