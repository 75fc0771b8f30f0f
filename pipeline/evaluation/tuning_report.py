"""The tables job's tuning phase as people read it (``pipeline.runs.tables.tune_rows``): the records of its trials
(:data:`TUNING_COLUMNS`, ``tables/tuning.csv``), each searched row's chosen point (:func:`chosen_points`), whether a
chosen value lies at the edge of its grid (:func:`at_edge`), and the section of ``reports/TABLES.md`` that says it
all (:func:`tuning_section`): the budget, every row's searched values, its choice and its validation score, and which
rows ran as written (untuned)."""

from __future__ import annotations

import json
from typing import Any

from pipeline.config.params import Params
from pipeline.evaluation.report import NA, fmt_cell

TUNING_COLUMNS = ("table", "name", "of", "point", "seed", "epochs", "knn_acc", "train_minutes", "trial_id", "status",
                  "error")


def chosen_points(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Each searched row's best trial (by the index ``of`` the row in tables.rows): the highest validation kNN, the
    first in plan order on a tie; a row none of whose trials scored is absent. Every trial of the tuning phase
    scores on the validation split, so no choice reads the test set."""
    best: dict[int, dict[str, Any]] = {}
    for r in records:
        score = r.get("knn_acc")
        if isinstance(score, (int, float)) and (r["of"] not in best or score > best[r["of"]]["knn_acc"]):
            best[r["of"]] = r
    return best


def at_edge(values: list[Any], chosen: Any) -> bool:
    """Whether ``chosen`` is the smallest or largest of the numeric ``values`` searched (two or more): the best may lie
    beyond the grid. Values that are not all numbers have no edge."""
    numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if len(numbers) != len(values) or len(values) < 2:
        return False
    return chosen in (min(numbers), max(numbers))


def _value(v: Any) -> str:
    """A searched value as written (0.001, 16.0, infonce), not at the accuracies' four decimals."""
    return format(v, "g") if isinstance(v, float) else str(v)


def tuning_section(records: list[dict[str, Any]], params: Params) -> list[str]:
    """The report's "Tuning on the validation split" section: the budget every searched row had, then a line per
    searched key of each row (searched values, chosen value, the chosen trial's validation kNN, an edge warning),
    then the rows that ran as written. Empty when no row has a space."""
    tuning, rows = params.tables.tuning, params.tables.rows
    searched = [i for i, r in enumerate(rows) if r.space]
    if tuning is None or not searched:
        return []
    epochs = tuning.epochs if tuning.epochs is not None else params.train.epochs
    best = chosen_points(records)
    tried = {i: sum(r["of"] == i for r in records) for i in searched}
    lines = ["## Tuning on the validation split", "",
             f"Every searched row had the same budget: {tuning.trials} trial(s) of {epochs} epoch(s), train.seed "
             f"{tuning.seed}, each scored by the online kNN (k = {params.train.knn_k}) of its last epoch on the "
             "validation split held out of the training images (`data.val_size`). No choice read the test set; "
             "the chosen point then ran with every seed of the tables below.", "",
             "| row | table | key | searched | chosen | validation kNN | trials | note |",
             "|---|---|---|---|---|---|---|---|"]
    for i in searched:
        row, pick = rows[i], best.get(i)
        point = json.loads(pick["point"]) if pick else {}
        for key, values in row.space.items():
            chosen = point.get(key)
            note = ("at the edge of its grid: the best may lie beyond it" if pick and at_edge(values, chosen)
                    else "" if pick else "no trial scored: the row ran as written")
            lines.append(f"| {row.name} | {row.table} | `{key}` | {', '.join(_value(v) for v in values)} | "
                         f"{_value(chosen) if pick else NA} | {fmt_cell(pick['knn_acc']) if pick else NA} | "
                         f"{tried[i]} | {note} |")
    untuned = [f"{r.name} (table {r.table})" for r in rows if not r.space]
    if untuned:
        lines += ["", f"Untuned (run as written, no space): {', '.join(untuned)}."]
    return [*lines, ""]


__all__ = ["TUNING_COLUMNS", "at_edge", "chosen_points", "tuning_section"]
