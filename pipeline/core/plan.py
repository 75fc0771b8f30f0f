"""How the head runs on each worker: row-sharded over the workers, dense or over column tiles, chosen by memory.

TransFusion's blocks and affinity losses compare every row of the global batch with every other. With W workers
and a global batch of n rows (n = 2B: two views of B images), each worker computes its r = n / W rows of every
block and of the loss against the keys and values of all n rows (``TransFusionHead.forward_rows``, whenever W > 1).
Per worker and step that is, for a head of depth d and width m:

- dense: the (r, n) score matrices autograd keeps: about ``DENSE_BLOCK`` fp32 buffers a block, ``DENSE_BLOCK_HALF``
  half-precision ones under bf16 / fp16 autocast, and ``DENSE_LOSS`` fp32 buffers for the loss. Measured with
  ``pipeline.training.measure.peak_bytes`` on the CPU (fp32, m = 64, r = n / W for n = 1,024-4,096 and W = 1-4:
  2.2 + 2.3 d to 2.3 + 2.6 d buffers of r·n·4 bytes) and with ``torch.cuda.max_memory_allocated`` on an H200
  (``benchmarks/bench_cuda.py``, m = 64 and 512, n = 8,192-16,384: a block 2.0 fp32 buffers, or 4.0 bf16 ones,
  i.e. autocast saves nothing here; the loss 1.5);
- tiled: (r, T) for one column tile of T keys at a time (:func:`pipeline.core.attention.fuse_rows`, the tiled
  losses of ``pipeline.core.tiled_losses``), recomputed in the backward;
- either way the rows' activations, linear in n: the gathered keys and values (n, 2m) of every block, the
  gathered q / k of the loss, and about ``ROW_FLOATS`` m-wide floats per local row and block.

:func:`plan_head` keeps the dense path where its estimate fits the budget (``train.head_budget_mb``; None: a
``HEAD_BUDGET_SHARE`` of the device's memory) and otherwise takes the largest tile (a multiple of ``TILE_STEP``)
whose estimate fits. The numbers are the same either way (``tests/training/test_sharded_head.py``); only memory and
time differ. Pure arithmetic: no torch needed to plan (``transfusion check`` prints a plan on any machine).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

HEAD_BUDGET_SHARE = 0.25  # train.head_budget_mb: null -> this share of the device's memory
DENSE_BLOCK = 2.6  # (r, n) fp32 buffers a dense block keeps for its backward (measured: CPU 2.3-2.6, H200 2.0)
DENSE_BLOCK_HALF = 4.0  # the same at a 2-byte compute dtype (measured: H200, bf16 autocast, 4.0)
DENSE_LOSS = 2.3  # (r, n) fp32 buffers of the dense loss (one tile), forward + backward (measured: 2.2-2.3)
TILED_BLOCK = 4.0  # (r, T) buffers alive while one tile of a block or the loss is computed
ROW_FLOATS = 12  # m-wide activations a block keeps per local row (LayerNorm, projections, residual, output)
TILE_STEP = 128
MIN_TILE = 128


@dataclass(frozen=True)
class HeadPlan:
    """The head's path on one worker: ``tile`` None = dense. Bytes are per worker and step, forward + backward."""

    n: int  # rows of the global batch (2 B)
    world: int  # workers; each computes r = n / world rows
    depth: int
    width: int
    tile: int | None
    bytes: int  # estimate of the chosen path
    dense_bytes: int  # estimate of the dense path
    budget: int

    @property
    def rows(self) -> int:
        return self.n // self.world

    @property
    def sharded(self) -> bool:
        return self.world > 1

    @property
    def path(self) -> str:
        return "dense" if self.tile is None else "tiled"

    def describe(self) -> str:
        """One line: ``head sharded over 2 workers (2,048 of 4,096 rows each), dense: 12.0 MiB per worker (...)``."""
        who = (f"sharded over {self.world} workers ({self.rows:,} of {self.n:,} rows each)" if self.sharded
               else f"on one worker ({self.n:,} rows)")
        how = "dense" if self.tile is None else f"in tiles of {self.tile:,} columns"
        fits = "" if self.bytes <= self.budget else ", over the budget even at the smallest tile"
        return (f"head {who}, {how}: {self.bytes / 2**20:,.1f} MiB per worker (dense {self.dense_bytes / 2**20:,.1f} "
                f"MiB; budget {self.budget / 2**20:,.0f} MiB{fits})")

    def tags(self) -> dict[str, str]:
        """MLflow tags: ``head.path`` (dense|tiled), ``head.sharded``, ``head.tile``, ``head.mib_per_worker``."""
        return {"head.path": self.path, "head.sharded": str(self.sharded).lower(),
                "head.tile": "none" if self.tile is None else str(self.tile),
                "head.mib_per_worker": f"{self.bytes / 2**20:.1f}"}

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def head_bytes(n: int, world: int, depth: int, width: int, tile: int | None, itemsize: int = 4,
               pairwise_loss: bool = True) -> int:
    """Estimated peak bytes of the head and the loss on one worker, forward + backward (see the module doc).

    ``depth``: blocks that fuse (a truncated head's last block only projects: count it as 0 here, it has no (r, n)
    matrix of its own). ``itemsize``: bytes of the head's compute dtype (2 under bf16 / fp16 autocast).
    """
    r = n // world
    linear = depth * (2 * n * width * itemsize + ROW_FLOATS * r * width * 4) + 4 * n * width * 4
    if tile is None or tile >= n:
        block = (DENSE_BLOCK if itemsize >= 4 else DENSE_BLOCK_HALF) * itemsize  # bytes per (r, n) element
        square = r * n * (block * depth + (DENSE_LOSS * 4 if pairwise_loss else 0))
    else:
        square = TILED_BLOCK * r * tile * 4 if (depth or pairwise_loss) else 0
    return int(linear + square)


