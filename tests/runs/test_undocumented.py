"""What pipeline/runs/undocumented.py uses of Ray and MLflow because no public API does the job, each against the
installed Ray and MLflow: an upgrade that moves or changes one fails here, by name (docs/cluster.md lists them)."""

from __future__ import annotations

import inspect
import json
import os
import time
from dataclasses import asdict

import pytest

from pipeline.runs import undocumented as U
from pipeline.runs.undocumented import AUTOSCALER_REPORT_STALE_S, pending_in_report


def test_the_engines_are_the_versions_each_use_was_read_against():
    """A new Ray or MLflow: read each use below again against it, then update ``CHECKED_ON``."""
    import mlflow
    import ray

    assert {"ray": ray.__version__, "mlflow": mlflow.__version__} == U.CHECKED_ON


def test_ray_train_keeps_its_run_record_checkpoints_and_poll_interval_where_they_are_read(tmp_path):
    from ray.train.v2._internal import constants
    from ray.train.v2._internal.execution import storage

    assert constants.CHECKPOINT_MANAGER_SNAPSHOT_FILENAME == U.SNAPSHOT_FILE
    assert constants.HEALTH_CHECK_INTERVAL_S_ENV_VAR == U.REPORT_POLL_ENV
    assert U.REPORT_POLL_ENV in constants.ENV_VARS_TO_PROPAGATE  # the controller reads the driver's value
    assert 'return f"checkpoint_{date_str(include_ms=True)}"' in inspect.getsource(storage)
    assert U.CHECKPOINT_PREFIX == "checkpoint_"
    assert not U.torn_snapshot(str(tmp_path))  # no record
    (tmp_path / U.SNAPSHOT_FILE).write_text('{"checkpoints": []}')
    assert not U.torn_snapshot(str(tmp_path))  # a readable record: Ray resumes by itself
    (tmp_path / U.SNAPSHOT_FILE).write_text('{"checkpoi')  # torn mid-write
    assert U.torn_snapshot(str(tmp_path)) and (tmp_path / (U.SNAPSHOT_FILE + ".corrupt")).exists()


def test_a_local_rays_record_file_and_gcs_port_variable_are_rays():
    from ray._private import ray_constants, utils

    assert ray_constants.GCS_PORT_ENVIRONMENT_VARIABLE == U.GCS_PORT_ENV
    assert utils.get_ray_address_file(None) == U.ray_record_file()
    with U.local_gcs_port(None) as extra:
        port = os.environ[U.GCS_PORT_ENV]
        assert extra == {"runtime_env": {"env_vars": {"RAY_ADDRESS": f"127.0.0.1:{port}"}}}
    assert U.GCS_PORT_ENV not in os.environ
    with U.local_gcs_port("10.0.0.1:6379") as extra:  # a cluster: nothing changes
        assert extra == {} and U.GCS_PORT_ENV not in os.environ


def test_ray_trains_and_tunes_errors_carry_what_failure_causes_and_trial_error_read(tmp_path):
    from ray.train import ControllerError
    from ray.train.v2.api.exceptions import WorkerGroupError
    from ray.tune.experiment import Trial

    rank = ValueError("bad")
    assert U.failure_causes(WorkerGroupError("failed", {1: rank})) == ({1: rank}, None)
    inner = RuntimeError("scheduling failed")
    assert U.failure_causes(ControllerError(inner)) == ({}, inner)
    assert isinstance(Trial.pickled_error_file, property) and callable(Trial.get_pickled_error)

    class Recorded:  # a trial whose error Tune pickled locally
        pickled_error_file = str(tmp_path / "error.pkl")
        error_file = None

    import cloudpickle

    (tmp_path / "error.pkl").write_bytes(cloudpickle.dumps(KeyError("x")))
    assert repr(U.trial_error(Recorded())) == "KeyError('x')"


@pytest.mark.slow
def test_the_mlflow_ui_opens_a_view_saved_as_the_shared_view_tag(tmp_path):
    """The UI's bundle reads the experiment tag ``mlflow.sharedViewState.<key>``; the view saved is that tag."""
    from pathlib import Path

    import mlflow
    from mlflow import MlflowClient

    bundle = Path(mlflow.__file__).parent / "server/js/build/static/js"
    assert any("mlflow.sharedViewState." in f.read_text(errors="ignore") for f in bundle.glob("main.*.js"))
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.create_experiment("x", artifact_location=(tmp_path / "a").as_uri())
    assert U.save_shared_view(client, exp, "k", ["metrics.`loss`"]) == "viewStateShareKey=k"
    tag = client.get_experiment(exp).tags["mlflow.sharedViewState.k"]
    assert json.loads(tag) == {"selectedColumns": ["metrics.`loss`"]}


