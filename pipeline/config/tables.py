"""The optional ``tables`` section: the paper's Tables 1-2 as an explicit list of rows.
"""

from __future__ import annotations

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

    @model_validator(mode="after")
    def _rows(self) -> TablesConfig:
        sections = {"model": ModelConfig, "loss": LossConfig, "augment": AugmentConfig, "train": TrainConfig}
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
            for key in row.params:
                section, _, field = key.partition(".")
                if section not in sections:
                    problems.append(f"{where}: params key {key!r}: a row overrides only "
                                    f"{', '.join(s + '.*' for s in ROW_SECTIONS)} (the data, the cluster and the "
                                    "probes are the job's)")
                    continue
                model, parts = sections[section], field.split(".")  # nested: "model.abc.blocks"
                for depth, part in enumerate(parts):
                    inner = model.model_fields[part].annotation if part in model.model_fields else None
                    if inner is None or (depth < len(parts) - 1 and not _is_section(inner)):
                        where_key = ".".join([section, *parts[:depth]])
                        problems.append(f"{where}: params key {key!r}: unknown key; allowed keys in {where_key}: "
                                        f"{', '.join(model.model_fields)}")
                        break
                    model = inner
        if problems:
            raise ValueError("\n  ".join(problems))
        return self


__all__ = ['CONTROLS', 'ROW_SECTIONS', 'TableRow', 'TablesConfig']
