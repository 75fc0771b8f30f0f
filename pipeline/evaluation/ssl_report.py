"""The recorded self-supervised study on Fashion-MNIST (``benchmarks/study_ssl.py``) as Markdown tables.

Each folder under ``benchmarks/results/ssl/`` is one configuration of the study (a device, a training set, a number
of epochs); its ``ssl.csv`` holds one row per method and seed, the controls (``raw pixels``, ``random init``)
included. A table has one line per method: the mean ± sample standard deviation over seeds of each probe's test
accuracy, the seeds, the epochs and the mean training seconds of a seed.
"""

from __future__ import annotations

import csv
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path

CONTROLS = ("raw pixels", "random init")  # the probes on the pixels; the backbone at its initialisation
PROBES = ("knn200", "logreg")
STUDY_DIR = Path("benchmarks/results/ssl")

__all__ = ["CONTROLS", "PROBES", "STUDY_DIR", "mean_sd", "read_rows", "section", "table"]


def read_rows(path: Path) -> list[dict[str, str]]:
    """The rows of a study CSV ([] when it is not there)."""
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def mean_sd(values: Sequence[float]) -> str:
    """``"0.712 ± 0.004"``: the mean and the sample standard deviation (0 for one value); "n/a" for none."""
    if not values:
        return "n/a"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {sd:.3f}"


def table(rows: Sequence[Mapping[str, str]]) -> str:
    """Markdown: one line per method (controls first), mean ± sd over seeds of each probe, seeds, epochs, seconds."""
    methods = list(dict.fromkeys([*CONTROLS, *(r["method"] for r in rows)]))
    lines = ["| method | kNN-200 | logistic regression | seeds | epochs | train s / seed |",
             "| --- | --- | --- | --- | --- | --- |"]
    for method in methods:
        mine = [r for r in rows if r["method"] == method]
        if not mine:
            continue
        cells = [mean_sd([float(r[p]) for r in mine if r.get(p) not in (None, "", "None")]) for p in PROBES]
        seconds = [float(r["train_seconds"]) for r in mine if r.get("train_seconds")]
        secs = f"{statistics.mean(seconds):.0f}" if seconds else "-"
        lines.append(f"| {method} | {' | '.join(cells)} | {len(mine)} | {mine[0]['epochs']} | {secs} |")
    return "\n".join(lines)


def section(study_dir: Path = STUDY_DIR, link: str = "../") -> str:
    """``## Self-supervised quality on Fashion-MNIST``: one table per recorded configuration ("" when none is
    there); ``link`` is the path from the report's folder to the project's root (for the figures)."""
    parts = []
    for folder in sorted(p for p in study_dir.glob("*") if (p / "ssl.csv").is_file()):
        rows = read_rows(folder / "ssl.csv")
        trained = [r for r in rows if r["method"] not in CONTROLS] or rows
        first = trained[0]
        parts.append(f"### {folder.name}: {first['device']}, {int(first['n_train']):,} training images, "
                     f"{first['epochs']} epochs, batch {first['batch_size']}\n\n{table(rows)}")
        if (folder / "ssl_knn.png").is_file():
            parts.append(f"![online kNN per epoch, {folder.name}]({link}{folder / 'ssl_knn.png'})")
    if not parts:
        return ""
    head = ("## Self-supervised quality on Fashion-MNIST (recorded: `python benchmarks/study_ssl.py`)\n\n"
            "Probes on the official 10,000 test images, fitted on a stratified 10,000 of the training embeddings; "
            "controls: the raw pixels and the backbone at its random initialisation (docs/results.md).")
    return "\n\n".join([head, *parts]) + "\n"
