"""``reports/REPORT.md``: our numbers in the layout of the paper's Tables 1-2, the paper's beside them.

The paper's tables (CIFAR-10, ResNet-18, 200 epochs, batch 128, 100 % labels) are reproduced verbatim as
reference rows; our row is measured on whatever ``data.dataset`` the pipeline ran, so the comparison is of
layout and trend unless that dataset is CIFAR-10 with the paper's recipe.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pipeline.evaluation.health import KERNEL, verdict, warnings_for

COLUMNS = ("ffn", "svm", "knn50", "knn200")
HEADER = "| Model | Batch Size | 3-FFN | SVM | K-NN (k=50) | K-NN (k=200) | Time (min) |"
RULE = "|---|---|---|---|---|---|---|"

# Table 1: self-supervised, CIFAR-10 (paper section 5.2.1)
PAPER_TABLE_1 = [
    ("InfoNCE", 128, (0.3854, 0.3728, 0.3398, 0.32), 990),
    ("DCL", 128, (0.3736, 0.383, 0.3099, 0.2962), 705),
    ("BarlowTwins", 128, (0.4827, 0.5032, 0.4259, 0.4085), 752),
    ("TransFusion 1-Layer", 128, (0.5231, 0.5102, 0.4231, 0.4107), 764),
    ("TransFusion 9-Layer", 128, (0.5626, 0.5430, 0.4616, 0.4453), 706),
]
# Table 2: supervised, CIFAR-10 (paper section 5.2.2)
PAPER_TABLE_2 = [
    ("SupCon", 128, (0.8121, 0.8049, 0.7907, 0.7717), 352),
    ("SupCon", 1024, (0.9091, 0.9056, 0.9002, 0.8931), 641),
    ("TransFusion 1-Layer", 128, (0.9475, 0.9309, 0.9355, 0.9350), 368),
    ("TransFusion 9-Layer", 128, (0.9489, 0.9432, 0.9487, 0.9487), 380),
    ("ResNet-18", 128, (0.935, None, None, None), None),
]
PAPER_TABLES = {1: ("Table 1 (self-supervised)", PAPER_TABLE_1), 2: ("Table 2 (supervised)", PAPER_TABLE_2)}
NA = "n/a"  # a number we could not compute (a failed run); "-" is a cell the paper leaves empty


def fmt_cell(v: Any, digits: int = 4) -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    if isinstance(v, float) and not math.isfinite(v):
        return "∞" if v > 0 else str(v)
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def fmt_minutes(minutes: float) -> str:
    """Training time in minutes: one decimal from a minute on, two significant digits below (a few-second run on a
    fast machine reads 0.0042, not 0.0)."""
    return f"{minutes:.1f}" if minutes >= 1 else f"{minutes:.2g}"


def table_row(name: str, batch: Any, accs: tuple, minutes: Any, *extra: str) -> str:
    """One Markdown row of the paper's layout (``HEADER``), plus ``extra`` cells for added columns. ``minutes``: our
    measured float (:func:`fmt_minutes`), the paper's whole number, None (a cell the paper leaves empty) or text."""
    cells = " | ".join(fmt_cell(a) for a in accs)
    took = fmt_minutes(minutes) if isinstance(minutes, float) and math.isfinite(minutes) else fmt_cell(minutes, 1)
    return f"| {name} | {batch} | {cells} | {took} |" + "".join(f" {e} |" for e in extra)


def our_value(by_fraction: Mapping[str, Any], fraction: str) -> Any:
    """One of our measurements: None where it was not measured (not asked for), "n/a" where it could not be."""
    if fraction in by_fraction and by_fraction[fraction] is None:
        return NA
    return by_fraction.get(fraction)


def our_accuracies(probes: Mapping[str, Any], representation: str, fraction: str = "1") -> tuple:
    rep = probes.get(representation, {})
    return tuple(our_value(rep.get(p, {}), fraction) for p in COLUMNS)


def model_name(params: Mapping[str, Any]) -> str:
    m, loss = params["model"], params["loss"]["name"]
    if loss in ("jsd", "jsd_appendix_e"):
        return f"TransFusion {m['depth']}-Layer ({loss})"
    return f"{loss} (depth {m['depth']})"


