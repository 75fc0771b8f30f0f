"""The set-clustering study's tables, verdict and figure, from its summary alone (no model code: the ``report`` stage
renders ``metrics/sets.json`` with this module).

The summary is :func:`pipeline.evaluation.set_study.summarize`'s: {dataset: {method: {metric: mean, metric_sd: sd}}}.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# ABC's published NMI (Coward et al., Tables 2-4), on data sets other than ours: context, not targets
PAPER_NMI = (
    ("Omniglot (Table 2)", "abc_multiplicative", 0.893, 0.874),
    ("Omniglot (Table 2)", "abc_additive", 0.873, 0.816),
    ("embedded ImageNet (Table 3)", "abc_multiplicative", 0.630, 0.550),
    ("CIFAR-100 (Table 4)", "abc_multiplicative", 0.591, 0.567),
)
COLUMNS = (("nmi_known", "NMI, k known"), ("ari_known", "ARI, k known"), ("nmi_unknown", "NMI, k̂"),
           ("ari_unknown", "ARI, k̂"), ("k_error", "mean |k̂ − k|"))
LABELS = {"abc_multiplicative": "ABC multiplicative", "abc_additive": "ABC additive", "transfusion": "TransFusion",
          "pairwise": "pairwise (no context)", "rbf": "RBF spectral"}


def _cell(entry: Mapping[str, Any], key: str) -> str:
    mean, sd = entry.get(key), entry.get(f"{key}_sd")
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return "n/a"
    if sd is None or (isinstance(sd, float) and math.isnan(sd)):
        return f"{mean:.3f}"
    return f"{mean:.3f} ± {sd:.3f}"


def winners(summary: Mapping[str, Mapping[str, Mapping[str, Any]]], key: str = "ari_known") -> dict[str, str]:
    """Per data set, a sentence: the best method by mean ``key``, and whether it leads the runner-up beyond the spread
    (its mean − sd above the runner-up's mean + sd, the sds over seeds) or only within it."""
    out = {}
    for name, methods in summary.items():
        ranked = sorted(methods.items(), key=lambda kv: -kv[1][key])
        best, entry = ranked[0]
        if len(ranked) == 1:
            out[name] = f"{LABELS.get(best, best)} (the only method run)"
            continue
        second, other = ranked[1]
        sd = (entry.get(f"{key}_sd") or 0.0, other.get(f"{key}_sd") or 0.0)
        sd = tuple(0.0 if math.isnan(s) else s for s in sd)
        beyond = entry[key] - sd[0] > other[key] + sd[1]
        out[name] = (f"{LABELS.get(best, best)} {entry[key]:.3f} vs {LABELS.get(second, second)} {other[key]:.3f}: "
                     + ("ahead beyond the spread (mean − sd > runner-up's mean + sd)" if beyond
                        else "within the spread (a tie at this length and these seeds)"))
    return out


def render(summary: Mapping[str, Mapping[str, Mapping[str, Any]]], setup: Mapping[str, Any],
           figure: str | None = None, level: int = 2) -> str:
    """Markdown: the table (data set × method, mean ± sd over seeds), the verdicts, ABC's published numbers."""
    h = "#" * level
    abc = ""
    if "abc_attention" in setup:
        abc = (f", {setup.get('circles_heads')} on the circles; SAB attention "
               + ("as each model's similarity, as ABC's code" if setup["abc_attention"] == "matched"
                  else "multiplicative") + (", with" if setup.get("abc_projection") else ", no") + " output projection")
    lines = [f"{h} Set clustering: ABC's protocol on unseen classes", ""]
    lines.append(
        f"Each trained method: {setup.get('steps')} Adam steps of {setup.get('batch_sets')} sets "
        f"(lr {setup.get('lr')}), {setup.get('blocks')} blocks of width {setup.get('width')} "
        f"({setup.get('heads')} heads for ABC{abc}); tested on {setup.get('test_sets')} sets of classes never "
        f"seen in training per seed; mean ± sd over seeds {setup.get('seeds')}. k̂: the eigengap, capped at "
        f"{setup.get('k_max')}.")
    lines += ["", "| data set | method | " + " | ".join(c for _, c in COLUMNS) + " |",
              "|---|---|" + "---|" * len(COLUMNS)]
    for name, methods in summary.items():
        for method, entry in methods.items():
            lines.append(f"| {name} | {LABELS.get(method, method)} | "
                         + " | ".join(_cell(entry, k) for k, _ in COLUMNS) + " |")
    lines += ["", "Who wins (ARI with k known):", ""]
    lines += [f"- **{name}**: {text}" for name, text in winners(summary).items()]
    lines += ["", "ABC's published NMI, on data this machine does not have (context, not targets):", "",
              "| benchmark | method | NMI, k known | NMI, k̂ |", "|---|---|---|---|"]
    lines += [f"| {b} | {LABELS[m]} | {k:.3f} | {u:.3f} |" for b, m, k, u in PAPER_NMI]
    if figure:
        lines += ["", f"![ARI per data set and method]({figure})"]
    return "\n".join(lines) + "\n"


def rows(summary: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """The summary as long rows (dataset, method, metric, mean, sd): ``plots/sets/sets.csv``."""
    return [{"dataset": name, "method": method, "metric": key, "mean": entry[key], "sd": entry.get(f"{key}_sd")}
            for name, methods in summary.items() for method, entry in methods.items() for key, _ in COLUMNS]


def figure(summary: Mapping[str, Mapping[str, Mapping[str, Any]]], path: Path) -> None:
    """Bars of ARI (k known, k̂) per method, a panel per data set, with ± sd error bars: ``plots/sets/ari.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.6), squeeze=False, sharey=True)
    for ax, name in zip(axes[0], names, strict=True):
        methods = list(summary[name])
        for j, (key, label) in enumerate((("ari_known", "k known"), ("ari_unknown", "k̂ (eigengap)"))):
            means = [summary[name][m][key] for m in methods]
            sds = [summary[name][m].get(f"{key}_sd") for m in methods]
            sds = [0.0 if s is None or math.isnan(s) else s for s in sds]
            ax.bar([i + 0.4 * j - 0.2 for i in range(len(methods))], means, width=0.4, yerr=sds, capsize=2,
                   label=label)
        ax.set_xticks(range(len(methods)), [LABELS.get(m, m).split(" (")[0] for m in methods], rotation=35,
                      ha="right", fontsize=8)
        ax.set_title(name)
        ax.axhline(0.0, color="grey", lw=0.5)
    axes[0][0].set_ylabel("ARI on unseen classes")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------- ABC's Figure 2 on the circles (benchmarks/study_circles.py)
CIRCLES_STUDY = Path("benchmarks/results/circles.csv")  # its rows: one per (part, points, method, seed)
CIRCLES_COMMAND = "python benchmarks/study_circles.py"
STUDY_METRICS = ("ari_known", "ari_unknown", "nmi_known", "nmi_unknown", "k_error", "final_loss")


def _stats(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else math.nan
    return mean, sd


def circles_summary(rows: list[Mapping[str, Any]]) -> dict[str, Any]:
    """The study's rows (strings, as read from its CSV) as {part: {points: {"steps", "batch_sets",
    "methods": {method: {metric: mean, metric_sd: sd, "seeds": n}}}}}, parts "full" and "points"."""
    out: dict[str, Any] = {}
    for r in rows:
        cell = out.setdefault(r["part"], {}).setdefault(str(int(r["points"])), {
            "steps": int(r["steps"]), "batch_sets": int(r["batch_sets"]), "methods": {}})
        cell["methods"].setdefault(r["method"], []).append(r)
    for part in out.values():
        for cell in part.values():
            for method, mine in list(cell["methods"].items()):
                entry: dict[str, Any] = {"seeds": len(mine)}
                for key in STUDY_METRICS:
                    values = [float(r[key]) for r in mine if r.get(key) not in (None, "")]
                    if values:
                        entry[key], entry[f"{key}_sd"] = _stats(values)
                cell["methods"][method] = {k: entry[k] for k in sorted(entry)}
            cell["methods"] = {m: cell["methods"][m] for m in LABELS if m in cell["methods"]}
    return out


def _beats(a: Mapping[str, Any], b: Mapping[str, Any], key: str = "ari_known") -> str:
    """'a > b' judged on the means and the sds over seeds: beyond the spread, within it, or reversed."""
    sd_a, sd_b = (0.0 if math.isnan(e.get(f"{key}_sd", math.nan)) else e[f"{key}_sd"] for e in (a, b))
    if a[key] - sd_a > b[key] + sd_b:
        return "holds beyond the spread"
    if a[key] > b[key]:
        return "a tie within the spread"
    return "does not hold"


def circles_orderings(methods: Mapping[str, Mapping[str, Any]], key: str = "ari_known") -> list[str]:
    """The paper's Figure 2 orderings (ABC ≫ RBF > pairwise) on one cell, a sentence each."""
    out = []
    rbf, pair = methods.get("rbf"), methods.get("pairwise")
    for abc in ("abc_additive", "abc_multiplicative"):
        if abc in methods and rbf:
            ratio = f", {methods[abc][key] / rbf[key]:.1f}×" if rbf[key] > 0 else ""
            out.append(f"{LABELS[abc]} > RBF: {_beats(methods[abc], rbf, key)} ({methods[abc][key]:.3f} vs "
                       f"{rbf[key]:.3f}{ratio})")
    if rbf and pair:
        out.append(f"RBF > pairwise: {_beats(rbf, pair, key)} ({rbf[key]:.3f} vs {pair[key]:.3f})")
    if "abc_additive" in methods and pair:
        out.append(f"ABC additive > pairwise (the context helps): {_beats(methods['abc_additive'], pair, key)} "
                   f"({methods['abc_additive'][key]:.3f} vs {pair[key]:.3f})")
    return out


