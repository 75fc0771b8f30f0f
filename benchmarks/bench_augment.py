"""Throughput of the batched augmentation vs a per-sample torchvision.transforms.v2 pipeline.

Both run on the same batch of random RGB images in the same process, with ``torch.set_num_threads`` as given.
Prints e.g.::

    augment simclr 1024x3x32x32: vectorized 15800 img/s, torchvision-v2 per-sample 1010 img/s, ratio 15.6x

Usage: ``PYTHONPATH=. python benchmarks/bench_augment.py --batch-size 1024 --repeats 10 --threads 2``
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from pipeline.data.augment import PRESETS, BatchAugment


def torchvision_per_sample(preset: str, strength: float, size: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The same recipe with torchvision.transforms.v2 applied image by image: (B, C, H, W) -> (B, C, H, W)."""
    from torchvision.transforms import v2

    r = PRESETS[preset].scaled(strength)
    b, c, s, h = r.jitter
    steps: list[torch.nn.Module] = []
    if r.crop_scale_min < 1.0:
        steps.append(v2.RandomResizedCrop(size, scale=(r.crop_scale_min, 1.0), antialias=True))
    if r.flip_p > 0:
        steps.append(v2.RandomHorizontalFlip(p=r.flip_p))
    if r.jitter_p > 0:
        jitter = v2.ColorJitter(brightness=b, contrast=c, saturation=s, hue=h)
        steps.append(v2.RandomApply([jitter], p=r.jitter_p))
    if r.grayscale_p > 0:
        steps.append(v2.RandomGrayscale(p=r.grayscale_p))
    pipeline = v2.Compose(steps)

    def run(x: torch.Tensor) -> torch.Tensor:
        return torch.stack([pipeline(img) for img in x])

    return run


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def time_interleaved(
    fast: Callable[[], object],
    slow: Callable[[], object],
    rounds: int,
    fast_per_round: int,
    device: torch.device,
) -> tuple[float, float]:
    """Median wall times (s) of ``fast`` and ``slow``, timed in alternating rounds after one warm-up each.

    Interleaving keeps the ratio meaningful when the machine's load drifts during the run.
    """
    fast()
    slow()
    fast_times, slow_times = [], []
    for _ in range(rounds):
        fast_times += [_timed(fast, device) for _ in range(fast_per_round)]
        slow_times.append(_timed(slow, device))
    return statistics.median(fast_times), statistics.median(slow_times)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--size", type=int, default=32, help="image height = width")
    parser.add_argument("--repeats", type=int, default=5, help="timed vectorized calls per round")
    parser.add_argument("--baseline-repeats", type=int, default=3, help="rounds = timed baseline calls")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--preset", default="simclr", choices=sorted(PRESETS))
    parser.add_argument("--strength", type=float, default=1.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    x = torch.rand(args.batch_size, 3, args.size, args.size, generator=gen, device=device)  # (B, 3, S, S)

    augment = BatchAugment(args.preset, args.strength)
    torch.manual_seed(args.seed)
    baseline = torchvision_per_sample(args.preset, args.strength, args.size)
    vec_s, tv_s = time_interleaved(
        lambda: augment(x, gen), lambda: baseline(x), args.baseline_repeats, args.repeats, device
    )

    vec_ips, tv_ips = args.batch_size / vec_s, args.batch_size / tv_s
    shape = f"{args.batch_size}x3x{args.size}x{args.size}"
    print(
        f"augment {args.preset} {shape}: vectorized {vec_ips:.0f} img/s, "
        f"torchvision-v2 per-sample {tv_ips:.0f} img/s, ratio {vec_ips / tv_ips:.1f}x "
        f"(threads={args.threads}, device={device.type}, strength={args.strength}, "
        f"load avg {os.getloadavg()[0]:.1f})"
    )
    return {"vectorized_img_per_s": vec_ips, "torchvision_img_per_s": tv_ips}


if __name__ == "__main__":
    main()
