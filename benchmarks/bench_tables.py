"""What the tables job costs: ``transfusion tables`` (Ray Tune, a tuning phase, a trial per (row, seed), MLflow)
against the same trials in one process without Ray or MLflow.

Both run the same trials on the same Fashion-MNIST subset, one after the other in one run of this script, with the
same torch threads: the tuning phase (the TransFusion row searches ``loss.power`` over 2 points, 1 epoch each, scored
on the validation split) and then the final (row, seed) trials with the chosen point:

- **one process**: each tuning trial by ``pipeline.training.rows.train_row`` on its params as the job seeds them
  (``PretrainLoop``, the loop a one-worker trial runs: online kNN and health every epoch, no checkpoint), the choice by
  the job's own rule (``chosen_points``), then each final trial by ``train_and_probe`` (the loop, then the trial's
  probes); the controls the same way, untrained;
- **tables job**: :func:`pipeline.runs.tables.run_tables` as ``transfusion tables`` calls it, with MLflow tracking
  (a sqlite store in a temporary folder): Ray's start, Tune, each trial's checkpoints and reports, the MLflow runs.

It prints both wall times, ``tables job / one process: R``, and where the job's extra time goes: before Tune (Ray's
start, MLflow, the staged data), the trials' training and probes as the trials timed them, and the rest (trial
starts, checkpoints, Tune's and MLflow's bookkeeping). A shared 2-core machine drifts by ~10 % between two runs of
the same work, as much as the overhead itself: ``--repeat N`` runs the pair N times, alternating, and the ratio is the
fastest job over the fastest single process (as ``timeit`` takes the best of its runs). The default (2 rows x 1 seed
and the random-init control, 10,000 images, 2 epochs, 3 repeats) takes about 25 minutes on 2 cores.

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
ROWS = ("tables.rows=[{name: TransFusion 1-Layer, table: 1, params: {loss.name: jsd, model.depth: 1}, "
        "space: {loss.power: [4, 16]}}, {name: InfoNCE, table: 1, params: {loss.name: infonce, model.depth: 0}}]")
TUNING = "tables.tuning={trials: 2, epochs: 1, seed: 0}"  # the same budget for every searched row


def one_process(params: Params, data, device: torch.device) -> tuple[float, float, float, float]:
    """The job's tuning trials trained in this process (``train_row``), each searched row's choice made as the job
    makes it, then every final (row, seed) trial (and the controls) trained and probed (``train_and_probe``), each
    seeded as the job seeds it (``trial_row_params``); wall seconds, and of them the training's, its steps' and the
    probes'."""
    import json

    from pipeline.evaluation.tables_rows import (
        resolve_rows,
        trial_configs,
        trial_row_params,
        tuning_rows,
        with_choices,
    )
    from pipeline.evaluation.tuning_report import chosen_points
    from pipeline.training.rows import train_and_probe, train_row

    start = time.perf_counter()
    train = steps = probe = 0.0
    n_train, seed = len(data.train.y), params.tables.tuning.seed if params.tables.tuning else 0
    tried = []
    for t in tuning_rows(params, resolve_rows(params, n_train), n_train):
        trained = train_row(trial_row_params(params, t.config(seed)), data, device)
        tried.append({"of": t.of, "point": json.dumps(t.point, sort_keys=True), "knn_acc": trained.knn_acc})
        train, steps = train + trained.seconds, steps + sum(h["seconds"] for h in trained.history)
    params = with_choices(params, {i: json.loads(r["point"]) for i, r in chosen_points(tried).items()})
    for config in trial_configs(params, resolve_rows(params, n_train)):
        done = train_and_probe(trial_row_params(params, config), data, device, control=config["control"])
        train, probe = train + done.train_seconds, probe + done.probe_seconds
        steps += sum(h["seconds"] for h in done.history)
    return time.perf_counter() - start, train, steps, probe


