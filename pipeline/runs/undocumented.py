"""The adapter: every use of Ray or MLflow that their public, documented APIs do not offer, in one place (nothing
else in ``pipeline/`` or ``stages/`` reads their internals). tests/runs/test_undocumented.py checks each against the
versions in :data:`CHECKED_ON`, failing by name when an upgrade moves one; docs/cluster.md says why each is needed.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from urllib.parse import urlsplit

CHECKED_ON = {"ray": "2.60.0", "mlflow": "3.17.2"}  # the versions each use below was read against

# ------------------------------------------------------------------------------------------ the autoscaler
AUTOSCALER_REPORT_STALE_S = 60.0  # an autoscaler report older than this is a monitor that stopped, not news


def pending_in_report(status: Mapping[str, object], now: float) -> int:
    """The nodes autoscaler v1 is launching or booting, from its status (``autoscaler_report``); 0 if none or stale."""
    report = status.get("autoscaler_report")
    if not isinstance(report, dict) or now - float(status.get("time", 0.0)) > AUTOSCALER_REPORT_STALE_S:
        return 0
    return len(report.get("pending_nodes") or []) + sum((report.get("pending_launches") or {}).values())


def autoscaler_v1_status() -> dict[str, object] | None:
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
    """How many nodes the cluster's autoscaler is adding right now (v2's cluster status, else v1's report), so that
    the bounded wait for workers goes on while a cold cluster boots; 0 without an autoscaler or an answer."""
    try:
        v2 = autoscaler_v2_pending()
        if v2 is not None:
            return v2
        status = autoscaler_v1_status()
        return pending_in_report(status, time.time()) if status else 0
    except Exception:  # noqa: BLE001 -- an autoscaler we cannot read is one that adds nothing we can wait for
        return 0


# ------------------------------------------------------------------------------------------- a local Ray
GCS_PORT_ENV = "RAY_GCS_SERVER_PORT"  # read by the ``ray.init`` that starts a local Ray's GCS


def ray_record_file() -> str:
    """Where ``ray start`` records the last local cluster it started, which ``ray.init()`` without an address joins."""
    return os.path.join(os.environ.get("RAY_TMPDIR") or "/tmp", "ray", "ray_current_cluster")


def stale_local_record(timeout: float = 2.0) -> str | None:
    """The address of the local cluster Ray recorded when nothing answers there within ``timeout`` seconds (a Ray
    killed without ``ray stop`` leaves it, and ``ray.init()`` retries it for minutes); else None."""
    try:
        with open(ray_record_file()) as f:
            recorded = f.read().strip()
    except OSError:
        return None
    parts = urlsplit(f"gcs://{recorded}") if recorded else None
    if parts is None or parts.hostname is None or parts.port is None:
        return None
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=timeout):
            return None
    except OSError:
        return recorded


@contextlib.contextmanager
def local_gcs_port(address: str | None) -> Iterator[dict[str, dict[str, dict[str, str]]]]:
    """For a local Ray this process starts: its GCS port (``RAY_GCS_SERVER_PORT``), chosen here, and that address in
    the job's processes, whose lookup without one fails beside a second local Ray ("Found multiple active Ray
    instances": Ray Train's placement-group cleaner dies). Yields extra ``ray.init`` arguments ({} if not ours)."""
    if address not in (None, "local") or GCS_PORT_ENV in os.environ:
        yield {}
        return
    with socket.socket() as s:  # a free port now; Ray binds it a moment later
        s.bind(("", 0))
        port = s.getsockname()[1]
    os.environ[GCS_PORT_ENV] = str(port)
    try:
        yield {"runtime_env": {"env_vars": {"RAY_ADDRESS": f"127.0.0.1:{port}"}}}
    finally:
        os.environ.pop(GCS_PORT_ENV, None)


# ------------------------------------------------------------------------------ Ray Train's run directory
SNAPSHOT_FILE = "checkpoint_manager_snapshot.json"  # Ray Train V2's record of a run's checkpoints
CHECKPOINT_PREFIX = "checkpoint_"  # its checkpoint folders: checkpoint_<date>_<time>.<ms>, sorting by time
REPORT_POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"  # how often Ray Train's controller polls its workers


def torn_snapshot(run_dir: str) -> bool:
    """Ray Train writes its run record in place; a driver killed then leaves it torn, and the next ``fit`` dies in
    the controller's start-up. An unreadable record in the local ``run_dir`` is moved aside (True)."""
    snapshot = Path(run_dir, SNAPSHOT_FILE)
    if not snapshot.exists():
        return False
    try:
        json.loads(snapshot.read_text())
        return False
    except (ValueError, OSError, UnicodeDecodeError):
        snapshot.replace(snapshot.with_name(SNAPSHOT_FILE + ".corrupt"))
        return True


def checkpoint_dirs(run_dir: str) -> list[str]:
    """A Ray Train run directory's checkpoint folders (local or a URI), newest first; [] if none or unreadable."""
    from pyarrow import fs as pafs

    from pipeline.data.storage import filesystem, join

    try:
        fs, path = filesystem(run_dir)
        infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    except (OSError, ValueError):
        return []
    names = sorted((i.base_name for i in infos if i.type == pafs.FileType.Directory
                    and i.base_name.startswith(CHECKPOINT_PREFIX)), reverse=True)
    return [join(run_dir, name) for name in names]


