"""Loss speed and memory: forward + backward of every loss vs an NT-Xent baseline written like lightly's.

The baseline is lightly's ``NTXentLoss`` reduced to its computation: ``F.cross_entropy`` over the 2N × 2N
logits ``normalize(z) normalize(z)ᵀ / τ`` with the diagonal masked, measured in the same run. Every loss gets
q = k = z (2N, d) requiring grad (the default head) and the self-supervised ids. Time: ``--repeats`` rounds
after one warm-up, each round running every loss once in turn, so that other jobs on the machine slow the
baseline and the losses alike; the table gives the median ms and the median of the per-round ratios, and
the fastest round of each (the least disturbed) with its ratio to the fastest baseline round. Peak
memory: the highest running total of the CPU allocator's allocations minus frees during one forward +
backward (``torch.profiler`` with ``profile_memory=True``), in n×n fp32 buffers (n = 2N); z is allocated
before and not counted, its gradient is.

    python benchmarks/bench_loss.py                          # n = 2 x 2048 and 2 x 8192, d = 128, 2 threads
    python benchmarks/bench_loss.py --n 4096 --reference     # also the pre-fusion jsd / jsd_appendix_e
    python benchmarks/bench_loss.py --n 4096 --tile 256 --layout two_view --threads 1   # also column-tiled
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

# the profiler's own lines: kineto prints the levels >= KINETO_LOG_LEVEL, and torch 2.15's prints "profiler_start" /
# "profiler_stop" at level 5 ("USDT"): 6 keeps them off the table
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from pipeline.core.losses import LOSS_NAMES, make_loss
from pipeline.core.targets import self_supervised_ids  # noqa: E402
from pipeline.training import measure  # noqa: E402

TEMPERATURE = 0.1
REFERENCE_MAX_N = 8192  # --reference only up to here: 14 n x n fp32 buffers are 3.5 GiB at 8192


def nt_xent_baseline(z: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """lightly's NT-Xent without the bookkeeping: cross-entropy over the masked 2N × 2N logits."""
    n = z.shape[0]
    unit = F.normalize(z, dim=1)
    logits = unit @ unit.T / TEMPERATURE  # (2N, 2N)
    logits = logits.masked_fill(torch.eye(n, dtype=torch.bool), float("-inf"))  # no self-similarity
    labels = torch.cat([torch.arange(n // 2, n), torch.arange(n // 2)])  # the other view
    return F.cross_entropy(logits, labels)


def loss_fns(
    reference: bool, tile: int | None = None, layout: str | None = None
) -> dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    fns: dict[str, Callable] = {"nt_xent (baseline)": nt_xent_baseline}
    for name in LOSS_NAMES:
        fn = make_loss(name, temperature=TEMPERATURE)
        fns[name] = lambda z, ids, fn=fn: fn(z, z, ids, layout=layout)
        if tile is not None and name != "barlow_twins":  # each pairwise loss also in tiles of `tile` columns
            fns[f"{name} (tile {tile})"] = lambda z, ids, fn=fn: fn(z, z, ids, layout=layout, tile=tile)
    if reference:  # the implementation before fusion, kept as the tests' reference
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.core.test_losses import reference_jsd, reference_jsd_appendix_e

        fns["jsd (pre-fusion)"] = lambda z, ids: reference_jsd(z, z, ids)
        fns["jsd_appendix_e (pre-fusion)"] = lambda z, ids: reference_jsd_appendix_e(z, z, ids)
    return fns


def step(fn: Callable, z: torch.Tensor, ids: torch.Tensor) -> None:
    loss = fn(z, ids)
    (grad,) = torch.autograd.grad(loss, z)
    if not torch.isfinite(grad).all():
        raise RuntimeError("non-finite gradient")


def time_rounds(fns: dict[str, Callable], z: torch.Tensor, ids: torch.Tensor, repeats: int) -> dict[str, list]:
    """Seconds of each loss in each of ``repeats`` rounds; a round runs every loss once, in turn, so that a
    load change on a shared machine hits the baseline and the losses alike."""
    for fn in fns.values():
        step(fn, z, ids)  # warm-up
    times: dict[str, list] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            step(fn, z, ids)
            times[name].append(time.perf_counter() - t)
    return times


def peak_bytes(fn: Callable, z: torch.Tensor, ids: torch.Tensor) -> int:
    """Highest running total of allocations minus frees of one forward + backward (CPU allocator)."""
    return measure.peak_bytes(lambda: step(fn, z, ids))


def run(n: int, d: int, repeats: int, reference: bool, tile: int | None = None, layout: str | None = None) -> None:
    torch.manual_seed(0)
    z = torch.randn(n, d, requires_grad=True)
    ids = self_supervised_ids(n // 2)
    fns = loss_fns(reference and n <= REFERENCE_MAX_N, tile, layout)  # the pre-fusion jsd needs ~14 n x n buffers
    ours = make_loss("infonce", temperature=TEMPERATURE)(z, z, ids)
    torch.testing.assert_close(ours, nt_xent_baseline(z, ids), rtol=1e-5, atol=1e-5)  # the same loss
    buffer = n * n * 4
    times = time_rounds(fns, z, ids, repeats)
    base = times[next(iter(fns))]
    print(f"\nforward + backward, n = {n} rows (2 x {n // 2}), d = {d}, {torch.get_num_threads()} threads, "
          f"layout {layout}, {repeats} interleaved rounds (median; min); peak memory in n x n fp32 buffers "
          f"({buffer / 2**20:,.0f} MiB each)")
    print(f"  {'loss':<28} {'ms':>9} {'vs NT-Xent':>11}   {'min ms':>9} {'min vs min':>11} {'peak mem':>9}")
    for name, fn in fns.items():
        ratio = statistics.median(t / b for t, b in zip(times[name], base, strict=True))
        best = min(times[name])
        mem = peak_bytes(fn, z, ids) / buffer
        print(f"  {name:<28} {1e3 * statistics.median(times[name]):9.1f} {ratio:10.2f}x   {1e3 * best:9.1f} "
              f"{best / min(base):10.2f}x {mem:9.2f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[4096, 16384], help="total rows 2N (two views)")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reference", action="store_true", help="also time the pre-fusion jsd (slow; n <= 8192 only)")
    ap.add_argument("--tile", type=int, default=None, help="also every pairwise loss in column tiles of this size")
    ap.add_argument("--layout", choices=["two_view"], default=None, help="the losses' layout (default: None)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for n in args.n:
        run(n, args.d, args.repeats, args.reference, args.tile, args.layout)


if __name__ == "__main__":
    main()