def tables_job(params: Params, data_dir: Path, tmp: Path) -> tuple[float, dict[str, float], list[dict], list[dict]]:
    """The tables job as ``transfusion tables`` runs it on ``data_dir``, in ``tmp`` (MLflow's sqlite store, Ray's
    storage); wall seconds, where they went, its rows and its tuning trials."""
    import ray

    from pipeline.runs.job import cleanup
    from pipeline.runs.tables import run_tables

    tmp.mkdir()
    os.chdir(tmp)
    params = params.model_copy(update={"ray": params.ray.model_copy(update={"storage_path": str(tmp / "r")})})
    start = time.perf_counter()
    result = run_tables(params, data_dir, tmp, tracking=True)
    job = time.perf_counter() - start
    cleanup(params, tmp, result.job.name, result.trial_runs())
    ray.shutdown()  # the next job starts its own Ray, as each `transfusion tables` does
    os.chdir(ROOT)
    fit = sum(r["fit_seconds"] or 0.0 for r in result.rows)
    probe = sum(r["eval_seconds"] or 0.0 for r in result.rows)
    steps = sum(60 * (r["train_minutes"] or 0.0) for r in result.rows)
    tuning = sum(60 * (r["train_minutes"] or 0.0) for r in result.tuning)
    parts = {"before the final trials (Ray, MLflow, staging, the tuning phase)": job - result.seconds,
             "of it, the tuning trials' steps": tuning, "final trials' training (fit)": fit,
             "of it, the steps": steps, "final trials' probes": probe,
             "the rest (trial starts, Tune, MLflow)": result.seconds - fit - probe,
             "the steps of all trials": tuning + steps}
    return job, parts, result.rows, result.tuning


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default="/usr/share/datasets/fashion-mnist", help="Fashion-MNIST's IDX files")
    ap.add_argument("--limit-train", type=int, default=10_000, help="0: all 60,000")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3, help="runs of each, alternating; the best of each counts")
    ap.add_argument("-S", dest="overrides", action="append", default=[], help="more params overrides")
    args = ap.parse_args()
    from pipeline.config.ray import TRIAL_CPU, torch_threads
    from pipeline.data.prepared import load_prepared, save_prepared
    from pipeline.data.sources import load_dataset
    from pipeline.runs.cluster import with_worker_cpus

    params = load_params(ROOT / "presets/fashion-mnist-ssl.yaml", [
        f"data.root={args.root}", f"data.limit_train={args.limit_train or 'null'}", f"train.epochs={args.epochs}",
        "tables.seeds=[0]", "tables.controls=[random_init]", ROWS, TUNING, *args.overrides])
    threads = torch_threads(with_worker_cpus(params, TRIAL_CPU).ray.cpus_per_worker)  # what a trial's worker uses
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        save_prepared(load_dataset(params.data), tmp / "data/prepared")
        data = load_prepared(tmp / "data/prepared")
        plains, jobs = [], []
        for i in range(args.repeat):
            plains.append(one_process(params, data, torch.device("cpu")))
            jobs.append(tables_job(params, tmp / "data/prepared", tmp / f"job{i}"))
            print(f"# run {i + 1}: one process {plains[-1][0]:.1f} s, tables job {jobs[-1][0]:.1f} s", flush=True)
    rows = jobs[0][2]
    print(f"CPU, {threads} thread(s): Fashion-MNIST {len(data.train.y):,} images, {len(jobs[0][3])} tuning trials "
          f"({params.tables.tuning.epochs} epoch each), then {len(rows)} trials "
          f"({', '.join(sorted({r['name'] for r in rows}))}), {args.epochs} epochs, best of {args.repeat}")
    plain, job = min(plains), min(jobs, key=lambda j: j[0])
    print(f"  one process: {plain[0]:7.1f} s (training {plain[1]:.1f} s, of it the steps {plain[2]:.1f} s; "
          f"probes {plain[3]:.1f} s); "
          f"all runs: {', '.join(f'{p[0]:.1f}' for p in plains)}")
    print(f"  tables job (Ray Tune, MLflow): {job[0]:7.1f} s; all runs: {', '.join(f'{j[0]:.1f}' for j in jobs)}")
    for what, seconds in job[1].items():
        print(f"    {what}: {seconds:.1f} s")
    print(f"tables job / one process, the trials' steps alone: {job[1]['the steps of all trials'] / plain[2]:.3f}")
    print(f"tables job / one process: {job[0] / plain[0]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
