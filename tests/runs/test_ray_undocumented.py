"""The Ray APIs that pipeline/runs/ray_undocumented.py uses because no public one does the job, each against the
installed Ray: a Ray upgrade that moves or changes one fails here, by name (docs/cluster.md lists them)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict

import pytest

from pipeline.runs.ray_undocumented import AUTOSCALER_REPORT_STALE_S, pending_in_report


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
    import inspect

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

    from pipeline.runs.ray_undocumented import autoscaler_v1_status, pending_nodes

    assert pending_nodes() == 0  # a local Ray has no autoscaler: nothing on its way
    status = {"time": time.time(), "autoscaler_report": {"pending_nodes": [["10.0.0.7", "gpu", "setting-up"]],
                                                          "pending_launches": {"gpu": 2}}}
    _internal_kv_put(DEBUG_AUTOSCALING_STATUS, json.dumps(status), overwrite=True)
    try:
        assert autoscaler_v1_status() == status
        assert pending_nodes() == 3
    finally:
        _internal_kv_del(DEBUG_AUTOSCALING_STATUS)
    assert autoscaler_v1_status() is None


@pytest.mark.slow
def test_the_v2_cluster_status_has_what_pending_nodes_counts(ray_session):
    """On the session's Ray (no v2 autoscaler) v2 is not reported, and its cluster status answers with the two lists
    :func:`autoscaler_v2_pending` counts."""
    import ray
    from ray.autoscaler.v2.sdk import get_cluster_status

    from pipeline.runs.ray_undocumented import autoscaler_v2_pending

    assert autoscaler_v2_pending() is None
    status = get_cluster_status(ray.get_runtime_context().gcs_address)
    assert status.pending_launches == [] and status.pending_nodes == []
    assert sum(r.count for r in status.pending_launches) + len(status.pending_nodes) == 0
