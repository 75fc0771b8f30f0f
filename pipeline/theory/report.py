"""The ``theory`` stage's report: aggregation over seeds, the verdict, CSV tables, ``theory.md`` and the metrics.

``run_all`` runs the three parts of :mod:`pipeline.theory.experiments` (formula table, trained heads) and writes
everything: ``aggregate`` (per grid point, means over seeds), ``summarize`` (the numbers behind the verdict, also
the stage's metrics), ``verdict`` (a Markdown paragraph from those numbers) and ``write_outputs`` (files, through
:mod:`pipeline.io`; the figure is :func:`pipeline.theory.figure.theory_figure`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from scipy.stats import spearmanr

from pipeline.io import json_safe, write_csv, write_text
from pipeline.theory.experiments import (
    EMPIRICAL_COLUMNS,
    FORMULA_COLUMNS,
    EmpiricalGrid,
    TheoryGrid,
    formula_table,
    run_empirical,
)
from pipeline.theory.experiments import format_number as _num

__all__ = ["TABLE_COLUMNS", "aggregate", "run_all", "summarize", "verdict", "write_outputs"]

TABLE_COLUMNS = (
    "n", "eps", "depth", "runs", "rho", "delta", "Delta", "gamma", "meaningful", "gamma_gt1", "contrast_gain",
    "sharpness", "contrast_in", "contrast_out", "nmi_in", "nmi", "learned",
)


# ---------------------------------------------------------------------------------------------- aggregation
def _mean(values: Sequence[float]) -> float:
    """Mean of the values; +inf / -inf if any is infinite (and none of the other sign); NaN if empty or any NaN."""
    v = [float(x) for x in values]
    if not v or any(math.isnan(x) for x in v):
        return math.nan
    return float(np.mean(v))


def aggregate(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per grid point (n, ε, depth): means over seeds (``TABLE_COLUMNS``); booleans become the fraction of runs."""
    groups: dict[tuple, list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["n"], r["eps"], r["depth"]), []).append(r)
    out = []
    for (n, eps, depth), rs in sorted(groups.items()):
        row: dict[str, Any] = {"n": n, "eps": eps, "depth": depth, "runs": len(rs)}
        for c in TABLE_COLUMNS[4:]:
            vals = [r[c] for r in rs]
            row[c] = sum(bool(v) for v in vals) / len(vals) if isinstance(vals[0], bool) else _mean(vals)
        out.append(row)
    return out


def _rankable(v: float) -> float:
    """±inf -> ±1e300 so that a rank correlation can order it; NaN stays NaN (and is dropped)."""
    return math.copysign(1e300, v) if math.isinf(v) else float(v)


