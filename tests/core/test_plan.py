"""The head's plan (``pipeline.core.plan``): dense within the budget, the largest tile beyond it, and estimates
that bound what the head and the loss really allocate (measured with ``peak_bytes``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.core.losses import make_loss
from pipeline.core.model import Rows, TransFusionHead
from pipeline.core.plan import HeadPlan, budget_bytes, head_bytes, largest_batch, plan_head
from pipeline.training.measure import peak_bytes

MiB = 2**20


def test_dense_within_the_budget_tiled_beyond_it():
    dense = plan_head(4096, 2, 3, 64, budget=1024 * MiB)
    assert dense.tile is None and dense.bytes == dense.dense_bytes <= dense.budget
    tiled = plan_head(4096, 2, 3, 64, budget=dense.dense_bytes // 3)
    assert tiled.tile is not None and tiled.tile < 4096 and tiled.tile % 128 == 0
    assert tiled.bytes <= tiled.budget < tiled.dense_bytes
    bigger = plan_head(4096, 2, 3, 64, budget=dense.dense_bytes // 2)
    assert bigger.tile > tiled.tile  # the largest tile that fits
    assert plan_head(4096, 2, 3, 64, budget=0).tile == 128  # nothing fits: the smallest tile, said so
    assert "over the budget" in plan_head(4096, 2, 3, 64, budget=0).describe()


def test_the_plan_is_per_worker_and_shrinks_with_workers():
    one, eight = (plan_head(2 * 8192, w, 9, 512, 10**15, itemsize=2) for w in (1, 8))
    assert not one.sharded and eight.sharded and eight.rows == 2048
    assert eight.dense_bytes < one.dense_bytes / 6  # the (r, n) matrices fall as 1/8; the gathered (n, 2m) stay


def test_tags_and_the_dict_round_trip():
    plan = plan_head(1024, 2, 1, 32, budget=MiB)
    assert HeadPlan(**plan.as_dict()) == plan
    assert plan.tags() == {"head.path": "tiled", "head.sharded": "true", "head.tile": str(plan.tile),
                           "head.mib_per_worker": f"{plan.bytes / MiB:.1f}"}
    assert budget_bytes(None, 4000) == 1000 and budget_bytes(1.5, 0) == int(1.5 * MiB)


@pytest.mark.parametrize("world,depth,width", [(1, 1, 64), (8, 9, 512), (4, 0, 128)])
def test_largest_batch_is_the_edge_of_the_budget(world, depth, width):
    budget = 256 * MiB
    b = largest_batch(world, depth, width, budget)
    assert b > 0 and b % world == 0
    assert plan_head(2 * b, world, depth, width, budget).bytes <= budget
    assert plan_head(2 * (b + world), world, depth, width, budget).bytes > budget
    assert largest_batch(world, depth, width, 2 * budget) > b


def _head_and_loss(n: int, world: int, depth: int, width: int, tile: int | None):
    """One simulated worker's head + jsd, forward and backward: its r rows, every row's keys and values given."""
    r = n // world
    torch.manual_seed(0)
    head = TransFusionHead(width, depth, qk_init="identity")
    x = torch.randn(r, width, requires_grad=True)
    rows = Rows(torch.arange(r), n, lambda t: t.repeat(world, 1))
    ids = torch.cat([torch.arange(n // 2)] * 2)
    loss = make_loss("jsd")
    kw = {} if tile is None else {"tile": tile}

    def step():
        out = head.forward_rows(x, rows, views=2, tile=tile)
        q = rows.gather(out.q)
        loss(q, q, ids, rows=slice(0, r), layout="two_view", **kw).backward()

    return step


@pytest.mark.parametrize("n,world,depth", [(1024, 1, 1), (2048, 2, 3), (2048, 4, 0)])
def test_the_dense_estimate_bounds_the_measured_peak(n, world, depth):
    measured = peak_bytes(_head_and_loss(n, world, depth, 64, None))
    estimate = head_bytes(n, world, depth, 64, None)
    assert measured <= estimate <= 1.5 * measured, (measured, estimate)


def _gpu_records() -> list[dict]:
    path = Path(__file__).parents[2] / "benchmarks" / "results" / "cuda.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("record", _gpu_records(), ids=lambda r: f"{r['dtype']}-n{r['n']}-d{r['depth']}-m{r['width']}"
                         f"-{'dense' if r['tile'] is None or r['tile'] >= r['n'] else 'tiled'}")
def test_the_estimate_bounds_the_peaks_measured_on_a_gpu(record):
    """Peaks measured on an H200 (``benchmarks/bench_cuda.py --out benchmarks/results/cuda.jsonl``; this machine has
    no GPU): the dense estimate bounds each peak within 1.5× where the (r, n) matrices dominate (above 64 MiB), and the
    tiled estimate is never below 1/1.5 of it. bf16 autocast keeps 4 half buffers a block there (DENSE_BLOCK_HALF)."""
    itemsize = 2 if record["dtype"] in ("bfloat16", "float16") else 4
    tile = record["tile"] if record["tile"] is not None and record["tile"] < record["n"] else None
    estimate = head_bytes(record["n"], record["world"], record["depth"], record["width"], tile, itemsize=itemsize)
    measured = record["peak_bytes"]
    if tile is None:
        assert measured <= estimate, (measured, estimate)
        if measured > 64 * MiB:
            assert estimate <= 1.5 * measured, (measured, estimate)
    else:
        assert measured <= 1.5 * estimate, (measured, estimate)
