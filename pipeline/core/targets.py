"""What every loss shares: the target affinity Y of eq. (1) and the ids behind it, the positive pairs of a row
slice in each ``layout`` (see :mod:`pipeline.core.losses`), the pairwise cosine of the two embedding sets, and the
input checks. Shapes: q, k (n, d) embeddings; ids (n,) int64; rows a slice of the n rows."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["LAYOUTS", "check_layout", "pairwise_cosine", "self_supervised_ids", "target_affinity"]

LAYOUTS: tuple[str, ...] = ("two_view", "labels")  # the ``layout`` hints besides None (module docstring)


def row_range(rows: slice | None, n: int) -> tuple[int, int]:
    """Resolve ``rows`` against n rows into ``(start, stop)``, ``stop >= start``; only step 1 is allowed."""
    if rows is None:
        return 0, n
    if not isinstance(rows, slice):
        raise TypeError(f"rows must be a slice or None, got {type(rows).__name__}")
    start, stop, step = rows.indices(n)
    if step != 1:
        raise ValueError(f"rows must be a contiguous slice (step 1), got step {step}")
    return start, max(start, stop)


def _diag_mask(n: int, start: int, stop: int, device: torch.device | None = None) -> Tensor:
    """(r, n) bool, True at the diagonal entries (i, start + i) of rows start..stop-1."""
    r_idx = torch.arange(start, stop, device=device)  # (r,)
    return r_idx[:, None] == torch.arange(n, device=device)[None, :]  # (r, n)


def self_supervised_ids(batch: int, device: torch.device | str | None = None) -> Tensor:
    """Ids of the self-supervised two-view layout: ``[0..B-1, 0..B-1]``, shape (2B,) int64.

    Row i and row i + B are the two views of image i, so each row has exactly one positive in eq. (1).
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    return torch.arange(batch, device=device).repeat(2)  # (2B,)


def target_affinity(ids: Tensor, rows: slice | None = None, dtype: torch.dtype | None = None) -> Tensor:
    """Target affinity of eq. (1), rows ``rows`` only: ``Y[i, j] = 1`` iff ids equal and i != j.

    ids: (n,) int. Returns (r, n) float (``dtype``, default torch's default dtype), 0/1, zero on the diagonal
    (local row i has its diagonal at column ``rows.start + i``).
    """
    if ids.dim() != 1:
        raise ValueError(f"ids must be 1-D (n,), got shape {tuple(ids.shape)}")
    n = ids.shape[0]
    start, stop = row_range(rows, n)
    same = ids[start:stop, None] == ids[None, :]  # (r, n)
    same = same & ~_diag_mask(n, start, stop, ids.device)
    return same.to(dtype or torch.get_default_dtype())


def pairwise_cosine(q: Tensor, k: Tensor, rows: slice | None = None) -> Tensor:
    """Cosine affinity ``A[rows] = normalize(q)[rows] @ normalize(k).T``.

    q, k: (n, d). Returns (r, n). Rows are L2-normalised with ``F.normalize`` (eps 1e-12).
    """
    if q.dim() != 2 or k.dim() != 2 or q.shape != k.shape:
        raise ValueError(f"q and k must both be (n, d), got {tuple(q.shape)} and {tuple(k.shape)}")
    start, stop = row_range(rows, q.shape[0])
    qn = F.normalize(q[start:stop], dim=1)  # (r, d)
    kn = F.normalize(k, dim=1)  # (n, d)
    return qn @ kn.T  # (r, n)


def check_inputs(q: Tensor, k: Tensor, ids: Tensor) -> int:
    """Validate shapes; return n."""
    if q.dim() != 2 or k.dim() != 2 or q.shape != k.shape:
        raise ValueError(f"q and k must both be (n, d), got {tuple(q.shape)} and {tuple(k.shape)}")
    n = q.shape[0]
    if ids.shape != (n,):
        raise ValueError(f"ids must have shape ({n},) to match q, got {tuple(ids.shape)}")
    if n < 2:
        raise ValueError(f"a contrastive loss needs at least 2 samples, got {n}")
    return n


