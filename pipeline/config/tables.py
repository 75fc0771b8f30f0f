"""The optional ``tables`` section: the paper's Tables 1-2 as an explicit list of rows.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from pipeline.config.augment import AugmentConfig
from pipeline.config.base import MAX_SEED, Section
from pipeline.config.loss import LossConfig
from pipeline.config.model import ModelConfig
from pipeline.config.train import TrainConfig

ROW_SECTIONS = ("model", "loss", "augment", "train")  # what a row of the tables job may override
#: the controls a table can carry beside its trained rows, probed like them and never trained: the flattened input
#: pixels, and the backbone (and head) at its random initialisation with each seed
CONTROLS = {"raw_pixels": "raw pixels", "random_init": "random init"}


class TableRow(Section):
    """One row of the paper's Tables 1-2: a named configuration, and the params it overrides on the file's base."""

    name: str = Field(min_length=1, max_length=200)
    table: Literal[1, 2]  # 1: self-supervised, 2: supervised
    paper: str | None = None  # the paper's row it stands beside (default: the paper's row of the same name, if any)
    params: dict[str, Any] = Field(default_factory=dict)  # dotted overrides, e.g. {"loss.name": infonce}
    # the values the tuning phase (tables.tuning) tries, by dotted key of the row's sections, e.g.
    # {"loss.temperature": [0.05, 0.1, 0.2]}: the grid of their combinations; empty: the row runs as written (untuned)
    space: dict[str, list[Any]] = Field(default_factory=dict)


def _paper_rows() -> list[TableRow]:
    """The paper's rows: Table 1 (self-supervised, the paper's augmentation), Table 2 (supervised, none)."""
    ssl, sup = {"train.mode": "self_supervised"}, {"train.mode": "supervised", "augment.strength": 0.0}
    rows = [("InfoNCE", 1, ssl, "infonce", 0), ("DCL", 1, ssl, "dcl", 0), ("BarlowTwins", 1, ssl, "barlow_twins", 0),
            ("TransFusion 1-Layer", 1, ssl, "jsd", 1), ("TransFusion 9-Layer", 1, ssl, "jsd", 9),
            ("SupCon", 2, sup, "supcon", 0), ("TransFusion 1-Layer", 2, sup, "jsd", 1),
            ("TransFusion 9-Layer", 2, sup, "jsd", 9)]
    return [TableRow(name=n, table=t, params={**base, "loss.name": loss, "model.depth": depth})
            for n, t, base, loss, depth in rows]


def _reference_names(rows: list[TableRow], controls: list[str]) -> set[str]:
    """The names ``tables.reference`` may take: every row's, and each chosen control's key and report name."""
    return {r.name for r in rows} | set(controls) | {CONTROLS[c] for c in controls}


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, Section)


def _key_problem(where: str, key: str, what: str) -> str | None:
    """Why the dotted ``key`` of a row's ``what`` (params, space) is not a key a row may set; None if it is."""
    sections = {"model": ModelConfig, "loss": LossConfig, "augment": AugmentConfig, "train": TrainConfig}
    section, _, field = key.partition(".")
    if section not in sections:
        return (f"{where}: {what} key {key!r}: a row overrides only {', '.join(s + '.*' for s in ROW_SECTIONS)} "
                "(the data, the cluster and the probes are the job's)")
    model, parts = sections[section], field.split(".")  # nested: "model.abc.blocks"
    for depth, part in enumerate(parts):
        inner = model.model_fields[part].annotation if part in model.model_fields else None
        if inner is None or (depth < len(parts) - 1 and not _is_section(inner)):
            where_key = ".".join([section, *parts[:depth]])
            return (f"{where}: {what} key {key!r}: unknown key; allowed keys in {where_key}: "
                    f"{', '.join(model.model_fields)}")
        model = inner
    return None


class TuningConfig(Section):
    """The tuning phase of ``transfusion tables``: every row with a ``space`` gets the same budget, ``trials`` trials
    of ``epochs`` epochs with ``train.seed`` ``seed``, scored by the online kNN of their last epoch on the validation
    split (``data.val_size``); each row's best point then runs ``tables.seeds`` times and is probed on the test set.
    A row whose grid holds more than ``trials`` points tries a sample of them drawn with ``seed``."""

    trials: int = Field(4, ge=1, le=10_000)
    epochs: int | None = Field(None, ge=1, le=100_000)  # None: the file's train.epochs (the same for every row)
    seed: int = Field(0, ge=0, le=MAX_SEED)


