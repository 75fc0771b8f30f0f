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
    assert next(line for line in text.splitlines() if "| digits |" in line).endswith("| n/a |")


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


def study_rows():
    """The circles study's CSV rows (strings, as csv.DictReader gives them): a full part and a points part."""
    rows = []
    aris = {"abc_additive": [0.36, 0.38, 0.34], "abc_multiplicative": [0.30, 0.29, 0.31],
            "pairwise": [0.10, 0.12, 0.11], "rbf": [0.13, 0.12, 0.14]}
    for method, values in aris.items():
        for seed, ari in enumerate(values):
            rows.append({"part": "full", "points": "20", "steps": "7812", "batch_sets": "128", "dataset": "circles",
                         "method": method, "seed": str(seed), "ari_known": str(ari), "ari_unknown": str(ari / 2),
                         "nmi_known": "0.5", "nmi_unknown": "0.3", "k_error": "1.5",
                         "final_loss": "" if method == "rbf" else "0.4", "rbf_c": "2.0" if method == "rbf" else ""})
    for points in ("20", "50"):
        for seed in range(2):
            rows.append({**rows[0], "part": "points", "points": points, "steps": "500", "batch_sets": "32",
                         "seed": str(seed), "ari_known": str(0.1 * int(points) / 20 + 0.01 * seed)})
    return rows


def test_the_circles_study_summary_is_the_mean_and_sd_over_seeds_per_cell():
    summary = set_report.circles_summary(study_rows())
    full = summary["full"]["20"]
    assert (full["steps"], full["batch_sets"]) == (7812, 128)
    assert list(full["methods"]) == ["abc_multiplicative", "abc_additive", "pairwise", "rbf"]  # the report's order
    e = full["methods"]["abc_additive"]
    assert e["seeds"] == 3 and math.isclose(e["ari_known"], 0.36) and math.isclose(e["ari_known_sd"], 0.02)
    assert "final_loss" not in full["methods"]["rbf"]  # nothing trained: no loss, not a zero
    points = summary["points"]
    assert sorted(points) == ["20", "50"] and points["50"]["methods"]["abc_additive"]["seeds"] == 2
    assert math.isclose(points["50"]["methods"]["abc_additive"]["ari_known"], 0.255)


def test_the_circles_section_states_the_papers_orderings():
    text = set_report.circles_section(set_report.circles_summary(study_rows()), figure="../plots/sets/circles.png")
    assert "| ABC additive | 3 | 0.360 ± 0.020 |" in text
    assert "ABC additive > RBF: holds beyond the spread (0.360 vs 0.130, 2.8×)" in text
    assert "RBF > pairwise: a tie within the spread (0.130 vs 0.110)" in text  # 0.130 ± 0.010 vs 0.110 ± 0.010
    assert "| ABC additive | 0.105 ± 0.007 / 0.180 ± 0.000 | 0.255 ± 0.007 / 0.180 ± 0.000 |" in text
    assert "| RBF spectral | n/a | n/a |" not in text and "![ARI against the points per set]" in text
    reversed_ = set_report.circles_orderings({"rbf": entry(0.1), "pairwise": entry(0.3)})
    assert reversed_ == ["RBF > pairwise: does not hold (0.100 vs 0.300)"]


def test_the_circles_figure(tmp_path):
    set_report.circles_figure(set_report.circles_summary(study_rows()), tmp_path / "circles.png")
    assert (tmp_path / "circles.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
