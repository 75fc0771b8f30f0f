"""Ray overhead: steady-state samples/s of the pretrain stage on Ray Train (1 worker) vs a bare PyTorch loop.

Both run the same ``PretrainLoop`` (model, batch, augmentation, step) with the same thread count, in one
run of this script. Throughput is wall-clock between the ends of the first and the last epoch, so the
Ray side pays for everything the stage does per epoch (report barrier, checkpoint every epoch, MLflow off).

    python benchmarks/bench_ray_overhead.py --epochs 8
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from pipeline.config.params import load_params
from pipeline.data.prepared import load_prepared, save_prepared
from pipeline.data.sources import load_dataset
from pipeline.runs.job import cleanup
from pipeline.runs.train import pretrain
from pipeline.training.loop import PretrainLoop

ROOT = Path(__file__).resolve().parents[1]


def steady_throughput(history: list[dict], batch: int, steps: int) -> float:
    ends = [h["ended_at"] for h in history]
    return (len(ends) - 1) * steps * batch / (ends[-1] - ends[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch threads = ray.cpus_per_worker")
    ap.add_argument("-S", dest="overrides", action="append", default=[], help="extra param overrides")
    args = ap.parse_args()
    overrides = [f"train.epochs={args.epochs}", "train.knn_every=0", "train.checkpoint_every=1",
                 f"ray.cpus_per_worker={float(args.threads)}", "ray.num_workers=1", *args.overrides]
    params = load_params(ROOT / "params.yaml", overrides)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        d = params.data
        save_prepared(load_dataset(d), tmp / "prepared")
        data = load_prepared(tmp / "prepared")

        torch.set_num_threads(args.threads)
        loop = PretrainLoop(params, data, torch.device("cpu"))
        bare: list[dict] = []
        loop.fit(lambda m, ckpt: bare.append(m.as_dict()))
        bare_sps = steady_throughput(bare, params.train.batch_size, loop.steps_per_epoch)

        params_ray = params.model_copy(update={"ray": params.ray.model_copy(update={"storage_path": str(tmp / "ray")})})
        res = pretrain(params_ray, tmp / "prepared", tmp, tracking=False)
        ray_sps = steady_throughput(res.state.history, params.train.batch_size, loop.steps_per_epoch)
        cleanup(params_ray, tmp, res.job.name)

    step_bare = statistics.median(h["samples_per_s"] for h in bare[1:])
    step_ray = statistics.median(h["samples_per_s"] for h in res.state.history[1:])
    print(f"ray overhead ({params.model.backbone}, depth {params.model.depth}, batch {params.train.batch_size}, "
          f"{args.threads} thread(s), {args.epochs} epochs, checkpoint every epoch):")
    print(f"  steady wall-clock: bare PyTorch {bare_sps:,.0f} samples/s, Ray Train 1 worker {ray_sps:,.0f} "
          f"samples/s, ratio {ray_sps / bare_sps:.3f}")
    print(f"  training steps only (median epoch): bare {step_bare:,.0f}, Ray {step_ray:,.0f}, "
          f"ratio {step_ray / step_bare:.3f}")


if __name__ == "__main__":
    main()
