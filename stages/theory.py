"""``theory`` stage: Theorem 2's γ over (ρ, ε, n) beside a TransFusion head trained on synthetic subspaces.

Reads params: ``theory`` only. Writes (atomically): ``plots/theory/``, figures and their data only (DVC renders
them) -- ``theory.png`` (formula panels | measured panels), ``measured_nmi.{png,csv}``, ``measured_gain.{png,csv}``,
``formula.csv``, ``empirical.csv``, ``table.csv`` --; ``reports/theory.md`` (setup, verdict, tables) and
``metrics/theory.json``. No input data: everything is generated from
the seeds in the params (see :mod:`pipeline.theory.experiments` and :mod:`pipeline.theory.report`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace

import click
from pydantic import ValidationError

from pipeline.config.base import load_section
from pipeline.config.theory import TheoryConfig
from pipeline.io import atomic_dir, write_json
from pipeline.theory.experiments import EmpiricalGrid, TheoryGrid
from pipeline.theory.report import run_all
from stages._common import ParamsUsageError, params_options, runtime_errors

PLOTS = Path("plots/theory")
METRICS = Path("metrics/theory.json")
REPORT = Path("reports/theory.md")


def load_theory(path: str, overrides: Sequence[str] = ()) -> SimpleNamespace:
    """The ``theory`` section of ``path`` with ``overrides``, validated alone (``params.theory``); the stage reads no
    other section, so no other section's config is among its DVC deps."""
    return SimpleNamespace(theory=load_section(path, "theory", TheoryConfig, overrides))


def grids(cfg: object) -> tuple[TheoryGrid, EmpiricalGrid]:
    """The two grids from the ``theory`` params section: a :class:`TheoryConfig`, or any object with its
    attributes (validated into one here).

    Raises ValueError starting ``theory:`` and naming ``theory.<key>`` where it can if a value is out of range.
    """
    if not isinstance(cfg, TheoryConfig):
        try:
            cfg = TheoryConfig.model_validate(cfg, from_attributes=True)
        except ValidationError as exc:
            problems = [(f"theory.{'.'.join(map(str, e['loc']))}: " if e["loc"] else "")
                        + e["msg"].removeprefix("Value error, ") for e in exc.errors()]
            raise ValueError("theory: " + "; ".join(problems)) from None
    tg = TheoryGrid.uniform(cfg.formula_points, cfg.formula_n, log_points=cfg.formula_log_points,
                            eps_min=cfg.formula_eps_min)
    return tg, EmpiricalGrid.from_config(cfg)


def run(params: object, plots: Path = PLOTS, metrics: Path = METRICS,
        progress: Callable[[str], object] | None = click.echo,
        report: Path | None = None) -> dict:
    """Formula table, empirical grid, figures and tables into ``plots`` (swapped in whole), metrics to ``metrics``,
    the Markdown report to ``report`` (None: none; the command's default is ``reports/theory.md``).

    ``params`` needs a ``theory`` attribute (the validated section, or any object with the same fields).
    Returns the metrics written.
    """
    cfg = getattr(params, "theory", None)
    if cfg is None:
        raise ValueError("params has no `theory` section: add the theory block to params.yaml")
    tg, eg = grids(cfg)
    with atomic_dir(plots) as out:
        result = run_all(tg, eg, out, progress, report=report)
    write_json(metrics, result)
    return result


@click.command("theory")
@params_options(load_theory)
@click.option("--plots", "plots_dir", type=click.Path(file_okay=False, path_type=Path), default=PLOTS,
              show_default=True, help="Output directory for figures and tables.")
@click.option("--metrics", "metrics_path", type=click.Path(dir_okay=False, path_type=Path), default=METRICS,
              show_default=True, help="Metrics JSON.")
@click.option("--report", "report_path", type=click.Path(dir_okay=False, path_type=Path), default=REPORT,
              show_default=True, help="Markdown report (setup, verdict, tables).")
@click.option("--quiet", is_flag=True, help="No per-run progress lines.")
@runtime_errors()
def theory_cmd(params: SimpleNamespace, plots_dir: Path, metrics_path: Path, report_path: Path, quiet: bool) -> None:
    """Theorem 2's γ regions per batch size, and the measured counterpart on union-of-subspaces data."""
    try:
        m = run(params, plots_dir, metrics_path, progress=None if quiet else click.echo, report=report_path)
    except ValueError as exc:
        if str(exc).startswith(("theory:", "params has no")):
            raise ParamsUsageError(str(exc)) from None
        raise
    e = m["empirical"]
    click.echo(
        f"theory: learned in {e['learned']}/{e['runs']} runs; printed γ > 1 in {e['gamma_gt1']}, meaningful in "
        f"{e['meaningful']}, both {e['learnable']}; {m['seconds']} s -> {plots_dir}/, {report_path}, {metrics_path}"
    )
