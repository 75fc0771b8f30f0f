"""``sets`` stage: ABC's set-clustering protocol on data this machine has (the circles, fresh subspaces, digits split
by class; Omniglot when its files are there): ABC (multiplicative, additive), TransFusion, the pairwise ablation and
RBF spectral clustering, with the number of clusters known and estimated by the eigengap.

Reads params: ``sets`` only. Writes (atomically): ``plots/sets/`` (``ari.png``, ``sets.csv`` the summary in long
form, ``runs.csv`` one row per data set × method × seed), ``reports/sets.md`` and ``metrics/sets.json``; one MLflow
parent run with a child per method and data set. No input data: everything is generated from the seeds in the
params, or read from scikit-learn's bundled digits (see :mod:`pipeline.data.set_tasks`,
:mod:`pipeline.evaluation.set_study`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import click

from pipeline.config.base import load_section
from pipeline.config.sets import SetsConfig
from pipeline.evaluation import set_report
from pipeline.evaluation.set_study import METRICS, run_study, summarize
from pipeline.io import atomic_dir, write_csv, write_json, write_text
from stages._common import params_options, runtime_errors

PLOTS = Path("plots/sets")
METRICS_PATH = Path("metrics/sets.json")
REPORT = Path("reports/sets.md")


def load_sets(path: str, overrides: Sequence[str] = ()) -> SimpleNamespace:
    """The ``sets`` section of ``path`` with ``overrides``, validated alone."""
    return SimpleNamespace(sets=load_section(path, "sets", SetsConfig, overrides))


def log_runs(cfg: SetsConfig, summary: dict, files: list[Path]) -> str:
    """One MLflow parent run (the setup as params, every mean as a metric ``<data>.<method>.<metric>``, the files)
    and a child per data set and method (its means and sds); returns the parent's id."""
    from pipeline.runs import tracking as trk

    root = trk.project_root()
    params = {f"sets.{k}": v for k, v in cfg.model_dump().items()}
    flat = {f"{d}.{m}.{k}": v for d, ms in summary.items() for m, e in ms.items() for k, v in e.items()
            if k in METRICS}
    parent = trk.log_stage_run("sets", root, params=params, metrics=flat, files=files, artifact_path="sets",
                               name=f"sets{trk.SEP}{'+'.join(cfg.datasets)}{trk.SEP}{len(cfg.seeds)} seeds")
    for d, ms in summary.items():
        for m, e in ms.items():
            metrics = {k: v for k, v in e.items() if isinstance(v, (int, float)) and v == v}
            trk.log_stage_run("sets", root, params={**params, "dataset": d, "method": m}, metrics=metrics, files=[],
                              parent=parent, name=f"{m}{trk.SEP}{d}")
    return parent


def run(cfg: SetsConfig, plots: Path = PLOTS, metrics: Path = METRICS_PATH, report: Path = REPORT,
        progress: Any = click.echo, track: bool = True) -> dict:
    """The study, its files and (``track``) its MLflow runs; returns what ``metrics`` holds."""
    start = time.perf_counter()
    runs = run_study(cfg, progress)
    summary = summarize(runs)
    setup = cfg.model_dump(include={"steps", "batch_sets", "lr", "blocks", "width", "heads", "test_sets", "seeds",
                                    "k_max"})
    with atomic_dir(plots) as out:
        set_report.figure(summary, out / "ari.png")
        write_csv(out / "sets.csv", set_report.rows(summary))
        write_csv(out / "runs.csv", runs)
    result = {"setup": setup, "summary": summary, "seconds": round(time.perf_counter() - start, 1)}
    write_text(report, set_report.render(summary, setup, figure=f"../{plots}/ari.png", level=1))
    write_json(metrics, result)
    if track:
        log_runs(cfg, summary, [plots / "ari.png", plots / "sets.csv", report])
    return result


@click.command("sets")
@params_options(load_sets)
@click.option("--quiet", is_flag=True, help="No per-run progress lines.")
@click.option("--no-mlflow", "no_mlflow", is_flag=True, help="Do not log MLflow runs.")
@runtime_errors(FileNotFoundError)
def sets_cmd(params: Any, quiet: bool, no_mlflow: bool) -> None:
    """ABC's set-clustering protocol: five methods on sets of unseen classes, k known and estimated."""
    m = run(params.sets, progress=None if quiet else click.echo, track=not no_mlflow)
    best = set_report.winners(m["summary"])
    for name, text in best.items():
        click.echo(f"sets: {name}: {text}")
    click.echo(f"sets: {m['seconds']} s -> {PLOTS}/, {REPORT}, {METRICS_PATH}")
