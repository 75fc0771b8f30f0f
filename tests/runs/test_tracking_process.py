"""The tracking process (pipeline/runs/tracking_process.py): the stage's MLflow calls made in a process of their own.

Here the class itself, from the test's process: answers, errors and printed lines come back; a stage that dies leaves
its run FAILED, not RUNNING. tests/stages/test_console.py runs ``transfusion pretrain`` as a program (the tracking
process started by the command) and checks that the stage's own process never imports MLflow, and what Ctrl-C and a
kill leave in the store.
"""

from __future__ import annotations

import json
import time

import mlflow
import pytest

from pipeline.runs import tracking
from pipeline.runs.tracking import TrackingError
from pipeline.runs.tracking_process import DIED, TrackingProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]  # each starts a process: 1.5-2.5 s of a core
MANIFEST = {"dataset": "digits", "n_train": 4, "n_val": 2, "n_test": 2, "classes": ["0", "1"], "input_shape": [1, 2, 2],
            "dtype": "uint8", "params": {"data": {}}, "files": {"train_x.npy": {"sha256": "a" * 64}}}


@pytest.fixture(scope="module")
def proc():
    """One tracking process for the tests that leave it answering (each starts in 1.5-2.5 s of a core)."""
    p = TrackingProcess()
    yield p
    p.close()
    p.proc.wait(timeout=60)


def wait_for_status(client: mlflow.MlflowClient, run_id: str, timeout: float = 60.0) -> str:
    end = time.monotonic() + timeout
    while (status := client.get_run(run_id).info.status) == "RUNNING" and time.monotonic() < end:
        time.sleep(0.2)
    return status


def test_calls_are_answered_in_order_as_in_this_process(proc, tmp_path, capsys):
    """A job's run made through the tracking process is the run the tracking module makes here: its name, tags,
    params, dataset input, the epochs sent without waiting, its artifacts and its end; the new store's line is
    printed here."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    exp = proc.experiment_id(uri, tmp_path)
    new_store = f"[mlflow] new tracking store {tmp_path / 'mlflow.db'} (browse it with `transfusion ui`)\n"
    assert capsys.readouterr().out == new_store
    run_id = proc.create_job_run(uri, tmp_path, "job", {"stage": "pretrain"}, {"train.lr": 0.1}, MANIFEST,
                                 tmp_path / "data")
    with proc.EpochLog(uri, run_id) as log:
        for epoch in (1, 2, 3):
            log({"epoch": epoch, "loss": 1.0 / epoch, "ended_at": 0.0})
    (tmp_path / "a.json").write_text("{}")
    proc.log_artifacts(uri, run_id, [tmp_path / "a.json"])
    proc.end_run(uri, run_id, "FINISHED", {"workers": json.dumps([0])})
    client = mlflow.MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.info.experiment_id == exp == tracking.experiment_id(uri, tmp_path)
    assert run.info.status == "FINISHED" and run.info.run_name == "job"
    assert run.data.params == {"train.lr": "0.1"} and run.data.tags["stage"] == "pretrain"
    assert run.data.tags["workers"] == "[0]"
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == [(1, 1.0), (2, 0.5),
                                                                                       (3, 1.0 / 3)]
    assert run.inputs.dataset_inputs[0].dataset.name == "digits"
    assert [a.path for a in client.list_artifacts(run_id)] == ["a.json"]


def test_an_error_there_is_raised_here_naming_the_store(proc, tmp_path):
    """Ours travel as they are; a library's error becomes a TrackingError with its type and first line."""
    (tmp_path / "garbage.db").write_text("not a database")
    with pytest.raises(TrackingError, match=r"^MLflow tracking store sqlite:///.*/garbage.db is not an SQLite"):
        proc.check_reachable(f"sqlite:///{tmp_path / 'garbage.db'}")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with pytest.raises(TrackingError, match=r"^MlflowException: Run .* not found"):
        proc.resume_run(uri, "0" * 32)
    with pytest.raises(AttributeError, match="no_such_call"):
        proc.no_such_call()
    assert proc.experiment_id(uri)  # and it goes on answering


def test_a_stage_that_dies_leaves_its_runs_failed_not_running(tmp_path):
    """End of input without a goodbye (the stage killed): the runs it created or resumed and did not end are ended
    FAILED with the reason; a run it ended keeps its status."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = TrackingProcess()
    proc.experiment_id(uri, tmp_path)
    left = proc.create_job_run(uri, tmp_path, "left", {}, {}, MANIFEST, tmp_path)
    ended = proc.create_job_run(uri, tmp_path, "ended", {}, {}, MANIFEST, tmp_path)
    proc.end_run(uri, ended, "KILLED")
    proc.proc.stdin.close()  # as when the stage's process is gone: no goodbye
    assert proc.proc.wait(timeout=60) == 0
    client = mlflow.MlflowClient(uri)
    assert client.get_run(left).info.status == "FAILED"
    assert client.get_run(left).data.tags["error"] == DIED
    assert client.get_run(ended).info.status == "KILLED"


def test_after_a_goodbye_the_runs_stay_as_the_stage_left_them(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = TrackingProcess()
    proc.experiment_id(uri, tmp_path)
    run_id = proc.create_job_run(uri, tmp_path, "job", {}, {}, MANIFEST, tmp_path)
    proc.close()
    assert proc.proc.wait(timeout=60) == 0
    assert mlflow.MlflowClient(uri).get_run(run_id).info.status == "RUNNING"


def test_a_block_that_fails_or_is_interrupted_reaches_the_context_manager_there(proc, tmp_path):
    """``system_metrics`` entered there ends the run FAILED when the block here raises, KILLED on Ctrl-C, as the
    tracking module's own context manager does in this process."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc.experiment_id(uri, tmp_path)
    client = mlflow.MlflowClient(uri)
    for error, status in ((RuntimeError("boom"), "FAILED"), (KeyboardInterrupt(), "KILLED")):
        run_id = proc.create_job_run(uri, tmp_path, status, {}, {}, MANIFEST, tmp_path)
        with pytest.raises(type(error)), proc.system_metrics(uri, run_id):
            raise error
        assert wait_for_status(client, run_id) == status


def test_a_tracking_process_that_is_gone_never_stops_training(tmp_path, capsys):
    """The epochs are sent without waiting: once the tracking process is gone they are one warning line and
    nothing more; a call that waits for an answer raises a TrackingError naming what happened."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = TrackingProcess()
    proc.experiment_id(uri, tmp_path)
    capsys.readouterr()
    proc.proc.kill()
    proc.proc.wait(timeout=60)
    for epoch in (1, 2, 3):
        proc.send("log_metrics_batch", uri, "0" * 32, [{"epoch": epoch, "loss": 1.0}], ("loss",))
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("[mlflow] warning: the MLflow tracking process ended (exit code -9)")
    with pytest.raises(TrackingError, match=r"the MLflow tracking process ended \(exit code -9\)"):
        proc.experiment_id(uri, tmp_path)
