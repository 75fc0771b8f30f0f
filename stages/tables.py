"""``tables`` command: the paper's Tables 1-2 as one Ray Tune job (``pipeline.runs.tables``).

Reads params: ``tables.rows`` (each row's overrides on ``model``/``loss``/``augment``/``train``), ``tables.seeds``,
``tables.controls``, ``ray``, ``probe``; input ``data/prepared/``. Writes (atomically, once every run has ended):
``tables/results.csv`` and ``tables/results.json`` (a record per row and seed, the controls' included),
``tables/curves.csv`` (per epoch: online kNN, loss, health), and what renders from them: ``reports/TABLES.md`` (both
tables in the paper's layout, ours beside the paper's, mean ± sd over seeds, with each row's GPU-hours or, on a
CPU-only cluster, worker-hours; every probe of every row) and ``plots/tables/curves.png``. ``--render`` renders those
two again from the CSVs, without training. Invalid rows exit 2 before any work; an interrupted job exits 1 and
resumes when rerun.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from pipeline.config.base import ParamsError
from pipeline.config.params import Params, load_params
from pipeline.data.storage import StorageError
from pipeline.data.types import DatasetError
from pipeline.io import write_csv, write_json, write_text
from pipeline.runs.cluster import ClusterError
from pipeline.runs.tracking import TrackingError
from stages._common import ParamsUsageError, params_options, runtime_errors
from stages._job import run_job

REPORT = Path("reports/TABLES.md")
OUT = Path("tables")
FIGURE = Path("plots/tables/curves.png")


def write_outputs(base: Path, records: list[dict], curves: list[dict], params: Params, unit: str,
                  dataset: str) -> list[Path]:
    """What renders from the job's records and curves, under ``base``: ``reports/TABLES.md`` and the curves figure."""
    from pipeline.evaluation.tables_report import curves_figure, render

    curves_figure(curves, base / FIGURE)
    write_text(base / REPORT, render(records, params, unit, dataset, figure=f"../{FIGURE}", curves=curves))
    return [base / REPORT, base / FIGURE]


@click.command("tables")
@params_options(load_params)
@click.option("--data", "data_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("data/prepared"),
              show_default=True)
@click.option("--out", "base", type=click.Path(file_okay=False, path_type=Path), default=Path("."),
              help=f"Where {OUT}/, {REPORT} and {FIGURE} go (a recorded study's folder).")
@click.option("--no-tracking", is_flag=True, help="Do not log to MLflow.")
@click.option("--render", "render_only", is_flag=True,
              help=f"Only render {REPORT} and {FIGURE} again from {OUT}/ (the job's params, results.csv, curves.csv): "
                   "no training, no params read.")
@runtime_errors(DatasetError, TrackingError, ClusterError, StorageError)
def tables_cmd(params: Params, data_dir: Path, base: Path, no_tracking: bool, render_only: bool) -> None:
    """Run tables.rows x tables.seeds (and the controls) as one Ray Tune job; write reports/TABLES.md."""
    from pipeline.evaluation.tables_report import (
        COLUMNS,
        csv_records,
        curve_columns,
        curve_rows,
        read_curves,
        read_records,
    )
    from pipeline.evaluation.tables_rows import resolve_rows
    from pipeline.runs.tables import run_tables
    from pipeline.runs.tune import close_tune_job

    out = base / OUT
    if render_only:
        if not (out / "results.json").is_file():
            raise click.ClickException(f"no {out}/results.json to render: run `transfusion tables` first")
        saved = json.loads((out / "results.json").read_text())
        job = Params.model_validate({**saved["params"], "tables": saved["tables"]}, strict=False)  # the job's own
        records = read_records(out / "results.csv")
        files = write_outputs(base, records, read_curves(out / "curves.csv"), job, saved["hours_unit"],
                              saved["dataset"])
        click.echo(f"tables: {' and '.join(map(str, files))} rendered from {out}/ ({len(records)} runs)")
        return
    try:  # every row resolves to valid params of its table before any work
        resolve_rows(params)
    except ParamsError as exc:
        raise ParamsUsageError(str(exc)) from None
    with run_job(run_tables, params, data_dir, no_tracking) as (result, unit):  # the MLflow run ends with the block
        dataset = json.loads((data_dir / "manifest.json").read_text()).get("dataset", "")
        curves = curve_rows(result.rows)
        write_csv(out / "results.csv", csv_records(result.rows), COLUMNS)
        write_csv(out / "curves.csv", curves, curve_columns(curves))
        write_json(out / "results.json", {"dataset": dataset, "hours_unit": unit, "rows": csv_records(result.rows),
                                          "params": params.model_dump(mode="json"),
                                          "tables": params.tables.model_dump(mode="json")})
        files = write_outputs(base, result.rows, curves, params, unit, dataset)
        close_tune_job(result, [*files, out / "results.csv", out / "results.json", out / "curves.csv"])
    failed = sum(r["status"] != "TERMINATED" for r in result.rows)
    click.echo(f"tables: {len(result.rows)} runs ({failed} failed) in {result.seconds:.0f} s -> {files[0]}, "
               f"{out}/results.csv, {files[1]}")
