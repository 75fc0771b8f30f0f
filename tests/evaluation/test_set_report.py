"""The set-clustering report (pipeline.evaluation.set_report): the table's cells, n/a for a spread that cannot be
computed, who wins beyond or within the spread, ABC's published numbers beside ours, the figure."""

from __future__ import annotations

import math

from pipeline.evaluation import set_report


def entry(ari, sd=0.01):
    e = {}
    for key, _ in set_report.COLUMNS:
        e[key], e[f"{key}_sd"] = ari, sd
    return e


def test_the_table_has_a_row_per_cell_and_the_papers_numbers():
    summary = {"circles": {"abc_multiplicative": entry(0.9), "rbf": entry(0.5, math.nan)}}
    text = set_report.render(summary, {"steps": 7, "seeds": [0, 1]}, figure="../plots/sets/ari.png")
    assert "| circles | ABC multiplicative | 0.900 ± 0.010 |" in text
    assert "| circles | RBF spectral | 0.500 | 0.500 |" in text  # one seed: no sd shown
    assert "| Omniglot (Table 2) | ABC additive | 0.873 | 0.816 |" in text
    assert "| CIFAR-100 (Table 4) | ABC multiplicative | 0.591 | 0.567 |" in text
    assert "7 Adam steps" in text and "![ARI per data set and method](../plots/sets/ari.png)" in text


def test_a_missing_mean_reads_n_a():
    e = entry(0.4)
    e["k_error"] = math.nan
    text = set_report.render({"digits": {"rbf": e}}, {})
    assert text.splitlines()[[i for i, line in enumerate(text.splitlines()) if "| digits |" in line][0]].endswith(
        "| n/a |")


def test_winners_beyond_and_within_the_spread():
    beyond = set_report.winners({"d": {"rbf": entry(0.8, 0.05), "transfusion": entry(0.5, 0.05)}})["d"]
    assert beyond.startswith("RBF spectral 0.800 vs TransFusion 0.500") and "beyond the spread" in beyond
    within = set_report.winners({"d": {"rbf": entry(0.52, 0.05), "transfusion": entry(0.5, 0.05)}})["d"]
    assert "within the spread" in within
    assert "only method" in set_report.winners({"d": {"rbf": entry(0.5)}})["d"]


def test_rows_and_figure(tmp_path):
    summary = {"circles": {"pairwise": entry(0.2), "rbf": entry(0.3)}, "digits": {"rbf": entry(0.6, math.nan)}}
    rows = set_report.rows(summary)
    assert len(rows) == 3 * len(set_report.COLUMNS)
    assert {"dataset": "digits", "method": "rbf", "metric": "ari_known", "mean": 0.6} | {"sd": rows[-4]["sd"]} in rows
    set_report.figure(summary, tmp_path / "ari.png")
    assert (tmp_path / "ari.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
