"""The tracking store fails fast and in one paragraph when it cannot be used."""

from __future__ import annotations

import ast
import json
import sqlite3
from pathlib import Path

import pytest

from pipeline.config.names import data_digest
from pipeline.runs.tracking import (
    DVC_EXP_TAGS,
    IDENTITY_TAG,
    TrackingError,
    check_reachable,
    child_run,
    create_run,
    dataset_input,
    dvc_experiment_tags,
    end_run,
    experiment_id,
    log_metrics_batch,
)

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = {"dataset": "digits", "n_train": 256, "n_test": 360, "classes": list("0123456789"),
            "input_shape": [1, 8, 8], "dtype": "uint8", "params": {"data": {"limit_train": 256, "seed": 0}},
            "files": {"train.pt": {"sha256": "a" * 64}, "test.pt": {"sha256": "b" * 64}}}


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


def table_of(db: Path, rows: int, name: str = "t") -> None:
    """An SQLite file at ``db`` holding table ``name`` of the integers 0 .. rows - 1 in its column x."""
    con = sqlite3.connect(db)
    con.execute(f"create table {name} (x integer)")
    con.executemany(f"insert into {name} values (?)", [(i,) for i in range(rows)])
    con.commit()
    con.close()


def test_a_damaged_sqlite_file_is_refused(tmp_path):
    db = tmp_path / "mlflow.db"
    table_of(db, 5000)
    blob = bytearray(db.read_bytes())
    blob[4096:8192] = b"\xff" * 4096  # a page of the table overwritten
    db.write_bytes(bytes(blob))
    with pytest.raises(TrackingError, match="damaged SQLite database"):
        check_reachable(f"sqlite:///{db}")


