"""``transfusion ui``: the MLflow UI over the project's tracking store, in the foreground until Ctrl-C.

The store is resolved like every stage resolves it (:func:`pipeline.runs.tracking.tracking_uri`): the project's
``mlflow.db`` with artifacts in ``mlartifacts/``, or ``MLFLOW_TRACKING_URI``. A remote ``http(s)://``
tracking URI already has a UI: its URL is printed and nothing is started. Otherwise the store and the port are
checked, the experiment's saved view of the runs table (:func:`pipeline.runs.tracking.save_view`: dataset,
metrics and main params as columns) is written, the URLs are printed, and the command hands its process to
``mlflow server`` (:func:`pipeline.runs.mlflow_ui.exec_server`), which then owns the terminal: its own log says
when it is ready, and Ctrl-C stops it.
"""

from __future__ import annotations

import os

import click

from pipeline.runs.mlflow_ui import (
    WILDCARD_HOSTS,
    UiError,
    base_url,
    check_port_free,
    exec_server,
    remote_experiment_id,
    runs_url,
    server_command,
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
    click.echo(f"Starting the MLflow UI (mlflow server, pid {os.getpid()}) on {uri}: it answers in 15-40 s, once it "
               "logs 'Uvicorn running on ...'. Press Ctrl-C to stop it.")
    if host in WILDCARD_HOSTS:
        click.echo(f"Listening on every interface ({host or '*'}): other machines reach it at this host's "
                   "address (MLflow accepts only localhost and private-network Host headers by default).")
    click.echo(f"Runs of experiment {EXPERIMENT!r} (id {exp_id}): {url}")
    click.echo(f"The runs with their dataset, kNN accuracy, loss and main params as columns: {url}&{view}")
    click.echo(f"One run by its id (mlflow_run_id in metrics/*.json, `dvc exp show`): {base}/#/runs/<run id>")
    exec_server(server_command(uri, root / "mlartifacts", host, port, workers))
