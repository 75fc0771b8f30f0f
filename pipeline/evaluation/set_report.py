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
    lines = [f"{h} Set clustering: ABC's protocol on unseen classes", ""]
    lines.append(
        f"Each trained method: {setup.get('steps')} Adam steps of {setup.get('batch_sets')} sets "
        f"(lr {setup.get('lr')}), {setup.get('blocks')} blocks of width {setup.get('width')} "
        f"({setup.get('heads')} heads for ABC); tested on {setup.get('test_sets')} sets of classes never seen in "
        f"training per seed; mean ± sd over seeds {setup.get('seeds')}. k̂: the eigengap, capped at "
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
