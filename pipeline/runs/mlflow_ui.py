"""The MLflow UI as a supervised process: a free port, ``mlflow server`` in its own process group, /health, stop.

:class:`UiServer` runs ``python -m mlflow server`` on a tracking store (a subprocess, not an import: only
``pipeline.runs.tracking`` imports MLflow) in a new session, so that the process group it leads holds the server
and every worker it forks, and a terminal's Ctrl-C reaches only its caller. :meth:`UiServer.stop` ends that whole
group: SIGTERM, then SIGKILL after a grace period (at once on a second Ctrl-C). :func:`stop_signals` turns SIGTERM
and SIGHUP into :class:`UiStopped` and SIGINT into ``KeyboardInterrupt`` while the UI runs, so that a caller stops
the server on any of them::

    check_port_free(host, port)
    with stop_signals(), UiServer(uri, artifacts, host=host, port=port) as server:
        server.wait_healthy(timeout=180)
        print(runs_url(server.base, exp_id))
        server.wait()  # until a signal (UiStopped, KeyboardInterrupt) or the server's exit

``transfusion ui`` (``stages/ui.py``) is this plus the project's store and what it prints. Problems raise
:class:`UiError` with the message to show.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import FrameType

from pipeline.runs.tracking import EXPERIMENT

WILDCARD_HOSTS = {"0.0.0.0", "::", ""}
STOP_GRACE_S = 10.0
KILL_WAIT_S = 5.0
POLL_S = 0.5
RUNS_VIEW = "workflowType=machine_learning"  # the UI's "Model training" layout rather than its GenAI one
PORT_SEARCH = 100  # how far past a taken port :func:`next_free_port` looks


class UiError(RuntimeError):
    """The UI cannot be started or stopped answering; the message says why and what to do."""


class UiStopped(Exception):
    """SIGTERM or SIGHUP while :func:`stop_signals` is active: stop the server as Ctrl-C does."""


# ------------------------------------------------------------------------------------------------ addresses
def url_host(host: str) -> str:
    """The host part of a URL that reaches a server bound to ``host``."""
    if host in WILDCARD_HOSTS:
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def base_url(host: str, port: int) -> str:
    return f"http://{url_host(host)}:{port}"


def runs_url(base: str, exp_id: str | None) -> str:
    """The runs table of the experiment (a fresh browser would open its GenAI overview page)."""
    base = base.rstrip("/")
    return f"{base}/#/experiments/{exp_id}/runs?{RUNS_VIEW}" if exp_id else base


def _bind_address(host: str, port: int) -> tuple[int, int, int, tuple]:
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UiError(f"cannot resolve --host {host!r}: {exc}") from None
    family, kind, proto, _, addr = infos[0]
    return family, kind, proto, addr


def _bind_error(host: str, port: int) -> OSError | None:
    """None if ``host:port`` can be bound now (as the server binds it: SO_REUSEADDR), else the bind's error."""
    family, kind, proto, addr = _bind_address(host, port)
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as exc:
            return exc
    return None


def port_is_free(host: str, port: int) -> bool:
    return _bind_error(host, port) is None


def next_free_port(host: str, after: int, search: int = PORT_SEARCH) -> int | None:
    """The first port above ``after`` that ``host`` can bind (``search`` tried), or None."""
    return next((p for p in range(after + 1, min(after + search, 65535) + 1) if port_is_free(host, p)), None)


def check_port_free(host: str, port: int) -> None:
    """Raise :class:`UiError` if ``host:port`` cannot be bound (taken, or not an address of this machine); for a
    taken port the message suggests the next free one."""
    exc = _bind_error(host, port)
    if exc is None:
        return
    if exc.errno == errno.EADDRINUSE:
        other = next_free_port(host, port)
        hint = f", e.g. --port {other}" if other is not None else ""
        raise UiError(f"port {port} on {host} is already in use (another MLflow UI?); "
                      f"pick a free one with --port{hint}")
    raise UiError(f"cannot listen on {host}:{port}: {exc.strerror or exc}")


# ------------------------------------------------------------------------------------------------- health
def healthy(base: str, timeout: float = 2.0) -> bool:
    """Whether the server at ``base`` answers ``/health`` with 200."""
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=timeout) as resp:  # noqa: S310 - local URL
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def remote_experiment_id(base: str, name: str = EXPERIMENT) -> str | None:
    """The id of the experiment ``name`` on a remote tracking server, or None if it has none (yet)."""
    query = urllib.parse.urlencode({"experiment_name": name})
    url = f"{base}/api/2.0/mlflow/experiments/get-by-name?{query}"
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:  # noqa: S310 - user-given tracking URI
            return json.load(resp)["experiment"]["experiment_id"]
    except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError):
        return None


