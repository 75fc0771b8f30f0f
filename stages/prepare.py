"""``prepare`` stage: load the configured dataset and write ``data/prepared/`` atomically.

Reads params: ``data`` (validated alone: the stage's code deps are the data code and the ground floor, so a change
to a loss, a probe or the training code never re-runs it). Writes: ``{train,test}_x.npy`` (inputs),
``{train,test}_y.npy`` (labels) and ``manifest.json`` (shapes, classes, sha256); an image folder in bounded memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import click

from pipeline.config.base import load_section
from pipeline.config.data import DataConfig
from pipeline.data.prepared import prepare_dataset
from pipeline.data.types import DatasetError
from stages._common import params_options, runtime_errors

DEFAULT_OUT = Path("data/prepared")


def load_data(path: str, overrides: Sequence[str] = ()) -> DataConfig:
    """The ``data`` section of ``path`` with ``overrides``, validated (the other sections are not read)."""
    return load_section(path, "data", DataConfig, overrides)


def run(data: DataConfig, out: Path = DEFAULT_OUT) -> dict:
    return prepare_dataset(data, out, extra={"params": {"data": data.model_dump()}})


@click.command("prepare")
@params_options(load_data)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_OUT,
              show_default=True, help="Output directory.")
@runtime_errors(DatasetError)
def prepare(data: DataConfig, out: Path) -> None:
    """Load the dataset named by data.dataset and write its train, validation and test arrays plus a manifest."""
    manifest = run(data, out)
    click.echo(
        f"prepared {manifest['dataset']}: {manifest['n_train']} train / {manifest['n_val']} validation / "
        f"{manifest['n_test']} test, "
        f"input shape {tuple(manifest['input_shape'])}, {len(manifest['classes'])} classes -> {out}/"
    )
