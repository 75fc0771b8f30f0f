"""``transfusion check``: validate params (and overrides) without running anything."""

from __future__ import annotations

import click

from pipeline.config.base import flatten
from pipeline.config.params import Params, load_params
from stages._common import params_options


@click.command("check")
@params_options(load_params)
def check(params: Params) -> None:
    """Validate params.yaml (exit 2 naming every bad key) and print the resolved values."""
    for key, value in flatten(params).items():
        click.echo(f"{key} = {value!r}")
    click.echo("params OK")