def circles_section(summary: Mapping[str, Any], figure: str | None = None, level: int = 2) -> str:
    """Markdown: the full-length table (20 points), the points-per-set table, the orderings, the command."""
    h = "#" * level
    lines = [f"{h} The circles: ABC's Figure 2, measured", ""]
    full = summary.get("full", {})
    for points, cell in full.items():
        lines += [f"{points} points per set on 4 circles drawn as ABC's code draws them, {cell['steps']} steps of "
                  f"{cell['batch_sets']} sets (the code's 1,000,000 training sets), ABC's SABs as its code builds them "
                  "(1 head, no W_O; additive attention in the additive model); mean ± sd over seeds of the mean over "
                  "100 test sets:", "",
                  "| method | seeds | ARI, k known | ARI, k̂ | NMI, k known | NMI, k̂ | mean \\|k̂ − k\\| "
                  "| final loss (ABC, pairwise: BCE; TransFusion: JSD) |",
                  "|---|---|---|---|---|---|---|---|"]
        for method, e in cell["methods"].items():
            cells = [_cell(e, k) for k in ("ari_known", "ari_unknown", "nmi_known", "nmi_unknown", "k_error",
                                           "final_loss")]
            lines.append(f"| {LABELS.get(method, method)} | {e['seeds']} | " + " | ".join(cells) + " |")
        lines += ["", "The paper's orderings (ARI, k known):", ""]
        lines += [f"- {s}" for s in circles_orderings(cell["methods"])]
        lines += ["", "With the eigengap's k̂:", ""]
        lines += [f"- {s}" for s in circles_orderings(cell["methods"], "ari_unknown")]
    sizes = summary.get("points", {})
    if sizes:
        any_cell = next(iter(sizes.values()))
        names = [m for m in LABELS if any(m in c["methods"] for c in sizes.values())]
        keys = sorted(sizes, key=int)
        lines += ["", f"Against the points per set, at a shorter length ({any_cell['steps']} steps of "
                  f"{any_cell['batch_sets']} sets for every size), ARI with k known / with k̂:", "",
                  "| method | " + " | ".join(f"{p} points" for p in keys) + " |", "|---|" + "---|" * len(keys)]
        for m in names:
            row = [f"{_cell(sizes[p]['methods'][m], 'ari_known')} / {_cell(sizes[p]['methods'][m], 'ari_unknown')}"
                   if m in sizes[p]["methods"] else "n/a" for p in keys]
            lines.append(f"| {LABELS[m]} | " + " | ".join(row) + " |")
    if figure:
        lines += ["", f"![ARI against the points per set]({figure})"]
    lines += ["", f"Measured by `{CIRCLES_COMMAND}` ({CIRCLES_STUDY}); `docs/sets.md` discusses it."]
    return "\n".join(lines) + "\n"


