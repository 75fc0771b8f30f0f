"""``transfusion ui``: the MLflow UI over the project's tracking store, in the foreground until Ctrl-C.

The store is resolved like every stage resolves it (:func:`pipeline.runs.tracking.tracking_uri`): the project's
``mlflow.db`` with artifacts in ``mlartifacts/``, or ``MLFLOW_TRACKING_URI``. A remote ``http(s)://``
tracking URI already has a UI: its URL is printed and nothing is started. Otherwise ``mlflow server`` runs
in its own process group (so a terminal's Ctrl-C reaches only this command), and that whole group is
stopped on Ctrl-C, SIGTERM or SIGHUP (:mod:`pipeline.runs.mlflow_ui` supervises it). The experiment's saved view of
the runs table (:func:`pipeline.runs.tracking.save_view`: dataset, metrics and main params as columns) is written
first; its URL is printed after the runs table's.
"""

from __future__ import annotations

import click

from pipeline.runs.mlflow_ui import (
    WILDCARD_HOSTS,
    UiError,
    UiServer,
    UiStopped,
    check_port_free,
    remote_experiment_id,
    runs_url,
    stop_signals,
)
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
@click.option("--start-timeout", default=180.0, show_default=True, type=click.FloatRange(min=1),
              help="Seconds to wait for the server to answer /health.")
@runtime_errors(UiError, TrackingError)
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
    check_reachable(uri)
    check_port_free(host, port)  # before anything is set up
    try:
        exp_id = experiment_id(uri, root)
        view = save_view(uri, exp_id)
    except Exception as exc:  # MLflow / SQLAlchemy errors: name the store instead of a traceback
        raise click.ClickException(f"cannot open the MLflow tracking store {uri}: {exc}") from None

    server = UiServer(uri, root / "mlartifacts", host=host, port=port, workers=workers, cwd=root)
    with stop_signals(), server:  # the server's whole process group is stopped on leaving, however
        try:
            click.echo(f"Starting the MLflow UI on {uri} (mlflow server pid {server.pid}, ~20 s) ...")
            if host in WILDCARD_HOSTS:
                click.echo(f"Listening on every interface ({host or '*'}): other machines reach it at this host's "
                           "address (MLflow accepts only localhost and private-network Host headers by default).")
            server.wait_healthy(start_timeout)
            url = runs_url(server.base, exp_id)
            click.echo(f"MLflow UI ready: {url}")
            click.echo(f"Runs of experiment {EXPERIMENT!r} (id {exp_id}). Press Ctrl-C to stop.")
            click.echo(f"The runs with their dataset, kNN accuracy, loss and main params as columns: {url}&{view}")
            click.echo("One run by its id (mlflow_run_id in metrics/*.json, `dvc exp show`): "
                       f"{server.base}/#/runs/<run id>")
            raise UiError(f"mlflow server exited unexpectedly with code {server.wait()}")
        except (KeyboardInterrupt, UiStopped):
            click.echo("\nStopping the MLflow UI ...")
    click.echo("MLflow UI stopped.")
