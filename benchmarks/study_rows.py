"""A tables preset's rows x seeds as plain processes, several at once on one machine, without Ray or MLflow.

For a GPU machine that has neither (``transfusion tables`` needs both): each (row, seed) trains as the tables job's
trial does (the row's params through ``pipeline.config.space.trial_params``, ``train.seed`` the seed, the pretrain
stage's ``PretrainLoop`` with its online kNN every ``train.knn_every`` epochs, checkpoints, health), then
``probe.probes`` on the frozen backbone (``pipeline.evaluation.evaluate.probe_frozen``, as the tables job's
``probe_row``). No controls, no MLflow, no resume. Every epoch and every finished run is appended to the output
folder at once, so a run cut short by ``--deadline`` still leaves its curves:

- ``tables/curves.csv``: the tables job's (table, name, seed, epoch, seconds of training so far, loss, online kNN),
  without the blocks' health;
- ``rows.csv``: row, seed, epochs, each probe's test accuracy, the last online kNN, GPUs, train and probe seconds
  (finished runs only).

Then the folder is a recorded study, as ``transfusion tables --out DIR`` leaves one: ``tables/results.csv`` and
``results.json`` in the job's format, from every run in ``rows.csv`` (earlier calls' too), and what the job renders
from them (``stages.tables.write_outputs``): ``reports/TABLES.md`` and ``plots/tables/curves.png``. ``--render``
writes only those, from the folder's ``rows.csv`` and ``tables/curves.csv``.

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
import tempfile
import time
from pathlib import Path

from pipeline.config.params import Params
from pipeline.config.probe import PROBES as ALL_PROBES
from pipeline.evaluation.tables_rows import Row


def append(path: Path, fields: list[str], row: dict[str, object]) -> None:
    """One CSV line, written and flushed at once (the header with the file's first line)."""
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fields, extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerow(row)


def run_one(job: tuple[str, int, dict[str, object], dict[str, object], int, str, str, int]) -> dict[str, object]:
    """Train and probe one (row, seed) in this process (``pipeline.training.rows.train_and_probe``); returns its line
    of ``rows.csv``."""
    name, table, base, overrides, seed, data_dir, out, threads = job  # base: the file's params, dumped
    import torch

    from pipeline.config.params import Params
    from pipeline.data.prepared import load_prepared
    from pipeline.evaluation.evaluate import resolve_device
    from pipeline.evaluation.tables_report import curve_columns, curve_rows
    from pipeline.evaluation.tables_rows import trial_row_params
    from pipeline.training.rows import train_and_probe

    torch.set_num_threads(threads)
    params = trial_row_params(Params.model_validate(base), {"name": name, "params": overrides, "seed": seed})
    data = load_prepared(Path(data_dir))

    def each(history: list[dict[str, float]]) -> None:
        line = curve_rows([{"table": table, "name": name, "seed": seed, "history": history}])[-1]
        append(Path(out) / "tables" / "curves.csv", curve_columns([line]), line)
        knn = "" if line.get("knn_acc") is None else f" knn {line['knn_acc']:.4f}"
        print(f"[{name} / seed {seed}] epoch {line['epoch']}/{params.train.epochs} loss {line['loss']:.5f}{knn} "
              f"{history[-1]['seconds']:.1f} s", flush=True)

    device = resolve_device(params.train.device)
    done = train_and_probe(params, data, device, on_epoch=each)
    return {"row": name, "seed": seed, "epochs": len(done.history),
            **{f"probe.{k}": v for k, v in done.accuracies.items()}, "n_probe_train": done.n_probe,
            "knn_acc": done.knn_acc, "gpus": int(device.type == "cuda"),
            "train_seconds": round(done.train_seconds, 1), "probe_seconds": round(done.probe_seconds, 1)}


def record(line: dict[str, str], row: Row) -> dict[str, object]:
    """A line of ``rows.csv`` as the tables job's record of a (row, seed) (``pipeline.runs.tables.collect``)."""
    gpus = int(line["gpus"])
    seconds = float(line["train_seconds"])
    def number(v: str) -> float | None:
        return float(v) if v not in ("", "None") else None

    return {**row.record(int(line["seed"])), "trial_id": f"study_{row.index}_{line['seed']}",
            "epochs": int(line["epochs"]),
            **{k: number(line.get(f"probe.{k}", "")) for k in ALL_PROBES}, "knn_acc": number(line["knn_acc"]),
            "train_minutes": seconds / 60, "fit_seconds": seconds, "eval_seconds": float(line["probe_seconds"]),
            "workers": 1, "gpus": gpus, "hours": seconds / 3600, "hours_unit": unit_of(gpus),
            "probe_cpus": None, "probe_gpus": None, "status": "TERMINATED", "error": ""}


def unit_of(gpus: int) -> str:
    return "GPU-hours" if gpus else "worker-hours"


def write_study(out: Path, params: Params, rows: list[Row]) -> list[str]:
    """``out`` as a recorded tables study: ``tables/results.{csv,json}`` from every run in ``rows.csv``, and the
    tables job's report and figure of them with ``tables/curves.csv``; returns the console's lines: the report's
    every-probe table (mean ± sd over seeds) and the files rendered."""
    from pipeline.evaluation.tables_report import COLUMNS, aggregate, csv_records, probe_table, read_curves
    from pipeline.io import write_csv, write_json
    from stages.tables import write_outputs

    by_name = {r.name: r for r in rows}
    with (out / "rows.csv").open(newline="") as f:
        records = sorted((record(line, by_name[line["row"]]) for line in csv.DictReader(f)),
                         key=lambda r: (r["index"], r["seed"]))
    unit = unit_of(max((int(r["gpus"]) for r in records), default=0))
    names = {r["name"] for r in records}
    reference = params.tables.reference if params.tables.reference in names else None  # one of these rows, or none
    tables = params.tables.model_copy(update={"rows": [t for t in params.tables.rows if t.name in names],
                                              "seeds": sorted({r["seed"] for r in records}),
                                              "controls": [], "reference": reference})
    job = params.model_copy(update={"tables": tables})
    write_csv(out / "tables" / "results.csv", csv_records(records), COLUMNS)
    write_json(out / "tables" / "results.json", {
        "dataset": params.data.dataset, "hours_unit": unit, "rows": csv_records(records),
        "params": job.model_dump(mode="json"), "tables": tables.model_dump(mode="json")})
    files = write_outputs(out, records, read_curves(out / "tables" / "curves.csv"), job, unit, params.data.dataset,
                          tuning=[])  # no tuning phase here: rows run as written
    return [*probe_table(aggregate(records)), f"rendered {', '.join(map(str, files))}"]


def main() -> int:
    from pipeline.config.params import load_params
    from pipeline.data.prepared import save_prepared
    from pipeline.data.sources import load_dataset
    from pipeline.evaluation.tables_rows import resolve_rows, seeds_of

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", required=True, help="a params file with tables.rows (a preset)")
    ap.add_argument("--row", action="append", default=[], help="a row's name (repeat; default: every row)")
    ap.add_argument("--seeds", type=int, nargs="+", help="default: tables.seeds")
    ap.add_argument("--jobs", type=int, default=1, help="(row, seed) runs at once")
    ap.add_argument("--out", type=Path, required=True, help="the study's folder (its rows.csv and curves appended to)")
    ap.add_argument("--render", action="store_true", help="only the study's files from --out's rows.csv and curves")
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
    if args.render:
        print("\n".join(write_study(args.out, params, rows)))
        return 0
    (args.out / "tables").mkdir(parents=True, exist_ok=True)
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    with tempfile.TemporaryDirectory() as tmp:
        started = time.time()
        save_prepared(load_dataset(params.data), Path(tmp) / "prepared")
        print(f"prepared in {time.time() - started:.1f} s; {len(chosen)} row(s) x {len(seeds)} seed(s), "
              f"{args.jobs} at once, {threads} thread(s) each", flush=True)
        jobs = [(r.name, r.table, params.model_dump(), r.overrides, s, str(Path(tmp) / "prepared"), str(args.out),
                 threads) for r in chosen for s in seeds]
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
                append(args.out / "rows.csv", list(line), line)
                done.append(line)
                print(f"done: {line}", flush=True)
    if done:
        print("\n".join(write_study(args.out, params, rows)))
    return 0 if len(done) == len(jobs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
