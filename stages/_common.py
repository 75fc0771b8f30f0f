"""What every stage command shares: the ``--params`` / ``-S`` options and error-to-exit-code mapping.

Bad params exit with code 2 (usage error) before any work; runtime failures (missing data, ...) exit 1
with a one-paragraph message instead of a traceback.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import click

from pipeline.config import Params, ParamsError, load_params


class ParamsUsageError(click.ClickException):
    exit_code = 2


def params_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Add ``--params PATH`` and repeatable ``-S key=value``; pass the validated :class:`Params`."""

    @click.option("--params", "params_path", default="params.yaml", show_default=True,
                  type=click.Path(dir_okay=False), help="Params file.")
    @click.option("-S", "--set", "overrides", multiple=True, metavar="KEY=VALUE",
                  help="Override a param, like `dvc exp run -S` (repeatable), e.g. -S model.depth=3.")
    @functools.wraps(fn)
    def wrapper(params_path: str, overrides: tuple[str, ...], **kwargs: Any) -> Any:
        try:
            params = load_params(params_path, overrides)
        except ParamsError as exc:
            raise ParamsUsageError(str(exc)) from None
        return fn(params, **kwargs)

    return wrapper


def runtime_errors(*kinds: type[Exception]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Turn the given expected runtime errors into a clean ``Error: ...`` and exit code 1."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except kinds as exc:
                raise click.ClickException(str(exc)) from exc

        return wrapper

    return deco


__all__ = ["Params", "ParamsUsageError", "params_options", "runtime_errors"]
