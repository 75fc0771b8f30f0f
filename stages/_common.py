"""What every stage command shares: the ``--params`` / ``-S`` options and error-to-exit-code mapping.

Bad params exit with code 2 (usage error) before any work; runtime failures (missing data, ...) exit 1
with a one-paragraph message instead of a traceback.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import ParamSpec, TypeVar

import click

from pipeline.config.base import ParamsError
from pipeline.io import OutputError

STARTED_ENV = "TRANSFUSION_STAGE_STARTED"  # a stage's start (time.time()) when it does not start its own process


P = ParamSpec("P")
R = TypeVar("R")
C = TypeVar("C")


class ParamsUsageError(click.ClickException):
    exit_code = 2


def params_options(load: Callable[[str, Sequence[str]], C]) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """Add ``--params PATH`` and repeatable ``-S key=value``; pass what ``load(path, overrides)`` validated.

    A stage names its loader, and so its import closure holds only the config it reads: most stages pass
    :func:`pipeline.config.params.load_params` (all of ``params.yaml``); ``prepare`` reads the ``data`` section
    alone (:func:`pipeline.config.base.load_section`), so no other section's names are among its DVC deps.
    """

    def deco(fn: Callable[..., R]) -> Callable[..., R]:
        @click.option("--params", "params_path", default="params.yaml", show_default=True,
                      type=click.Path(dir_okay=False), help="Params file.")
        @click.option("-S", "--set", "overrides", multiple=True, metavar="KEY=VALUE",
                      help="Override a param, like `dvc exp run -S` (repeatable), e.g. -S model.depth=3.")
        @functools.wraps(fn)
        def wrapper(params_path: str, overrides: tuple[str, ...], **kwargs: object) -> R:
            try:
                params = load(params_path, overrides)
            except ParamsError as exc:
                raise ParamsUsageError(str(exc)) from None
            return fn(params, **kwargs)

        return wrapper

    return deco


def runtime_errors(*kinds: type[Exception]) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Turn the given expected runtime errors (and any :class:`OutputError`) into ``Error: ...`` and exit code 1."""
    caught = (*kinds, OutputError)

    def deco(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            try:
                return fn(*args, **kwargs)
            except caught as exc:
                raise click.ClickException(str(exc)) from exc

        return wrapper

    return deco


def check_weights(weights: str | None) -> None:
    """Fail fast, before data loading and Ray, if ``model.weights`` is not a loadable resnet18 state_dict.

    The file is loaded weights-only (pickled code never runs). Raises :class:`click.ClickException` (exit 1).
    """
    if weights is None:
        return
    from pathlib import Path

    import torch
    from torchvision.models import resnet18

    from pipeline.io import TensorFileError, load_torch

    fix = "point it at a local resnet18 state_dict file (it is never downloaded), or set it to null"
    if not Path(weights).is_file():
        raise click.ClickException(f"model.weights: {weights} does not exist; {fix}")
    try:
        state = load_torch(weights)
    except TensorFileError as exc:
        raise click.ClickException(f"model.weights: {exc}; {fix}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise click.ClickException(f"model.weights: {weights} does not hold a state_dict (names -> tensors); {fix}")
    try:
        missing, unexpected = resnet18(weights=None).load_state_dict(state, strict=False)
    except RuntimeError as exc:  # a tensor of the wrong size
        raise click.ClickException(f"model.weights: {weights} does not fit resnet18 "
                                   f"({str(exc).strip().splitlines()[-1].strip()}); {fix}") from None
    if missing or unexpected:
        shown = ", ".join(f"{'missing' if k in missing else 'unexpected'} {k!r}" for k in [*missing, *unexpected][:3])
        raise click.ClickException(f"model.weights: {weights} is not a resnet18 state_dict ({len(missing)} missing, "
                                   f"{len(unexpected)} unexpected keys, e.g. {shown}); {fix}")



def process_started() -> float:
    """When this process started (``time.time()`` seconds): a stage's time counts the interpreter and its imports."""
    import os

    import psutil

    override = os.environ.get(STARTED_ENV)  # `transfusion rehearse` runs the stages one after another in one process
    return float(override) if override else psutil.Process().create_time()


def time_line(stage: str, started: float, parts: Sequence[tuple[str, float]], now: float | None = None) -> str:
    """``[stage] T s in all: label s, ...``: where a stage's wall time went, from its process's start (``started``)
    to ``now`` (default: now). The closing line of the stages that spend more than a few seconds."""
    total = (time.time() if now is None else now) - started
    return f"[{stage}] {total:.0f} s in all: " + ", ".join(f"{label} {seconds:.1f} s" for label, seconds in parts)


def around(started: float, run_started: float, run_seconds: float, now: float) -> tuple[float, float]:
    """(seconds before, seconds after) a run of ``run_seconds`` that began at ``run_started``, within the stage's
    time from ``started`` to ``now`` (all ``time.time()``; clock jitter never gives a negative part)."""
    before = max(run_started - started, 0.0)
    return before, max(now - started - before - run_seconds, 0.0)


__all__ = ["STARTED_ENV", "ParamsUsageError", "around", "check_weights", "params_options", "process_started",
           "runtime_errors", "time_line"]