def render(params: Mapping[str, Any], pretrain: Mapping[str, Any], evaluation: Mapping[str, Any],
           figures: Mapping[str, str]) -> str:
    """The whole report as Markdown. ``figures``: caption -> path relative to the report."""
    probes = evaluation["probes"]
    data, train = params["data"], params["train"]
    minutes = pretrain.get("train_seconds", 0.0) / 60
    supervised = train["mode"] == "supervised"
    ours = table_row(f"**{model_name(params)}, ours on {data['dataset']}**", train["batch_size"],
                our_accuracies(probes, "backbone"), minutes)
    raw = table_row(f"raw input ({data['dataset']}), same probes", "-", our_accuracies(probes, "input"), None)
    caption, table = PAPER_TABLES[2 if supervised else 1]
    lines = [
        "# TransFusion pipeline report",
        "",
        f"Dataset **{data['dataset']}**, {train['mode'].replace('_', '-')} pretraining, "
        f"backbone `{params['model']['backbone']}`, depth {params['model']['depth']}, loss `{params['loss']['name']}`, "
        f"{pretrain.get('epochs')} epochs, global batch {train['batch_size']}, augmentation "
        f"`{params['augment']['preset']}` at strength {params['augment']['strength']} "
        f"(measured view noise ε = {fmt_cell(pretrain.get('view_noise'))}).",
        "",
        f"## Linear and non-linear probes, in the layout of the paper's {caption}",
        "",
        "Probes on frozen backbone embeddings of the test split, fitted on 100 % of the train labels "
        "(as the paper). The paper's rows are CIFAR-10 with ResNet-18 for 200 epochs: compare trends, not values, "
        "unless this run is that recipe.",
        "",
        HEADER,
        RULE,
        ours,
        raw,
        *(table_row(f"paper: {n}", b, a, t) for n, b, a, t in table),
        "",
        "## Every representation, every label fraction",
        "",
        "| representation | probe | " + " | ".join(f"{float(f):.0%} labels" for f in _fractions(probes)) + " |",
        "|---|---|" + "---|" * len(_fractions(probes)),
    ]
    for rep, by_probe in probes.items():
        for probe, by_frac in by_probe.items():
            cells = " | ".join(fmt_cell(our_value(by_frac, f)) for f in _fractions(probes))
            lines.append(f"| {rep} | {probe} | {cells} |")
    spectral = evaluation.get("spectral", {})
    lines += [
        "",
        "## Cluster quality of the learned affinity",
        "",
        f"Spectral clustering of the `{spectral.get('affinity')}` affinity of a test batch: "
        f"NMI {fmt_cell(spectral.get('nmi'))}, ARI {fmt_cell(spectral.get('ari'))}.",
        "",
        *_layer_table(evaluation.get("layers", {})),
        "Definition 2's sharpness takes the worst pairs: it is 0 as soon as one same-class pair of the batch has a "
        "zero ReLU affinity, which is nearly always, so a 0 there says little. The 10 % quantile version "
        "(10th percentile of same-class affinities over the 90th of different-class ones) and the contrast "
        "(mean over mean) move with the bulk of the pairs.",
        "",
        "| layer | sharpness (def. 2, worst pair) | sharpness (10 % quantiles) "
        "| contrast (mean same / mean different) |",
        "|---|---|---|---|",
    ]
    for layer, s in evaluation.get("sharpness", {}).items():
        q10 = evaluation.get("sharpness_q10", {}).get(layer)
        lines.append(f"| {layer} | {fmt_cell(s)} | {fmt_cell(NA if q10 is None else q10)} "
                     f"| {fmt_cell(evaluation.get('contrast', {}).get(layer))} |")
    lines += health_section(evaluation.get("health"), params["model"]["depth"])
    lines += ["", "## Figures", ""]
    for caption_, path in figures.items():
        lines += [f"**{caption_}**", "", f"![{caption_}]({path})", ""]
    lines += ["## Params", "", "```yaml", _yaml(params), "```", ""]
    return "\n".join(lines)


def health_section(health: Mapping[str, Any] | None, depth: int) -> list[str]:
    """The fusion health of every block on a test batch (``evaluation.health``), with a plain-words warning for a
    dead or mostly uniform block."""
    if health and KERNEL in health:  # ABC (model.method: abc): its kernel, no blocks that could die
        h = health[KERNEL]
        return ["", "## Kernel health (ABC)", "",
                "ABC's kernel κ on one test batch of the trained size (one view per image), over the pairs i ≠ j. "
                "Its softmax attention cannot die, so there is no dead-block verdict.", "",
                "| mean κ, same class | mean κ, other pairs | share κ > 0.5 |", "|---|---|---|",
                f"| {fmt_cell(h.get('same_class'), 3)} | {fmt_cell(h.get('other'), 3)} "
                f"| {fmt_cell(h.get('above_half'), 3)} |"]
    lines = ["", "## Fusion health", ""]
    if depth == 0:
        return lines + ["Depth 0: no TransFusion block, nothing fuses."]
    if not health:
        return lines + [f"{NA}: this evaluation has no health numbers (made by an older version)."]
    chance = next(iter(health.values())).get("same_class_chance")
    lines += [
        f"Each block's attention on one test batch of the trained size (one view per image). Uniform attention gives "
        f"entropy 1 and a same-class share of {fmt_cell(chance, 3) if chance is not None else NA} (chance); "
        "a block below 1 % positive pairs is dead: its attention is uniform and it adds the batch mean to its input.",
        "",
        "| block | positive pairs | uniform rows | attention entropy | same-class share | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for block, h in health.items():
        share = NA if h.get("same_class") is None else f"{h['same_class']:.3f}"
        lines.append(f"| {block} | {h['positive']:.1%} | {h['uniform_rows']:.1%} | {h['entropy']:.3f} | {share} "
                     f"| {verdict(h) or 'alive'} |")
    warnings = warnings_for(health)
    lines += [""] + [f"**Warning: {w}.**" for w in warnings]
    if warnings:
        lines += ["", "What keeps blocks alive on these data, measured over seeds: `docs/fusion.md`."]
    return lines


def _fractions(probes: Mapping[str, Any]) -> list[str]:
    fr = {f for rep in probes.values() for p in rep.values() for f in p}
    return sorted(fr, key=float)


def _yaml(params: Mapping[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(dict(params), sort_keys=False).rstrip()


def _layer_table(layers: dict) -> list[str]:
    """Each representation's own clusters (the paper's Figure 4 in numbers): spectral NMI of its cosine affinity and
    its cosine silhouette, on the same test batch; nothing for an evaluation written before they existed."""
    if not layers:
        return []
    def cell(v: Any) -> str:
        return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt_cell(v)

    rows = [f"| {name} | {cell(v.get('nmi'))} | {cell(v.get('silhouette'))} |" for name, v in layers.items()]
    return ["Each representation's own clusters on that batch (do the classes condense with depth?): spectral NMI of "
            "its cosine affinity, and its cosine silhouette (1 = condensed classes, 0 = overlapping).", "",
            "| representation | NMI | silhouette |", "|---|---|---|", *rows, ""]
