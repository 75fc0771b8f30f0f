"""``sweep`` stage: Ray Tune over depth × batch size × augmentation strength (× lr × loss).

Reads params: ``sweep`` plus ``model``, ``loss``, ``augment``, ``train``, ``ray.num_workers`` (the base of every
trial); input ``data/prepared/``. Writes (atomically, and only when every trial has ended):
``sweeps/results.csv`` (a row per trial), ``sweeps/best.json``, ``plots/sweep/`` (``phase.{png,csv}``: final online
kNN accuracy over batch size × strength, a panel per depth; ``lr.{png,csv}``: final online kNN accuracy against the
learning rate, a line per loss (and per depth, batch, strength where they vary), mean ± sd over seeds, the paper's
Figure 5 when the sweep lists lr and loss values; ``curves.csv``: every trial's per-epoch metrics); ``--out DIR``
writes both folders under DIR instead (a recorded study, as ``transfusion tables --out``). An interrupted sweep
exits 1 without touching the outputs; rerunning it resumes without redoing finished trials.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from pipeline.config.params import Params, load_params
from pipeline.data.storage import StorageError
from pipeline.data.types import DatasetError
from pipeline.io import atomic_dir, write_csv, write_json
from pipeline.runs.cluster import ClusterError
from pipeline.runs.tracking import TrackingError
from pipeline.training.loop import epoch_metrics
from stages._common import (
    around,
    params_options,
    process_started,
    runtime_errors,
    time_line,
)
from stages._job import job_options, run_job

if TYPE_CHECKING:
    from pipeline.runs.tune import JobResult

POINT = ("trial_id", "model.depth", "train.batch_size", "augment.strength", "train.lr", "loss.name", "train.seed")
LINES = ("loss.name", "model.depth", "train.batch_size", "augment.strength")  # plots/sweep/lr.png: a line per value


def columns() -> tuple[str, ...]:
    """``sweeps/results.csv``'s columns: the point, the last epoch's per-epoch metrics
    (:func:`~pipeline.training.loop.epoch_metrics`; ``seconds`` is the trial's training in all), the best online kNN,
    the blocks' health, how it ended."""
    return (*POINT, *(m for m in epoch_metrics() if m != "seconds"), "best_knn_acc", "min_positive",
            "max_uniform_rows", "dead_blocks", "epochs", "stopped_early", "seconds", "workers", "gpu_ids", "status",
            "error")


def curve_columns() -> tuple[str, ...]:
    """``plots/sweep/curves.csv``'s columns: a trial's every epoch and its per-epoch metrics."""
    return ("trial_id", "epoch", *epoch_metrics())


def best_trial(rows: list[dict[str, object]]) -> dict[str, object] | None:
    """The finished trial with the highest final online kNN accuracy (ties: the earliest trial id)."""
    done = [r for r in rows if r["status"] == "TERMINATED" and not math.isnan(r["knn_acc"])]
    return max(sorted(done, key=lambda r: str(r["trial_id"])), key=lambda r: r["knn_acc"]) if done else None


def write_outputs(params: Params, rows: list[dict[str, object]], sweeps: Path, plots: Path,
                  dataset: str = "") -> dict[str, object] | None:
    """results.csv, best.json (the best finished trial; {} if none) and plots/sweep/; returns the best row."""
    from pipeline import plots as P
    for r in rows:
        r.setdefault("train.lr", params.train.lr)
        r.setdefault("loss.name", params.loss.name)
        r.setdefault("train.seed", params.train.seed)
    rows = sorted(rows, key=lambda r: str(r["trial_id"]))
    best = best_trial(rows)
    with atomic_dir(plots) as out:
        early = {(r["train.batch_size"], r["augment.strength"], r["model.depth"]) for r in rows if r["stopped_early"]}
        dead = {(r["train.batch_size"], r["augment.strength"], r["model.depth"]) for r in rows if r.get("dead_blocks")}
        epochs = f"{params.sweep.epochs} epoch" + ("s" if params.sweep.epochs != 1 else "")
        title = f"final online kNN accuracy after {epochs}" + (f" ({dataset})" if dataset else "")
        P.phase_diagram(
            rows, x="train.batch_size", y="augment.strength", value="knn_acc", panel="model.depth",
            png=out / "phase.png", csv=out / "phase.csv", title=title,
            region=(lambda x, y, p: (x, y, p) in early) if early else None, region_label="stopped early by ASHA",
            marked=(lambda x, y, p: (x, y, p) in dead) if dead else None,
            marked_label="a dead TransFusion block (< 1 % positive pairs) in a trial of this cell")
        P.lr_curves(rows, x="train.lr", value="knn_acc", lines=LINES, png=out / "lr.png", csv=out / "lr.csv",
                    title=f"final online kNN accuracy against the learning rate, {epochs}"
                    + (f" ({dataset})" if dataset else ""))
        curves = [{"trial_id": r["trial_id"], **h} for r in rows for h in r["history"]]
        write_csv(out / "curves.csv", curves, curve_columns())
    write_csv(sweeps / "results.csv", rows, columns())
    write_json(sweeps / "best.json", {k: best[k] for k in columns() if k in best} if best else {})
    return best


@click.command("sweep")
@params_options(load_params)
@job_options("sweeps/ and plots/sweep/")
@runtime_errors(DatasetError, TrackingError, ClusterError, ValueError, StorageError)
def sweep_cmd(params: Params, data_dir: Path, base: Path, no_tracking: bool) -> None:
    """Sweep depth, batch size and augmentation strength with Ray Tune (each trial a Ray Train run)."""
    from pipeline.runs.sweep import run_sweep
    from pipeline.runs.tune import close_tune_job

    started = process_started()
    sweeps, plots = base / "sweeps", base / "plots/sweep"
    # every point of the grid is checked (exit 2) before Ray starts; the MLflow run ends with the block
    with run_job(run_sweep, params, data_dir, no_tracking) as result:
        best = write_outputs(params, result.rows, sweeps, plots, result.job.spec.manifest.get("dataset", ""))
        close_tune_job(result, [sweeps / "results.csv", sweeps / "best.json", plots / "phase.png",
                                plots / "phase.csv", plots / "lr.png", plots / "lr.csv", plots / "curves.csv"], best)
    failed = sum(r["status"] == "ERROR" for r in result.rows)
    if best:
        click.echo(f"swept {len(result.rows)} trials ({failed} failed) in {result.seconds:.0f} s; best knn_acc "
                   f"{best['knn_acc']:.4f} at depth {best['model.depth']}, batch {best['train.batch_size']}, "
                   f"strength {best['augment.strength']} -> {sweeps}/, {plots}/")
    now = time.time()
    click.echo(time_line("sweep", started, time_parts(started, result, now), now))


def time_parts(started: float, result: JobResult, now: float) -> list[tuple[str, float]]:
    """Where the stage's time went: before Ray Tune's run (imports, Ray's start, the checks, the MLflow parent run),
    the trials, after them (outputs, figures, MLflow)."""
    before, after = around(started, result.started, result.seconds, now)
    return [("start (imports, Ray, checks, MLflow run)", before), ("trials", result.seconds),
            ("outputs, figures and MLflow", after)]