def poll_reports_fast(seconds: float = 0.2) -> None:
    """Ray Train's controller collects reports when it polls (every 2 s) and a worker's next report waits for it,
    idling the workers of short epochs; it reads the interval from the driver's environment (a user's value kept)."""
    os.environ.setdefault(REPORT_POLL_ENV, str(seconds))


# ------------------------------------------------------------------------------------------------ errors
def run_torn_down(exc: BaseException) -> bool:
    """``exc`` (a worker's ``ActorDiedError``) says the controller tore the run down (ASHA, Ctrl-C), not a failure."""
    text = str(exc)
    return "SynchronizationActor" in text and "placement group was removed" in text


def failure_causes(exc: BaseException) -> tuple[dict[int, BaseException], BaseException | None]:
    """A Ray Train failure's errors of its failed ranks (``WorkerGroupError.worker_failures``), and the error it
    wraps (a ``RayTaskError``'s ``cause``, a ``ControllerError``'s ``controller_failure``, else ``__cause__``)."""
    failures = getattr(exc, "worker_failures", None)
    inner = getattr(exc, "cause", None) or getattr(exc, "controller_failure", None) or exc.__cause__
    return (failures if isinstance(failures, dict) else {}), (inner if isinstance(inner, BaseException) else None)


def trial_error(trial: object) -> BaseException:
    """The error Tune recorded for a trial: its local pickle (the storage's copy comes after the callbacks), else the
    storage's, else the last line of Tune's text of it."""
    import cloudpickle

    path = getattr(trial, "pickled_error_file", None)
    try:
        if path and os.path.exists(path):
            with open(path, "rb") as f:
                return cloudpickle.load(f)
        error = trial.get_pickled_error()  # type: ignore[attr-defined]
        if isinstance(error, BaseException):
            return error
    except Exception:  # noqa: BLE001 -- a class this process cannot import: Tune's text instead
        pass
    text = getattr(trial, "error_file", None)
    lines = Path(text).read_text().strip().splitlines() if text and os.path.exists(text) else []
    return RuntimeError(lines[-1] if lines else "unknown error")


# ------------------------------------------------------------------------------------------- the console
#: What no Ray setting keeps off the console, as the filter Ray's driver applies to each line a worker prints
#: (``RAY_DEDUP_LOGS_SKIP_REGEX``, set by the ``transfusion`` command; tests/stages/test_console_filter.py).
CONSOLE_SKIP_PATTERNS = (
    # Ray's C++ core logs ERROR to stderr as well as to its log file; its only knob, RAY_BACKEND_LOG_LEVEL, would take
    # them out of python-core-worker-*.log too
    r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[,.]\d+ [DIWE] \d+ \d+\] \S+\.(cc|h):\d+: ",
    # the raylet's hint when trials start many worker processes at once (its threshold is the start-up concurrency)
    r"^WARNING: \d+ PYTHON worker processes have been started on node",
    # the native dump of a worker killed by a signal (ASHA stopping a multi-worker trial: ~60 lines each): Ray's
    # failure-signal handler, Python's faulthandler (its frames have "line N in", a traceback's ", in"), C++'s
    # terminate and glibc's backtrace. It stays in the worker's ``worker-*.err``; a failed run still ends in an error.
    r"^\*\*\* SIG[A-Z]+ received at time=", r"^PC: @ +0x[0-9a-f]+ ", r"^ +@ +0x[0-9a-f]+ ",
    r"^Fatal Python error: ", r"^(Stack|(Current thread|Thread) 0x[0-9a-f]+) \(most recent call first\):",
    r"^  File \".*\", line \d+ in ", r"^Extension modules: ", r"^terminate called ", r"^  what\(\): ",
    r"^ ?/\S+\([^)]*\) \[0x[0-9a-f]+\]",
    # Abseil's raw log of Ray's native mutexes, which a process killed at shutdown may print: "[mutex.cc : 452] RAW:"
    r"^\[\w+\.(cc|h) : \d+\] RAW: ",
    r"^\s*$",  # and the blank lines between the parts of a dump
)
CONSOLE_SKIP = "|".join(CONSOLE_SKIP_PATTERNS)


# ------------------------------------------------------------------------------------------------ MLflow
SHARED_VIEW_TAG = "mlflow.sharedViewState.{key}"  # the experiment tag the UI opens as ?viewStateShareKey=<key>


def save_shared_view(client: object, experiment_id: str, key: str, columns: list[str]) -> str:
    """Save the runs table's view ``key`` (``selectedColumns``: beside each run's name) as the experiment tag the UI
    opens, through an ``MlflowClient``; returns the URL query that opens it."""
    client.set_experiment_tag(experiment_id, SHARED_VIEW_TAG.format(key=key),  # type: ignore[attr-defined]
                              json.dumps({"selectedColumns": columns}))
    return f"viewStateShareKey={key}"