def _spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman rank correlation over the pairs where both are not NaN (NaN if < 3 pairs or a constant side)."""
    pairs = [(float(a), float(b)) for a, b in zip(x, y, strict=True) if not (math.isnan(a) or math.isnan(b))]
    if len(pairs) < 3:
        return math.nan
    a, b = zip(*pairs, strict=True)
    if len(set(a)) < 2 or len(set(b)) < 2:
        return math.nan
    return float(spearmanr(a, b).statistic)


def summarize(formula_rows: Sequence[Mapping[str, Any]], empirical_rows: Sequence[Mapping[str, Any]]) -> dict:
    """The numbers behind the verdict (also the stage's metrics). Keys:

    formula: per n, the fraction of (ρ, ε) cells with printed γ > 1, the fraction ``meaningful``, the number of
      cells that are both (``overlap``, 0 by ``theory.learnable_region``) and the largest γ on a meaningful cell.
    empirical: over all runs, counts of ``learned``, ``meaningful``, ``gamma_gt1``, ``learnable`` at the data's
      (ρ, ε, n); the confusion of printed γ > 1 with learned (``both``, ``formula_only``, ``measured_only``,
      ``neither``); runs with contrast gain > 1 and their overlap with γ > 1; runs where NMI / the trained
      affinity's contrast beat the input's (``nmi_improved``, ``contrast_improved``); on meaningful runs, how often the
      measured gain reaches γ; Spearman correlations of NMI, contrast gain and γ with ε and with n (pooled);
      the mean NMI in and out per ε.
    """
    formula: dict[str, Any] = {}
    for n in sorted({int(r["n"]) for r in formula_rows}):
        rs = [r for r in formula_rows if r["n"] == n]
        mg = [r["gamma"] for r in rs if r["meaningful"]]
        formula[str(n)] = {
            "cells": len(rs),
            "gamma_gt1_fraction": sum(r["gamma_gt1"] for r in rs) / len(rs),
            "meaningful_fraction": sum(r["meaningful"] for r in rs) / len(rs),
            "overlap": sum(bool(r["gamma_gt1"] and r["meaningful"]) for r in rs),
            "max_gamma_meaningful": max(mg) if mg else math.nan,
        }
    e = list(empirical_rows)
    learned = [bool(r["learned"]) for r in e]
    printed = [bool(r["gamma_gt1"]) for r in e]
    gain_up = [bool(r["contrast_gain"] > 1) for r in e]
    meaningful = [r for r in e if r["meaningful"]]
    by_eps = {}
    for eps in sorted({r["eps"] for r in e}):
        rs = [r for r in e if r["eps"] == eps]
        by_eps[repr(float(eps))] = {"nmi_in": _mean([r["nmi_in"] for r in rs]), "nmi": _mean([r["nmi"] for r in rs]),
                                    "learned": sum(r["learned"] for r in rs), "runs": len(rs)}
    gamma = [_rankable(r["gamma"]) for r in e]
    empirical = {
        "runs": len(e),
        "learned": sum(learned),
        "meaningful": len(meaningful),
        "gamma_gt1": sum(printed),
        "learnable": sum(bool(r["learnable"]) for r in e),
        "both": sum(p and q for p, q in zip(printed, learned, strict=True)),
        "formula_only": sum(p and not q for p, q in zip(printed, learned, strict=True)),
        "measured_only": sum(q and not p for p, q in zip(printed, learned, strict=True)),
        "neither": sum(not p and not q for p, q in zip(printed, learned, strict=True)),
        "gain_gt1": sum(gain_up),
        "gain_gt1_and_gamma_gt1": sum(p and g for p, g in zip(printed, gain_up, strict=True)),
        "meaningful_gain_ge_gamma": sum(bool(r["contrast_gain"] >= r["gamma"]) for r in meaningful),
        "nmi_mean": _mean([r["nmi"] for r in e]),
        "nmi_in_mean": _mean([r["nmi_in"] for r in e]),
        "nmi_improved": sum(bool(r["nmi"] > r["nmi_in"]) for r in e),
        "contrast_improved": sum(bool(r["contrast_out"] > r["contrast_in"]) for r in e),
        "sharpness_positive": sum(bool(r["sharpness"] > 0) for r in e),
        "spearman_eps_nmi": _spearman([r["eps"] for r in e], [r["nmi"] for r in e]),
        "spearman_eps_gain": _spearman([r["eps"] for r in e], [r["contrast_gain"] for r in e]),
        "spearman_eps_gamma": _spearman([r["eps"] for r in e], gamma),
        "spearman_n_nmi": _spearman([r["n"] for r in e], [r["nmi"] for r in e]),
        "spearman_n_gain": _spearman([r["n"] for r in e], [r["contrast_gain"] for r in e]),
        "spearman_n_gamma": _spearman([r["n"] for r in e], gamma),
        "rho_min": min((r["rho"] for r in e), default=math.nan),
        "rho_max": max((r["rho"] for r in e), default=math.nan),
        "by_eps": by_eps,
    }
    return {"formula": formula, "empirical": empirical}


def _trend(s: float) -> str:
    if math.isnan(s):
        return "undefined (constant or too few points)"
    return f"Spearman {s:+.2f}"


def verdict(summary: Mapping[str, Any], learned_nmi: float = 0.9) -> str:
    """A short Markdown paragraph (bullets) from ``summarize``'s numbers: where formula and measurement agree and
    disagree, stated as counts and correlations, with the caveat that Theorem 2 is a sufficient condition about
    the existence of weights, so learning outside its region does not contradict it."""
    f, e = summary["formula"], summary["empirical"]
    per_n = "; ".join(
        f"n={n}: γ>1 on {100 * v['gamma_gt1_fraction']:.1f}% of the cells, meaningful on "
        f"{100 * v['meaningful_fraction']:.1f}%, "
        f"both on {v['overlap']} cells, max γ where meaningful {_num(v['max_gamma_meaningful'])}"
        for n, v in f.items())
    runs = e["runs"]
    overlap = sum(int(v["overlap"]) for v in f.values())
    if overlap == 0:
        overlap_text = (
            "The printed region {γ > 1} and the region where the bound is valid share no cell, so read as printed "
            "the theorem certifies sharpening on none of them; its {γ > 1} cells lie where Δ ≤ 0 or "
            "Δ³ ≤ n²(δ + δ²), i.e. where the bound says nothing.")
    else:
        overlap_text = (f"The printed region {{γ > 1}} and the valid region share {overlap} cells, contradicting "
                        "theory.learnable_region's proof: check the grid and the formula.")
    by_eps = ", ".join(f"ε={float(k):g}: {v['learned']}/{v['runs']}" for k, v in e["by_eps"].items())
    lines = [
        f"- **Formula alone** (cells of the (ρ, ε) grid; with a mixed log / linear ε grid these are cell counts, "
        f"not areas): {per_n}. {overlap_text}",
        f"- **At the data's (ρ, ε, n)** ({runs} runs, ρ of the clean test batch in "
        f"[{_num(e['rho_min'])}, {_num(e['rho_max'])}]): meaningful in {e['meaningful']}, printed γ > 1 in "
        f"{e['gamma_gt1']}, meaningful and γ > 1 in {e['learnable']}.",
        f"- **Measurement**: learned (spectral NMI of the trained affinity ≥ {learned_nmi:g}) in {e['learned']} of "
        f"{runs} runs; mean NMI {_num(e['nmi_in_mean'])} on the input → {_num(e['nmi_mean'])} after the head, higher "
        f"than the input's in {e['nmi_improved']} runs; learned per ε: {by_eps}; per-block contrast gain > 1 in "
        f"{e['gain_gt1']} runs (the blocks' own ReLU(QKᵀ) affinities), while the trained affinity's contrast exceeds "
        f"the input's in {e['contrast_improved']} runs; "
        f"Definition 2 sharpness of the last block > 0 in {e['sharpness_positive']} runs.",
        f"- **Agreement of printed γ > 1 with learned**: both {e['both']}, γ > 1 but not learned {e['formula_only']}, "
        f"learned but γ ≤ 1 {e['measured_only']}, neither {e['neither']} "
        f"(agree on {e['both'] + e['neither']} of {runs}). Contrast gain > 1 and γ > 1 together in "
        f"{e['gain_gt1_and_gamma_gt1']} runs.",
        f"- **Trends, pooled over the grid**: with ε, NMI {_trend(e['spearman_eps_nmi'])}, contrast gain "
        f"{_trend(e['spearman_eps_gain'])}, printed γ {_trend(e['spearman_eps_gamma'])}; with n, NMI "
        f"{_trend(e['spearman_n_nmi'])}, contrast gain {_trend(e['spearman_n_gain'])}, printed γ "
        f"{_trend(e['spearman_n_gamma'])}. Opposite signs mean the formula and the measurement move in opposite "
        "directions along that axis.",
        f"- **Caveat**: Theorem 2 asserts that SOME weights sharpen every block by γ; trained weights are one "
        "instance, so learning where the theorem is silent does not refute it, and a measured gain below γ only "
        f"says training did not find such weights. Where meaningful, the measured gain reached γ in "
        f"{e['meaningful_gain_ge_gamma']} of {e['meaningful']} runs.",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- writing
def _csv_value(v: Any) -> str:
    """CSV cell: floats to 6 significant digits (keeps the formula table small; 'inf', 'nan' spelled out), bools as
    true/false."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (float, np.floating)):
        return f"{float(v):.6g}"
    return str(v)


def _markdown_table(table: Sequence[Mapping[str, Any]]) -> str:
    head = ("n", "ε", "depth", "ρ", "δ", "Δ", "γ (printed)", "meaningful", "gain/block", "S(A^d)", "NMI in → out",
            "learned")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table:
        runs = r["runs"]
        lines.append("| " + " | ".join([
            _num(r["n"]), _num(r["eps"]), _num(r["depth"]), _num(r["rho"]), _num(r["delta"]), _num(r["Delta"]),
            _num(r["gamma"]), f"{round(r['meaningful'] * runs)}/{runs}", _num(r["contrast_gain"]),
            _num(r["sharpness"]), f"{_num(r['nmi_in'])} → {_num(r['nmi'])}", f"{round(r['learned'] * runs)}/{runs}",
        ]) + " |")
    return "\n".join(lines)


def write_outputs(
    formula_rows: Sequence[Mapping[str, Any]],
    empirical_rows: Sequence[Mapping[str, Any]],
    out_dir: Path,
    *,
    setup: Mapping[str, Any] | None = None,
    learned_nmi: float = 0.9,
    report: Path | None = None,
) -> dict[str, Any]:
    """Write part (c) into ``out_dir`` (and ``report``) and return the metrics (``summarize``, JSON-safe, plus the
    file list of ``out_dir``).

    Files: ``theory.png`` (formula panels beside measurement panels), ``measured_nmi.{png,csv}`` and
    ``measured_gain.{png,csv}`` (``plots.phase_diagram``: x = ε, y = n, one panel per depth, hatched where the
    printed γ > 1 at the data's ρ), ``formula.csv`` (``FORMULA_COLUMNS``), ``empirical.csv`` (one row per run,
    ``EMPIRICAL_COLUMNS``), ``table.csv`` (per grid point, means over seeds, booleans as fractions,
    ``TABLE_COLUMNS``); and, if ``report`` is given, the Markdown report there (setup, verdict, per-n formula summary,
    the table; the stage's is ``reports/theory.md``, outside the plots directory, which holds only figures and their
    data). Each file is written atomically; ``setup`` (e.g. the grid's fields) is listed in the Markdown.
    """
    from pipeline import plots  # matplotlib only when writing
    from pipeline.theory.figure import theory_figure

    if not formula_rows or not empirical_rows:
        raise ValueError("write_outputs needs formula rows and empirical rows")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = aggregate(empirical_rows)
    summary = summarize(formula_rows, empirical_rows)

    write_csv(out_dir / "formula.csv", formula_rows, FORMULA_COLUMNS, _csv_value)
    write_csv(out_dir / "empirical.csv", empirical_rows, EMPIRICAL_COLUMNS, _csv_value)
    write_csv(out_dir / "table.csv", table, TABLE_COLUMNS, _csv_value)
    printed = {(int(r["n"]), float(r["eps"]), int(r["depth"])): r["gamma_gt1"] >= 0.5 for r in table}

    def region(x: Any, y: Any, panel: Any) -> bool:
        return bool(printed.get((int(y), float(x), int(panel)), False))

    for value, name in (("nmi", "measured_nmi"), ("contrast_gain", "measured_gain")):
        plots.phase_diagram(empirical_rows, x="eps", y="n", value=value, panel="depth", png=out_dir / f"{name}.png",
                              csv=out_dir / f"{name}.csv", region=region)
    theory_figure(formula_rows, table, empirical_rows, out_dir / "theory.png")

    setup_lines = "\n".join(f"- {k}: {v}" for k, v in (setup or {}).items())
    per_n = "\n".join(
        f"| {n} | {v['cells']} | {100 * v['gamma_gt1_fraction']:.1f}% | {100 * v['meaningful_fraction']:.1f}% | "
        f"{v['overlap']} | {_num(v['max_gamma_meaningful'])} |" for n, v in summary["formula"].items())
    md = "\n".join([
        "# Theorem 2 against a trained TransFusion head",
        "",
        "γ is Theorem 2's factor exactly as printed; *meaningful* = (Δ > 0) and (Δ³ > n²(δ + δ²)), where Appendix D's "
        "lower bound is positive and γ is a bound at all. ρ: cluster integrity (Definition 1) of the clean test "
        "samples, a lower-bound estimate. Measured: a head trained with the JSD loss on fresh union-of-subspaces "
        "batches of n, evaluated on a fresh stratified test batch of n. *gain/block* = (c(A^d) / c(A⁰))^(1/d), c = "
        "mean same-cluster / mean different-cluster affinity, A⁰ = ReLU(cos x), A^ℓ = block ℓ's ReLU(QKᵀ). *NMI*: "
        f"spectral clustering of cos² (the affinity the loss trains) on the input → on the head's output; "
        f"*learned* = NMI ≥ {learned_nmi:g}. Fractions are over seeds.",
        "",
        "## Setup",
        "",
        setup_lines or "- (not given)",
        "",
        "## Verdict",
        "",
        verdict(summary, learned_nmi),
        "",
        "## The formula on the (ρ, ε) grid",
        "",
        "| n | cells | printed γ > 1 | meaningful | both | max γ where meaningful |",
        "|---|---|---|---|---|---|",
        per_n,
        "",
        "## Per grid point",
        "",
        _markdown_table(table),
        "",
        "Figures and tables (the stage's plots/theory/): theory.png (formula | measurement), measured_nmi.png, "
        "measured_gain.png, formula.csv, empirical.csv, table.csv.",
        "",
    ])
    if report is not None:
        Path(report).parent.mkdir(parents=True, exist_ok=True)
        write_text(report, md)
    metrics = json_safe(summary)
    metrics["files"] = sorted(p.name for p in out_dir.iterdir() if not p.name.startswith("."))
    return metrics


def run_all(theory_grid: TheoryGrid, empirical_grid: EmpiricalGrid, out_dir: Path,
            progress: Callable[[str], Any] | None = print, report: Path | None = None) -> dict[str, Any]:
    """Parts (a), (b), (c) in one call: returns ``write_outputs``' metrics plus ``seconds`` (wall time); the
    Markdown report goes to ``report`` (None: none)."""
    t0 = time.perf_counter()
    formula = formula_table(theory_grid)
    rows = run_empirical(empirical_grid, progress)
    setup = asdict(empirical_grid)
    setup["formula grid"] = f"{len(theory_grid.rho)} x {len(theory_grid.eps)} (ρ, ε) points, n = {list(theory_grid.n)}"
    metrics = write_outputs(formula, rows, out_dir, setup=setup, learned_nmi=empirical_grid.learned_nmi,
                            report=report)
    metrics["seconds"] = round(time.perf_counter() - t0, 2)
    return metrics
