"""Gradient caching: peak memory of one global-batch step with and without chunks (same gradients).

Each configuration runs in a fresh subprocess and reports its peak resident memory above the baseline
of a process that built the model and the batch but took no step.

    python benchmarks/bench_grad_cache_memory.py --batch 2048 --chunks 0 512 128
"""

from __future__ import annotations

import argparse
import subprocess
import sys

CHILD = r"""
import resource, sys, torch
from pipeline.core.backbones import build_backbone
from pipeline.core.losses import make_loss
from pipeline.core.model import TransFusion, TransFusionHead
from pipeline.training.step import GlobalBatchStep
batch, chunk, step = int(sys.argv[1]), int(sys.argv[2]) or None, sys.argv[3] == "1"
torch.manual_seed(0)
bb, dim = build_backbone("cnn_small", (3, 32, 32), embed_dim=128)
model = TransFusion(bb, dim, TransFusionHead(dim, 3))
x = torch.rand(2 * batch, 3, 32, 32)
ids = torch.arange(batch).repeat(2)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if step:
    GlobalBatchStep(model, make_loss("jsd"), grad_cache_chunk=chunk)(x, ids)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


def peak_kib(batch: int, chunk: int, step: bool) -> int:
    out = subprocess.run([sys.executable, "-c", CHILD, str(batch), str(chunk), "1" if step else "0"],
                         capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2048, help="images; the step sees 2x views")
    ap.add_argument("--chunks", type=int, nargs="+", default=[0, 512, 128], help="0 = no gradient caching")
    args = ap.parse_args()
    rows = [(c, peak_kib(args.batch, c, True)) for c in args.chunks]
    plain = rows[0][1] if rows[0][0] == 0 else None
    print(f"grad cache memory (cnn_small 3x32x32, depth 3, {2 * args.batch} views in one step):")
    for chunk, kib in rows:
        label = "no caching" if chunk == 0 else f"chunk {chunk}"
        ratio = f", {kib / plain:.2f} of no caching" if plain else ""
        print(f"  {label:>12}: peak +{kib / 1024:,.0f} MiB{ratio}")


if __name__ == "__main__":
    main()
