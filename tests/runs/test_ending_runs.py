"""``pipeline.runs.job.ending_runs`` on a real MLflow sqlite store: a job's run that an error or Ctrl-C leaves RUNNING
ends FAILED with the error's one line as its ``error`` tag, or KILLED; one a deeper handler ended keeps its status."""

from __future__ import annotations

import mlflow
import pytest

from pipeline.io import OutputError
from pipeline.runs import job as J
from pipeline.runs import tracking as trk


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One sqlite store for the module (creating one takes seconds): its URI, its experiment, a client."""
    root = tmp_path_factory.mktemp("store")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    return root, uri, trk.experiment_id(uri, root), mlflow.MlflowClient(uri)


@pytest.fixture
def opened(store):
    """``opened()``: a new RUNNING job run, registered as ``open_job`` registers one (no Ray needed)."""
    root, uri, exp, client = store

    def make() -> J.Tracked:
        run = J.Tracked(uri, exp, trk.create_run(uri, root, "job", {}, {}))
        J.run_opened(run)  # as open_job does
        return run

    yield make, client
    for run in J.open_runs():
        J.run_ended(run)


def test_an_error_ends_the_run_failed_with_its_line_as_the_error_tag(opened):
    make, client = opened
    with pytest.raises(OutputError), J.ending_runs():
        run = make()
        raise OutputError("cannot write metrics/pretrain.json: a directory of that name is in the way")
    got = client.get_run(run.run_id)
    assert got.info.status == "FAILED" and got.info.end_time
    assert got.data.tags["error"] == "cannot write metrics/pretrain.json: a directory of that name is in the way"
    assert run not in J.open_runs()


def test_ctrl_c_ends_the_run_killed(opened):
    make, client = opened
    with pytest.raises(KeyboardInterrupt), J.ending_runs():
        run = make()
        raise KeyboardInterrupt
    got = client.get_run(run.run_id)
    assert got.info.status == "KILLED" and "error" not in got.data.tags


def test_a_run_ended_deeper_or_opened_before_the_block_is_left_alone(opened):
    make, client = opened
    earlier = make()
    with pytest.raises(ValueError), J.ending_runs():
        run = make()
        trk.end_run(run.uri, run.run_id, "KILLED")  # as tune_job ends an interrupted sweep, then raises
        J.run_ended(run)
        raise ValueError("bad\nsecond line")
    assert client.get_run(run.run_id).info.status == "KILLED"
    assert client.get_run(earlier.run_id).info.status == "RUNNING"
    with pytest.raises(ValueError), J.ending_runs():
        other = make()
        raise ValueError("bad\nsecond line")
    assert client.get_run(other.run_id).data.tags["error"] == "ValueError: bad"  # one line, not ours: its type
