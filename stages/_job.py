"""What the stages that run a Ray job share (``pretrain``, ``sweep``, ``tables``): apart from ``stages._common``, so
that the other stages' code deps (dvc.yaml) do not hold ``pipeline.runs``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import click

from pipeline.config.base import ParamsError
from pipeline.config.params import Params
from pipeline.runs.job import SweepError
from pipeline.runs.tracking import project_root
from stages._common import ParamsUsageError, check_weights

T = TypeVar("T")


def run_job(run: Callable[..., T], params: Params, data_dir: Path, no_tracking: bool) -> T:
    """A stage's Ray job (``pipeline.runs``: ``pretrain``, ``run_sweep``, ``run_tables``) on the prepared data in
    ``data_dir``, after the checks that need neither Ray nor the data (``model.weights``): a request that contradicts
    the data or what the cluster can hold exits 2, an interrupted job or one whose every trial failed exits 1."""
    check_weights(params.model.weights)
    try:
        return run(params, data_dir, project_root(), tracking=not no_tracking)
    except ParamsError as exc:
        raise ParamsUsageError(str(exc)) from None
    except SweepError as exc:
        raise click.ClickException(str(exc)) from exc
