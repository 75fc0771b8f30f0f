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
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.config.model import ModelConfig  # noqa: E402
from pipeline.core.batchnorm import convert_batchnorm  # noqa: E402
from pipeline.core.losses import make_loss  # noqa: E402
from pipeline.core.model import build_model  # noqa: E402
from pipeline.training import measure  # noqa: E402
from pipeline.training.step import GlobalBatchStep  # noqa: E402

BACKBONE, IMAGE = "resnet18_cifar", 32


def build(world: int, device: torch.device, backbone: str = BACKBONE) -> GlobalBatchStep:
    torch.manual_seed(0)
    embed = None if backbone.startswith("resnet") else 64
    model = build_model(ModelConfig(backbone=backbone, depth=1, embed_dim=embed), (3, IMAGE, IMAGE)).to(device)
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


class _BackwardTrace(TorchDispatchMode):
    """Inside a ``FlopCounterMode``: the FLOPs done so far at each BatchNorm backward (where global BN issues its
    all-reduce) and at each gradient bucket's readiness (``marks``, filled by the buckets' hooks)."""

    def __init__(self, flops) -> None:
        super().__init__()
        self.flops = flops
        self.bn_backward: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ("native_batch_norm_backward", "cudnn_batch_norm_backward"):
            self.bn_backward.append(self.flops.get_total_flops())
        return func(*args, **(kwargs or {}))


def backward_trace(images_per_gpu: int, backbone: str = BACKBONE) -> tuple[int, int, list[int], list[int], int]:
    """One step of the recipe's model on this CPU: (total FLOPs, FLOPs at the start of the backward, FLOPs done when
    each gradient bucket of ``comm.BUCKET_MB`` is ready, FLOPs done at each BatchNorm backward, gradient bytes)."""
    from torch.utils.flop_counter import FlopCounterMode

    from pipeline.training.comm import buckets_of

    step = build(1, torch.device("cpu"), backbone)
    x, ids = batch(images_per_gpu, 0, 1, torch.device("cpu"))
    ready: list[int] = []
    handles = []
    with FlopCounterMode(display=False) as flops:
        for bucket in buckets_of(step.params):
            left = {id(p) for p in bucket}

            def hook(p, left=left):
                left.discard(id(p))
                if not left:
                    ready.append(flops.get_total_flops())

            handles += [p.register_post_accumulate_grad_hook(hook) for p in bucket]
        with _BackwardTrace(flops) as trace:
            z = step.model.encode(x)
            loss = step._head_loss(z, ids, 1, 0)  # noqa: SLF001 (the head alone, as the step computes it)
            start = flops.get_total_flops()
            loss.backward()
    for h in handles:
        h.remove()
    grads = sum(p.numel() * 4 for p in step.params)  # fp32 gradients
    return flops.get_total_flops(), start, ready, trace.bn_backward, grads


def cost_model(workers: int = 4, images_per_gpu: int = 128, tflops: float = 70.0, utilisation: float = 0.4,
               latency_ms: float = 0.1, collectives: int = 44) -> None:
    """The network time of a step on the AWS recipe (one A10G per g5.xlarge node, ``workers`` nodes; 10 Gbps burst,
    2.5 Gbps baseline) against its compute time, for the preset's per-GPU batch. Bytes on the wire per rank: a
    ring all-reduce of S bytes sends 2 (W - 1) / W S (the gradients, fp32, and the gather's backward), an
    all-gather of s bytes from each rank sends (W - 1) s (the embeddings); ``collectives`` x ``latency_ms`` for the
    small ones. Compute: the step's FLOPs (``torch.utils.flop_counter`` on this CPU) at ``tflops`` x
    ``utilisation``.

    What the gradient buckets can hide, two ways:

    - one stream per kind (gloo, whose collectives of one group do not wait for each other; the old model's
      assumption): the backward compute after the first bucket is ready;
    - NCCL: global BN's collectives, the embeddings' gathers and the gradient buckets use one communicator, so one
      stream, and run in the order they were issued. Each BN layer's backward all-reduce waits for the buckets
      launched before it, and the backward waits for that all-reduce. A bucket hides only the backward compute
      between its launch and the next BatchNorm backward (counted in FLOPs on this CPU); the forward's BN
      gathers and the embeddings' gather and its backward come before any bucket is launched, and wait for none.
    """
    total, start, ready, bn_backward, grads = backward_trace(images_per_gpu)
    rows, dim = 2 * images_per_gpu, build(1, torch.device("cpu")).model.embed_dim
    w = workers
    wire = 2 * (w - 1) / w * grads + (w - 1) * rows * dim * 4 + 2 * (w - 1) / w * w * rows * dim * 4  # bytes
    rate = tflops * 1e12 * utilisation  # FLOP/s
    compute = total / rate  # s
    backward = (total - start) / rate
    gloo_hidden = (total - min(ready)) / rate  # behind the buckets, collectives not waiting for one another
    nccl_hidden = sum(min([b for b in bn_backward if b >= r] + [total]) - r for r in ready) / rate
    print(f"AWS recipe, {w} x g5.xlarge (1 A10G each), {BACKBONE} {IMAGE} px, {images_per_gpu} images "
          f"({rows} rows) per GPU; {total / 1e9:.0f} GFLOP per GPU step, gradients "
          f"{grads / 1e6:.1f} MB in {len(ready)} buckets, {wire / 1e6:.1f} MB on the wire per rank, {collectives} "
          f"collectives x {latency_ms} ms")
    print(f"compute at {tflops:g} TFLOPS x {utilisation:.0%}: {compute * 1e3:.0f} ms (backward {backward * 1e3:.0f} "
          f"ms; after the first bucket is ready {gloo_hidden * 1e3:.1f} ms; between a bucket's launch and the next "
          f"BatchNorm backward {nccl_hidden * 1e3:.2f} ms, over {len(bn_backward)} BatchNorm backwards)")
    for gbps in (10.0, 2.5):
        net = wire / (gbps * 1e9 / 8) + collectives * latency_ms / 1e3
        coalesced = compute + net
        gloo = compute + net - min(gloo_hidden, net)
        nccl = compute + net - min(nccl_hidden, net)
        hides = images_per_gpu * net / gloo_hidden  # the backward grows with the batch, the gradients do not
        print(f"{gbps:g} Gbps: network {net * 1e3:.0f} ms; step {coalesced * 1e3:.0f} ms coalesced, "
              f"{gloo * 1e3:.0f} ms overlapped with one stream per kind (GPU busy {compute / gloo:.0%}; the backward "
              f"hides the network from about {hides:.0f} images per GPU), {nccl * 1e3:.0f} ms on NCCL (GPU busy "
              f"{compute / nccl:.0%})")


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
