"""``sets`` stage: ABC's set-clustering protocol on data this machine has (the circles, fresh subspaces, digits split
by class; Omniglot when its files are there): ABC (multiplicative, additive), TransFusion, the pairwise ablation and
RBF spectral clustering, with the number of clusters known and estimated by the eigengap.

Reads params: ``sets`` only. Writes (atomically): ``plots/sets/`` (``ari.png``, ``sets.csv`` the summary in long
form, ``runs.csv`` one row per data set × method × seed), ``reports/sets.md`` and ``metrics/sets.json``; one MLflow
parent run with a child per method and data set. No input data: everything is generated from the seeds in the
params, or read from scikit-learn's bundled digits, or Omniglot under ``sets.omniglot_root`` when ``omniglot`` is
in ``sets.datasets`` (see :mod:`pipeline.data.set_tasks`, :mod:`pipeline.evaluation.set_study`). Every input is
checked before any work (:func:`pipeline.data.set_tasks.check_inputs`): missing or malformed Omniglot files exit 1,
a set size or k range the data cannot fill exits 2, each naming the key; nothing is written, no run is logged.
"""

from __future__ import annotations

import csv
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace

import click

from pipeline.config.base import ParamsError, load_section
from pipeline.config.names import SEP
from pipeline.config.sets import SetsConfig
from pipeline.data.set_tasks import check_inputs
from pipeline.data.types import DatasetError
from pipeline.evaluation import set_report
from pipeline.evaluation.set_study import METRICS, run_study, summarize
from pipeline.io import atomic_dir, write_csv, write_json, write_text
from stages._common import ParamsUsageError, params_options, runtime_errors

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
                               name=f"sets{SEP}{'+'.join(cfg.datasets)}{SEP}{len(cfg.seeds)} seeds")
    for d, ms in summary.items():
        for m, e in ms.items():
            metrics = {k: v for k, v in e.items() if isinstance(v, (int, float)) and v == v}
            trk.log_stage_run("sets", root, params={**params, "dataset": d, "method": m}, metrics=metrics, files=[],
                              parent=parent, name=f"{m}{SEP}{d}")
    return parent


def circles_study(path: Path = set_report.CIRCLES_STUDY) -> dict | None:
    """The full-length circles study's summary (:func:`set_report.circles_summary` of ``benchmarks/study_circles.py``'s
    CSV), or None where the file is not there; a :class:`DatasetError` naming the file where it cannot be read."""
    if not path.is_file():
        return None
    try:
        with path.open(newline="") as f:
            return set_report.circles_summary(list(csv.DictReader(f)))
    except (OSError, UnicodeDecodeError, csv.Error, KeyError, ValueError, TypeError, ZeroDivisionError) as exc:
        raise DatasetError(f"{path} is not the circles study's CSV ({type(exc).__name__}: {exc}); rerun "
                           f"`{set_report.CIRCLES_COMMAND}` to rewrite it, or delete it") from None


def run(cfg: SetsConfig, plots: Path = PLOTS, metrics: Path = METRICS_PATH, report: Path = REPORT,
        progress: Callable[[str], object] | None = click.echo, track: bool = True) -> dict:
    """The study, its files and (``track``) its MLflow runs; returns what ``metrics`` holds. The recorded circles
    study (``benchmarks/results/circles.csv``), when there, joins the report, the metrics and the plots."""
    start = time.perf_counter()
    circles = circles_study()
    runs = run_study(cfg, progress)
    summary = summarize(runs)
    setup = cfg.model_dump(include={"steps", "batch_sets", "lr", "blocks", "width", "heads", "circles_heads",
                                    "abc_attention", "abc_projection", "test_sets", "seeds", "k_max"})
    with atomic_dir(plots) as out:
        set_report.figure(summary, out / "ari.png")
        write_csv(out / "sets.csv", set_report.rows(summary))
        write_csv(out / "runs.csv", runs)
        if circles:
            set_report.circles_figure(circles, out / "circles.png")
    result = {"setup": setup, "summary": summary, "seconds": round(time.perf_counter() - start, 1)}
    text = set_report.render(summary, setup, figure=f"../{plots}/ari.png", level=1)
    if circles:
        result["circles"] = circles
        text += "\n" + set_report.circles_section(circles, figure=f"../{plots}/circles.png")
    write_text(report, text)
    write_json(metrics, result)
    if track:
        log_runs(cfg, summary, [plots / "ari.png", plots / "sets.csv", report]
                 + ([plots / "circles.png"] if circles else []))
    return result


@click.command("sets")
@params_options(load_sets)
@click.option("--quiet", is_flag=True, help="No per-run progress lines.")
@click.option("--no-mlflow", "no_mlflow", is_flag=True, help="Do not log MLflow runs.")
@runtime_errors(FileNotFoundError, DatasetError)
def sets_cmd(params: SimpleNamespace, quiet: bool, no_mlflow: bool) -> None:
    """ABC's set-clustering protocol: five methods on sets of unseen classes, k known and estimated."""
    try:  # before any work: the data the study reads (exit 1 when missing), the sets it can draw (exit 2)
        check_inputs(params.sets)
    except ParamsError as exc:
        raise ParamsUsageError(str(exc)) from None
    m = run(params.sets, progress=None if quiet else click.echo, track=not no_mlflow)
    best = set_report.winners(m["summary"])
    for name, text in best.items():
        click.echo(f"sets: {name}: {text}")
    click.echo(f"sets: {m['seconds']} s -> {PLOTS}/, {REPORT}, {METRICS_PATH}")
