"""Matplotlib without global state, for every figure of the pipeline, and the one plot kind two floors draw.

* :func:`new_figure`, :func:`save_figure` -- the object-oriented ``Figure`` API on an explicit Agg canvas (no pyplot,
  no global state, safe in worker processes without a display); the PNG and the CSV of the data behind it are
  written together through :func:`pipeline.io.atomic_path`: both land, or (if anything raises while rendering or
  writing) neither does and any previous files are left untouched.
* :func:`phase_diagram` -- heat maps of a value over two axes, one panel per third (the sweep's accuracy over batch
  size x augmentation strength per depth; the theory stage's measured NMI over ε x n per depth).

The ground floor: imports only :mod:`pipeline.io`.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from pipeline.config.names import axis_label
from pipeline.io import atomic_path, csv_text

DPI = 120


# ------------------------------------------------------------------------------------------ writing
def new_figure(width: float, height: float) -> Figure:
    """A standalone figure (constrained layout) with its own Agg canvas; nothing registered globally."""
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save_figure(fig: Figure, png: str | os.PathLike, csv_path: str | os.PathLike | None, csv_text: str | None) -> None:
    """Write the CSV and the PNG into temporary siblings, then rename both; on any error neither file appears."""
    with contextlib.ExitStack() as stack:
        png_tmp = stack.enter_context(atomic_path(png))
        if csv_path is not None:
            csv_tmp = stack.enter_context(atomic_path(csv_path))
            csv_tmp.write_text(csv_text or "")
        fig.savefig(png_tmp, format="png", dpi=DPI)


REGION_GID = "region"  # gid of the rectangles that mark phase_diagram's region cells (lets tests find them)


MARKED_GID = "phase-marked"  # gid of the cells phase_diagram marks (tests find them in the SVG)


# ----------------------------------------------------------------------------------- phase diagram
def phase_grids(
    rows: Sequence[Mapping], *, x: str, y: str, value: str, panel: str
) -> tuple[list[Any], list[Any], list[Any], np.ndarray]:
    """Arrange sweep rows into one (len(ys), len(xs)) grid per panel value.

    panels, xs, ys: sorted distinct values of ``row[panel]``, ``row[x]``, ``row[y]`` (numbers numerically first,
    then strings), shared by all panels. grids[p, i, j] = mean of the finite ``row[value]`` over the rows with
    (panel, y, x) = (panels[p], ys[i], xs[j]) -- repeated seeds are averaged -- and NaN if there is none.
    Returns (panels, xs, ys, grids) with grids of shape (P, len(ys), len(xs)), float64.
    """
    for k, r in enumerate(rows):
        missing = [c for c in (x, y, panel) if r.get(c) is None]
        if missing:
            raise ValueError(f"row {k} has no value for {missing}")
    panels = sorted({r[panel] for r in rows}, key=sort_key)
    xs = sorted({r[x] for r in rows}, key=sort_key)
    ys = sorted({r[y] for r in rows}, key=sort_key)
    pi, xi, yi = ({v: i for i, v in enumerate(vals)} for vals in (panels, xs, ys))
    total = np.zeros((len(panels), len(ys), len(xs)))
    count = np.zeros_like(total)
    for r in rows:
        val = as_float(r.get(value))
        if math.isfinite(val):
            cell = (pi[r[panel]], yi[r[y]], xi[r[x]])
            total[cell] += val
            count[cell] += 1
    with np.errstate(invalid="ignore", divide="ignore"):
        grids = np.where(count > 0, total / np.maximum(count, 1), np.nan)
    return panels, xs, ys, grids


def color_limits(grids: np.ndarray) -> tuple[float, float]:
    """Shared colour scale (vmin, vmax) = (nanmin, nanmax) over all panels' cells; (0, 1) if all are NaN, and
    (v - 0.5, v + 0.5) if every cell holds the same v."""
    g = np.asarray(grids, dtype=np.float64)
    finite = g[np.isfinite(g)]
    if finite.size == 0:
        return 0.0, 1.0
    lo, hi = float(finite.min()), float(finite.max())
    if lo == hi:
        return lo - 0.5, hi + 0.5
    return lo, hi


def _text_color(rgba: Sequence[float]) -> str:
    """Black on light cells, white on dark ones (Rec. 601 luma)."""
    return "black" if 0.299 * rgba[0] + 0.587 * rgba[1] + 0.114 * rgba[2] > 0.5 else "white"


def _iter_cells(ys: Sequence[Any], xs: Sequence[Any]) -> Iterator[tuple[int, int, Any, Any]]:
    for i, yv in enumerate(ys):
        for j, xv in enumerate(xs):
            yield i, j, xv, yv


def phase_diagram(
    rows: Sequence[Mapping],
    *,
    x: str,
    y: str,
    value: str,
    panel: str,
    png: Path,
    csv: Path,
    region: Callable[[float, float, Any], bool] | None = None,
    region_label: str = "region",
    title: str | None = None,
    marked: Callable[[float, float, Any], bool] | None = None,
    marked_label: str = "marked",
) -> None:
    """Sweep heat maps: one panel per distinct ``row[panel]`` (e.g. depth), categorical x / y axes (sorted distinct
    values, e.g. batch size x augmentation strength), cells coloured by ``row[value]`` (e.g. accuracy).

    Cells are laid out by :func:`phase_grids` (repeats averaged) and coloured on one scale shared by all panels,
    ``color_limits(grids)``, with one colour bar; each cell shows its number; a cell without a finite value is
    blank. ``region(x_value, y_value, panel_value) -> bool`` (optional) outlines and hatches the cells where it
    returns True -- e.g. where the theory predicts learning -- whether or not the cell has a value; the legend names it
    ``region_label``. ``marked`` (optional) likewise cross-hatches cells in black (e.g. a dead TransFusion block),
    named ``marked_label``. ``title``: an optional figure title.
    CSV (one line per input row): columns ``x, y, panel, value`` (the given key names), empty where value is missing.
    """
    panels, xs, ys, grids = phase_grids(rows, x=x, y=y, value=value, panel=panel)
    if not panels:
        raise ValueError("phase_diagram needs at least one row")
    vmin, vmax = color_limits(grids)
    cmap = colormaps["viridis"].with_extremes(bad="white")
    norm = Normalize(vmin=vmin, vmax=vmax)
    fig = new_figure(max(2.8, 0.55 * len(xs) + 1.4) * len(panels) + 1.0, max(2.6, 0.45 * len(ys) + 1.4))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    image = None
    for p, (pv, ax) in enumerate(zip(panels, axes, strict=True)):
        g = grids[p]  # (len(ys), len(xs))
        image = ax.imshow(np.ma.masked_invalid(g), cmap=cmap, norm=norm, origin="lower", aspect="auto",
                          interpolation="nearest")
        for i, j, xv, yv in _iter_cells(ys, xs):
            if np.isfinite(g[i, j]):
                ax.text(j, i, f"{g[i, j]:.3g}", ha="center", va="center", fontsize="x-small",
                        color=_text_color(cmap(norm(g[i, j]))))
            if region is not None and region(xv, yv, pv):
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1.0, 1.0, fill=False, edgecolor="tab:red", hatch="//",
                                       linewidth=1.5, gid=REGION_GID))
            if marked is not None and marked(xv, yv, pv):
                ax.add_patch(Rectangle((j - 0.42, i - 0.42), 0.84, 0.84, fill=False, edgecolor="black", hatch="xx",
                                       linewidth=1.0, linestyle="--", gid=MARKED_GID))
        ax.set_xticks(range(len(xs)), [fmt_value(v) for v in xs], rotation=45 if len(xs) > 5 else 0)
        ax.set_yticks(range(len(ys)), [fmt_value(v) for v in ys])
        ax.set_xlabel(x)
        ax.set_ylabel(y if p == 0 else "")
        ax.set_title(f"{panel} = {fmt_value(pv)}")
    fig.colorbar(image, ax=list(axes), label=value, shrink=0.9)
    handles = []
    if region is not None:
        handles.append(Patch(fill=False, edgecolor="tab:red", hatch="//", label=region_label))
    if marked is not None:
        handles.append(Patch(fill=False, edgecolor="black", hatch="xx", linestyle="--", label=marked_label))
    if handles:
        fig.legend(handles=handles, loc="outside lower center", fontsize="small", frameon=False, ncols=len(handles))
    if title:
        fig.suptitle(title)
    cols = [x, y, panel, value]
    text = csv_text(rows, cols, fmt_value)
    save_figure(fig, png, csv, text)


# ----------------------------------------------------------------------------------- lr curves
def lr_curves(rows: Sequence[Mapping], *, x: str, value: str, lines: Sequence[str], png: Path, csv: Path,
              title: str | None = None) -> None:
    """``row[value]`` against ``row[x]`` on a log axis (the paper's Figure 5: accuracy against the learning rate): a
    line per distinct combination of the ``lines`` keys that take more than one value (one line when none does), at
    each x the mean over its rows (e.g. seeds) with the sample sd as an error bar; rows without a finite value are
    left out. CSV: one line per (line, x) with columns ``line, x, <value>_mean, <value>_sd, n`` (the given key
    names), also for a line with no finite value (mean and sd empty, n 0)."""
    varying = [k for k in lines if len({fmt_value(r.get(k)) for r in rows}) > 1]
    groups: dict[str, dict[float, list[float]]] = {}
    for r in sorted(rows, key=lambda r: tuple(sort_key(r.get(k)) for k in varying)):
        label = ", ".join(f"{axis_label(k)} {fmt_value(r.get(k))}" for k in varying) or fmt_value(r.get(lines[0]))
        values = groups.setdefault(label, {}).setdefault(as_float(r.get(x)), [])
        if math.isfinite(as_float(r.get(value))):
            values.append(as_float(r.get(value)))
    fig = new_figure(6.4, 4.2)
    ax = fig.subplots()
    table: list[tuple[str, ...]] = []
    for label, by_x in groups.items():
        xs = sorted(by_x)
        means = [float(np.mean(by_x[v])) if by_x[v] else math.nan for v in xs]
        sds = [float(np.std(by_x[v], ddof=1)) if len(by_x[v]) > 1 else 0.0 for v in xs]
        ax.errorbar(xs, means, yerr=sds, marker="o", capsize=3, label=label)
        table += [(label, fmt_value(v), "" if math.isnan(m) else fmt_value(m), "" if math.isnan(m) else fmt_value(s),
                   str(len(by_x[v]))) for v, m, s in zip(xs, means, sds, strict=True)]
    ax.set_xscale("log")
    ax.set(xlabel=x, ylabel=f"{value} (mean ± sd over seeds)")
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=9)
    save_figure(fig, png, csv, csv_text(table, ("line", x, f"{value}_mean", f"{value}_sd", "n")))


def as_float(v: Any) -> float:
    """float(v), with None / non-numeric -> NaN."""
    if v is None:
        return math.nan
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def fmt_value(v: Any) -> str:
    """Tick / CSV text for a value: shortest round-trip repr for floats ('inf', 'nan' included), str otherwise."""
    if isinstance(v, numbers.Real) and not isinstance(v, (bool, numbers.Integral)):
        return repr(float(v))
    if isinstance(v, numbers.Integral) and not isinstance(v, bool):
        return str(int(v))
    return str(v)


def sort_key(v: Any) -> tuple[int, float, str]:
    """Numbers first in numeric order, then everything else by its string."""
    if isinstance(v, numbers.Real) and not isinstance(v, bool):
        return (0, float(v), "")
    return (1, 0.0, str(v))


__all__ = ["DPI", "MARKED_GID", "REGION_GID", "as_float", "color_limits", "fmt_value", "lr_curves", "new_figure",
           "phase_diagram", "phase_grids", "save_figure", "sort_key"]
