"""``transfusion ui``: the MLflow UI over the project's tracking store, in the foreground until Ctrl-C.

The store is resolved like every stage resolves it (:func:`pipeline.runs.tracking.tracking_uri`): the project's
``mlflow.db`` with artifacts in ``mlartifacts/``, or ``MLFLOW_TRACKING_URI``. A remote ``http(s)://``
tracking URI already has a UI: its URL is printed and nothing is started. Otherwise the store and the port are
checked (a taken port names the next free one), the experiment's saved view of the runs table
(:func:`pipeline.runs.tracking.save_view`: dataset, metrics and main params as columns) is written, the URLs are
printed, and the command's process *becomes* ``python -m mlflow server`` (:func:`exec_server`, ``os.execve``).

There is nothing left to supervise: a terminal's Ctrl-C (SIGINT to the foreground group), ``kill PID`` (SIGTERM) and
a closed terminal (SIGHUP) reach MLflow itself, which forwards SIGINT and SIGTERM to its uvicorn child and exits 0
once it has stopped; tests/stages/test_ui.py shows the whole process tree gone and the port free after Ctrl-C and
after ``kill PID``. Only ``pipeline.runs.tracking`` imports MLflow; here it is a command. Problems raise
:class:`UiError` with the message to show.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NoReturn

import click

from pipeline.runs.tracking import (
    EXPERIMENT,
    TrackingError,
    check_reachable,
    experiment_id,
    project_root,
    save_view,
    tracking_uri,
)
from stages._common import runtime_errors

WILDCARD_HOSTS = {"0.0.0.0", "::", ""}
RUNS_VIEW = "workflowType=machine_learning"  # the UI's "Model training" layout rather than its GenAI one
PORT_SEARCH = 100  # how far past a taken port :func:`next_free_port` looks


class UiError(RuntimeError):
    """The UI cannot be started; the message says why and what to do."""


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


# ---------------------------------------------------------------------------------------- a remote server
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
    """``python -m mlflow server`` (``mlflow ui`` is its alias) on the store ``uri``, new experiments' artifacts and
    proxied uploads in ``artifacts`` (where the stages put them). This interpreter's MLflow, so no ``mlflow`` on
    ``PATH`` is needed.

    Its uvicorn without the app's lifespan (``--lifespan off``): MLflow's lifespan only cleans up after its GenAI
    assistant's sandboxes, and on Ctrl-C uvicorn cancels it mid-wait and logs that as a 40-line ``CancelledError``
    traceback (uvicorn 0.54), on every stop; without it the terminal shows "Shutting down", "Finished server
    process" and the exit code 0 (tests/stages/test_ui.py)."""
    return [
        sys.executable, "-m", "mlflow", "server",
        "--backend-store-uri", uri,
        "--default-artifact-root", artifacts.as_uri(),  # new experiments: same place as the stages use
        "--artifacts-destination", str(artifacts),  # proxied artifact uploads (mlflow-artifacts:/)
        "--host", host,
        "--port", str(port),
        "--workers", str(workers),
        "--uvicorn-opts", "--lifespan off",
    ]


def server_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The server's environment: ``base`` (default ours) with MLflow's job runner off unless it is set.

    The job runner (7 huey consumers) serves GenAI features only: without it the UI starts in about a third of the
    time on 2 cores; ``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=true`` turns it back on."""
    env = dict(os.environ if base is None else base)
    env.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    return env


def exec_server(command: Sequence[str]) -> NoReturn:
    """Replace this process with ``command`` (an absolute executable first, e.g. :func:`server_command`'s) in
    :func:`server_env`: same pid, same terminal, same process group. What this process printed is flushed first
    (into a pipe it would otherwise be lost with the old process image)."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(command[0], list(command), server_env())
    except OSError as exc:
        raise UiError(f"cannot run {command[0]}: {exc.strerror or exc}") from None


# ------------------------------------------------------------------------------------------- the command
def show_remote(uri: str) -> None:
    base = uri.rstrip("/")
    click.echo(f"MLFLOW_TRACKING_URI points at the MLflow server {base}: it serves the UI itself, "
               "so no local UI is started.")
    check_reachable(base)
    exp_id = remote_experiment_id(base)
    if exp_id is None:
        click.echo(f"(no experiment named {EXPERIMENT!r} there yet: run a stage to create it)")
    click.echo(f"Open {runs_url(base, exp_id)}")


@click.command("ui")
@click.option("--port", default=5000, show_default=True, type=click.IntRange(1, 65535), help="Port to listen on.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Interface to bind. The UI has no login: bind beyond 127.0.0.1 (e.g. 0.0.0.0) only on purpose.")
@click.option("--workers", default=1, show_default=True, type=click.IntRange(min=1),
              help="Server worker processes (MLflow's own default, 4, is heavy on small machines).")
@runtime_errors(UiError, TrackingError)
def ui_cmd(port: int, host: str, workers: int) -> None:
    """Browse the project's MLflow runs: run the MLflow UI on its tracking store until Ctrl-C.

    Prints the URL of the runs table of the `transfusion` experiment, then becomes `mlflow server`. With
    MLFLOW_TRACKING_URI set to a remote http(s) tracking server, prints that server's URL instead of starting a UI.
    """
    root = project_root()
    uri = tracking_uri(root)
    if uri.startswith(("http://", "https://")):
        show_remote(uri)
        return
    check_reachable(uri)
    check_port_free(host, port)  # before anything is set up
    try:
        exp_id = experiment_id(uri, root)
        view = save_view(uri, exp_id)
    except Exception as exc:  # MLflow / SQLAlchemy errors: name the store instead of a traceback
        raise click.ClickException(f"cannot open the MLflow tracking store {uri}: {exc}") from None

    base = base_url(host, port)
    url = runs_url(base, exp_id)
    click.echo(f"Starting the MLflow UI (mlflow server, pid {os.getpid()}) on {uri}: it answers within seconds, once "
               "it logs 'Uvicorn running on ...'. Press Ctrl-C to stop it.")
    if host in WILDCARD_HOSTS:
        click.echo(f"Listening on every interface ({host or '*'}): other machines reach it at this host's "
                   "address (MLflow accepts only localhost and private-network Host headers by default).")
    click.echo(f"Runs of experiment {EXPERIMENT!r} (id {exp_id}): {url}")
    click.echo(f"The runs with their dataset, kNN accuracy, loss and main params as columns: {url}&{view}")
    click.echo(f"One run by its id (mlflow_run_id in metrics/*.json, `dvc exp show`): {base}/#/runs/<run id>")
    exec_server(server_command(uri, root / "mlartifacts", host, port, workers))
