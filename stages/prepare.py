"""``prepare`` stage: load the configured dataset and write ``data/prepared/`` atomically.

Reads params: ``data``. Writes: ``{train,test}_x.npy`` (inputs), ``{train,test}_y.npy`` (labels) and
``manifest.json`` (shapes, classes, sha256); an image folder in bounded memory (``pipeline.datasets.prepare_dataset``).
"""

from __future__ import annotations

from pathlib import Path

import click

from pipeline.config import Params
from pipeline.datasets import DatasetError, SyntheticSpec, prepare_dataset
from stages._common import params_options, runtime_errors

DEFAULT_OUT = Path("data/prepared")


def run(params: Params, out: Path = DEFAULT_OUT) -> dict:
    d = params.data
    return prepare_dataset(
        d.dataset,
        out,
        root=Path(d.root),
        download=d.download,
        test_fraction=d.test_fraction,
        seed=d.seed,
        image_size=d.image_size,
        limit_train=d.limit_train,
        limit_test=d.limit_test,
        synthetic=SyntheticSpec(**d.synthetic.model_dump()),
        extra={"params": {"data": d.model_dump()}},
    )


@click.command("prepare")
@params_options
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_OUT,
              show_default=True, help="Output directory.")
@runtime_errors(DatasetError)
def prepare(params: Params, out: Path) -> None:
    """Load the dataset named by data.dataset and write train/test arrays plus a manifest."""
    manifest = run(params, out)
    click.echo(
        f"prepared {manifest['dataset']}: {manifest['n_train']} train / {manifest['n_test']} test, "
        f"input shape {tuple(manifest['input_shape'])}, {len(manifest['classes'])} classes -> {out}/"
    )