def plan_head(n: int, world: int, depth: int, width: int, budget: int, itemsize: int = 4,
              pairwise_loss: bool = True, tile: int | None = None) -> HeadPlan:
    """The path for a global batch of ``n`` rows on ``world`` workers within ``budget`` bytes a worker.

    ``tile``: force this column tile (tests, benchmarks); None chooses: dense if it fits, else the largest tile that
    does (at least ``MIN_TILE``; if even that does not fit, that tile, and :meth:`HeadPlan.describe` says so).
    """
    if n % world:
        raise ValueError(f"{n} rows do not split over {world} workers")
    kw = {"itemsize": itemsize, "pairwise_loss": pairwise_loss}
    dense = head_bytes(n, world, depth, width, None, **kw)
    if tile is None and dense <= budget:
        chosen = None
    elif tile is not None:
        chosen = tile if tile < n else None
    else:
        r = n // world
        spare = budget - head_bytes(n, world, depth, width, 1, **kw) + TILED_BLOCK * r * 4
        fit = int(spare // (TILED_BLOCK * r * 4)) if spare > 0 else 0
        below_n = (n - 1) // TILE_STEP * TILE_STEP or max(1, n // 2)  # a tile must leave n in >= 2 pieces
        chosen = min(below_n, max(MIN_TILE, fit // TILE_STEP * TILE_STEP))
    return HeadPlan(n=n, world=world, depth=depth, width=width, tile=chosen,
                    bytes=head_bytes(n, world, depth, width, chosen, **kw), dense_bytes=dense, budget=int(budget))


def largest_batch(world: int, depth: int, width: int, budget: int, itemsize: int = 4, pairwise_loss: bool = True,
                  limit: int = 2**31) -> int:
    """The largest global batch B (images; n = 2B rows, B a multiple of ``world``) whose head fits ``budget`` bytes a
    worker on its best path (tiled where dense does not fit). 0 if not even B = world fits."""

    def fits(b: int) -> bool:
        n = 2 * b
        return plan_head(n, world, depth, width, budget, itemsize, pairwise_loss).bytes <= budget

    if not fits(world):
        return 0
    lo = world
    hi = lo
    while hi < limit and fits(hi * 2):
        hi *= 2
    hi = min(hi * 2, limit)
    while hi - lo > world:  # invariant: fits(lo); not fits(hi) unless hi == limit
        mid = (lo + hi) // 2 // world * world
        if mid <= lo:
            break
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return hi if hi == limit and fits(hi) else lo


def budget_bytes(budget_mb: float | None, device_bytes: int) -> int:
    """``train.head_budget_mb`` in bytes; None: ``HEAD_BUDGET_SHARE`` of the device's memory."""
    return int(budget_mb * 2**20) if budget_mb is not None else int(HEAD_BUDGET_SHARE * device_bytes)


__all__ = ["HEAD_BUDGET_SHARE", "HeadPlan", "budget_bytes", "head_bytes", "largest_batch", "plan_head"]
