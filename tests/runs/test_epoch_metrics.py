"""One path for a per-epoch metric: a field added to ``EpochMetrics`` reaches MLflow's metric names, the history Tune's
results keep, the pretrain CSV, the sweep's results and curves and the tables' curves, with no other list to edit."""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

from pipeline.config.params import load_params
from pipeline.evaluation.tables_report import curve_columns, curve_rows
from pipeline.runs.sweep import trial_rows
from pipeline.runs.train import epoch_metric_names
from pipeline.runs.tune import outcomes
from pipeline.training import loop
from pipeline.training.loop import EpochMetrics, epoch_metrics, epoch_record
from stages.pretrain import write_outputs as pretrain_outputs
from stages.sweep import write_outputs as sweep_outputs

PARAMS = load_params(Path(__file__).parents[2] / "params.yaml")


@dataclass
class WithGradNorm(EpochMetrics):
    """A copy of the record with one more per-epoch metric."""

    grad_norm: float = 0.0


@pytest.fixture
def grad_norm(monkeypatch) -> list[dict[str, object]]:
    """The record gains ``grad_norm``; returns two epochs' ``as_dict`` of it, with a block's health."""
    monkeypatch.setattr(loop, "EpochMetrics", WithGradNorm)
    return [WithGradNorm(epoch=e, loss=1.0 / e, lr=1e-3, samples_per_s=100.0, view_noise=0.1, knn_acc=0.5 + e / 10,
                         seconds=1.5, ended_at=1e9 + e, health={"block_1.positive": 0.5, "block_1.uniform_rows": 0.0},
                         grad_norm=2.0 * e).as_dict()
            for e in (1, 2)]


def read(path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


def test_the_list_is_the_records_fields():
    assert epoch_metrics() == ("loss", "lr", "samples_per_s", "view_noise", "knn_acc", "seconds")
    record = EpochMetrics(epoch=3, loss=1.0, lr=0.1, samples_per_s=9.0, view_noise=0.2, knn_acc=None, seconds=2.0,
                          ended_at=5.0, health={"block_1.entropy": 0.9}).as_dict()
    assert list(epoch_record(record)) == ["epoch", *epoch_metrics(), "block_1.entropy"]  # no wall clock


def test_a_new_field_reaches_every_consumer(grad_norm, tmp_path):
    assert "grad_norm" in epoch_metrics() and "grad_norm" in epoch_metric_names(grad_norm)  # MLflow's metrics

    # Tune's results (what a worker reports: the whole record, and Tune's own keys) -> a trial's kept history
    reported = [{**h, "training_iteration": h["epoch"], "time_this_iter_s": 0.1} for h in grad_norm]
    grid = [SimpleNamespace(metrics_dataframe=pd.DataFrame(reported), path=str(tmp_path / "trial-a"),
                            config={}, error=None, checkpoint=None)]
    (trial,) = outcomes(grid)
    assert [h["grad_norm"] for h in trial.history] == [2.0, 4.0]
    assert not {"training_iteration", "ended_at"} & set(trial.history[0])

    # the sweep: the last epoch's in results.csv, every epoch's in curves.csv
    (row,) = trial_rows([trial], epochs=2)
    assert row["grad_norm"] == 4.0 and row["seconds"] == 3.0  # seconds: the trial's in all
    row |= {"model.depth": 1, "train.batch_size": 64, "augment.strength": 1.0}
    sweep_outputs(PARAMS, [row], tmp_path / "sweeps", tmp_path / "plots/sweep")
    assert read(tmp_path / "sweeps/results.csv")[0]["grad_norm"] == "4.0"
    assert [r["grad_norm"] for r in read(tmp_path / "plots/sweep/curves.csv")] == ["2.0", "4.0"]

    # the tables' curves
    curves = curve_rows([{"table": 1, "name": "JSD", "seed": 0, "history": trial.history}])
    columns = curve_columns(curves)
    assert "grad_norm" in columns and columns.index("grad_norm") < columns.index("block_1.positive")
    assert [c["seconds"] for c in curves] == [1.5, 3.0]  # so far

    # the pretrain CSV (plots/pretrain.csv)
    res = SimpleNamespace(state=SimpleNamespace(model={}, history=grad_norm, epoch=2), input_shape=(1, 8, 8),
                          n_classes=10, job=SimpleNamespace(run=None, name="pretrain"))
    pretrain_outputs(PARAMS, res, tmp_path / "models", tmp_path / "pretrain.json", tmp_path / "pretrain.csv")
    curve = read(tmp_path / "pretrain.csv")
    assert list(curve[0]) == ["epoch", *epoch_metrics(), "block_1.positive", "block_1.uniform_rows"]
    assert [float(r["grad_norm"]) for r in curve] == [2.0, 4.0] and not math.isnan(float(curve[1]["knn_acc"]))
