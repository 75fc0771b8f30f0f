"""The tracking store fails fast and in one paragraph when it cannot be used."""

from __future__ import annotations

import ast
import sqlite3
from pathlib import Path

import pytest

from pipeline.tracking import (
    TrackingError,
    check_reachable,
    child_run,
    create_run,
    end_run,
    experiment_id,
    log_metrics_batch,
)

ROOT = Path(__file__).resolve().parents[1]


def test_missing_or_empty_store_is_fine(tmp_path):
    check_reachable(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (tmp_path / "empty.db").write_bytes(b"")
    check_reachable(f"sqlite:///{tmp_path / 'empty.db'}")


def test_a_garbage_file_is_named_with_the_fix(tmp_path):
    db = tmp_path / "mlflow.db"
    db.write_bytes(b"this is not a database at all\n" * 100)
    with pytest.raises(TrackingError) as err:
        check_reachable(f"sqlite:///{db}")
    text = str(err.value)
    assert "is not an SQLite database" in text and str(db) in text and "MLFLOW_TRACKING_URI" in text
    assert "\n" not in text


def test_a_damaged_sqlite_file_is_refused(tmp_path):
    db = tmp_path / "mlflow.db"
    con = sqlite3.connect(db)
    con.execute("create table t (x integer)")
    con.executemany("insert into t values (?)", [(i,) for i in range(5000)])
    con.commit()
    con.close()
    blob = bytearray(db.read_bytes())
    blob[4096:8192] = b"\xff" * 4096  # a page of the table overwritten
    db.write_bytes(bytes(blob))
    with pytest.raises(TrackingError, match="damaged SQLite database"):
        check_reachable(f"sqlite:///{db}")


@pytest.mark.slow
def test_a_sqlite_store_of_another_program_is_one_paragraph(tmp_path):
    db = tmp_path / "mlflow.db"
    con = sqlite3.connect(db)
    con.execute("create table experiments (x integer)")  # an MLflow table name, the wrong schema
    con.commit()
    con.close()
    check_reachable(f"sqlite:///{db}")  # a healthy SQLite file...
    with pytest.raises(TrackingError, match="cannot be used") as err:
        experiment_id(f"sqlite:///{db}", tmp_path)  # ...that MLflow cannot use
    assert "\n" not in str(err.value) and len(str(err.value)) < 1000


def mlflow_imports(path: Path) -> list[str]:
    """The lines of ``path`` that import MLflow (``import mlflow...``, ``from mlflow... import``, or
    ``importlib.import_module`` / ``__import__`` of a literal ``mlflow...`` name)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names = [node.args[0].value]
        if any(n == "mlflow" or n.startswith("mlflow.") for n in names):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_only_the_tracking_module_imports_mlflow():
    """Every MLflow call of the library and the stages goes through pipeline/tracking.py (stages/ui.py starts
    ``python -m mlflow server`` as a process, which is no import)."""
    files = sorted((ROOT / "pipeline").rglob("*.py")) + sorted((ROOT / "stages").rglob("*.py"))
    assert ROOT / "pipeline" / "tracking.py" in files and len(files) > 10
    assert mlflow_imports(ROOT / "pipeline" / "tracking.py"), "the scan finds tracking.py's own imports"
    offenders = [hit for f in files if f != ROOT / "pipeline" / "tracking.py" for hit in mlflow_imports(f)]
    assert offenders == [], f"import MLflow through pipeline.tracking instead: {offenders}"


@pytest.mark.slow
def test_runs_children_metrics_and_endings(tmp_path):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    exp = experiment_id(uri, tmp_path)
    parent = create_run(uri, tmp_path, "job", {"stage": "sweep"}, {"sweep.epochs": 3})
    child = child_run(uri, exp, parent, "trial-a", match={"trial_id": "a"}, tags={"stage": "sweep-trial"},
                      params={"lr": 0.1})
    end_run(uri, child, "KILLED")
    assert child_run(uri, exp, parent, "trial-a", match={"trial_id": "a"}, tags={}, params={}) == child
    client = MlflowClient(uri)
    run = client.get_run(child)
    assert run.info.status == "RUNNING" and run.info.run_name == "trial-a"
    assert run.data.tags["mlflow.parentRunId"] == parent and run.data.tags["stage"] == "sweep-trial"
    assert run.data.params == {"lr": "0.1"}
    rows = [{"epoch": 1, "loss": 2.0, "knn_acc": float("nan")}, {"epoch": 2, "loss": 1.5, "knn_acc": None}]
    log_metrics_batch(uri, child, rows, ("loss", "knn_acc"))
    assert [(m.step, m.value) for m in client.get_metric_history(child, "loss")] == [(1, 2.0), (2, 1.5)]
    assert client.get_metric_history(child, "knn_acc") == []
    end_run(uri, child, "FAILED", tags={"stopped_early": False, "error": "boom"})
    run = client.get_run(child)
    assert run.info.status == "FAILED" and run.data.tags["stopped_early"] == "False"
    assert run.data.tags["error"] == "boom"
    end_run(None, parent, "FAILED")  # no store: nothing happens
    assert client.get_run(parent).info.status == "RUNNING"