#: what a row's space may not search: the budget's own keys (tables.tuning) and the final runs' seeds
UNSEARCHABLE = ("train.epochs", "train.seed")


class TablesConfig(Section):
    """``transfusion tables``: the paper's Tables 1-2 as one Tune job, an explicit list of rows (not a grid).

    Each row's params are applied to the file's ``model``/``loss``/``augment``/``train``; the rows share the data,
    the cluster (``ray``) and the probes (``probe``). Whether a row's resolved params are valid (e.g. a loss that
    needs self-supervised mode) is checked by ``pipeline.evaluation.tables_rows.resolve_rows`` before any work.
    """

    rows: list[TableRow] = Field(default_factory=_paper_rows, min_length=1)
    # train.seed of each row's runs: every row runs once per seed (None: once, with the file's train.seed)
    seeds: list[Annotated[int, Field(ge=0, le=MAX_SEED)]] | None = Field(None, min_length=1)
    # probed beside the rows, with each seed (raw_pixels: once, it has no randomness of its own)
    controls: list[Literal["raw_pixels", "random_init"]] = Field(default_factory=lambda: list(CONTROLS))
    max_concurrent_trials: int | None = Field(None, ge=1)  # None: as many as the cluster holds
    # the row every other row of its table is tested against in reports/TABLES.md (a paired t-test by seed): a name
    # of tables.rows or a control of tables.controls (raw_pixels, or as the report names it, "raw pixels");
    # None: the report gives each row's spread and confidence interval, and no comparison
    reference: str | None = Field(None, min_length=1, max_length=200)
    # the tuning phase's budget, the same for every row with a space (required when a row has one)
    tuning: TuningConfig | None = None

    @model_validator(mode="after")
    def _rows(self) -> TablesConfig:
        problems, seen = [], set()
        if self.seeds is not None and len(set(self.seeds)) != len(self.seeds):
            problems.append(f"tables.seeds: {self.seeds} repeats a seed; list each seed once")
        if len(set(self.controls)) != len(self.controls):
            problems.append(f"tables.controls: {self.controls} repeats a control; allowed: {', '.join(CONTROLS)}")
        if self.reference is not None and self.reference not in _reference_names(self.rows, self.controls):
            allowed = [*dict.fromkeys(r.name for r in self.rows), *self.controls]
            problems.append(f"tables.reference: {self.reference!r} is not a row of this job; allowed: "
                            f"{', '.join(map(repr, allowed))}")
        for i, row in enumerate(self.rows):
            where = f"tables.rows[{i}] ({row.name!r})"
            if (row.table, row.name) in seen:
                problems.append(f"{where}: a second row named {row.name!r} in table {row.table}; names are unique "
                                "within a table")
            seen.add((row.table, row.name))
            problems += [p for key in row.params if (p := _key_problem(where, key, "params"))]
            problems += [p for key in row.space if (p := _key_problem(where, key, "space"))]
            problems += self._space_problems(where, row)
        if problems:
            raise ValueError("\n  ".join(problems))
        return self

    def _space_problems(self, where: str, row: TableRow) -> list[str]:
        """Why ``row``'s space cannot be searched on this job's budget (none: it can, or it has no space)."""
        if not row.space:
            return []
        problems = [f"{where}: space key {key!r}: the tuning budget sets it for every row (tables.tuning), and the "
                    "final runs' seeds are tables.seeds; search another key"
                    for key in row.space if key in UNSEARCHABLE]
        for key, values in row.space.items():
            if not values or len({repr(v) for v in values}) != len(values):
                problems.append(f"{where}: space key {key!r}: {values!r} must list each value to try once (at least "
                                "one value)")
        points = math.prod(len(v) for v in row.space.values())
        if self.tuning is None:
            problems.append(f"{where}: the row has a space, but the job has no tuning budget; set tables.tuning "
                            "(trials, epochs, seed: the same for every row)")
        elif points < self.tuning.trials:
            problems.append(f"{where}: its space holds {points} point(s), fewer than tables.tuning.trials "
                            f"({self.tuning.trials}): every row gets the same budget; widen the space or lower trials")
        return problems


__all__ = ['CONTROLS', 'ROW_SECTIONS', 'UNSEARCHABLE', 'TableRow', 'TablesConfig', 'TuningConfig']
