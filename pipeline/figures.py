"""Figures people look at, each written as a PNG together with the data behind it (CSV).

* :func:`tsne_layers` -- the paper's Figure 4: t-SNE of every representation (input, backbone, block 1, ...), left
  to right, one colour per class kept across panels, one legend.
* :func:`line_curves` -- training curves (loss, knn_acc, view_noise, ... over epoch), one small panel per series.
* :func:`sharpness_per_layer` -- Definition 2 of every block's affinity on a symmetric-log axis.
* :func:`phase_diagram` -- sweep heat maps (e.g. batch size x augmentation strength, one panel per depth).
* :func:`theory_figure` -- the theory stage's Theorem 2 regions per batch size beside the measured NMI (PNG only).

Matplotlib is used only through the object-oriented ``Figure`` API with an explicit Agg canvas: no pyplot, no global
state, safe in worker processes without a display. The PNG and its CSV are written together through
:func:`pipeline.io.atomic_path`: both land, or (if anything raises while rendering or writing) neither does and any
previous files are left untouched.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import ListedColormap, Normalize
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle
from sklearn.manifold import TSNE
from threadpoolctl import threadpool_limits  # a dependency of scikit-learn

from pipeline.datasets import stratified_subset
from pipeline.io import atomic_path, csv_text
from pipeline.resources import usable_cpus

__all__ = [
    "class_colors",
    "color_limits",
    "line_curves",
    "phase_diagram",
    "phase_grids",
    "sharpness_per_layer",
    "theory_figure",
    "tsne_layers",
    "tsne_perplexity",
]

DPI = 120
REGION_GID = "region"  # gid of the rectangles that mark phase_diagram's region cells (lets tests find them)
MARKED_GID = "phase-marked"  # gid of the cells phase_diagram marks (tests find them in the SVG)


# ------------------------------------------------------------------------------------------ writing
def _new_figure(width: float, height: float) -> Figure:
    """A standalone figure (constrained layout) with its own Agg canvas; nothing registered globally."""
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, png: str | os.PathLike, csv_path: str | os.PathLike | None, csv_text: str | None) -> None:
    """Write the CSV and the PNG into temporary siblings, then rename both; on any error neither file appears."""
    with contextlib.ExitStack() as stack:
        png_tmp = stack.enter_context(atomic_path(png))
        if csv_path is not None:
            csv_tmp = stack.enter_context(atomic_path(csv_path))
            csv_tmp.write_text(csv_text or "")
        fig.savefig(png_tmp, format="png", dpi=DPI)
    # ExitStack renames the CSV first and the PNG last, so a present PNG implies a complete CSV.


def _float(v: Any) -> float:
    """float(v), with None / non-numeric -> NaN."""
    if v is None:
        return math.nan
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _fmt(v: Any) -> str:
    """Tick / CSV text for a value: shortest round-trip repr for floats ('inf', 'nan' included), str otherwise."""
    if isinstance(v, numbers.Real) and not isinstance(v, (bool, numbers.Integral)):
        return repr(float(v))
    if isinstance(v, numbers.Integral) and not isinstance(v, bool):
        return str(int(v))
    return str(v)


def _sort_key(v: Any) -> tuple[int, float, str]:
    """Numbers first in numeric order, then everything else by its string."""
    if isinstance(v, numbers.Real) and not isinstance(v, bool):
        return (0, float(v), "")
    return (1, 0.0, str(v))


def _as_2d(rep: Any, n: int, i: int) -> np.ndarray:
    """(n, ...) array or CPU tensor -> (n, d) float64 with d >= 2 (a 1-d feature gets a zero column for PCA)."""
    if hasattr(rep, "detach"):  # torch tensor, without importing torch here
        rep = rep.detach().cpu().numpy()
    a = np.asarray(rep, dtype=np.float64)
    if a.ndim == 0 or a.shape[0] != n:
        raise ValueError(f"reps[{i}] must have {n} rows (one per label), got shape {a.shape}")
    a = a.reshape(n, -1)  # (n, d)
    if a.shape[1] < 2:
        a = np.hstack([a, np.zeros((n, 2 - a.shape[1]))])
    if not np.isfinite(a).all():
        raise ValueError(f"reps[{i}] contains NaN or inf")
    return a


# ------------------------------------------------------------------------------------------- t-SNE
def tsne_perplexity(perplexity: float, n: int) -> float:
    """The perplexity actually used for n points: min(perplexity, (n - 1) / 3), so it stays < n / 3."""
    return float(min(perplexity, (n - 1) / 3.0))


def class_colors(k: int) -> np.ndarray:
    """(k, 4) RGBA, one colour per class: tab10 for k <= 10, tab20 for k <= 20, else k samples of turbo."""
    if k <= 10:
        return colormaps["tab10"](np.arange(k))  # integer input indexes the listed colours
    if k <= 20:
        return colormaps["tab20"](np.arange(k))
    return colormaps["turbo"](np.linspace(0.0, 1.0, k))


def _class_name(cls: Any, class_names: Sequence[str] | Mapping[Any, str] | None) -> str:
    if class_names is None:
        return _fmt(cls)
    if isinstance(class_names, Mapping):
        return str(class_names.get(cls, _fmt(cls)))
    try:
        return str(class_names[int(cls)])
    except (IndexError, TypeError, ValueError):
        return _fmt(cls)


def tsne_layers(
    reps: Sequence[np.ndarray],
    labels: np.ndarray,
    titles: Sequence[str],
    png: Path,
    csv: Path,
    *,
    seed: int = 0,
    perplexity: float = 30.0,
    max_points: int = 2000,
    class_names: Sequence[str] | Mapping[Any, str] | None = None,
    max_iter: int = 1000,
) -> None:
    """The paper's Figure 4: a t-SNE panel per representation, left to right, points coloured by class.

    The same subset ``S = datasets.stratified_subset(labels, max_points, seed, min_per_class=1)`` (m <= max_points
    points, every class present) is embedded in every panel; t-SNE (sklearn, PCA init, ``random_state=seed``) runs
    on each representation ``reps[l][S]`` separately with perplexity ``min(perplexity, (m - 1) / 3)``. Class c
    always gets the same colour (``class_colors``, indexed by c's rank among the sorted distinct labels), one
    legend for the figure.

    reps: L arrays (or CPU tensors) of shape (n, ...) -- flattened to (n, d_l); labels: (n,); titles: L strings.
    class_names: list indexed by label, or a mapping label -> name, for the legend. max_iter: t-SNE iterations
    (sklearn requires >= 250). t-SNE runs on one OpenMP thread so the CSV is reproducible across machines.
    CSV (long format, m * L rows): ``layer,index,x,y,label`` with layer = the panel title, index = the row in reps.
    """
    y = np.asarray(labels).reshape(-1)
    n = y.shape[0]
    if len(reps) == 0:
        raise ValueError("tsne_layers needs at least one representation")
    if len(titles) != len(reps):
        raise ValueError(f"got {len(reps)} representations but {len(titles)} titles")
    if len({str(t) for t in titles}) != len(titles):
        raise ValueError(f"titles must be distinct (they name the CSV's layers), got {list(titles)}")
    arrays = [_as_2d(r, n, i) for i, r in enumerate(reps)]
    idx = stratified_subset(y, max_points, seed, min_per_class=1)  # (m,)
    m = idx.shape[0]
    if m < 3:
        raise ValueError(f"t-SNE needs at least 3 points, got {m}")
    perp = tsne_perplexity(perplexity, m)
    sub_y = y[idx]  # (m,)
    classes = np.unique(y)
    colors = class_colors(len(classes))  # (k, 4)
    point_colors = colors[np.searchsorted(classes, sub_y)]  # (m, 4)

    fig = _new_figure(3.0 * len(arrays) + 1.6, 3.3)
    axes = fig.subplots(1, len(arrays), squeeze=False)[0]
    rows: list[list[Any]] = []

    def embed(a: np.ndarray) -> np.ndarray:
        x = a[idx]  # (m, d)
        init = "pca" if np.ptp(x, axis=0).max() > 0 else "random"  # PCA init crashes on identical points
        tsne = TSNE(n_components=2, perplexity=perp, init=init, learning_rate="auto", max_iter=max_iter,
                    random_state=seed)
        # one OpenMP thread: the Barnes-Hut sums then do not depend on the core count (same CSV on every machine),
        # and a loaded machine cannot stall each of the max_iter parallel regions on a descheduled thread. Set in
        # the thread that runs the t-SNE: OpenMP's thread count is a per-thread setting
        with threadpool_limits(limits=1, user_api="openmp"):
            return tsne.fit_transform(x)  # (m, 2)

    # the panels side by side instead (scikit-learn's t-SNE releases the GIL: the same numbers in ~2/3 the time);
    # BLAS (the PCA init) on one thread too: its thread count is process-wide, so set it once around the pool
    with threadpool_limits(limits=1, user_api="blas"), ThreadPoolExecutor(min(len(arrays), usable_cpus())) as pool:
        embeddings = list(pool.map(embed, arrays))
    for emb, title, ax in zip(embeddings, titles, axes, strict=True):
        ax.scatter(emb[:, 0], emb[:, 1], c=point_colors, s=6, linewidths=0)
        ax.set_title(str(title))
        ax.set_xticks([])
        ax.set_yticks([])
        rows.extend([str(title), int(i), repr(float(e0)), repr(float(e1)), _fmt(lab)]
                    for i, (e0, e1), lab in zip(idx, emb, sub_y, strict=True))
    handles = [Line2D([], [], linestyle="", marker="o", markersize=6, color=colors[j],
                      label=_class_name(c, class_names)) for j, c in enumerate(classes)]
    fig.legend(handles=handles, loc="outside right upper", ncols=max(1, math.ceil(len(classes) / 25)),
               fontsize="small", frameon=False)
    _save(fig, png, csv, csv_text(rows, ["layer", "index", "x", "y", "label"]))


# ------------------------------------------------------------------------------------------ curves
def line_curves(
    rows: Sequence[Mapping[str, float]],
    x: str,
    ys: Sequence[str],
    png: Path,
    *,
    title: str = "",
    csv: Path | None = None,
) -> None:
    """One small panel per series ``ys[j]`` plotted against ``x`` (e.g. loss, knn_acc, view_noise over epoch).

    A row contributes to panel j only if both ``row[x]`` and ``row[ys[j]]`` are present, not None and finite, so
    series logged at different frequencies share one list of rows. A series without any point gets a "no data" note.
    rows: R mappings. CSV (optional, R rows): columns ``x, *ys``, an empty cell where a value is missing/None.
    """
    if len(ys) == 0:
        raise ValueError("line_curves needs at least one y series")
    ncols = min(len(ys), 3)
    nrows = math.ceil(len(ys) / ncols)
    fig = _new_figure(3.2 * ncols, 2.5 * nrows + (0.3 if title else 0.0))
    axes = fig.subplots(nrows, ncols, squeeze=False).reshape(-1)
    for ax, name in zip(axes, ys, strict=False):
        pts = [(_float(r.get(x)), _float(r.get(name))) for r in rows]
        pts = [(px, py) for px, py in pts if math.isfinite(px) and math.isfinite(py)]
        if pts:
            px, py = zip(*sorted(pts), strict=True)
            ax.plot(px, py, marker="o", markersize=2.5, linewidth=1.2)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
        ax.set_title(name, fontsize="medium")
        ax.set_xlabel(x)
        ax.grid(True, alpha=0.3)
    for ax in axes[len(ys):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    text = None
    if csv is not None:
        cols = [x, *ys]
        text = csv_text(rows, cols, _fmt)
    _save(fig, png, csv, text)


# --------------------------------------------------------------------------------------- sharpness
def sharpness_per_layer(
    values: Sequence[float],
    png: Path,
    csv: Path,
    *,
    labels: Sequence[str] | None = None,
    name: str = "sharpness",
) -> None:
    """Sharpness (Definition 2, ``S(A) = min_{c_i=c_j, i!=j} A_ij / max_{c_p!=c_q} A_pq``) of every block's affinity.

    A line chart over layers on a symmetric-log y axis (linear below the smallest non-zero |finite value|), so 0 and
    negative values are drawn. Only finite values are plotted; +inf is marked by an upward arrow labelled "+inf" at
    the top of the axis, -inf by a downward arrow "-inf" at the bottom, NaN by a grey "nan" at mid-height. A dashed
    line marks S = 1 (every same-class affinity above every cross-class one).
    values: L floats; labels: L names (default "block 1" ... "block L").
    CSV (L rows): ``layer,sharpness``, with inf / -inf / nan written as ``inf`` / ``-inf`` / ``nan``.
    ``name`` renames the quantity (axis label and CSV column), e.g. for the mean-ratio ``contrast``.
    """
    v = np.asarray([_float(s) for s in values], dtype=np.float64)  # (L,)
    names = [f"block {i + 1}" for i in range(len(v))] if labels is None else [str(s) for s in labels]
    if len(names) != len(v):
        raise ValueError(f"got {len(v)} values but {len(names)} labels")
    pos = np.arange(len(v))
    finite = np.isfinite(v)
    nonzero = np.abs(v[finite & (v != 0)])
    linthresh = float(nonzero.min()) if nonzero.size else 1.0

    fig = _new_figure(max(3.5, 0.9 * len(v) + 1.5), 3.2)
    ax = fig.add_subplot()
    ax.set_yscale("symlog", linthresh=linthresh)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=0.8)
    ax.plot(pos, np.where(finite, v, np.nan), marker="o", linewidth=1.2)  # the line breaks at non-finite values
    if finite.any():
        lo, hi = float(min(v[finite].min(), 1.0)), float(max(v[finite].max(), 1.0))
        pad = max(linthresh, 0.1 * max(abs(lo), abs(hi)))
        ax.set_ylim(lo - pad if lo <= 0 else lo / 2, hi * 2 if hi > 0 else hi + pad)
    arrow = {"arrowstyle": "->", "color": "tab:red", "linewidth": 1.5}
    trans = ("data", "axes fraction")
    for i, s in zip(pos, v, strict=True):
        if s == math.inf:
            ax.annotate("+inf", xy=(i, 0.98), xycoords=trans, xytext=(i, 0.80), textcoords=trans, ha="center",
                        va="top", color="tab:red", arrowprops=arrow)
        elif s == -math.inf:
            ax.annotate("-inf", xy=(i, 0.02), xycoords=trans, xytext=(i, 0.20), textcoords=trans, ha="center",
                        va="bottom", color="tab:red", arrowprops=arrow)
        elif math.isnan(s):
            ax.annotate("nan", xy=(i, 0.5), xycoords=trans, ha="center", va="center", color="grey")
    ax.set_xlim(-0.5, len(v) - 0.5)
    ax.set_xticks(pos, names, rotation=30 if len(v) > 6 else 0)
    ax.set_ylabel(f"{name} (symlog)")
    ax.grid(True, axis="y", alpha=0.3)
    table = [[layer, repr(float(s))] for layer, s in zip(names, v, strict=True)]
    _save(fig, png, csv, csv_text(table, ["layer", name]))


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
    panels = sorted({r[panel] for r in rows}, key=_sort_key)
    xs = sorted({r[x] for r in rows}, key=_sort_key)
    ys = sorted({r[y] for r in rows}, key=_sort_key)
    pi, xi, yi = ({v: i for i, v in enumerate(vals)} for vals in (panels, xs, ys))
    total = np.zeros((len(panels), len(ys), len(xs)))
    count = np.zeros_like(total)
    for r in rows:
        val = _float(r.get(value))
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
    fig = _new_figure(max(2.8, 0.55 * len(xs) + 1.4) * len(panels) + 1.0, max(2.6, 0.45 * len(ys) + 1.4))
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
        ax.set_xticks(range(len(xs)), [_fmt(v) for v in xs], rotation=45 if len(xs) > 5 else 0)
        ax.set_yticks(range(len(ys)), [_fmt(v) for v in ys])
        ax.set_xlabel(x)
        ax.set_ylabel(y if p == 0 else "")
        ax.set_title(f"{panel} = {_fmt(pv)}")
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
    text = csv_text(rows, cols, _fmt)
    _save(fig, png, csv, text)


# ------------------------------------------------------------------------------------------- theory
def _theory_formula_maps(rows: Sequence[Mapping[str, Any]],
                         n: int) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """ρ values (R,), ε values (E,) and (R, E) arrays of gamma_gt1 / meaningful / Delta for one n."""
    rs = [r for r in rows if r["n"] == n]
    rho = np.array(sorted({float(r["rho"]) for r in rs}))
    eps = np.array(sorted({float(r["eps"]) for r in rs}))
    ri = {v: i for i, v in enumerate(rho)}
    ei = {v: j for j, v in enumerate(eps)}
    maps = {k: np.full((len(rho), len(eps)), np.nan) for k in ("gamma_gt1", "meaningful", "Delta")}
    for r in rs:
        for k in maps:
            maps[k][ri[float(r["rho"])], ei[float(r["eps"])]] = float(r[k])
    return rho, eps, maps


THEORY_TICKS = (0.0, 1e-8, 1e-6, 1e-4, 1e-2, 0.25, 0.5, 0.75, 1.0)


def _theory_ticks(values: np.ndarray) -> tuple[list[float], list[str]]:
    """Tick positions (in index space: one unit per grid value) and labels for the values of THEORY_TICKS inside the
    grid's range, dropping a tick that would sit less than max(1.5, len / 15) columns from the previous one."""
    pos: list[float] = []
    text: list[str] = []
    gap = max(1.5, len(values) / 15)
    for v in THEORY_TICKS:
        if not values[0] <= v <= values[-1]:
            continue
        p = float(np.interp(v, values, np.arange(len(values))))
        if pos and p - pos[-1] < gap:
            continue
        pos.append(p)
        text.append("0" if v == 0 else (f"1e{round(math.log10(v))}" if v < 0.01 else f"{v:g}"))
    return pos, text


def theory_figure(formula_rows: Sequence[Mapping[str, Any]], table: Sequence[Mapping[str, Any]],
                  empirical_rows: Sequence[Mapping[str, Any]], png: str | os.PathLike) -> None:
    """The theory stage's figure (``pipeline.theory_report``): Theorem 2 as printed beside the trained heads.

    ``formula_rows``: ``theory_experiments.formula_table``'s rows; ``table``: ``theory_report.aggregate`` of
    ``empirical_rows`` (``theory_experiments.run_empirical``'s rows).
    Left: per formula n, categorical (ρ, ε) map {γ > 1 only, meaningful only, both}, the Δ = 0 line and the
    data's points (filled = learned in at least half of the runs there). Right: measured NMI over (n, ε), one panel
    per depth, hatched where the printed γ > 1 at the data's ρ in at least half of the runs, '*' where meaningful."""
    ns = sorted({int(r["n"]) for r in formula_rows})
    depths = sorted({int(r["depth"]) for r in table})
    n_emp = sorted({int(r["n"]) for r in table})
    eps_emp = sorted({float(r["eps"]) for r in table})
    fcols = min(len(ns), 2)
    frows = math.ceil(len(ns) / fcols)
    left_w = 3.3 * fcols + 0.5
    right_w = (0.55 * len(eps_emp) + 1.3) * len(depths) + 1.2
    height = max(3.0 * frows, 0.45 * len(n_emp) + 2.5) + 1.0
    fig = _new_figure(left_w + right_w, height)
    left, right = fig.subfigures(1, 2, width_ratios=[left_w, right_w])
    colors = ["white", "#f4a582", "#92c5de", "#762a83"]  # neither, printed γ>1 only, meaningful only, both
    cmap = ListedColormap(colors)
    axes = left.subplots(frows, fcols, squeeze=False).reshape(-1)
    emp_points: dict[tuple[int, float], list[Mapping[str, Any]]] = {}
    for r in empirical_rows:
        emp_points.setdefault((int(r["n"]), float(r["eps"])), []).append(r)
    for ax, n in zip(axes, ns, strict=False):
        rho, eps, maps = _theory_formula_maps(formula_rows, n)
        cat = np.nan_to_num(maps["gamma_gt1"]) + 2 * np.nan_to_num(maps["meaningful"])  # (R, E) in {0..3}
        # drawn in index space (one column per grid value): a mixed log / linear ε grid stays readable
        ax.imshow(cat, cmap=cmap, vmin=-0.5, vmax=3.5, origin="lower", aspect="auto", interpolation="nearest")
        if len(rho) > 1 and len(eps) > 1 and np.nanmin(maps["Delta"]) < 0 < np.nanmax(maps["Delta"]):
            ax.contour(np.arange(len(eps)), np.arange(len(rho)), maps["Delta"], levels=[0.0], colors="black",
                       linestyles="--", linewidths=1.0)
        for (pn, pe), rs in emp_points.items():
            if pn != n:
                continue
            ok = sum(bool(r["learned"]) for r in rs) >= len(rs) / 2
            py = float(np.interp(np.mean([r["rho"] for r in rs]), rho, np.arange(len(rho))))
            ax.plot([float(np.interp(pe, eps, np.arange(len(eps))))], [py], marker="o", markersize=6,
                    color="black", markerfacecolor="black" if ok else "white", linestyle="")
        for axis, values in ((ax.xaxis, eps), (ax.yaxis, rho)):
            pos, text = _theory_ticks(values)
            axis.set_ticks(pos, text, fontsize="x-small")
        ax.set_xlabel("noise bound ε (one column per grid value)", fontsize="small")
        ax.set_ylabel("cluster integrity ρ", fontsize="small")
        overlap = int(np.nansum(cat == 3))
        ax.set_title(f"n = {n}: γ>1 {100 * np.nanmean(maps['gamma_gt1']):.0f}%, valid "
                     f"{100 * np.nanmean(maps['meaningful']):.1f}%, both {overlap}", fontsize="small")
    for ax in axes[len(ns):]:
        ax.set_visible(False)
    left.legend(handles=[
        Patch(facecolor=colors[1], edgecolor="grey", label="printed γ > 1 (bound not valid)"),
        Patch(facecolor=colors[2], edgecolor="grey", label="bound valid (meaningful), γ ≤ 1"),
        Patch(facecolor=colors[3], edgecolor="grey", label="valid and γ > 1 (empty)"),
        Line2D([], [], color="black", linestyle="--", label="Δ = 0 (γ → ∞)"),
        Line2D([], [], color="black", marker="o", linestyle="", label="data, learned"),
        Line2D([], [], color="black", marker="o", markerfacecolor="white", linestyle="", label="data, not learned"),
    ], loc="outside lower center", ncols=2, fontsize="x-small", frameon=False)
    left.suptitle("Theorem 2 as printed, per batch size n", fontsize="medium")

    raxes = right.subplots(1, len(depths), squeeze=False)[0]
    cm = colormaps["viridis"].with_extremes(bad="white")
    norm = Normalize(vmin=0.0, vmax=1.0)
    image = None
    for ax, depth in zip(raxes, depths, strict=True):
        grid = np.full((len(n_emp), len(eps_emp)), np.nan)
        for r in table:
            if int(r["depth"]) == depth:
                i, j = n_emp.index(int(r["n"])), eps_emp.index(float(r["eps"]))
                grid[i, j] = r["nmi"]
                if r["gamma_gt1"] >= 0.5:
                    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="tab:red", hatch="//",
                                           linewidth=1.2))
        image = ax.imshow(np.ma.masked_invalid(grid), cmap=cm, norm=norm, origin="lower", aspect="auto",
                          interpolation="nearest")
        for r in table:
            if int(r["depth"]) == depth and math.isfinite(r["nmi"]):
                i, j = n_emp.index(int(r["n"])), eps_emp.index(float(r["eps"]))
                mark = "*" if r["meaningful"] >= 0.5 else ""
                ax.text(j, i, f"{r['nmi']:.2f}{mark}", ha="center", va="center", fontsize="x-small",
                        color="black" if r["nmi"] > 0.5 else "white")
        ax.set_xticks(range(len(eps_emp)), [f"{v:g}" for v in eps_emp])
        ax.set_yticks(range(len(n_emp)), [str(v) for v in n_emp])
        ax.set_xlabel("noise bound ε")
        ax.set_ylabel("batch size n")
        ax.set_title(f"measured NMI, depth {depth}", fontsize="small")
    right.colorbar(image, ax=list(raxes), label="spectral NMI of the trained affinity", shrink=0.9)
    right.legend(handles=[Patch(fill=False, edgecolor="tab:red", hatch="//",
                                label="printed γ > 1 at the data's (ρ, ε, n)"),
                          Line2D([], [], linestyle="", marker="$*$", color="black", label="bound valid there")],
                 loc="outside lower center", fontsize="x-small", frameon=False)
    right.suptitle("Measured (trained TransFusion head, test batch)", fontsize="medium")
    _save(fig, png, None, None)
