"""Head efficiency: achieved FLOP/s of a TransFusion head (forward + backward) vs plain torch.matmul.

FLOPs counted per block on a batch of n samples of width d (multiply-add = 2 FLOPs)::

    forward  = 3 projections 3·2nd² + affinity QKᵀ 2n²d + fusion AV 2n²d = 6nd² + 4n²d
    backward = 2 × forward  (each matmul has two gradient matmuls)

The baseline is torch.matmul on the same shapes ((n,d)·(d,n) and (n,n)·(n,d)), measured in the same run.

    python benchmarks/bench_head_flops.py --n 4096 --d 512 --depth 9
"""

from __future__ import annotations

import argparse

import torch

from pipeline.core.model import TransFusionHead
from pipeline.training.measure import best_time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--depth", type=int, default=9)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n, d = args.n, args.d
    torch.manual_seed(0)

    head = TransFusionHead(d, args.depth)
    x = torch.randn(n, d, requires_grad=True)

    def head_step() -> None:
        head.zero_grad(set_to_none=True)
        out = head(x)
        out.embedding.square().mean().backward()

    flops_head = 3 * args.depth * (6 * n * d * d + 4 * n * n * d)
    t_head = best_time(head_step, args.repeats)

    a, b = torch.randn(n, d), torch.randn(d, n)
    s, v = torch.randn(n, n), torch.randn(n, d)

    def mm() -> None:
        torch.matmul(a, b)
        torch.matmul(s, v)

    t_mm = best_time(mm, args.repeats * 3)
    flops_mm = 2 * n * d * n + 2 * n * n * d
    head_rate, mm_rate = flops_head / t_head, flops_mm / t_mm
    print(f"head efficiency (n={n}, d={d}, depth {args.depth}, fwd+bwd, {args.threads} threads): "
          f"head {head_rate / 1e9:.1f} GFLOP/s ({t_head:.2f} s/step), matmul {mm_rate / 1e9:.1f} GFLOP/s, "
          f"ratio {head_rate / mm_rate:.3f}")


if __name__ == "__main__":
    main()
