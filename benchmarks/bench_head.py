"""The sharded, tiled head: memory per row, tiled vs dense, 2 workers vs 1, FLOPs and the largest batch of a cluster.

Head + loss (``jsd``), forward and backward, on one worker's rows (:meth:`TransFusionHead.forward_rows`), each line
measured in this run against its baseline (CPU; peak bytes from ``pipeline.training.measure.peak_bytes``)::

    peak bytes per row, tiled, n=16384 / n=2048: R          goal <= 1.25 (flat per row: memory linear in n)
    tiled / dense peak at n=8192: R                          goal <= 0.1
    tiled / dense time at n=4096: R                          goal <= 1.5 (the backward recomputes the tiles)
    head time per worker, 2 workers / 1 at the same global batch: R    goal <= 0.65 (2 gloo processes, 1 thread each)
    head / backbone FLOP per worker at B=8192 on 8 workers: R          goal <= 0.5
    largest global batch on 8 x 80 GB, depth 9, embed 512, resnet18_cifar, bf16: N images (limited by: ...)

The FLOP line counts one simulated rank with ``torch.utils.flop_counter.FlopCounterMode``: its r = n/8 rows, the
keys and values of all n rows given; counted at two small sizes and extended by its r·n and r terms, and the
backbone (``resnet18_cifar``, 32 px, two views per image) counted on 2 images. The last line is computed: the head's
bytes per worker from ``pipeline.core.plan`` (bf16 head, fp32 loss), the backbone's activation bytes per image
measured here in fp32 and halved for bf16, plus the parameters, gradients and Adam's state.

    python benchmarks/bench_head.py                 # all lines (about 3 minutes on 2 cores)
    python benchmarks/bench_head.py --quick         # smaller n, for a smoke run
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeline.core.backbones import build_backbone
from pipeline.core.losses import make_loss
from pipeline.core.model import Rows, TransFusionHead
from pipeline.core.plan import head_bytes, plan_head
from pipeline.training.measure import best_time, peak_bytes
from pipeline.training.step import gather_views

WIDTH, DEPTH, TILE = 64, 1, 512


def step_fn(n: int, world: int, tile: int | None, depth: int = DEPTH, width: int = WIDTH, gather=None, rank=0):
    """One worker's head + jsd, forward and backward, on its r = n / world rows of a two-view batch."""
    r, b = n // world, n // (2 * world)
    torch.manual_seed(0)
    head = TransFusionHead(width, depth, qk_init="identity")
    x = torch.randn(r, width, requires_grad=True)
    index = torch.cat([torch.arange(rank * b, (rank + 1) * b), n // 2 + torch.arange(rank * b, (rank + 1) * b)])
    rows = Rows(index, n, gather or (lambda t: t.repeat(world, 1)))
    ids = torch.cat([torch.arange(n // 2)] * 2)
    loss = make_loss("jsd")
    kw = {} if tile is None else {"tile": tile}
    mine = (slice(rank * b, (rank + 1) * b), slice(n // 2 + rank * b, n // 2 + (rank + 1) * b))

    def step() -> None:
        head.zero_grad(set_to_none=True)
        out = head.forward_rows(x, rows, views=2, tile=tile)
        q = rows.gather(out.q)
        sum(loss(q, q, ids, rows=s, layout="two_view", **kw) for s in mine).backward()

    return step


def _worker(rank: int, world: int, init: str, n: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        step = step_fn(n, world, TILE, gather=lambda t: gather_views(t, world), rank=rank)
        dist.barrier()
        seconds = best_time(step)
        if rank == 0:
            with open(out, "w") as f:
                f.write(str(seconds))
    finally:
        dist.destroy_process_group()


def two_workers_time(n: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "seconds")
        mp.spawn(_worker, args=(2, os.path.join(d, "init"), n, out), nprocs=2, join=True)
        return float(open(out).read())


def flops(fn) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def head_flops_per_worker(n: int, world: int, depth: int, width: int) -> float:
    """FLOP of one rank's head + loss at n rows, from counts at n/16 and n/8 (terms in r·n and r)."""
    def count(m: int) -> int:
        return flops(step_fn(m, world, None, depth=depth, width=width))

    n1, n2 = n // 16, n // 8
    f1, f2 = count(n1), count(n2)
    r1, r2 = n1 // world, n2 // world
    # f = a r n + c r  ->  two equations
    a = (f2 - f1 * r2 / r1) / (r2 * n2 - r1 * n1 * r2 / r1)
    c = (f1 - a * r1 * n1) / r1
    r = n // world
    return a * r * n + c * r


def backbone_per_image(kind: str) -> tuple[float, float]:
    """(FLOP, activation bytes in fp32) of ``resnet18_cifar`` forward + backward per 32 px image."""
    bb, _ = build_backbone("resnet18_cifar", (3, 32, 32))
    x = torch.randn(4, 3, 32, 32)

    def run() -> None:
        bb.zero_grad(set_to_none=True)
        bb(x).square().mean().backward()

    run()
    if kind == "flops":
        return flops(run) / 4, 0.0
    return 0.0, peak_bytes(run) / 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="n / 4 everywhere (a smoke run, not the README's numbers)")
    args = ap.parse_args()
    q = 4 if args.quick else 1
    threads = torch.get_num_threads()
    print(f"head + jsd, forward and backward: depth {DEPTH}, width {WIDTH}, tile {TILE}; {threads} threads "
          f"(the 2-worker line: 1 thread a process); torch {torch.__version__}")

    big, small = 16384 // q, 2048 // q
    per_row = [peak_bytes(step_fn(n, 1, TILE)) / n for n in (big, small)]
    print(f"peak bytes per row, tiled, n={big} / n={small}: {per_row[0] / per_row[1]:.2f} "
          f"({per_row[0] / 1024:.1f} / {per_row[1] / 1024:.1f} KiB per row)  goal <= 1.25")

    n = 8192 // q
    tiled, dense = peak_bytes(step_fn(n, 1, TILE)), peak_bytes(step_fn(n, 1, None))
    print(f"tiled / dense peak at n={n}: {tiled / dense:.3f} ({tiled / 2**20:,.0f} / {dense / 2**20:,.0f} MiB)"
          f"  goal <= 0.1")

    n = 4096 // q
    tt, td = best_time(step_fn(n, 1, TILE)), best_time(step_fn(n, 1, None))
    print(f"tiled / dense time at n={n}: {tt / td:.2f} ({tt * 1e3:,.0f} / {td * 1e3:,.0f} ms)  goal <= 1.5")

    n = 8192 // q  # large enough that the gathers and the process start are small next to the head's work
    torch.set_num_threads(1)
    one = best_time(step_fn(n, 1, TILE))
    two = two_workers_time(n)
    torch.set_num_threads(threads)
    print(f"head time per worker, 2 workers / 1 at the same global batch: {two / one:.2f} (n={n}, tiled; "
          f"{two * 1e3:,.0f} / {one * 1e3:,.0f} ms, 1 thread each)  goal <= 0.65")

    world, images = 8, 8192
    head_f = head_flops_per_worker(2 * images, world, 9, 512)
    bb_f, _ = backbone_per_image("flops")
    bb_worker = bb_f * 2 * images / world  # two views of the worker's images
    print(f"head / backbone FLOP per worker at B={images} on {world} workers: {head_f / bb_worker:.2f} "
          f"(head {head_f / 1e12:.2f} TFLOP, backbone {bb_worker / 1e12:.2f} TFLOP; depth 9, embed 512, "
          f"resnet18_cifar {bb_f / 1e9:.2f} GFLOP per view)  goal <= 0.5")

    _, act = backbone_per_image("bytes")
    act_bf16 = act / 2  # bf16 activations: half of the fp32 bytes measured here
    gpu = 80 * 10**9
    n_params = sum(p.numel() for p in build_backbone("resnet18_cifar", (3, 32, 32))[0].parameters())
    n_params += sum(p.numel() for p in TransFusionHead(512, 9).parameters())
    fixed = n_params * 4 * 4  # fp32 weights, gradients, Adam's two moments

    def largest(with_backbone: bool, with_head: bool) -> tuple[int, float]:
        """The largest global batch (a multiple of 1,024 images) whose worker fits 80 GB, and its head's GB."""
        best, head_gb, b = 0, 0.0, 1024
        while b <= 2**22:
            left = gpu - fixed - (act_bf16 * 2 * b / world if with_backbone else 0)
            plan = plan_head(2 * b, world, 9, 512, int(max(left, 0)), itemsize=2) if with_head else None
            if left <= 0 or (plan is not None and plan.bytes > left):
                break
            best, head_gb = b, (plan.bytes / 1e9 if plan else 0.0)
            b += 1024
        return best, head_gb

    best, head_gb = largest(True, True)
    backbone_only, _ = largest(True, False)
    head_only, _ = largest(False, True)
    limit = "backbone" if backbone_only <= head_only else "head"
    print(f"largest global batch on {world} x 80 GB, depth 9, embed 512, resnet18_cifar, bf16: {best:,} images "
          f"(limited by: {limit}; head {head_gb:.1f} GB per worker; the backbone alone would allow {backbone_only:,}, "
          f"the head alone {head_only:,}; backbone {act_bf16 / 2**20:.1f} MiB per view; a dense head at "
          f"B={best:,} would need {head_bytes(2 * best, world, 9, 512, None, 2) / 1e9:,.0f} GB)  goal: backbone, "
          f">= 32,768")


if __name__ == "__main__":
    main()
