"""The theory stage's figure: Theorem 2's regions per batch size beside the NMI the trained heads reached (PNG)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.colors import ListedColormap, Normalize
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from pipeline.plots import new_figure, save_figure


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
    """The theory stage's figure (``pipeline.theory.report``): Theorem 2 as printed beside the trained heads.

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
    fig = new_figure(left_w + right_w, height)
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
    save_figure(fig, png, None, None)
