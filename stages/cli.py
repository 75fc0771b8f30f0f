"""The ``transfusion`` command: one subcommand per DVC stage.

Each subcommand's module is imported when that subcommand runs, not before: a stage pays for its own imports only
(all of them together, from torch and scikit-learn to Ray Tune and matplotlib, take seconds). Before it imports one,
the command sets what Ray reads when ``ray`` is imported (:func:`ray_env`): the console filter
(``pipeline.runs.undocumented.CONSOLE_SKIP``) for what no Ray setting keeps off the console, Tune's output engine,
``RAY_AUTH_MODE`` as Ray would set it. The rest of the console's quiet is Ray's logging configs
(``pipeline.runs.cluster``).
"""

from __future__ import annotations

import importlib
import os
import sys

import click

from pipeline.runs import tracking_process
from pipeline.runs.undocumented import CONSOLE_SKIP


def _token_available() -> bool:
    """A Ray auth token is at hand where Ray looks for one: ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``,
    ``~/.ray/auth_token``."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    return os.path.isfile(path)


def _auth_mode_default() -> str | None:
    """``RAY_AUTH_MODE`` for a local Ray, chosen as Ray would, so that Ray does not announce it.

    With ``RAY_AUTH_MODE`` unset, Ray (2.59+) turns token auth on for a local Ray it starts (creating
    ``~/.ray/auth_token`` if needed) and for a local cluster it finds while a token exists, and prints "Token
    authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out ..." on every run: nothing to
    act on for a local run. An explicit ``RAY_ADDRESS`` is left as Ray leaves it (Ray sends no token to a named cluster
    unless ``RAY_AUTH_MODE=token`` asks for it); when authentication matters, the connect error says what to do.
    """
    if "RAY_AUTH_MODE" in os.environ:
        return None
    address = os.environ.get("RAY_ADDRESS") or None
    if address is None or address == "local" or (address == "auto" and _token_available()):
        return "token"
    return None


def ray_env() -> dict[str, str]:
    """The environment settings Ray reads when ``ray`` is imported, for a program that is about to import it (the
    ``transfusion`` command does, before it imports a stage): the console filter; ``RAY_AIR_NEW_OUTPUT=0`` (Tune's
    default output engine prints an experiment box, the results path and a TensorBoard hint even at ``verbose=0``;
    the legacy one is silent there, and the jobs print their own line per trial event); and ``RAY_AUTH_MODE`` as Ray
    would choose it (:func:`_auth_mode_default`). Only defaults: a variable the user set is left out."""
    env = {"RAY_DEDUP_LOGS_SKIP_REGEX": CONSOLE_SKIP, "RAY_AIR_NEW_OUTPUT": "0"}
    mode = _auth_mode_default()
    if mode and "ray._raylet" not in sys.modules:  # set once Ray is loaded, the driver and Ray's processes disagree
        env["RAY_AUTH_MODE"] = mode
    return {k: v for k, v in env.items() if k not in os.environ}


# subcommand -> "module:click command", in the order of --help
COMMANDS = {
    "check": "stages.check:check",
    "prepare": "stages.prepare:prepare",
    "pretrain": "stages.pretrain:pretrain_cmd",
    "evaluate": "stages.evaluate:evaluate_cmd",
    "report": "stages.report:report_cmd",
    "sweep": "stages.sweep:sweep_cmd",
    "tables": "stages.tables:tables_cmd",
    "theory": "stages.theory:theory_cmd",
    "sets": "stages.sets:sets_cmd",
    "rehearse": "stages.rehearse:rehearse_cmd",
    "ui": "stages.ui:ui_cmd",
}


# subcommands that start their MLflow tracking process before their imports (pipeline.runs.tracking_process)
TRACKING_PROCESS = ("pretrain",)


class LazyGroup(click.Group):
    """A group whose subcommands (:data:`COMMANDS`) are imported on first use."""

    def resolve_command(self, ctx: click.Context, args: list[str]) -> tuple:
        """Before the subcommand's module is imported: a ``pretrain`` that tracks, run as a program of its own (no
        torch or MLflow loaded yet), starts its tracking process, so that MLflow's import and store open beside
        torch's import (:mod:`pipeline.runs.tracking_process`)."""
        if (args and args[0] in TRACKING_PROCESS and not {"--no-tracking", "-h", "--help"} & set(args[1:])
                and not {"torch", "mlflow"} & set(sys.modules)):
            tracking_process.start()
        return super().resolve_command(ctx, args)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None:
            return None
        module, attr = target.split(":")
        os.environ.update(ray_env())  # the settings Ray reads when it is imported: before the stage imports it
        command = getattr(importlib.import_module(module), attr)
        if command.name != cmd_name:
            raise RuntimeError(f"{target} is the command {command.name!r}, listed as {cmd_name!r}")
        return command


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="transfusion-pipeline")
def main() -> None:
    """TransFusion contrastive learning: the stages of the DVC pipeline (`dvc repro` runs them all)."""


if __name__ == "__main__":
    main()
