"""``sweep`` stage: Ray Tune over depth × batch size × augmentation strength (× lr).

Reads params: ``sweep`` plus ``model``, ``loss``, ``augment``, ``train``, ``ray`` (the base of every trial);
input ``data/prepared/``. Writes (atomically): ``sweeps/results.csv`` (a row per trial), ``sweeps/best.json``,
``plots/sweep/phase.{png,csv}`` (online kNN accuracy over batch size × strength, a panel per depth).
An interrupted sweep resumes without redoing finished trials.
"""

from __future__ import annotations

import csv
import io
import math
import shutil
from pathlib import Path

import click

from pipeline.config import Params
from pipeline.datasets import DatasetError
from pipeline.io import atomic_dir, write_json, write_text
from pipeline.tracking import TrackingError, check_reachable, project_root, tracking_uri
from stages._common import params_options, runtime_errors

COLUMNS = ("trial_id", "model.depth", "train.batch_size", "augment.strength", "train.lr", "view_noise", "knn_acc",
           "best_knn_acc", "loss", "epochs", "stopped_early", "seconds", "status")


@click.command("sweep")
@params_options
@click.option("--data", "data_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("data/prepared"),
              show_default=True)
@click.option("--no-tracking", is_flag=True, help="Do not log to MLflow.")
@runtime_errors(DatasetError, TrackingError, ValueError)
def sweep_cmd(params: Params, data_dir: Path, no_tracking: bool) -> None:
    """Sweep depth, batch size and augmentation strength with Ray Tune (each trial a Ray Train run)."""
    from pipeline import figures
    from pipeline.datasets import load_prepared
    from pipeline.sweep import log_sweep, run_sweep
    from pipeline.train import _storage

    root = project_root()
    if not no_tracking:
        check_reachable(tracking_uri(root))
    load_prepared(data_dir, verify=True)
    rows, name = run_sweep(params, data_dir, root)
    for r in rows:
        r.setdefault("train.lr", params.train.lr)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore")
    w.writeheader()
    w.writerows(sorted(rows, key=lambda r: str(r["trial_id"])))
    write_text("sweeps/results.csv", buf.getvalue())
    done = [r for r in rows if not math.isnan(r["knn_acc"])]
    best = max(done, key=lambda r: r["knn_acc"]) if done else None
    write_json("sweeps/best.json", {k: best[k] for k in COLUMNS if k in best} if best else {})
    with atomic_dir(Path("plots/sweep")) as out:
        figures.phase_diagram(rows, x="train.batch_size", y="augment.strength", value="knn_acc", panel="model.depth",
                              png=out / "phase.png", csv=out / "phase.csv")
    if not no_tracking:
        log_sweep(params, rows, root, name, [Path("sweeps/results.csv"), Path("sweeps/best.json"),
                                            Path("plots/sweep/phase.png")])
    storage = _storage(params, root)
    if "://" not in storage:  # a finished sweep is forgotten so that a forced rerun sweeps again
        shutil.rmtree(Path(storage) / name, ignore_errors=True)
        for r in rows:
            shutil.rmtree(Path(storage) / f"trial-{r['trial_id']}", ignore_errors=True)
    if best:
        click.echo(f"swept {len(rows)} trials; best knn_acc {best['knn_acc']:.4f} at depth {best['model.depth']}, "
                   f"batch {best['train.batch_size']}, strength {best['augment.strength']} -> sweeps/")
