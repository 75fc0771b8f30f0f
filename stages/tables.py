"""``tables`` command: the paper's Tables 1-2 as one Ray Tune job (``pipeline.runs.tables``).

Reads params: ``tables.rows`` (each row's overrides on ``model``/``loss``/``augment``/``train``), ``ray``, ``probe``;
input ``data/prepared/``. Writes (atomically, once every row has ended): ``reports/TABLES.md`` (both tables in the
paper's layout, ours beside the paper's, with each row's GPU-hours or, on a CPU-only cluster, worker-hours),
``tables/results.csv`` and ``tables/results.json`` (a record per row). Invalid rows exit 2 before any work; an
interrupted job exits 1 and resumes when rerun.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from pipeline.config.base import ParamsError
from pipeline.config.params import Params, load_params
from pipeline.data.types import DatasetError
from pipeline.io import write_csv, write_json, write_text
from pipeline.runs.cluster import ClusterError
from pipeline.runs.storage import StorageError
from pipeline.runs.tracking import TrackingError, project_root
from stages._common import ParamsUsageError, check_weights, params_options, runtime_errors

REPORT = Path("reports/TABLES.md")
OUT = Path("tables")


@click.command("tables")
@params_options(load_params)
@click.option("--data", "data_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("data/prepared"),
              show_default=True)
@click.option("--no-tracking", is_flag=True, help="Do not log to MLflow.")
@runtime_errors(DatasetError, TrackingError, ClusterError, StorageError)
def tables_cmd(params: Params, data_dir: Path, no_tracking: bool) -> None:
    """Run the paper's Tables 1-2 (tables.rows) as one Ray Tune job and write reports/TABLES.md."""
    from pipeline.data.prepared import load_prepared
    from pipeline.evaluation.tables_report import COLUMNS, csv_records, render
    from pipeline.runs.tables import resolve_rows, run_tables
    from pipeline.runs.train import cleanup
    from pipeline.runs.tune import SweepError, finish_tracking

    try:  # every row resolves to valid params of its table before any work
        resolve_rows(params)
    except ParamsError as exc:
        raise ParamsUsageError(str(exc)) from None
    check_weights(params.model.weights)
    root = project_root()
    load_prepared(data_dir, verify=True, mmap=True)  # a corrupt input fails here (mapped: never read whole)
    try:
        result, unit = run_tables(params, data_dir, root, tracking=not no_tracking)
    except ParamsError as exc:  # a row's batch beyond the prepared data, a request the cluster can never hold
        raise ParamsUsageError(str(exc)) from None
    except SweepError as exc:
        raise click.ClickException(str(exc)) from exc
    dataset = json.loads((data_dir / "manifest.json").read_text()).get("dataset", "")
    write_csv(OUT / "results.csv", csv_records(result.rows), COLUMNS)
    write_json(OUT / "results.json", {"dataset": dataset, "hours_unit": unit, "rows": csv_records(result.rows)})
    write_text(REPORT, render(result.rows, params, unit, dataset))
    finish_tracking(root, result, None, [REPORT, OUT / "results.csv", OUT / "results.json"])
    cleanup(params, root, result.name, result.trial_runs())
    failed = sum(r["status"] != "TERMINATED" for r in result.rows)
    click.echo(f"tables: {len(result.rows)} rows ({failed} failed) in {result.seconds:.0f} s -> {REPORT}, "
               f"{OUT}/results.csv")
