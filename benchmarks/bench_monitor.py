"""What the pretraining loop's per-epoch work costs against the epoch's own steps, in one process (no Ray, no MLflow).

``benchmarks/bench_pipeline.py``'s data and params (Fashion-MNIST, 10,000 images, batch 256, 2 torch threads): one
epoch of :class:`pipeline.training.loop.PretrainLoop` is trained, then each piece of the work between two epochs is
timed on its own (the best of ``--repeats``): the online kNN monitor (``PretrainLoop.knn``: 5,000 bank + 2,000 query
forwards of the backbone), the blocks' health (``PretrainLoop.health``: one global batch, two views) and the checkpoint
as the Ray worker writes it (``torch.save`` of the loop's state, the history as JSON). Each is printed in seconds and as
a share of the epoch's steps: the least that ``pipeline / plain loop`` can be (with ``train.knn_every: 1``) before Ray's
start and stop.

    python benchmarks/bench_monitor.py          # about 2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pipeline.config.params import load_params
from pipeline.data.prepared import load_prepared, save_prepared
from pipeline.data.sources import load_dataset
from pipeline.training.loop import PretrainLoop

ROOT = Path(__file__).resolve().parents[1]


def best(f: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(wall, CPU) seconds of ``f``, the best of ``repeats`` calls (CPU: this process, all threads)."""
    runs = []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        f()
        runs.append((time.perf_counter() - wall, time.process_time() - cpu))
    return min(r[0] for r in runs), min(r[1] for r in runs)


def checkpoint(loop: PretrainLoop, folder: Path) -> None:
    """What rank 0 writes on a checkpoint epoch: the loop's state and its history."""
    torch.save(loop.state_dict(), folder / "state.pt")
    (folder / "history.json").write_text(json.dumps(loop.history))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default="/usr/share/datasets/fashion-mnist", help="Fashion-MNIST's IDX files")
    ap.add_argument("--limit-train", type=int, default=10_000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    params = load_params(ROOT / "params.yaml", [
        "data.dataset=fashion_mnist", f"data.root={args.root}", f"data.limit_train={args.limit_train}",
        "data.limit_test=2000", "train.batch_size=256", "train.epochs=6", "train.device=cpu"])
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        save_prepared(load_dataset(params.data), tmp / "prepared")
        loop = PretrainLoop(params, load_prepared(tmp / "prepared"), torch.device("cpu"))
        epoch = loop.train_epoch()  # its steps' wall seconds in .seconds (the kNN and health after them not counted)
        loop.history.append(epoch.as_dict())
        pieces = {"online kNN (7,000 forwards)": best(loop.knn, args.repeats),
                  "health (one global batch, 2 views)": best(loop.health, args.repeats),
                  "checkpoint (state + history)": best(lambda: checkpoint(loop, tmp), args.repeats)}
    print(f"CPU, {args.threads} thread(s): one epoch of {loop.steps_per_epoch} steps: {epoch.seconds:.1f} s")
    for name, (wall, cpu) in pieces.items():
        print(f"  {name}: {wall:.2f} s wall, {cpu:.2f} s CPU, {wall / epoch.seconds:.1%} of the epoch's steps")
    total = sum(wall for wall, _ in pieces.values())
    print(f"per-epoch work / the epoch's steps: {total / epoch.seconds:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
