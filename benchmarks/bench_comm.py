"""Communication of one training step: collectives, bytes, host syncs, overlap, and 2 workers against 1 process.

Two workers (``torch.multiprocessing``, gloo on the CPU by default) train ``resnet18_cifar`` (global BatchNorm, a
1-block TransFusion head, the jsd loss, self-supervised) on a global batch split between them, with the step the
pipeline uses on a GPU (``GlobalBatchStep.lazy``: no host sync, the loss checked once per epoch). Rank 0 counts
one step with ``pipeline.training.measure.OpCounter`` (every c10d collective and the bytes it sends, every op that would
sync a CUDA host) and reads how many gradient buckets started during the backward. Then both ranks time
``--steps`` steps, overlapped (gradient buckets all-reduced as the backward produces them) and coalesced (one
all-reduce after the backward: the baseline, same run); one process times the same global batch alone, with as
many threads as the workers have together. It prints::

    collectives per step: N
    bytes per step: N
    host syncs per step: N
    gradient all-reduce overlapped: yes|no
    step time 2 workers / 1 process at the same global batch: R

    python benchmarks/bench_comm.py                       # 2 gloo workers on the CPU, global batch 64, 32 px
    python benchmarks/bench_comm.py --batch 256 --steps 5
    python benchmarks/bench_comm.py --backend nccl        # 2 GPUs: the NCCL path (reduce-scatter backward)
    python benchmarks/bench_comm.py --cost-model          # the AWS recipe's network time against compute
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.config.model import ModelConfig  # noqa: E402
from pipeline.core.batchnorm import convert_batchnorm  # noqa: E402
from pipeline.core.losses import make_loss  # noqa: E402
from pipeline.core.model import build_model  # noqa: E402
from pipeline.training import measure  # noqa: E402
from pipeline.training.step import GlobalBatchStep  # noqa: E402

BACKBONE, IMAGE = "resnet18_cifar", 32


def build(world: int, device: torch.device) -> GlobalBatchStep:
    torch.manual_seed(0)
    model = build_model(ModelConfig(backbone=BACKBONE, depth=1, embed_dim=None), (3, IMAGE, IMAGE)).to(device)
    if world > 1:
        convert_batchnorm(model)
    return GlobalBatchStep(model, make_loss("jsd"), layout="two_view")


def batch(global_batch: int, rank: int, world: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's two views (2b, 3, H, W) and their global image ids (2b,), as ``PretrainLoop`` makes them."""
    b = global_batch // world
    g = torch.Generator().manual_seed(rank)
    x = torch.rand(2 * b, 3, IMAGE, IMAGE, generator=g)
    ids = torch.arange(rank * b, (rank + 1) * b)
    return x.to(device), torch.cat([ids, ids]).to(device)


