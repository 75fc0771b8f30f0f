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
