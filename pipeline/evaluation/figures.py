"""Figures people look at, each written as a PNG together with the data behind it (CSV).

* :func:`tsne_layers` -- the paper's Figure 4: t-SNE of every representation (input, backbone, block 1, ...), left
  to right, one colour per class kept across panels, one legend.
* :func:`line_curves` -- training curves (loss, knn_acc, view_noise, ... over epoch), one small panel per series.
* :func:`sharpness_per_layer` -- Definition 2 of every block's affinity on a symmetric-log axis.

The sweep's heat maps (:func:`pipeline.plots.phase_diagram`) and the theory figure
(:func:`pipeline.theory.figure.theory_figure`) live beside the floors that draw them. Every figure goes through
:mod:`pipeline.plots`: an explicit Agg canvas, no pyplot, and the PNG and its CSV written together atomically.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.lines import Line2D
from sklearn.manifold import TSNE
from threadpoolctl import threadpool_limits  # a dependency of scikit-learn

from pipeline.data.split import stratified_subset
from pipeline.host import usable_cpus
from pipeline.io import csv_text
from pipeline.plots import as_float, fmt_value, new_figure, save_figure

__all__ = [
    "class_colors",
    "line_curves",
    "sharpness_per_layer",
    "tsne_layers",
    "tsne_perplexity",
]





    # ExitStack renames the CSV first and the PNG last, so a present PNG implies a complete CSV.








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
        return fmt_value(cls)
    if isinstance(class_names, Mapping):
        return str(class_names.get(cls, fmt_value(cls)))
    try:
        return str(class_names[int(cls)])
    except (IndexError, TypeError, ValueError):
        return fmt_value(cls)


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

    The same subset ``S = split.stratified_subset(labels, max_points, seed, min_per_class=1)`` (m <= max_points
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

    fig = new_figure(3.0 * len(arrays) + 1.6, 3.3)
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
        rows.extend([str(title), int(i), repr(float(e0)), repr(float(e1)), fmt_value(lab)]
                    for i, (e0, e1), lab in zip(idx, emb, sub_y, strict=True))
    handles = [Line2D([], [], linestyle="", marker="o", markersize=6, color=colors[j],
                      label=_class_name(c, class_names)) for j, c in enumerate(classes)]
    fig.legend(handles=handles, loc="outside right upper", ncols=max(1, math.ceil(len(classes) / 25)),
               fontsize="small", frameon=False)
    save_figure(fig, png, csv, csv_text(rows, ["layer", "index", "x", "y", "label"]))


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
    fig = new_figure(3.2 * ncols, 2.5 * nrows + (0.3 if title else 0.0))
    axes = fig.subplots(nrows, ncols, squeeze=False).reshape(-1)
    for ax, name in zip(axes, ys, strict=False):
        pts = [(as_float(r.get(x)), as_float(r.get(name))) for r in rows]
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
        text = csv_text(rows, cols, fmt_value)
    save_figure(fig, png, csv, text)


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
    v = np.asarray([as_float(s) for s in values], dtype=np.float64)  # (L,)
    names = [f"block {i + 1}" for i in range(len(v))] if labels is None else [str(s) for s in labels]
    if len(names) != len(v):
        raise ValueError(f"got {len(v)} values but {len(names)} labels")
    pos = np.arange(len(v))
    finite = np.isfinite(v)
    nonzero = np.abs(v[finite & (v != 0)])
    linthresh = float(nonzero.min()) if nonzero.size else 1.0

    fig = new_figure(max(3.5, 0.9 * len(v) + 1.5), 3.2)
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
    save_figure(fig, png, csv, csv_text(table, ["layer", name]))


