def check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def _positive_pairs(ids: Tensor, start: int, stop: int) -> tuple[Tensor, Tensor, Tensor]:
    """The ones of Y[start:stop] (eq. 1) as index lists, without building the (r, n) matrix.

    ids: (n,) int. Returns ``(pos_row, pos_col, npos)``: pos_row (P,) local row in 0..r-1 (sorted), pos_col
    (P,) column in 0..n-1 (ascending within a row), npos (r,) int64 = |P(i)| = number of positives of each
    row. Memory is O(n + P) with P = sum_i |P(i)| (P = r in the self-supervised layout). One host sync: P.

    In ``order`` (ids sorted, stable) the class of row i is the run [first_i, first_i + |P(i)| + 1), its own
    place in it s_i; its w-th positive (w = 0..|P(i)|-1) is ``order[first_i + w + (w >= s_i)]``.
    """
    r = stop - start
    sorted_ids, order = torch.sort(ids, stable=True)  # (n,), (n,)
    mine = ids[start:stop]  # (r,)
    first = torch.searchsorted(sorted_ids, mine)  # (r,) where the row's class starts in `order`
    npos = torch.searchsorted(sorted_ids, mine, right=True) - first - 1  # (r,) |P(i)|
    place = torch.empty_like(order).scatter_(0, order, torch.arange(ids.shape[0], device=ids.device))  # (n,)
    own = place[start:stop] - first  # (r,) s_i, the row's own place in its run
    total = int(npos.sum())  # P: the host sync (a data-dependent size)
    pos_row = torch.repeat_interleave(torch.arange(r, device=ids.device), npos, output_size=total)  # (P,)
    offset = torch.repeat_interleave(npos.cumsum(0) - npos, npos, output_size=total)  # (P,) row's first pair
    within = torch.arange(total, device=ids.device) - offset  # (P,) w
    within = within + (within >= own[pos_row]).long()  # skip the diagonal
    return pos_row, order[first[pos_row] + within], npos


class _Pairs(NamedTuple):
    """Positives of rows start..stop-1 as P index pairs; the values at the positives are (P,) vectors."""

    row: Tensor  # (P,) local row in 0..r-1, sorted
    col: Tensor  # (P,) column in 0..n-1, ascending within a row
    npos: Tensor  # (r,) int64 |P(i)|

    def take(self, x: Tensor) -> Tensor:
        """(r, n) -> (P,): x at the positives."""
        return x[self.row, self.col]

    def spread(self, v: Tensor) -> Tensor:
        """(r,) per row -> (P,) per positive."""
        return v[self.row]

    def row_sum(self, x: Tensor) -> Tensor:
        """(P,) -> (r,): sum over each row's positives."""
        return x.new_zeros(self.npos.shape).index_add_(0, self.row, x)

    def add_(self, grad: Tensor, x: Tensor) -> None:
        """grad (r, n) += x (P,) at the positives."""
        grad.index_put_((self.row, self.col), x, accumulate=True)

    def fill_(self, z: Tensor, value: float) -> None:
        """z (r, n) = value at the positives."""
        z.index_put_((self.row, self.col), z.new_full((), value))


class _Mask(NamedTuple):
    """Positives of rows start..stop-1 as a dense mask; the values at the positives stay (r, n) (or (r, 1))."""

    mask: Tensor  # (r, n) bool, Y[start:stop] > 0
    npos: Tensor  # (r,) int64 |P(i)|

    def take(self, x: Tensor) -> Tensor:
        return x  # (r, n), masked where it is summed

    def spread(self, v: Tensor) -> Tensor:
        return v[:, None]  # (r, 1)

    def row_sum(self, x: Tensor) -> Tensor:
        return torch.where(self.mask, x, 0.0).sum(dim=1)  # (r,) sum_j Y_ij x_ij

    def add_(self, grad: Tensor, x: Tensor) -> None:
        grad.add_(torch.where(self.mask, x, 0.0))

    def fill_(self, z: Tensor, value: float) -> None:
        z.masked_fill_(self.mask, value)


