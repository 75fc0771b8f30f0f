"""The ``transfusion`` command: one subcommand per DVC stage.

Each subcommand's module is imported when that subcommand runs, not before: a stage pays for its own imports only
(all of them together, from torch and scikit-learn to Ray Tune and matplotlib, take seconds).
"""

from __future__ import annotations

import importlib
import os

import click

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


class LazyGroup(click.Group):
    """A group whose subcommands (:data:`COMMANDS`) are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None:
            return None
        module, attr = target.split(":")
        from pipeline.runs.cluster import ray_env

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
