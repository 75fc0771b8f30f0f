"""``transfusion ui``: the MLflow UI over the project's tracking store, in the foreground until Ctrl-C.

The store is resolved like every stage resolves it (:func:`pipeline.runs.tracking.tracking_uri`): the project's
``mlflow.db`` with artifacts in ``mlartifacts/``, or ``MLFLOW_TRACKING_URI``. A remote ``http(s)://``
tracking URI already has a UI: its URL is printed and nothing is started. Otherwise ``mlflow server`` runs
in its own process group (so a terminal's Ctrl-C reaches only this command), and that whole group is
stopped on Ctrl-C, SIGTERM or SIGHUP. The experiment's saved view of the runs table
(:func:`pipeline.runs.tracking.save_view`: dataset, metrics and main params as columns) is written first; its URL is
printed after the runs table's.
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
from pathlib import Path

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

WILDCARD_HOSTS = {"0.0.0.0", "::", ""}
STOP_GRACE_S = 10.0


class _Stop(Exception):
    """SIGTERM / SIGHUP while the UI runs: stop the server like Ctrl-C does."""


def url_host(host: str) -> str:
    """The host part of a URL that reaches a server bound to ``host``."""
    if host in WILDCARD_HOSTS:
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


RUNS_VIEW = "workflowType=machine_learning"  # the UI's "Model training" layout rather than its GenAI one


def runs_url(base: str, exp_id: str | None) -> str:
    """The runs table of the experiment (a fresh browser would open its GenAI overview page)."""
    base = base.rstrip("/")
    return f"{base}/#/experiments/{exp_id}/runs?{RUNS_VIEW}" if exp_id else base


def check_port_free(host: str, port: int) -> None:
    """Raise a ClickException if ``host:port`` cannot be bound (taken, or not an address of this machine)."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise click.ClickException(f"cannot resolve --host {host!r}: {exc}") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server does
        try:
            sock.bind(addr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise click.ClickException(
                    f"port {port} on {host} is already in use (another MLflow UI?); "
                    f"pick a free one with --port, e.g. --port {port + 1}"
                ) from None
            raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def healthy(base: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=timeout) as resp:  # noqa: S310 - local URL
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def remote_experiment_id(base: str) -> str | None:
    """The id of the project's experiment on a remote tracking server, or None if it has none (yet)."""
    query = urllib.parse.urlencode({"experiment_name": EXPERIMENT})
    url = f"{base}/api/2.0/mlflow/experiments/get-by-name?{query}"
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:  # noqa: S310 - user-given tracking URI
            return json.load(resp)["experiment"]["experiment_id"]
    except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError):
        return None


def show_remote(uri: str) -> None:
    base = uri.rstrip("/")
    click.echo(f"MLFLOW_TRACKING_URI points at the MLflow server {base}: it serves the UI itself, "
               "so no local UI is started.")
    try:
        check_reachable(base)
    except TrackingError as exc:
        raise click.ClickException(str(exc)) from None
    exp_id = remote_experiment_id(base)
    if exp_id is None:
        click.echo(f"(no experiment named {EXPERIMENT!r} there yet: run a stage to create it)")
    click.echo(f"Open {runs_url(base, exp_id)}")


def server_command(uri: str, artifacts: Path, host: str, port: int, workers: int) -> list[str]:
    return [
        sys.executable, "-m", "mlflow", "server",
        "--backend-store-uri", uri,
        "--default-artifact-root", artifacts.as_uri(),  # new experiments: same place as the stages use
        "--artifacts-destination", str(artifacts),  # proxied artifact uploads (mlflow-artifacts:/)
        "--host", host,
        "--port", str(port),
        "--workers", str(workers),
    ]


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_group(proc: subprocess.Popen, grace: float = STOP_GRACE_S) -> None:
    """SIGTERM the server's whole process group, SIGKILL whatever is left after ``grace`` seconds."""
    pgid = proc.pid  # start_new_session: the server leads its own group
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
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


def _raise_stop(signum, frame):  # noqa: ARG001 - signal handler signature
    raise _Stop(signal.Signals(signum).name)