@functools.lru_cache(maxsize=64)
def _two_view_pairs(n: int, start: int, stop: int, device: torch.device) -> _Pairs:
    """The pairs of the two-view layout (n = 2B): row i's one positive is (i + B) mod n. Equal to
    :func:`_positive_pairs` on such ids, but from (n, rows) alone: built once, no data-dependent shape."""
    with torch.inference_mode(False), torch.no_grad():  # plain tensors, whatever mode the first call runs in
        rows = torch.arange(start, stop, device=device)  # (r,) global row indices
        return _Pairs(rows - start, (rows + n // 2) % n, torch.ones_like(rows))


def check_layout_name(layout: str | None) -> None:
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; allowed: None, {', '.join(map(repr, LAYOUTS))}")


def positives(ids: Tensor, start: int, stop: int, layout: str | None) -> _Pairs | _Mask:
    """The positives of rows start..stop-1 in the representation ``layout`` asks for (module docstring)."""
    check_layout_name(layout)
    if layout is None:
        return _Pairs(*_positive_pairs(ids, start, stop))
    if layout == "two_view":
        if ids.shape[0] % 2:
            raise ValueError(f"layout='two_view' needs an even number of rows, got {ids.shape[0]}")
        return _two_view_pairs(ids.shape[0], start, stop, ids.device)
    mask = target_affinity(ids, slice(start, stop), dtype=torch.bool)  # (r, n), layout "labels"
    return _Mask(mask, mask.sum(dim=1))


def is_two_view(ids: Tensor) -> bool:
    """ids (n,): n even, ``ids[:B] == ids[B:]`` and ``ids[:B]`` distinct (B = n / 2). Host syncs."""
    n = ids.shape[0]
    half = n // 2
    return bool(
        n >= 2 and n % 2 == 0 and bool((ids[:half] == ids[half:]).all()) and ids[:half].unique().numel() == half
    )


def check_layout(ids: Tensor, layout: str | None) -> None:
    """Raise ValueError unless ``ids`` (n,) fit ``layout`` (module docstring). Reads ``ids``: host syncs.

    ``"two_view"``: n even, ``ids[:B] == ids[B:]`` and ``ids[:B]`` pairwise distinct (B = n / 2), so that row
    i's only positive is ``(i + B) mod n`` (e.g. :func:`self_supervised_ids`). ``"labels"`` and None accept
    any 1-D ids (without reading them).
    """
    check_layout_name(layout)
    if ids.dim() != 1:
        raise ValueError(f"ids must be 1-D (n,), got shape {tuple(ids.shape)}")
    if layout == "two_view" and not is_two_view(ids):
        raise ValueError(
            "layout='two_view' needs the self-supervised two-view ids: [view 1; view 2] with ids[:B] == ids[B:] "
            "and ids[:B] distinct, e.g. [0..B-1, 0..B-1]"
        )


def by_row_blocks(a: Tensor, fn: Callable[[Tensor], Tensor], block: int = 256) -> Tensor:
    """``fn`` (b, n) -> (b,) applied to blocks of ``block`` rows of a (r, n): (r,). Temporaries stay (block, n)."""
    if a.shape[0] == 0:
        return a.new_zeros(0)
    return torch.cat([fn(a[i : i + block]) for i in range(0, a.shape[0], block)])


def row_affinity(qn: Tensor, kn: Tensor, start: int) -> tuple[Tensor, Tensor]:
    """``A = qn @ kn.T`` (r, n), a fresh buffer, and the view of its diagonal entries (i, start + i)."""
    a = qn @ kn.T  # (r, n)
    return a, a.diagonal(offset=start)  # (r,) view
