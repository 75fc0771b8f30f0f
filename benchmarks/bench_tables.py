"""What the tables job costs: ``transfusion tables`` (Ray Tune, a trial per (row, seed), MLflow) against the same rows
trained and probed in one process without Ray or MLflow.

Both run the same (row, seed) trials on the same Fashion-MNIST subset, one after the other in one run of this script,
with the same torch threads:

- **one process**: for each trial, ``pipeline.training.loop.PretrainLoop`` (the loop a tables trial runs: online
  kNN and health every epoch, no checkpoint) on the row's params with the seed, then
  ``pipeline.evaluation.evaluate.probe_frozen`` (the trial's probes); the controls the same way, untrained;
- **tables job**: :func:`pipeline.runs.tables.run_tables` as ``transfusion tables`` calls it, with MLflow tracking
  (a sqlite store in a temporary folder): Ray's start, Tune, each trial's checkpoints and reports, the MLflow runs.

It prints both wall times and ``tables job / one process: R``. The default (2 rows x 1 seed and the random-init
control, 10,000 images, 2 epochs) takes a few minutes on 2 cores.

    python benchmarks/bench_tables.py
    python benchmarks/bench_tables.py --epochs 3 -S 'tables.seeds=[0, 1]'
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from pipeline.config.params import Params, load_params

ROOT = Path(__file__).resolve().parents[1]
ROWS = ("tables.rows=[{name: TransFusion 1-Layer, table: 1, params: {loss.name: jsd, model.depth: 1}}, "
        "{name: InfoNCE, table: 1, params: {loss.name: infonce, model.depth: 0}}]")


def one_process(params: Params, data, device: torch.device) -> float:
    """Every (row, seed) trial of the job (and its controls) trained and probed in this process; wall seconds."""
    from pipeline.core.model import build_model
    from pipeline.evaluation.evaluate import probe_frozen
    from pipeline.evaluation.tables_rows import resolve_rows, trial_configs
    from pipeline.training.loop import PretrainLoop

    start = time.perf_counter()
    rows = {r.index: r for r in resolve_rows(params)}
    for config in trial_configs(params, list(rows.values())):
        if config["control"]:
            p = params.model_copy(update={"train": params.train.model_copy(update={"seed": config["seed"]})})
            torch.manual_seed(config["seed"])
            model = None if config["control"] == "raw_pixels" else build_model(p.model, data.input_shape)
            probe_frozen(p, data, model)
            continue
        p = rows[config["index"]].params
        p = p.model_copy(update={"train": p.train.model_copy(update={"seed": config["seed"]})})
        loop = PretrainLoop(p, data, device)
        loop.fit(lambda m, ckpt: None)
        probe_frozen(p, data, loop.model)
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default="/usr/share/datasets/fashion-mnist", help="Fashion-MNIST's IDX files")
    ap.add_argument("--limit-train", type=int, default=10_000, help="0: all 60,000")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("-S", dest="overrides", action="append", default=[], help="more params overrides")
    args = ap.parse_args()
    from pipeline.config.ray import TRIAL_CPU, torch_threads
    from pipeline.data.prepared import load_prepared, save_prepared
    from pipeline.data.sources import load_dataset
    from pipeline.runs.cluster import with_worker_cpus
    from pipeline.runs.job import cleanup
    from pipeline.runs.tables import run_tables

    params = load_params(ROOT / "presets/fashion-mnist-ssl.yaml", [
        f"data.root={args.root}", f"data.limit_train={args.limit_train or 'null'}", f"train.epochs={args.epochs}",
        "tables.seeds=[0]", "tables.controls=[random_init]", ROWS, *args.overrides])
    threads = torch_threads(with_worker_cpus(params, TRIAL_CPU).ray.cpus_per_worker)  # what a trial's worker uses
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        save_prepared(load_dataset(params.data), tmp / "data/prepared")
        data = load_prepared(tmp / "data/prepared")
        plain = one_process(params, data, torch.device("cpu"))
        os.chdir(tmp)  # MLflow's sqlite store and Ray's storage live here
        params = params.model_copy(update={"ray": params.ray.model_copy(update={"storage_path": str(tmp / "r")})})
        start = time.perf_counter()
        result, _ = run_tables(params, tmp / "data/prepared", tmp, tracking=True)
        job = time.perf_counter() - start
        cleanup(params, tmp, result.job.name, result.trial_runs())
        os.chdir(ROOT)
    n = len(data.train.y)
    print(f"CPU, {threads} thread(s): Fashion-MNIST {n:,} images, {len(result.rows)} trials "
          f"({', '.join(sorted({r['name'] for r in result.rows}))}), {args.epochs} epochs")
    print(f"  one process: {plain:7.1f} s")
    print(f"  tables job (Ray Tune, MLflow): {job:7.1f} s (Tune's run of the trials: {result.seconds:.1f} s)")
    print(f"tables job / one process: {job / plain:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