def wait_healthy(proc: subprocess.Popen, base: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        code = proc.poll()
        if code is not None:
            raise click.ClickException(f"mlflow server exited with code {code} before answering {base}/health "
                                       "(its messages are above)")
        if healthy(base):
            return
        if time.monotonic() > deadline:
            raise click.ClickException(f"mlflow server did not answer {base}/health within {timeout:.0f} s")
        time.sleep(0.5)


@click.command("ui")
@click.option("--port", default=5000, show_default=True, type=click.IntRange(1, 65535), help="Port to listen on.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Interface to bind. The UI has no login: bind beyond 127.0.0.1 (e.g. 0.0.0.0) only on purpose.")
@click.option("--workers", default=1, show_default=True, type=click.IntRange(min=1),
              help="Server worker processes (MLflow's own default, 4, is heavy on small machines).")
@click.option("--start-timeout", default=180.0, show_default=True, type=click.FloatRange(min=1),
              help="Seconds to wait for the server to answer /health.")
def ui_cmd(port: int, host: str, workers: int, start_timeout: float) -> None:
    """Browse the project's MLflow runs: start the MLflow UI on its tracking store until Ctrl-C.

    Prints the URL of the runs table of the `transfusion` experiment. With MLFLOW_TRACKING_URI set to a
    remote http(s) tracking server, prints that server's URL instead of starting a UI.
    """
    root = project_root()
    uri = tracking_uri(root)
    if uri.startswith(("http://", "https://")):
        show_remote(uri)
        return
    try:
        check_reachable(uri)
    except TrackingError as exc:
        raise click.ClickException(str(exc)) from None
    check_port_free(host, port)
    try:
        exp_id = experiment_id(uri, root)
        view = save_view(uri, exp_id)
    except Exception as exc:  # MLflow / SQLAlchemy errors: name the store instead of a traceback
        raise click.ClickException(f"cannot open the MLflow tracking store {uri}: {exc}") from None
    base = f"http://{url_host(host)}:{port}"
    url = runs_url(base, exp_id)
    artifacts = root / "mlartifacts"

    env = dict(os.environ)
    # MLflow's job runner (7 huey consumers) serves GenAI features only: without it the UI starts in
    # about a third of the time on 2 cores; MLFLOW_SERVER_ENABLE_JOB_EXECUTION=true turns it back on
    env.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    # Ctrl-C stops the UI even when started with SIGINT ignored (e.g. `transfusion ui &` from a script);
    # a hang-up does unless ignored on purpose (nohup)
    previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
                signal.SIGTERM: signal.signal(signal.SIGTERM, _raise_stop)}
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, _raise_stop)
    proc: subprocess.Popen | None = None
    try:
        proc = subprocess.Popen(server_command(uri, artifacts, host, port, workers), cwd=root, env=env,
                                start_new_session=True)
        click.echo(f"Starting the MLflow UI on {uri} (mlflow server pid {proc.pid}, ~20 s) ...")
        if host in WILDCARD_HOSTS:
            click.echo(f"Listening on every interface ({host or '*'}): other machines reach it at this host's "
                       "address (MLflow accepts only localhost and private-network Host headers by default).")
        wait_healthy(proc, base, start_timeout)
        click.echo(f"MLflow UI ready: {url}")
        click.echo(f"Runs of experiment {EXPERIMENT!r} (id {exp_id}). Press Ctrl-C to stop.")
        click.echo(f"The runs with their dataset, kNN accuracy, loss and main params as columns: {url}&{view}")
        click.echo(f"One run by its id (mlflow_run_id in metrics/*.json, `dvc exp show`): {base}/#/runs/<run id>")
        code = proc.wait()
        raise click.ClickException(f"mlflow server exited unexpectedly with code {code}")
    except (KeyboardInterrupt, _Stop):
        click.echo("\nStopping the MLflow UI ...")
    finally:
        try:
            if proc is not None:
                stop_group(proc)
        except KeyboardInterrupt:  # a second Ctrl-C: no more grace
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    click.echo("MLflow UI stopped.")
