"""What channels-last, ``torch.compile`` and a cheaper first layer buy for ``cnn_small`` on Fashion-MNIST's 28×28.

One training step as the pipeline runs it (two views of a 256-image batch through the backbone, the TransFusion
head at depth 1, the ``jsd`` loss, backward, Adam), timed on random 28×28 images after warm-up steps; each variant
prints its median step time and its ratio to the eager, channels-first step measured in the same run:

- ``channels_last``: the model and the inputs in ``torch.channels_last``;
- ``compile``: ``torch.compile`` of the model (inductor; its compile time is printed apart);
- ``strided``: the first convolution with stride 2 (the rest of the network runs on 14×14: a different model);
- ``narrow``: widths 16/32/64 instead of 32/64/128 (a different model).

    python benchmarks/bench_backbone.py                  # the CPU, 2 threads
    python benchmarks/bench_backbone.py --device cuda    # a GPU (bf16 autocast, as the pipeline's auto precision)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_pipeline import plain_step
from torch import nn

from pipeline.config.model import ModelConfig
from pipeline.core.losses import make_loss
from pipeline.core.model import build_model


def variant(name: str) -> nn.Module:
    model = build_model(ModelConfig(backbone="cnn_small", embed_dim=128, depth=1, qk_init="identity"), (1, 28, 28))
    net = model.backbone
    if name == "strided":
        first = net[0]
        net[0] = nn.Conv2d(first.in_channels, first.out_channels, 3, stride=2, padding=1)
    if name == "narrow":
        widths = {32: 16, 64: 32, 128: 64}
        for i, layer in enumerate(net):
            if isinstance(layer, nn.Conv2d):
                net[i] = nn.Conv2d(widths.get(layer.in_channels, layer.in_channels), widths[layer.out_channels], 3,
                                   padding=1)
            elif isinstance(layer, nn.GroupNorm):
                net[i] = nn.GroupNorm(8, widths[layer.num_channels])
            elif isinstance(layer, nn.Linear):
                net[i] = nn.Linear(64, layer.out_features)
    return model


def step_time(name: str, device: torch.device, steps: int, batch: int) -> tuple[float, float]:
    """(median seconds of a step, seconds of the first step: compile time where there is one)."""
    torch.manual_seed(0)
    model = variant(name).to(device)
    memory = torch.channels_last if name == "channels_last" else torch.contiguous_format
    model = model.to(memory_format=memory)
    run = torch.compile(model) if name == "compile" else model
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = make_loss("jsd")
    x = torch.rand(2 * batch, 1, 28, 28, device=device).contiguous(memory_format=memory)  # (2b, 1, 28, 28)
    ids = torch.arange(batch, device=device).repeat(2)
    autocast = torch.bfloat16 if device.type == "cuda" else None
    times = []
    for _ in range(steps + 3):
        t = time.perf_counter()
        plain_step(run, opt, loss_fn, x, ids, autocast)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times[3:]), times[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--variants", nargs="+", default=["eager", "channels_last", "compile", "strided", "narrow"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {args.threads} thread(s)"
    print(f"{name}, torch {torch.__version__}: cnn_small + depth-1 head + jsd, 2 x {args.batch} images of 28x28, "
          f"median of {args.steps} steps")
    base = None
    for v in args.variants:
        seconds, first = step_time(v, device, args.steps, args.batch)
        base = base or seconds
        print(f"  {v:14s} {seconds * 1e3:8.1f} ms a step, {2 * args.batch / seconds:8,.0f} views/s, "
              f"ratio to eager {seconds / base:.2f} (first step {first:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
