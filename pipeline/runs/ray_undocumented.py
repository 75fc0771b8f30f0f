"""Every use of Ray that no public, documented Ray API offers, in one place (docs/cluster.md lists them and why).

Each is tested against the installed Ray (tests/runs/test_ray_undocumented.py), so that a Ray upgrade that moves or
changes one fails there, by name, instead of silently changing what the stages do.

- :func:`pending_nodes`: how many nodes the cluster's autoscaler is adding right now. Ray documents its autoscaler
  only through ``ray status`` and the dashboard; the bounded wait for workers (``pipeline.runs.cluster.
  wait_for_workers``) needs the number to keep waiting while a cold cluster boots. Autoscaler v2: its cluster status
  (``ray.autoscaler.v2.sdk.get_cluster_status``, what ``ray status`` prints, not in the API reference); v1: the
  report its monitor writes to Ray's internal key-value store (``__autoscaling_status``, a private key read through a
  private function).
"""

from __future__ import annotations

import json
import time
from typing import Any

AUTOSCALER_REPORT_STALE_S = 60.0  # an autoscaler report older than this is a monitor that stopped, not news


def pending_in_report(status: dict[str, Any], now: float) -> int:
    """The nodes autoscaler v1 (the cluster launcher's default) is launching or booting, from the status it writes
    (``asdict`` of its ``AutoscalerSummary`` under ``autoscaler_report``); 0 without a report or with one older than
    :data:`AUTOSCALER_REPORT_STALE_S`."""
    report = status.get("autoscaler_report")
    if not report or now - float(status.get("time", 0.0)) > AUTOSCALER_REPORT_STALE_S:
        return 0
    return len(report.get("pending_nodes") or []) + sum((report.get("pending_launches") or {}).values())


def autoscaler_v1_status() -> dict[str, Any] | None:
    """The status autoscaler v1 last wrote to the connected cluster's internal key-value store, None if none."""
    from ray._private.ray_constants import DEBUG_AUTOSCALING_STATUS
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(DEBUG_AUTOSCALING_STATUS)
    return json.loads(raw) if raw else None


def autoscaler_v2_pending() -> int | None:
    """Nodes autoscaler v2 is launching or booting on the connected cluster; None when the cluster runs no v2."""
    import ray
    from ray.autoscaler.v2.sdk import get_cluster_status
    from ray.autoscaler.v2.utils import is_autoscaler_v2

    if not is_autoscaler_v2():
        return None
    status = get_cluster_status(ray.get_runtime_context().gcs_address)
    return sum(r.count for r in status.pending_launches) + len(status.pending_nodes)


def pending_nodes() -> int:
    """How many nodes the cluster's autoscaler is adding right now (launch requested, or booting and not yet in the
    cluster): v2's cluster status, else v1's report (:func:`pending_in_report`). 0 for a cluster without an
    autoscaler (a local Ray, ``ray start`` by hand) or when the autoscaler cannot be asked."""
    try:
        v2 = autoscaler_v2_pending()
        if v2 is not None:
            return v2
        status = autoscaler_v1_status()
        return pending_in_report(status, time.time()) if status else 0
    except Exception:  # noqa: BLE001 -- an autoscaler we cannot read is one that adds nothing we can wait for
        return 0
