"""``transfusion check``: validate params (and overrides) without running anything."""

from __future__ import annotations

import click

from pipeline.config import Params, flatten
from stages._common import params_options


@click.command("check")
@params_options
def check(params: Params) -> None:
    """Validate params.yaml (exit 2 naming every bad key) and print the resolved values."""
    for key, value in flatten(params).items():
        click.echo(f"{key} = {value!r}")
    click.echo("params OK")
