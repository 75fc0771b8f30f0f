"""An output path that cannot be written (here: a directory where a file goes, a file where a directory goes), after a
real job on Ray and a real MLflow sqlite store: exit 1 with one line naming the path, no traceback, no temporary or
half-written file, and the job's MLflow run ended FAILED with that line as its ``error`` tag (pipeline.runs.job's
``ending_runs``, pipeline.io's ``OutputError``). The cheapest job of each stage: one epoch, one trial, one row."""

from __future__ import annotations

from pathlib import Path

import mlflow
import pytest

from tests.conftest import invoke

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

OUTPUT_DIRS = ("models", "metrics", "plots", "sweeps", "tables", "reports")


def job_run(project: Path, stage: str):
    """The stage's one MLflow job run (the parent of a Tune job's trial runs)."""
    client = mlflow.MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    exp = client.get_experiment_by_name("transfusion")
    runs = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("stage") == stage]
    assert len(runs) == 1, [r.data.tags for r in runs]
    return runs[0]


def leftovers(project: Path) -> list[Path]:
    """Temporary siblings (``.<name>.*.tmp``) and swapped-out directories (``.<name>.old-<pid>``) under the outputs."""
    return [p for d in OUTPUT_DIRS for p in (project / d).rglob(".*") if p.name.endswith(".tmp") or ".old-" in p.name]


def check_blocked(project: Path, result, stage: str, blocked: str, why: str) -> None:
    assert result.exit_code == 1, result.output
    assert f"Error: cannot write {blocked}: {why}" in result.output
    assert "Traceback" not in result.output
    run = job_run(project, stage)
    assert run.info.status == "FAILED"
    assert run.data.tags["error"].startswith(f"cannot write {blocked}: {why}")
    assert not leftovers(project), leftovers(project)


def test_pretrain_with_a_directory_in_a_files_place(prepared, ray_session):
    """The issue's case: ``metrics/pretrain.json`` is a directory. Nothing of it is touched."""
    (prepared / "metrics/pretrain.json").mkdir(parents=True)
    (prepared / "metrics/pretrain.json/keep.txt").write_text("someone's")
    result = invoke("pretrain", "-S", "train.epochs=1", "-S", "train.batch_size=128", "-S", "model.embed_dim=32")
    check_blocked(prepared, result, "pretrain", "metrics/pretrain.json", "a directory of that name is in the way")
    assert [p.name for p in (prepared / "metrics").iterdir()] == ["pretrain.json"]
    assert (prepared / "metrics/pretrain.json/keep.txt").read_text() == "someone's"
    assert not (prepared / "plots/pretrain.csv").exists()  # written after the metrics: never started


def test_sweep_with_a_file_in_a_directorys_place(prepared, ray_session):
    """``plots/sweep`` (a directory output) is a file: the sweep's one trial finishes, its outputs are refused."""
    (prepared / "plots").mkdir()
    (prepared / "plots/sweep").write_text("in the way")
    result = invoke("sweep", "-S", "model.embed_dim=16", "-S", "sweep.depth=[1]", "-S", "sweep.batch_size=[64]",
                    "-S", "sweep.strength=[1.0]", "-S", "sweep.epochs=1")
    check_blocked(prepared, result, "sweep", "plots/sweep", "a file of that name is in the way")
    assert (prepared / "plots/sweep").read_text() == "in the way"
    assert [p.name for p in (prepared / "plots").iterdir()] == ["sweep"]
    assert not (prepared / "sweeps").exists()  # written after plots/sweep/: never started


def test_tables_with_a_directory_in_the_reports_place(prepared, ray_session):
    """``reports/TABLES.md``, the last output the tables job writes, is a directory: those before it are whole."""
    (prepared / "reports/TABLES.md").mkdir(parents=True)
    result = invoke("tables", "-S", "tables.rows=[{name: InfoNCE, table: 1}]", "-S", "tables.seeds=[0]",
                    "-S", "tables.controls=[]", "-S", "train.epochs=1", "-S", "probe.probes=[knn200]")
    check_blocked(prepared, result, "tables", "reports/TABLES.md", "a directory of that name is in the way")
    assert (prepared / "reports/TABLES.md").is_dir() and not any((prepared / "reports/TABLES.md").iterdir())
    assert sorted(p.name for p in (prepared / "tables").iterdir()) == ["curves.csv", "results.csv", "results.json"]
