"""What every loss shares: the target affinity Y of eq. (1) and the ids behind it, the positive pairs of a row
slice in each ``layout`` (see :mod:`pipeline.core.losses`), the pairwise cosine of the two embedding sets, and the
input checks. Shapes: q, k (n, d) embeddings; ids (n,) int64; rows a slice of the n rows."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from pipeline.config.loss import MAX_POWER

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


def check_power(power: float) -> None:
    if not 1 <= power <= MAX_POWER:
        raise ValueError(f"power must be in [1, {MAX_POWER}], got {power}")


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


class Pairs(NamedTuple):
    """The positives of rows start..stop-1 as P index pairs (layout None when dense, and ``"two_view"``); the values
    at the positives are (P,) vectors. A tile is the (r, T) block of columns c0..c0+T-1 of an (r, n) matrix."""

    row: Tensor  # (P,) local row in 0..r-1, sorted
    col: Tensor  # (P,) column in 0..n-1, ascending within a row
    npos: Tensor  # (r,) int64 |P(i)|
    n: int  # the columns of the whole matrix

    def _in_tile(self, c0: int, width: int) -> tuple[Tensor, Tensor | None]:
        """(P,) the pairs' columns in the tile (clamped into it) and (P,) bool which pairs lie in it (None: all)."""
        if c0 == 0 and width == self.n:
            return self.col, None
        return (self.col - c0).clamp(0, width - 1), (self.col >= c0) & (self.col < c0 + width)

    def take(self, x: Tensor, c0: int = 0) -> Tensor:
        """x (r, T), the tile at column c0 -> (P,): x at the positives, 0 for the positives outside the tile."""
        col, inside = self._in_tile(c0, x.shape[1])
        values = x[self.row, col]
        return values if inside is None else values.where(inside, 0.0)

    def add_(self, x: Tensor, values: Tensor, c0: int = 0) -> None:
        """x (r, T), the tile at column c0, += values (P,) at the positives within it."""
        col, inside = self._in_tile(c0, x.shape[1])
        x.index_put_((self.row, col), values if inside is None else values.where(inside, 0.0), accumulate=True)

    def spread(self, v: Tensor) -> Tensor:
        """(r,) per row -> (P,) per positive."""
        return v[self.row]

    def row_sum(self, x: Tensor) -> Tensor:
        """(P,) -> (r,): sum over each row's positives."""
        return x.new_zeros(self.npos.shape).index_add_(0, self.row, x)


class LabelMask(NamedTuple):
    """The positives of rows start..stop-1 read from the ids a tile of columns at a time (layout ``"labels"``, and
    None when tiled): no host sync, nothing (r, n) unless the tile is the whole row."""

    start: int
    row_ids: Tensor  # (r,) ids[start:stop]
    ids: Tensor  # (n,)

    def mask(self, c0: int, c1: int) -> Tensor:
        """(r, T) bool: Y[rows, c0:c1] > 0 of eq. (1), the positives within columns c0..c1-1."""
        same = self.row_ids[:, None] == self.ids[None, c0:c1]  # (r, T)
        same.diagonal(offset=self.start - c0).fill_(False)
        return same

    def count(self, c0: int, c1: int) -> Tensor:
        """(r,) int64 |P(i) ∩ [c0, c1)| without a (r, T) buffer: each row's id searched in the tile's sorted ids,
        less the row itself where its diagonal (i, start + i) lies in the tile."""
        tile_ids = self.ids[c0:c1].sort().values  # (T,)
        same = torch.searchsorted(tile_ids, self.row_ids, right=True) - torch.searchsorted(tile_ids, self.row_ids)
        rows = torch.arange(self.start, self.start + self.row_ids.shape[0], device=self.ids.device)  # (r,)
        return same - ((rows >= c0) & (rows < c1)).long()


@functools.lru_cache(maxsize=64)
def _two_view_pairs(n: int, start: int, stop: int, device: torch.device) -> Pairs:
    """The pairs of the two-view layout (n = 2B): row i's one positive is (i + B) mod n. Equal to
    :func:`_positive_pairs` on such ids, but from (n, rows) alone: built once, no data-dependent shape."""
    with torch.inference_mode(False), torch.no_grad():  # plain tensors, whatever mode the first call runs in
        rows = torch.arange(start, stop, device=device)  # (r,) global row indices
        return Pairs(rows - start, (rows + n // 2) % n, torch.ones_like(rows), n)


def check_layout_name(layout: str | None) -> None:
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; allowed: None, {', '.join(map(repr, LAYOUTS))}")


def positives(ids: Tensor, start: int, stop: int, layout: str | None, tiled: bool) -> Pairs | LabelMask:
    """The positives of rows start..stop-1 as ``layout`` asks (:mod:`pipeline.core.losses`): the cached pairs of
    ``"two_view"``; the pairs read from ``ids`` for None (one host sync), or, ``tiled``, a mask per tile as for
    ``"labels"`` (no host sync)."""
    check_layout_name(layout)
    if layout == "two_view":
        if ids.shape[0] % 2:
            raise ValueError(f"layout='two_view' needs an even number of rows, got {ids.shape[0]}")
        return _two_view_pairs(ids.shape[0], start, stop, ids.device)
    if layout is None and not tiled:
        return Pairs(*_positive_pairs(ids, start, stop), ids.shape[0])
    return LabelMask(start, ids[start:stop], ids)


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