def test_autoscaler_v1_report_format_is_what_pending_in_report_reads():
    """The report autoscaler v1 writes is ``asdict`` of Ray's own ``AutoscalerSummary``: nodes booting plus launches
    requested; none from a report a stopped monitor left behind, or without a report."""
    from ray.autoscaler._private.autoscaler import AutoscalerSummary

    summary = AutoscalerSummary(active_nodes={"head": 1}, idle_nodes={}, failed_nodes=[],
                                pending_nodes=[("10.0.0.7", "gpu_worker", "waiting-for-ssh"),
                                               ("10.0.0.8", "gpu_worker", "setting-up")],
                                pending_launches={"gpu_worker": 3})
    status = {"time": 1000.0, "autoscaler_report": asdict(summary)}
    assert pending_in_report(status, now=1010.0) == 5
    assert pending_in_report(status, now=1000.0 + AUTOSCALER_REPORT_STALE_S + 1) == 0
    idle = asdict(AutoscalerSummary(active_nodes={"head": 1}, idle_nodes={}, failed_nodes=[], pending_nodes=[],
                                    pending_launches={}))
    assert pending_in_report({"time": 1000.0, "autoscaler_report": idle}, now=1001.0) == 0
    assert pending_in_report({"time": 1000.0}, now=1001.0) == 0  # a local Ray's monitor: no autoscaler


def test_autoscaler_v1_writes_its_status_where_it_is_read():
    """The key and the writer autoscaler v1's monitor uses (``ray/autoscaler/_private/monitor.py``) are the ones
    :func:`autoscaler_v1_status` reads."""
    from ray._private import ray_constants
    from ray.autoscaler._private import monitor

    assert ray_constants.DEBUG_AUTOSCALING_STATUS == "__autoscaling_status"
    source = " ".join(inspect.getsource(monitor).split())
    assert "_internal_kv_put( ray_constants.DEBUG_AUTOSCALING_STATUS, as_json" in source
    assert 'status["autoscaler_report"] = asdict(autoscaler_summary)' in source


@pytest.mark.slow
def test_the_v1_status_is_read_from_the_live_kv(ray_session):
    """A report put where autoscaler v1 puts it is read back, and counted, on the session's Ray."""
    from ray._private.ray_constants import DEBUG_AUTOSCALING_STATUS
    from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_put

    assert U.pending_nodes() == 0  # a local Ray has no autoscaler: nothing on its way
    status = {"time": time.time(), "autoscaler_report": {"pending_nodes": [["10.0.0.7", "gpu", "setting-up"]],
                                                          "pending_launches": {"gpu": 2}}}
    _internal_kv_put(DEBUG_AUTOSCALING_STATUS, json.dumps(status), overwrite=True)
    try:
        assert U.autoscaler_v1_status() == status
        assert U.pending_nodes() == 3
    finally:
        _internal_kv_del(DEBUG_AUTOSCALING_STATUS)
    assert U.autoscaler_v1_status() is None


@pytest.mark.slow
def test_the_v2_cluster_status_has_what_pending_nodes_counts(ray_session):
    """On the session's Ray (no v2 autoscaler) v2 is not reported, and its cluster status answers with the two lists
    :func:`autoscaler_v2_pending` counts."""
    import ray
    from ray.autoscaler.v2.sdk import get_cluster_status

    assert U.autoscaler_v2_pending() is None
    status = get_cluster_status(ray.get_runtime_context().gcs_address)
    assert status.pending_launches == [] and status.pending_nodes == []
    assert sum(r.count for r in status.pending_launches) + len(status.pending_nodes) == 0


def test_a_stale_local_ray_record_is_found_and_a_live_one_is_not(tmp_path, monkeypatch):
    import socket

    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    assert U.stale_local_record() is None  # no record
    (tmp_path / "ray").mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # closed when the block ends: nothing listens there
    with socket.socket() as live:
        live.bind(("127.0.0.1", 0))
        live.listen()
        with open(U.ray_record_file(), "w") as f:
            f.write(f"127.0.0.1:{live.getsockname()[1]}")
        assert U.stale_local_record() is None  # it answers: ray.init() joins it, as always
    with open(U.ray_record_file(), "w") as f:
        f.write(f"127.0.0.1:{dead}")
    assert U.stale_local_record(timeout=1.0) == f"127.0.0.1:{dead}"


def test_a_run_torn_down_is_told_apart_from_a_failing_worker():
    """Ray's own error (seen when Ctrl-C removed a multi-worker trial's placement group) ends a worker quietly; any
    other actor death stays an error."""
    from ray.core.generated.common_pb2 import ActorDiedErrorContext
    from ray.exceptions import ActorDiedError

    def died(class_name: str, why: str) -> ActorDiedError:
        return ActorDiedError(ActorDiedErrorContext(class_name=class_name, actor_id=bytes(16), pid=23204,
                                                    error_message=why))

    removed = ("The actor is dead because its worker process has died. Worker exit type: INTENDED_SYSTEM_EXIT Worker "
               "exit detail: Destroying worker since its placement group was removed.")
    assert U.run_torn_down(died("SynchronizationActor", removed))
    assert not U.run_torn_down(died("TrainController", removed))
    assert not U.run_torn_down(died("SynchronizationActor", "The actor is dead because its worker process has died. "
                                    "Worker exit type: SYSTEM_ERROR Worker exit detail: the node was killed (OOM)."))
