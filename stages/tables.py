"""``tables`` command: the paper's Tables 1-2 as one Ray Tune job (``pipeline.runs.tables``).

Reads params: ``tables.rows`` (each row's overrides on ``model``/``loss``/``augment``/``train``), ``tables.seeds``,
``tables.controls``, ``ray``, ``probe``; input ``data/prepared/``. Writes (atomically, once every run has ended):
``tables/results.csv`` and ``tables/results.json`` (a record per row and seed, the controls' included),
``tables/curves.csv`` (per epoch: online kNN, loss, health), ``tables/tuning.csv`` (the tuning phase's trials, when
rows have a ``space``: ``tables.tuning``), and what renders from them: ``reports/TABLES.md`` (both
tables in the paper's layout, ours beside the paper's, mean ± sd over seeds, with each row's GPU-hours or, on a
CPU-only cluster, worker-hours; every probe of every row) and ``plots/tables/curves.png``. ``--render`` renders those
two again from the CSVs, without training. Invalid rows exit 2 before any work; an interrupted job exits 1 and
resumes when rerun.
"""

from __future__ import annotations

import json
from pathlib import Path

import click
from pydantic import ValidationError

from pipeline.config.base import ParamsError, format_error
from pipeline.config.params import Params, load_params
from pipeline.data.storage import StorageError
from pipeline.data.types import DatasetError
from pipeline.io import write_csv, write_json, write_text
from pipeline.runs.cluster import ClusterError
from pipeline.runs.tracking import TrackingError
from stages._common import ParamsUsageError, params_options, runtime_errors
from stages._job import job_options, run_job

REPORT = Path("reports/TABLES.md")
OUT = Path("tables")
FIGURE = Path("plots/tables/curves.png")


def write_outputs(base: Path, records: list[dict], curves: list[dict], params: Params, unit: str,
                  dataset: str, tuning: list[dict]) -> list[Path]:
    """What renders from the job's records, curves and tuning trials, under ``base``: ``reports/TABLES.md`` and the
    curves figure."""
    from pipeline.evaluation.tables_report import curves_figure, render

    report = render(records, params, unit, dataset, figure=f"../{FIGURE}", curves=curves, tuning=tuning)  # first:
    curves_figure(curves, base / FIGURE)  # a record it cannot render leaves both files as they were
    write_text(base / REPORT, report)
    return [base / REPORT, base / FIGURE]


def read_study(out: Path, reference: str | None = None) -> tuple[dict, Params]:
    """``out/results.json`` (what ``--render`` renders from) and the job's params in it, with ``tables.reference``
    set to ``reference`` if given (validated as the job validates it); a missing, truncated or wrongly shaped file is a
    :class:`click.ClickException` naming it, before anything is written."""
    path = out / "results.json"
    if not path.is_file():
        raise click.ClickException(f"no {path} to render: run `transfusion tables` first")
    try:
        saved = json.loads(path.read_text())
        try:
            job = Params.model_validate({**saved["params"], "tables": saved["tables"]}, strict=False)  # the job's own
        except ValidationError as e:  # its params, each problem named by key
            raise ParamsError("; ".join(format_error(e, str(path), Params).splitlines()[1:4]).strip()) from None
        if reference is not None:
            try:
                job = job.model_copy(update={"tables": type(job.tables).model_validate(
                    {**job.tables.model_dump(), "reference": reference})})
            except ValidationError as e:
                raise ParamsUsageError(f"--reference: {e.errors()[0]['msg'].removeprefix('Value error, ')}") from None
        if not isinstance(saved["hours_unit"], str) or not isinstance(saved["dataset"], str):
            raise TypeError("hours_unit and dataset must be strings")
        if not isinstance(saved.get("tuning", []), list):
            raise TypeError("tuning must be a list of records")
    except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError and ParamsError are ValueErrors
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise click.ClickException(f"{path} is damaged ({type(e).__name__}: {reason}); it was not rendered and "
                                   "nothing was written: restore it, or run `transfusion tables` again") from None
    return saved, job


@click.command("tables")
@params_options(load_params)
@job_options(f"{OUT}/, {REPORT} and {FIGURE}")
@click.option("--render", "render_only", is_flag=True,
              help=f"Only render {REPORT} and {FIGURE} again from {OUT}/ (the job's params, results.csv, curves.csv): "
                   "no training, no params read.")
@click.option("--reference", default=None, metavar="ROW",
              help="With --render: test every row against this row (or control) of the study, paired by seed, "
                   "instead of the job's tables.reference.")
@runtime_errors(DatasetError, TrackingError, ClusterError, StorageError)
def tables_cmd(params: Params, data_dir: Path, base: Path, no_tracking: bool, render_only: bool,
               reference: str | None) -> None:
    """Run tables.rows x tables.seeds (and the controls) as one Ray Tune job; write reports/TABLES.md."""
    from pipeline.evaluation.tables_report import (
        COLUMNS,
        csv_records,
        curve_columns,
        curve_rows,
        read_curves,
        read_records,
    )
    from pipeline.evaluation.tuning_report import TUNING_COLUMNS
    from pipeline.runs.tables import run_tables
    from pipeline.runs.tune import close_tune_job

    out = base / OUT
    if render_only:
        saved, job = read_study(out, reference)
        try:
            records, curves = read_records(out / "results.csv"), read_curves(out / "curves.csv")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise click.ClickException(f"{out}/results.csv or curves.csv is damaged or missing ({e}); it was not "
                                       "rendered and nothing was written") from None
        try:
            files = write_outputs(base, records, curves, job, saved["hours_unit"], saved["dataset"],
                                  saved.get("tuning", []))
        except (ValueError, KeyError, TypeError) as e:
            raise click.ClickException(f"{out}/ holds records that do not render ({type(e).__name__}: {e}); nothing "
                                       "was written: restore them, or run `transfusion tables` again") from None
        click.echo(f"tables: {' and '.join(map(str, files))} rendered from {out}/ ({len(records)} runs)")
        return
    if reference is not None:
        raise ParamsUsageError("--reference re-renders a finished study (with --render); a job reads "
                               "tables.reference (-S tables.reference=ROW)")
    # every row, and every point of a row's space, is checked (exit 2) before Ray starts; the MLflow run ends with
    # the block
    with run_job(run_tables, params, data_dir, no_tracking) as result:
        dataset = result.job.spec.manifest.get("dataset", "")
        curves = curve_rows(result.rows)
        write_csv(out / "results.csv", csv_records(result.rows), COLUMNS)
        write_csv(out / "curves.csv", curves, curve_columns(curves))
        tuned = [out / "tuning.csv"] if result.tuning else []
        if result.tuning:
            write_csv(out / "tuning.csv", result.tuning, TUNING_COLUMNS)
        write_json(out / "results.json", {"dataset": dataset, "hours_unit": result.unit,
                                          "rows": csv_records(result.rows), "params": params.model_dump(mode="json"),
                                          "tables": params.tables.model_dump(mode="json"), "tuning": result.tuning})
        files = write_outputs(base, result.rows, curves, params, result.unit, dataset, result.tuning)
        close_tune_job(result, [*files, out / "results.csv", out / "results.json", out / "curves.csv", *tuned])
    failed = sum(r["status"] != "TERMINATED" for r in result.rows)
    click.echo(f"tables: {len(result.rows)} runs ({failed} failed) in {result.seconds:.0f} s -> {files[0]}, "
               f"{out}/results.csv, {files[1]}")
