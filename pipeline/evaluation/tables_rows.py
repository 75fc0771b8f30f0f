"""The tables job's plan, before any work: its rows (``tables.rows``, :class:`pipeline.config.tables.TableRow`) each
resolved to full, validated params (:func:`resolve_rows`: a row's mode must be its table's, a loss must suit the
mode, ...), the controls (:func:`control_rows`) and one trial per (row, seed) (:func:`trial_configs`); the tuning
phase's rows (:func:`tuning_rows`: each searched row at the points of its space) and the final rows with each row's
chosen point (:func:`with_choices`). The job itself is ``pipeline.runs.tables``."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from pipeline.config.base import ParamsError, flatten
from pipeline.config.names import fusing_blocks, head_description
from pipeline.config.params import Params
from pipeline.config.space import trial_params
from pipeline.config.tables import CONTROLS, TableRow
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

    def record(self, seed: int) -> dict[str, object]:
        """The first fields of a (row, seed)'s record in ``tables/results.csv``: who it is and what it trains (with
        what sits on the backbone: ``head``, :func:`pipeline.config.names.head_description`, and ``fusing``)."""
        p, model = self.params, flatten(self.params.model, "model.")
        return {"index": self.index, "table": self.table, "name": self.name, "paper": self.paper, "seed": seed,
                "control": self.control or "", "train.mode": p.train.mode, "loss.name": p.loss.name,
                "model.depth": p.model.depth, "model.projector": p.model.projector, "model.head": p.model.head,
                "fusing": fusing_blocks(model), "head": head_description(model), "model.backbone": p.model.backbone,
                "train.batch_size": p.train.batch_size}


def trial_row_params(base: Params, config: dict[str, object]) -> Params:
    """A (row, seed) trial's params from its config (:meth:`Row.config`): ``base`` (the job's params) with the row's
    params and ``train.seed`` the seed, validated as every row is."""
    return trial_params(base.model_dump(), {**config["params"], "train.seed": config["seed"]},
                        source=f"tables row {config['name']!r}")


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


# -------------------------------------------------------------------------------------------- the tuning phase
def space_points(space: dict[str, list[object]], trials: int, seed: int) -> list[dict[str, object]]:
    """The points of a row's ``space`` the tuning phase tries: its grid (the keys in order, the last one varying
    fastest) when it holds ``trials`` points, else ``trials`` of them drawn without replacement with ``seed``, kept in
    grid order. Every row tries ``trials`` points: the same budget."""
    keys = list(space)
    grid = [dict(zip(keys, values, strict=True)) for values in itertools.product(*(space[k] for k in keys))]
    if len(grid) <= trials:
        return grid
    picked = np.random.default_rng(seed).choice(len(grid), size=trials, replace=False)
    return [grid[i] for i in sorted(int(i) for i in picked)]


@dataclass(frozen=True)
class Tuned:
    """A row of the tuning phase: ``row`` (a searched row of ``tables.rows``) at ``point``, trained with the budget's
    epochs and seed."""

    row: Row  # the point's own row, resolved: the searched row's overrides, the point, train.epochs of the budget
    of: int  # the index of the searched row in tables.rows
    point: dict[str, object]

    def config(self, seed: int) -> dict[str, object]:
        return {**self.row.config(seed), "phase": "tuning", "of": self.of, "point": self.point}


def tuning_rows(params: Params, rows: list[Row], n_train: int | None = None) -> list[Tuned]:
    """The tuning phase's rows: one per (row with a space, point of :func:`space_points`), each resolved and
    validated as every row is (:func:`resolve_rows`; a point a row's table refuses is named before any work). Their
    ``train.epochs`` is ``tables.tuning.epochs`` (None: the file's), whatever the row's own, so that every row's
    budget is ``trials x epochs``."""
    tuning, specs = params.tables.tuning, {r.index: params.tables.rows[r.index] for r in rows}
    searched = [r for r in rows if specs[r.index].space]
    if tuning is None or not searched:
        return []
    epochs = tuning.epochs if tuning.epochs is not None else params.train.epochs
    plan = [(r, point) for r in searched for point in space_points(specs[r.index].space, tuning.trials, tuning.seed)]
    expanded = [TableRow(name=f"{r.name} · tuning {j + 1}", table=r.table, paper=r.paper,
                         params={**r.overrides, **point, "train.epochs": epochs})
                for j, (r, point) in enumerate(plan)]
    resolved = resolve_rows(params.model_copy(update={"tables": params.tables.model_copy(update={"rows": expanded})}),
                            n_train)
    return [Tuned(row, r.index, point) for row, (r, point) in zip(resolved, plan, strict=True)]


def with_choices(params: Params, chosen: dict[int, dict[str, object]]) -> Params:
    """``params`` whose searched rows carry their chosen point in their params (the final phase's rows)."""
    rows = [r.model_copy(update={"params": {**r.params, **chosen.get(i, {})}})
            for i, r in enumerate(params.tables.rows)]
    return params.model_copy(update={"tables": params.tables.model_copy(update={"rows": rows})})