def test_a_store_left_mid_write_by_a_killed_process_is_recovered_not_refused(tmp_path):
    """A process SIGKILLed inside a write (a driver killed mid-epoch, seen in CI) leaves a hot journal; SQLite rolls
    it back on the next read-write open. A read-only probe cannot (SQLITE_READONLY_ROLLBACK: "attempt to write a
    readonly database") and called such a store damaged."""
    import os
    import signal
    import subprocess
    import sys

    db = tmp_path / "mlflow.db"
    table_of(db, 3000)
    writer = subprocess.Popen([sys.executable, "-c", (
        "import sqlite3, sys, time\n"
        f"con = sqlite3.connect({str(db)!r}, isolation_level=None)\n"
        "con.execute('pragma cache_size=1'); con.execute('begin')\n"
        "con.execute('delete from t'); con.execute('insert into t values (-1)')\n"
        "print('mid-write', flush=True); time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "mid-write"
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    journal = tmp_path / "mlflow.db-journal"
    assert journal.exists() and journal.stat().st_size > 0  # hot: the killed transaction's pages
    check_reachable(f"sqlite:///{db}")  # recovered, not refused
    con = sqlite3.connect(db)
    assert con.execute("select count(*), min(x) from t").fetchone() == (3000, 0)  # the killed write rolled back
    con.close()


@pytest.mark.slow
def test_a_sqlite_store_of_another_program_is_one_paragraph(tmp_path):
    db = tmp_path / "mlflow.db"
    table_of(db, 0, "experiments")  # an MLflow table name, the wrong schema
    check_reachable(f"sqlite:///{db}")  # a healthy SQLite file...
    with pytest.raises(TrackingError, match="cannot be used") as err:
        experiment_id(f"sqlite:///{db}", tmp_path)  # ...that MLflow cannot use
    assert "\n" not in str(err.value) and len(str(err.value)) < 1000


def mlflow_imports(path: Path) -> list[str]:
    """``path:line`` of each MLflow import in ``path``: import, from-import, import_module/__import__ of a literal."""
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


@pytest.mark.slow
def test_only_the_tracking_module_imports_mlflow():
    """Every MLflow call of the library and the stages goes through pipeline/runs/tracking.py (stages/ui.py starts
    ``python -m mlflow server`` as a process, which is no import)."""
    files = sorted((ROOT / "pipeline").rglob("*.py")) + sorted((ROOT / "stages").rglob("*.py"))
    assert ROOT / "pipeline" / "runs" / "tracking.py" in files and len(files) > 10
    assert mlflow_imports(ROOT / "pipeline" / "runs" / "tracking.py"), "the scan finds tracking.py's own imports"
    offenders = [hit for f in files if f != ROOT / "pipeline" / "runs" / "tracking.py" for hit in mlflow_imports(f)]
    assert offenders == [], f"import MLflow through pipeline.runs.tracking instead: {offenders}"


def test_trials_and_rows_are_named_by_their_point_or_row():
    """A sweep trial's MLflow run is named by its point, a tables row by its name and table (``pipeline.config.names``
    makes the names; tests/config/test_names.py)."""
    from pipeline.config.params import load_params
    from pipeline.config.space import grid_points
    from pipeline.runs.sweep import SweepTracker
    from pipeline.runs.tables import TablesTracker

    default = load_params(ROOT / "params.yaml")
    names = [SweepTracker(1, "").child_name(point) for point in grid_points(default)]
    assert names[1] == "depth 0 · b16 · strength 1.0" and len(set(names)) == len(names) == 8
    seeds = load_params(ROOT / "params.yaml", ["sweep.num_samples=2"])
    assert SweepTracker(1, "").child_name(grid_points(seeds)[1]) == "depth 0 · b16 · strength 0.0 · s1"
    row = {"name": "TransFusion 9-Layer", "table": 1, "params": {"model.depth": 9}, "seed": 2, "control": None}
    tracker = TablesTracker(1, "", None, unit="GPU-hours")
    assert tracker.child_name({"row": row}) == "TransFusion 9-Layer (table 1) · seed 2"
    control = {"name": "random init", "table": 0, "params": {}, "seed": 0, "control": "random_init"}
    assert tracker.child_name({"row": control}) == "random init (control) · seed 0"
    assert tracker.labels({"row": control}) == {"table": 0, "row": "random init", "seed": 0, "control": "random_init"}


def test_dvc_experiment_tags_come_from_the_variables_dvc_sets():
    """``dvc exp run`` gives each stage command DVC_EXP_NAME and DVC_EXP_BASELINE_REV (dvc/env.py); they become the
    tags ``dvc.exp_name`` and ``dvc.exp_baseline``, and outside an experiment there are none."""
    from dvc import env

    assert set(DVC_EXP_TAGS) == {env.DVC_EXP_NAME, env.DVC_EXP_BASELINE_REV}  # DVC's own names for them
    commit = "c0ffee" * 6 + "ab"
    assert dvc_experiment_tags({"DVC_EXP_NAME": "bulky-lamb", "DVC_EXP_BASELINE_REV": commit, "DVC_ROOT": "/x"}) == {
        "dvc.exp_name": "bulky-lamb", "dvc.exp_baseline": commit}
    assert dvc_experiment_tags({"PATH": "/bin"}) == {}


def test_the_dataset_input_names_the_data_its_digest_and_source(tmp_path):
    data = dataset_input(MANIFEST, tmp_path / "data/prepared", context="evaluation")
    assert data.dataset.name == "digits" and data.dataset.digest == data_digest(MANIFEST)[:8]  # the staged copy's, cut
    assert len(data.dataset.digest) == 8 and data.dataset.source_type == "local"
    assert json.loads(data.dataset.source) == {"uri": str(tmp_path / "data/prepared")}
    profile = json.loads(data.dataset.profile)
    assert profile["train"] == 256 and profile["classes"] == 10 and profile["prepared_with"]["limit_train"] == 256
    assert [(t.key, t.value) for t in data.tags] == [("mlflow.data.context", "evaluation")]
    other = {**MANIFEST, "files": {**MANIFEST["files"], "test.pt": {"sha256": "c" * 64}}}
    assert data_digest(other) != data_digest(MANIFEST)


@pytest.mark.slow
def test_runs_children_metrics_and_endings(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.setenv("DVC_EXP_NAME", "bulky-lamb")
    monkeypatch.setenv("DVC_EXP_BASELINE_REV", "f" * 40)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    exp = experiment_id(uri, tmp_path)
    parent = create_run(uri, tmp_path, "job", {"stage": "sweep", IDENTITY_TAG: "sweep-0123"}, {"sweep.epochs": 3},
                        inputs=[dataset_input(MANIFEST, tmp_path)])
    child = child_run(uri, exp, parent, "trial-a", match={"trial_id": "a"}, tags={"stage": "sweep-trial"},
                      params={"lr": 0.1})
    client = MlflowClient(uri)
    for run in (client.get_run(parent), client.get_run(child)):  # the child inherits the data; both are tagged
        assert [(i.dataset.name, i.dataset.digest) for i in run.inputs.dataset_inputs] == [
            ("digits", data_digest(MANIFEST)[:8])]
        assert run.data.tags["dvc.exp_name"] == "bulky-lamb" and run.data.tags["dvc.exp_baseline"] == "f" * 40
    assert [r.info.run_id for r in client.search_runs([exp], "tags.dvc.exp_name = 'bulky-lamb' and "
                                                      "tags.identity = 'sweep-0123'")] == [parent]
    assert {r.info.run_id for r in client.search_runs([exp], "dataset.name = 'digits'")} == {parent, child}
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


@pytest.mark.slow
def test_param_keys_mlflow_refuses_are_made_valid(tmp_path):
    """A tables row's name is free text; the parent run's param key made of it must still be one MLflow takes."""
    import mlflow

    from pipeline.runs import tracking

    flat = tracking.flat_params({"tables.1.JSD (no head)": 1, "tables.1.InfoNCE tau 0.1": "x" * 7000})
    assert list(flat) == ["tables.1.JSD _no head_", "tables.1.InfoNCE tau 0.1"]
    assert len(flat["tables.1.InfoNCE tau 0.1"]) == 6000
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = tracking.create_run(uri, tmp_path, "job", {}, {"tables.1.JSD (no head)": '{"model.depth": 0}'})
    assert mlflow.MlflowClient(uri).get_run(run).data.params == {"tables.1.JSD _no head_": '{"model.depth": 0}'}
