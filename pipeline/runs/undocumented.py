"""The adapter: every use of Ray or MLflow that their public, documented APIs do not offer, in one place.

Each is checked against the versions in :data:`CHECKED_ON` by tests/runs/test_undocumented.py, which fails, by name,
when an upgrade moves or changes one; docs/cluster.md says why each is needed. Nothing else in ``pipeline/`` or
``stages/`` reads Ray's or MLflow's internals.

Ray:
- :func:`pending_nodes`: the nodes the cluster's autoscaler is adding (v2's cluster status; v1's report in Ray's
  internal key-value store), so that the bounded wait for workers keeps waiting while a cold cluster boots.
- :func:`stale_local_record`, :func:`local_gcs_port`: the file ``ray start`` records its cluster in, and the GCS port
  variable a local Ray starts on (so that Ray's own processes find their cluster beside another local Ray).
- :func:`torn_snapshot`, :func:`checkpoint_dirs`: Ray Train's run directory (its checkpoint record, written in
  place, and its checkpoint folders), to resume a run whose record an interruption tore.
- :func:`poll_reports_fast`: Ray Train's controller poll interval, so that short epochs do not idle the workers.
- :func:`run_torn_down`, :func:`failure_causes`, :func:`trial_error`: the error text of a run the controller tore
  down, the failed ranks of a Ray Train error, and the error Tune pickled for a trial.
- :data:`CONSOLE_SKIP_PATTERNS`: the lines Ray's native code prints that no Ray setting keeps off the console.

MLflow:
- :func:`save_shared_view`: the runs table's saved view, an experiment tag the UI reads.
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
    """The nodes autoscaler v1 (the cluster launcher's default) is launching or booting, from the status it writes
    (``asdict`` of its ``AutoscalerSummary`` under ``autoscaler_report``); 0 without a report or with one older than
    :data:`AUTOSCALER_REPORT_STALE_S`."""
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


# ------------------------------------------------------------------------------------------- a local Ray
GCS_PORT_ENV = "RAY_GCS_SERVER_PORT"  # read by the ``ray.init`` that starts a local Ray's GCS


def ray_record_file() -> str:
    """Where ``ray start`` records the last local cluster it started (``<Ray temp dir>/ray_current_cluster``; the
    temp dir is ``$RAY_TMPDIR/ray``, ``/tmp/ray`` by default). ``ray.init()`` without an address joins that cluster."""
    return os.path.join(os.environ.get("RAY_TMPDIR") or "/tmp", "ray", "ray_current_cluster")


def stale_local_record(timeout: float = 2.0) -> str | None:
    """The address of the local cluster Ray recorded (:func:`ray_record_file`) when nothing answers there within
    ``timeout`` seconds: a Ray killed without ``ray stop`` (a crash, the OOM killer) leaves it behind, and
    ``ray.init()`` then retries it for minutes. None when there is no record, or it answers."""
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
    """For a local Ray this process starts: its GCS port, chosen here, and that address in the job's processes.

    Ray's own processes look their cluster up when they call Ray's state API without an address (Ray Train's
    placement-group cleaner does, every second): with ``RAY_ADDRESS`` unset they search the machine, and with a
    second local Ray running (another stage, a test session, a ``ray start``) that search fails, the cleaner's
    thread dies with "Found multiple active Ray instances" and its traceback reaches the console. Ray starts its GCS
    on ``RAY_GCS_SERVER_PORT`` when that is set (read while ``ray.init`` starts it, unset again after); the job's
    ``runtime_env`` hands every process of this run the address. Nothing changes for a cluster (an address) or
    when the user set the port. Yields the extra ``ray.init`` arguments."""
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
    """Ray Train writes its run record (:data:`SNAPSHOT_FILE`) in place; a driver killed during that write leaves it
    empty or truncated, and the next ``fit`` of the run then dies in the controller's start-up. When the record in
    the local ``run_dir`` is unreadable it is moved aside (``.corrupt``) and True returned."""
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
    """The checkpoint folders of a Ray Train run directory (a local path or a URI), newest first; [] where there is
    none or the directory cannot be read."""
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
    """Ray Train's controller collects each report when it polls (every 2 s by default) and a worker's next report
    waits for that: with short epochs that idles the workers. The controller reads the interval from the driver's
    environment (Ray Train propagates it); a value the user set is kept."""
    os.environ.setdefault(REPORT_POLL_ENV, str(seconds))


# ------------------------------------------------------------------------------------------------ errors
def run_torn_down(exc: BaseException) -> bool:
    """``exc`` (a worker's ``ActorDiedError``) says that the run's own synchronization actor died because the run's
    placement group was removed: the controller tore the run down (a trial stopped by ASHA, an interrupted job), not a
    failure of this worker."""
    text = str(exc)
    return "SynchronizationActor" in text and "placement group was removed" in text


def failure_causes(exc: BaseException) -> tuple[dict[int, BaseException], BaseException | None]:
    """A Ray Train failure's errors of its failed ranks (``WorkerGroupError.worker_failures``), and the error it
    wraps (a ``RayTaskError``'s ``cause``, a ``ControllerError``'s ``controller_failure``, else ``__cause__``)."""
    failures = getattr(exc, "worker_failures", None)
    inner = getattr(exc, "cause", None) or getattr(exc, "controller_failure", None) or exc.__cause__
    return (failures if isinstance(failures, dict) else {}), (inner if isinstance(inner, BaseException) else None)


def trial_error(trial: object) -> BaseException:
    """The error Tune recorded for a trial: its pickle in the trial's local directory (written before the callbacks
    run; the copy on the storage comes later), else the storage's; Tune's text of it when it cannot be unpickled
    here (its last line is the exception)."""
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
#: What no Ray setting keeps off the console, as the filter Ray's driver applies to each line a worker prints before
#: it forwards it (``RAY_DEDUP_LOGS_SKIP_REGEX``, set by the ``transfusion`` command). Each pattern is tested with the
#: line it hides (tests/stages/test_console_filter.py).
CONSOLE_SKIP_PATTERNS = (
    # Ray's C++ core logs ERROR and above to the process's stderr as well as to its log file ("[date time E pid tid]
    # core_worker.cc:N: ..."); its only knob, RAY_BACKEND_LOG_LEVEL, would take them out of python-core-worker-*.log too
    r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[,.]\d+ [DIWE] \d+ \d+\] \S+\.(cc|h):\d+: ",
    # the raylet, when trials start their worker processes at once (several per CPU): its hint about its start-up
    # concurrency, whose threshold is the start-up concurrency itself (raising it would start more processes at once)
    r"^WARNING: \d+ PYTHON worker processes have been started on node",
    # the native dump of a worker that dies by a signal (ASHA stopping a multi-worker trial kills its workers inside a
    # collective: ~60 lines each): Ray's failure-signal handler ("*** SIGABRT received at time=... ***", its "@ 0x..."
    # frames), Python's faulthandler, which Ray enables in every worker ("Fatal Python error: Aborted", "Stack/Thread
    # ... (most recent call first):", frames '  File "...", line N in f' (a traceback's have ", in"), "Extension
    # modules: ..."), C++'s "terminate called ..." and Ray's terminate handler's backtrace in glibc's format
    # ("/lib/libc.so.6(+0x91500) [0x7fe7f0aaf500] symbol"). It stays in the worker's ``worker-*.err``; a run that fails
    # by it still ends in an error.
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
    """Save the runs table's view ``key`` on the experiment through an ``MlflowClient``: the MLflow UI opens a view
    shared as the experiment tag ``mlflow.sharedViewState.<key>`` (JSON of the table's state; ``selectedColumns``:
    the columns beside each run's name). Returns the URL query that opens it."""
    client.set_experiment_tag(experiment_id, SHARED_VIEW_TAG.format(key=key),  # type: ignore[attr-defined]
                              json.dumps({"selectedColumns": columns}))
    return f"viewStateShareKey={key}"
