"""A tables preset's rows x seeds as plain processes, several at once on one machine, without Ray or MLflow.

For a GPU machine that has neither (``transfusion tables`` needs both): each (row, seed) trains as the tables job's
trial does (the row's params through ``pipeline.config.space.trial_params``, ``train.seed`` the seed, the pretrain
stage's ``PretrainLoop`` with its online kNN every ``train.knn_every`` epochs, checkpoints, health), then
``probe.probes`` on the frozen backbone (``pipeline.evaluation.evaluate.probe_frozen``, as the tables job's
``probe_row``). No controls, no MLflow, no resume. Every epoch and every finished run is appended to the output
folder at once, so a run cut short by ``--deadline`` still leaves its curves:

- ``curves.csv``: the tables job's ``tables/curves.csv`` columns (table, name, seed, epoch, seconds of training so
  far, loss, online kNN), without the blocks' health;
- ``rows.csv``: row, seed, epochs, each probe's test accuracy, train and probe seconds (finished runs only).

It ends with each row's mean ± sd over its finished seeds, the tables report's budget table (where each row's online
kNN stops rising) and its figure of the online kNN per epoch, ``curves.png``.

    python benchmarks/study_rows.py --params presets/fashion-mnist-ssl.yaml \\
        --row "TransFusion 1-Layer truncated power 16" --row "InfoNCE tau 0.05" --seeds 0 1 --jobs 4 --out study
    python benchmarks/study_rows.py --params presets/fashion-mnist-ssl.yaml --row InfoNCE --seeds 0 \\
        -S data.limit_train=1000 -S train.epochs=1 --out /tmp/smoke               # a smoke run on the CPU
"""

from __future__ import annotations

import argparse
import csv
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path


def append(path: Path, fields: list[str], row: dict[str, object]) -> None:
    """One CSV line, written and flushed at once (the header with the file's first line)."""
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fields, extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerow(row)


def run_one(job: tuple[str, int, dict[str, object], int, str, str, int]) -> dict[str, object]:
    """Train and probe one (row, seed) in this process; returns its line of ``rows.csv``."""
    name, table, base, seed, data_dir, out, threads = job
    import torch

    from pipeline.config.space import trial_params
    from pipeline.data.prepared import load_prepared
    from pipeline.evaluation.evaluate import probe_frozen, resolve_device
    from pipeline.evaluation.tables_report import CURVE_COLUMNS, curve_rows
    from pipeline.training.loop import PretrainLoop

    torch.set_num_threads(threads)
    params = trial_params(base, {"train.seed": seed}, source=f"row {name!r}, seed {seed}")
    data = load_prepared(Path(data_dir))
    loop = PretrainLoop(params, data, resolve_device(params.train.device))

    def report(m, _checkpoint_now: bool) -> None:
        line = curve_rows([{"table": table, "name": name, "seed": seed, "history": loop.history}])[-1]
        append(Path(out) / "curves.csv", list(CURVE_COLUMNS), line)
        knn = "" if m.knn_acc is None else f" knn {m.knn_acc:.4f}"
        print(f"[{name} / seed {seed}] epoch {m.epoch}/{params.train.epochs} loss {m.loss:.5f}{knn} "
              f"{m.seconds:.1f} s", flush=True)

    start = time.time()
    loop.fit(report)
    trained = time.time() - start
    accuracies, n_probe = probe_frozen(params, data, loop.model)
    return {"row": name, "seed": seed, "epochs": loop.epoch, **{f"probe.{k}": v for k, v in accuracies.items()},
            "n_probe_train": n_probe, "train_seconds": round(trained, 1),
            "probe_seconds": round(time.time() - start - trained, 1)}


def main() -> int:
    from pipeline.config.params import load_params
    from pipeline.data.prepared import save_prepared
    from pipeline.data.sources import load_dataset
    from pipeline.evaluation.tables_report import curves_figure, read_curves, rise_table
    from pipeline.evaluation.tables_rows import resolve_rows, seeds_of

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", required=True, help="a params file with tables.rows (a preset)")
    ap.add_argument("--row", action="append", default=[], help="a row's name (repeat; default: every row)")
    ap.add_argument("--seeds", type=int, nargs="+", help="default: tables.seeds")
    ap.add_argument("--jobs", type=int, default=1, help="(row, seed) runs at once")
    ap.add_argument("--out", type=Path, required=True, help="folder of curves.csv and rows.csv (appended to)")
    ap.add_argument("--deadline", type=float, default=None, help="seconds: stop the runs still going then")
    ap.add_argument("-S", dest="overrides", action="append", default=[], help="params overrides (key=value)")
    args = ap.parse_args()
    params = load_params(Path(args.params), args.overrides)
    rows = resolve_rows(params)
    unknown = set(args.row) - {r.name for r in rows}
    if unknown:
        ap.error(f"--row {sorted(unknown)}: not in tables.rows of {args.params}; "
                 f"choose from {[r.name for r in rows]}")
    chosen = [r for r in rows if not args.row or r.name in args.row]
    seeds = args.seeds if args.seeds is not None else seeds_of(params)
    args.out.mkdir(parents=True, exist_ok=True)
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    with tempfile.TemporaryDirectory() as tmp:
        started = time.time()
        save_prepared(load_dataset(params.data), Path(tmp) / "prepared")
        print(f"prepared in {time.time() - started:.1f} s; {len(chosen)} row(s) x {len(seeds)} seed(s), "
              f"{args.jobs} at once, {threads} thread(s) each", flush=True)
        jobs = [(r.name, r.table, r.params.model_dump(), s, str(Path(tmp) / "prepared"), str(args.out), threads)
                for r in chosen for s in seeds]
        ctx = mp.get_context("spawn")  # CUDA in the children
        with ctx.Pool(args.jobs, maxtasksperchild=1) as pool:
            pending = [pool.apply_async(run_one, (job,)) for job in jobs]
            done: list[dict[str, object]] = []
            for p in pending:
                left = None if args.deadline is None else max(0.0, args.deadline - (time.time() - started))
                try:
                    line = p.get(timeout=left)
                except mp.TimeoutError:
                    print(f"deadline of {args.deadline:.0f} s reached: {len(jobs) - len(done)} run(s) unfinished",
                          flush=True)
                    pool.terminate()
                    break
                fields = list(line)
                append(args.out / "rows.csv", fields, line)
                done.append(line)
                print(f"done: {line}", flush=True)
    probes = [k for k in (done[0] if done else {}) if k.startswith("probe.")]
    for r in chosen:
        mine = [d for d in done if d["row"] == r.name]
        cells = []
        for k in probes:
            v = [float(d[k]) for d in mine]
            sd = f" ± {statistics.stdev(v):.3f}" if len(v) > 1 else ""
            cells.append(f"{k} {statistics.mean(v):.3f}{sd}" if v else f"{k} n/a")
        print(f"{r.name}: {len(mine)} seed(s): {', '.join(cells) or 'n/a'}")
    curves = read_curves(args.out / "curves.csv")
    print("\n".join(rise_table(curves)))
    curves_figure(curves, args.out / "curves.png")
    return 0 if len(done) == len(jobs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