# ------------------------------------------------------------------------------------------- the process
def server_command(uri: str, artifacts: Path, host: str, port: int, workers: int) -> list[str]:
    """``python -m mlflow server`` on the store ``uri``, new experiments' artifacts and proxied uploads in
    ``artifacts`` (where the stages put them)."""
    return [
        sys.executable, "-m", "mlflow", "server",
        "--backend-store-uri", uri,
        "--default-artifact-root", artifacts.as_uri(),  # new experiments: same place as the stages use
        "--artifacts-destination", str(artifacts),  # proxied artifact uploads (mlflow-artifacts:/)
        "--host", host,
        "--port", str(port),
        "--workers", str(workers),
    ]


def server_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The server's environment: ``base`` (default ours) with MLflow's job runner off unless it is set.

    The job runner (7 huey consumers) serves GenAI features only: without it the UI starts in about a third of the
    time on 2 cores; ``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=true`` turns it back on."""
    env = dict(os.environ if base is None else base)
    env.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    return env


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_group(proc: subprocess.Popen, grace: float = STOP_GRACE_S) -> None:
    """SIGTERM the process group ``proc`` leads, SIGKILL whatever is left after ``grace`` seconds; returns when the
    leader has exited and the group is empty (or after the SIGKILL's wait)."""
    pgid = proc.pid  # start_new_session: the server leads its own group
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, KILL_WAIT_S)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if proc.poll() is not None and not group_alive(pgid):
                return
            time.sleep(0.1)
    proc.poll()


def kill_group(pgid: int) -> None:
    """SIGKILL the whole group at once (no grace)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def wait_healthy(proc: subprocess.Popen, base: str, timeout: float, poll: float = POLL_S) -> None:
    """Until the server at ``base`` answers /health; :class:`UiError` if ``proc`` exits first or ``timeout``
    seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        code = proc.poll()
        if code is not None:
            raise UiError(f"mlflow server exited with code {code} before answering {base}/health "
                          "(its messages are above)")
        if healthy(base):
            return
        if time.monotonic() > deadline:
            raise UiError(f"mlflow server did not answer {base}/health within {timeout:.0f} s")
        time.sleep(poll)


class UiServer:
    """``mlflow server`` on the store ``uri`` in its own process group; a context manager that always stops it.

    :meth:`start` launches it (``cwd``: the server's working directory), :meth:`wait_healthy` waits for /health,
    :meth:`wait` until it exits, :meth:`stop` ends its whole group (idempotent)."""

    def __init__(self, uri: str, artifacts: Path, *, host: str = "127.0.0.1", port: int = 5000, workers: int = 1,
                 cwd: Path | None = None, grace: float = STOP_GRACE_S) -> None:
        self.uri, self.artifacts = uri, artifacts
        self.host, self.port, self.workers = host, port, workers
        self.cwd, self.grace = cwd, grace
        self.proc: subprocess.Popen | None = None

    @property
    def base(self) -> str:
        """The server's URL, e.g. ``http://127.0.0.1:5000``."""
        return base_url(self.host, self.port)

    @property
    def pid(self) -> int | None:
        """The server's pid, also its process group's id (None before :meth:`start`)."""
        return None if self.proc is None else self.proc.pid

    @property
    def command(self) -> list[str]:
        return server_command(self.uri, self.artifacts, self.host, self.port, self.workers)

    def start(self) -> UiServer:
        if self.proc is not None:
            raise UiError(f"the MLflow UI was already started (pid {self.proc.pid})")
        self.proc = subprocess.Popen(self.command, cwd=self.cwd, env=server_env(), start_new_session=True)
        return self

    def wait_healthy(self, timeout: float) -> None:
        wait_healthy(self._started(), self.base, timeout)

    def wait(self) -> int:
        """Until the server exits (it does not on its own): its exit code."""
        return self._started().wait()

    def stop(self) -> None:
        """Stop the whole process group (:func:`stop_group`); a second Ctrl-C or a stop signal meanwhile kills it at
        once."""
        if self.proc is None or (self.proc.returncode is not None and not group_alive(self.proc.pid)):
            return
        try:
            stop_group(self.proc, self.grace)
        except (KeyboardInterrupt, UiStopped):  # no more grace
            kill_group(self.proc.pid)
            self.proc.poll()

    def _started(self) -> subprocess.Popen:
        if self.proc is None:
            raise UiError("the MLflow UI was not started")
        return self.proc

    def __enter__(self) -> UiServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


# ------------------------------------------------------------------------------------------------- signals
def _raise_stop(signum: int, frame: FrameType | None) -> None:  # noqa: ARG001 - signal handler signature
    raise UiStopped(signal.Signals(signum).name)


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """While active: SIGINT raises ``KeyboardInterrupt`` even where it was ignored (``transfusion ui &`` from a
    script), SIGTERM raises :class:`UiStopped`, and so does SIGHUP unless ignored on purpose (``nohup``). The
    previous handlers come back on exit. Main thread only (Python's rule for signal handlers)."""
    previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
                signal.SIGTERM: signal.signal(signal.SIGTERM, _raise_stop)}
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, _raise_stop)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