def one_step(step: GlobalBatchStep, x: torch.Tensor, ids: torch.Tensor, device: torch.device) -> float:
    """Seconds of one lazy step."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    loss = step.lazy(x, ids)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    assert torch.isfinite(loss), "the benchmark's loss is not finite"
    return time.perf_counter() - start


def timed(step: GlobalBatchStep, x: torch.Tensor, ids: torch.Tensor, steps: int, device: torch.device,
          modes: tuple[bool, ...] = (True,)) -> list[float]:
    """Median seconds of one lazy step for each ``overlap`` mode, the modes taking turns step by step (so that
    other work on the machine slows them alike), after one warm-up round."""
    times: list[list[float]] = [[] for _ in modes]
    for _ in range(steps + 1):
        for i, overlap in enumerate(modes):
            step.overlap = overlap
            times[i].append(one_step(step, x, ids, device))
    return [statistics.median(t[1:]) for t in times]


def worker(rank: int, world: int, args: argparse.Namespace, init: str, out: str) -> None:
    cuda = args.backend == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    torch.set_num_threads(args.threads)
    dist.init_process_group(args.backend, init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        step = build(world, device)
        x, ids = batch(args.batch, rank, world, device)
        step.lazy(x, ids)  # warm-up: the reducer's buckets are made in the first step
        counted = measure.count(lambda: step.lazy(x, ids))
        overlapped = step.reducer.launched_early if step.reducer is not None else 0
        # overlap=False is the baseline: one coalesced all-reduce after the backward
        seconds, coalesced = timed(step, x, ids, args.steps, device, modes=(True, False))
        if rank == 0:
            Path(out).write_text(json.dumps({
                "collectives": len(counted.collectives), "kinds": sorted(set(counted.collectives)),
                "bytes": counted.collective_bytes, "syncs": counted.syncs, "buckets_early": overlapped,
                "buckets": len(step.reducer.buckets) if step.reducer else 0, "seconds": seconds,
                "coalesced_seconds": coalesced}))
    finally:
        dist.destroy_process_group()


def cost_model(workers: int = 4, images_per_gpu: int = 128, tflops: float = 70.0, utilisation: float = 0.4,
               latency_ms: float = 0.1, collectives: int = 44) -> None:
    """The network time of a step on the AWS recipe (one A10G per g5.xlarge node, ``workers`` nodes; 10 Gbps burst,
    2.5 Gbps baseline) against its compute time, for the preset's per-GPU batch. Bytes on the wire per rank: a
    ring all-reduce of S bytes sends 2 (W - 1) / W S (the gradients, fp32, and the gather's backward), an
    all-gather of s bytes from each rank sends (W - 1) s (the embeddings); ``collectives`` x ``latency_ms`` for the
    small ones. Compute: the step's FLOPs (``torch.utils.flop_counter`` on this CPU) at ``tflops`` x
    ``utilisation``; the backward is 2/3 of it, and what the bucketed all-reduce can hide the gradients behind."""
    from torch.utils.flop_counter import FlopCounterMode

    step = build(1, torch.device("cpu"))
    x, ids = batch(images_per_gpu, 0, 1, torch.device("cpu"))
    with FlopCounterMode(display=False) as flops:
        step.lazy(x, ids)
    grads = sum(p.numel() * 4 for p in step.params)  # fp32 gradients
    rows, dim = 2 * images_per_gpu, step.model.embed_dim
    w = workers
    wire = 2 * (w - 1) / w * grads + (w - 1) * rows * dim * 4 + 2 * (w - 1) / w * w * rows * dim * 4  # bytes
    compute = flops.get_total_flops() / (tflops * 1e12 * utilisation)  # s
    backward = 2 / 3 * compute
    print(f"AWS recipe, {w} x g5.xlarge (1 A10G each), {BACKBONE} {IMAGE} px, {images_per_gpu} images "
          f"({rows} rows) per GPU; {flops.get_total_flops() / 1e9:.0f} GFLOP per GPU step, gradients "
          f"{grads / 1e6:.1f} MB, {wire / 1e6:.1f} MB on the wire per rank, {collectives} collectives x "
          f"{latency_ms} ms")
    print(f"compute at {tflops:g} TFLOPS x {utilisation:.0%}: {compute * 1e3:.0f} ms "
          f"(backward {backward * 1e3:.0f} ms)")
    for gbps in (10.0, 2.5):
        net = wire / (gbps * 1e9 / 8) + collectives * latency_ms / 1e3
        coalesced = compute + net
        overlapped = compute - backward + max(backward, net)
        hides = images_per_gpu * net / backward  # the backward grows with the batch, the gradients do not
        print(f"{gbps:g} Gbps: network {net * 1e3:.0f} ms; step {coalesced * 1e3:.0f} ms coalesced, "
              f"{overlapped * 1e3:.0f} ms overlapped; GPU busy {compute / overlapped:.0%}; the backward hides "
              f"the network from about {hides:.0f} images per GPU")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    ap.add_argument("--batch", type=int, default=64, help="global batch (images); each worker has half")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="threads per worker; one process gets 2x")
    ap.add_argument("--cost-model", action="store_true", help="print the AWS recipe's cost model and stop")
    args = ap.parse_args()
    if args.cost_model:
        cost_model()
        return
    world = 2
    device = torch.device("cuda", 0) if args.backend == "nccl" else torch.device("cpu")
    torch.set_num_threads(args.threads * world)
    alone = build(1, device)
    x, ids = batch(args.batch, 0, 1, device)
    (one,) = timed(alone, x, ids, args.steps, device)
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "rank0.json")
        mp.spawn(worker, args=(world, args, os.path.join(tmp, "init"), result), nprocs=world, join=True)
        r = json.loads(Path(result).read_text())
    print(f"{BACKBONE} {IMAGE} px, global batch {args.batch}, {world} {args.backend} workers x {args.threads} "
          f"thread(s); one process {world * args.threads} threads")
    print(f"collectives per step: {r['collectives']}")
    print(f"bytes per step: {r['bytes']}")
    print(f"host syncs per step: {len(r['syncs'])}")
    print(f"gradient all-reduce overlapped: {'yes' if r['buckets_early'] else 'no'}")
    print(f"step time {world} workers / 1 process at the same global batch: {r['seconds'] / one:.2f}")
    print(f"  (collectives: {', '.join(r['kinds'])}; gradient buckets {r['buckets']}, {r['buckets_early']} started "
          f"during the backward; step {r['seconds'] * 1e3:.0f} ms overlapped, {r['coalesced_seconds'] * 1e3:.0f} ms "
          f"coalesced (ratio {r['seconds'] / r['coalesced_seconds']:.2f}), one process {one * 1e3:.0f} ms)")
    if r["syncs"]:
        print(f"  host syncs: {', '.join(r['syncs'])}")


if __name__ == "__main__":
    main()
