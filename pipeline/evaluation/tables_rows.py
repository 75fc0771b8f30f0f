"""The tables job's plan, before any work: its rows (``tables.rows``, :class:`pipeline.config.tables.TableRow`) each
resolved to full, validated params (:func:`resolve_rows`: a row's mode must be its table's, a loss must suit the
mode, ...), the controls (:func:`control_rows`) and one trial per (row, seed) (:func:`trial_configs`). The job itself
is ``pipeline.runs.tables``."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config.base import ParamsError
from pipeline.config.params import Params
from pipeline.config.space import trial_params
from pipeline.config.tables import CONTROLS
from pipeline.evaluation.report import PAPER_TABLES


@dataclass(frozen=True)
class Row:
    index: int
    name: str
    table: int  # 0: a control, in every table
    paper: str | None  # the paper's row it stands beside (None: ours only)
    overrides: dict[str, object]
    params: Params  # the file's base with the overrides, validated
    control: str | None = None  # raw_pixels | random_init: probed, never trained

    def config(self, seed: int) -> dict[str, object]:
        """What the Tune trial of this row with ``train.seed`` ``seed`` gets (plain values)."""
        return {"index": self.index, "name": self.name, "table": self.table, "paper": self.paper,
                "params": self.overrides, "seed": seed, "control": self.control}


def seeds_of(params: Params) -> list[int]:
    """``tables.seeds``, or the file's ``train.seed`` alone."""
    return list(params.tables.seeds) if params.tables.seeds is not None else [params.train.seed]


def control_rows(params: Params) -> list[Row]:
    """``tables.controls`` as rows of table 0 (indices below the trained rows': listed first), on the file's base."""
    chosen = params.tables.controls
    return [Row(i - len(chosen), CONTROLS[c], 0, None, {}, params, c) for i, c in enumerate(chosen)]


def trial_configs(params: Params, rows: list[Row]) -> list[dict[str, object]]:
    """One Tune trial per (row, seed), the controls included; ``raw_pixels`` once (it has no randomness)."""
    seeds = seeds_of(params)
    return [r.config(s) for r in [*control_rows(params), *rows]
            for s in (seeds[:1] if r.control == "raw_pixels" else seeds)]


def resolve_rows(params: Params, n_train: int | None = None) -> list[Row]:
    """Every row's full params; raises :class:`ParamsError` naming each bad row and key, before any work."""
    base = params.model_dump()  # what every row starts from
    modes = {1: "self_supervised", 2: "supervised"}
    rows, problems = [], []
    for i, r in enumerate(params.tables.rows):
        where = f"tables.rows[{i}] ({r.name!r}, table {r.table})"
        try:
            p = trial_params(base, r.params, source=where)
        except ParamsError as exc:
            problems.append(str(exc))
            continue
        if p.train.mode != modes[r.table]:
            problems.append(f"{where}: train.mode is {p.train.mode}, but table {r.table} is {modes[r.table]}; set "
                            f"train.mode: {modes[r.table]} in the row's params (or move the row)")
        if n_train is not None and p.train.batch_size > n_train:
            problems.append(f"{where}: train.batch_size {p.train.batch_size} exceeds the training set ({n_train} "
                            "samples)")
        names = [n for n, *_ in PAPER_TABLES[r.table][1]]
        if r.paper is not None and r.paper not in names:
            problems.append(f"{where}: paper: {r.paper!r} is not a row of the paper's table {r.table} "
                            f"({', '.join(names)}); use one of those or null")
        paper = r.paper if r.paper is not None else (r.name if r.name in names else None)
        rows.append(Row(i, r.name, r.table, paper, dict(r.params), p))
    if problems:
        raise ParamsError("invalid tables rows:\n  " + "\n  ".join(problems))
    return rows
