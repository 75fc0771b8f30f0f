"""The paper's Tables 1-2 as our tables job (``pipeline.runs.tables``) fills them: ``reports/TABLES.md``
(:func:`render`) and the rows of ``tables/results.csv`` (:func:`csv_records`, :data:`COLUMNS`)."""

from __future__ import annotations

import json
import math
from typing import Any

from pipeline.config.params import Params
from pipeline.evaluation.report import HEADER, NA, PAPER_TABLES, RULE, fmt_cell, table_row

PROBES = ("ffn", "svm", "knn50", "knn200")  # the paper's columns, in the order of report.COLUMNS
COLUMNS = ("table", "name", "paper", "trial_id", "train.mode", "loss.name", "model.depth", "model.backbone",
           "train.batch_size", "epochs", *PROBES, "train_minutes", "fit_seconds", "eval_seconds", "workers", "gpus",
           "hours", "hours_unit", "probe_cpus", "probe_gpus", "status", "error")


def render(records: list[dict[str, Any]], params: Params, unit: str, dataset: str) -> str:
    """``reports/TABLES.md``: Tables 1-2 in the paper's layout, each of our rows under the paper's row it reproduces
    (ours in bold; "n/a": not computed), with the cost of each row in ``unit``."""
    m, t = params.model, params.train
    lines = [
        "# The paper's Tables 1-2, reproduced",
        "",
        f"Ours: dataset **{dataset}**, backbone `{m.backbone}`, {t.epochs} epochs (unless a row says otherwise), "
        f"augmentation `{params.augment.preset}`, {params.ray.num_workers} worker(s) per row. Probes on the frozen "
        "backbone embeddings of the test split (3-layer FFN 256/128/64, SVM, K-NN k=50 and k=200), fitted on 100 % "
        "of the train labels" + (f" (at most {params.probe.max_train} samples)" if params.probe.max_train else "")
        + ". Time: our training minutes. The paper's rows are CIFAR-10 with ResNet-18 for 200 epochs: compare "
        "values only if ours is that recipe.",
        "",
    ]
    failed = []
    for table, (caption, paper_rows) in PAPER_TABLES.items():
        ours = [r for r in records if r["table"] == table]
        if not ours:
            continue
        lines += [f"## {caption}", "", HEADER + f" {unit} |", RULE + "---|"]
        placed = set()
        for name, batch, accs, minutes in paper_rows:
            lines.append(table_row(f"paper: {name}", batch, accs, minutes, "-"))
            for r in ours:
                if r["paper"] == name and r["index"] not in placed and (
                        r["train.batch_size"] == batch or not any(n == name and b == r["train.batch_size"]
                                                                  for n, b, *_ in paper_rows)):
                    lines.append(_our_row(r))
                    placed.add(r["index"])
        lines += [_our_row(r) for r in ours if r["index"] not in placed]
        failed += [r for r in ours if r["status"] != "TERMINATED"]
        lines.append("")
    if failed:
        lines += ["Rows that failed (their numbers are n/a):", ""]
        lines += [f"- table {r['table']} **{r['name']}**: {r['error']}" for r in failed]
        lines.append("")
    lines += ["Rows and their params:", "", "| table | row | params |", "|---|---|---|"]
    lines += [f"| {r.table} | {r.name} | `{json.dumps(r.params, sort_keys=True)}` |" for r in params.tables.rows]
    lines.append("")
    return "\n".join(lines)


def _our_row(r: dict[str, Any]) -> str:
    accs = tuple(NA if r[k] is None else r[k] for k in PROBES)
    minutes = NA if r["train_minutes"] is None else float(r["train_minutes"])
    hours = NA if r["hours"] is None else fmt_cell(float(r["hours"]))
    return table_row(f"**ours: {r['name']}**", r["train.batch_size"], accs, minutes, hours)


def csv_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``tables/results.csv`` rows: a number we could not compute is "n/a"."""
    return [{k: NA if r.get(k) is None or (isinstance(r.get(k), float) and not math.isfinite(r[k])) else r[k]
             for k in COLUMNS} for r in records]
