"""What the stages that run a Ray job share (``pretrain``, ``sweep``, ``tables``): apart from ``stages._common``, so
that the other stages' code deps (dvc.yaml) do not hold ``pipeline.runs``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import click

from pipeline.config.base import ParamsError
from pipeline.config.params import Params
from pipeline.runs.job import SweepError, ending_runs
from pipeline.runs.tracking import project_root
from stages._common import ParamsUsageError, check_weights

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., object])


def job_options(outputs: str) -> Callable[[F], F]:
    """The options of every stage that runs a Ray job: ``--data`` (the prepared data), ``--out`` (the folder its
    ``outputs`` go under: the project, or a recorded study's folder), ``--no-tracking``."""

    def deco(fn: F) -> F:
        for option in reversed((
            click.option("--data", "data_dir", type=click.Path(file_okay=False, path_type=Path),
                         default=Path("data/prepared"), show_default=True, help="Prepared data (`prepare`'s output)."),
            click.option("--out", "base", type=click.Path(file_okay=False, path_type=Path), default=Path("."),
                         help=f"Where {outputs} go (a recorded study's folder)."),
            click.option("--no-tracking", is_flag=True, help="Do not log to MLflow."),
        )):
            fn = option(fn)
        return fn

    return deco


@contextlib.contextmanager
def run_job(run: Callable[..., T], params: Params, data_dir: Path, no_tracking: bool) -> Iterator[T]:
    """A stage's Ray job (``pipeline.runs``: ``pretrain``, ``run_sweep``, ``run_tables``) on the prepared data in
    ``data_dir``, after the checks that need neither Ray nor the data (``model.weights``), as a block that gets its
    result, writes the stage's outputs and closes the job (``close_job``, ``close_tune_job``): the job's MLflow run
    ends FINISHED there, or FAILED with the error as its ``error`` tag, or KILLED on Ctrl-C, wherever it stops
    (``pipeline.runs.job.ending_runs``). A request that contradicts the data or what the cluster can hold exits 2; an
    interrupted job, one whose every trial failed, or an output that cannot be written exits 1 (the stage's
    ``runtime_errors`` turn ``pipeline.io.OutputError`` into one line naming the path)."""
    check_weights(params.model.weights)
    try:
        with ending_runs():
            yield run(params, data_dir, project_root(), tracking=not no_tracking)
    except ParamsError as exc:
        raise ParamsUsageError(str(exc)) from None
    except SweepError as exc:
        raise click.ClickException(str(exc)) from exc
