"""The ``transfusion`` command: one subcommand per DVC stage."""

from __future__ import annotations

import click

from stages.check import check
from stages.evaluate import evaluate_cmd
from stages.prepare import prepare
from stages.pretrain import pretrain_cmd
from stages.report import report_cmd
from stages.sweep import sweep_cmd
from stages.tables import tables_cmd
from stages.theory import theory_cmd
from stages.ui import ui_cmd


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="transfusion-pipeline")
def main() -> None:
    """TransFusion contrastive learning: the stages of the DVC pipeline (`dvc repro` runs them all)."""


main.add_command(check)
main.add_command(prepare)
main.add_command(pretrain_cmd)
main.add_command(evaluate_cmd)
main.add_command(report_cmd)
main.add_command(sweep_cmd)
main.add_command(tables_cmd)
main.add_command(theory_cmd)
main.add_command(ui_cmd)

if __name__ == "__main__":
    main()