def circles_figure(summary: Mapping[str, Any], path: Path) -> None:
    """ARI (k known; k̂) against the points per set, a line per method with ± sd bars, the full-length 20-point
    cells as stars: ``plots/sets/circles.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes, full = summary.get("points", {}), summary.get("full", {})
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    for ax, key, title in ((axes[0], "ari_known", "ARI, k known"), (axes[1], "ari_unknown", "ARI, eigengap k̂")):
        for m in LABELS:
            xs = [int(p) for p in sorted(sizes, key=int) if m in sizes[p]["methods"]]
            color = None
            if xs:
                es = [sizes[str(p)]["methods"][m] for p in xs]
                sds = [e.get(f"{key}_sd", math.nan) for e in es]
                line = ax.errorbar(xs, [e[key] for e in es], capsize=3, marker="o", label=LABELS[m],
                                   yerr=[0.0 if math.isnan(sd) else sd for sd in sds])
                color = line[0].get_color()
            for p, cell in full.items():
                if m in cell["methods"]:
                    e = cell["methods"][m]
                    sd = e.get(f"{key}_sd", math.nan)
                    ax.errorbar([int(p)], [e[key]], yerr=[0.0 if math.isnan(sd) else sd], marker="*", markersize=13,
                                color=color, capsize=3, linestyle="none", label=None if xs else LABELS[m])
        ax.set_xscale("log")
        ticks = sorted({int(p) for p in sizes} | {int(p) for p in full})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("points per set")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("ARI on fresh circles")
    axes[0].legend(fontsize=8)
    note = []
    if sizes:
        c = next(iter(sizes.values()))
        note.append(f"lines: {c['steps']} steps of {c['batch_sets']} sets")
    for p, c in full.items():
        note.append(f"stars: {p} points, {c['steps']} steps of {c['batch_sets']} sets (ABC's code)")
    fig.suptitle("The circles, ABC's Figure 2 measured (mean ± sd over seeds); " + "; ".join(note), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
