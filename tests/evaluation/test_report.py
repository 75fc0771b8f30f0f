"""The report renders our row in the paper's table layout, the paper's rows, every probe and the figures."""

from __future__ import annotations

import pytest

from pipeline.evaluation.report import HEADER, PAPER_TABLE_1, fmt_minutes, render


def sample(mode="self_supervised"):
    params = {"data": {"dataset": "digits"}, "model": {"depth": 3, "backbone": "cnn_small"},
              "loss": {"name": "jsd"}, "augment": {"preset": "paper", "strength": 1.0},
              "train": {"mode": mode, "batch_size": 128}}
    pre = {"epochs": 40, "train_seconds": 90.0, "view_noise": 0.045}
    ev = {"probes": {"input": {"svm": {"1": 0.986, "0.1": 0.9}, "ffn": {"1": 0.97}},
                     "backbone": {"svm": {"1": 0.99}, "ffn": {"1": 0.98}, "knn50": {"1": 0.97}, "knn200": {"1": 0.93}}},
          "spectral": {"affinity": "output", "nmi": 0.8, "ari": 0.7},
          "sharpness": {"backbone": 0.0, "block_1": "inf"}, "contrast": {"backbone": 1.5, "block_1": 3.0}}
    return params, pre, ev


def test_our_row_sits_in_the_paper_layout_beside_the_paper_rows():
    text = render(*sample(), {"t-SNE": "../plots/evaluate/tsne.png"})
    assert HEADER in text
    assert "| **TransFusion 3-Layer (jsd), ours on digits** | 128 | 0.9800 | 0.9900 | 0.9700 | 0.9300 | 1.5 |" in text
    assert "| raw input (digits), same probes | - | 0.9700 | 0.9860 | - | - | - |" in text
    for name, *_ in PAPER_TABLE_1:
        assert f"paper: {name}" in text
    assert "![t-SNE](../plots/evaluate/tsne.png)" in text
    assert "| input | svm | 0.9000 | 0.9860 |" in text  # every representation x fraction
    assert "NMI 0.8000, ARI 0.7000" in text and "| block_1 | inf |" in text
    assert "Table 1 (self-supervised)" in text


def test_supervised_runs_use_table_2():
    text = render(*sample("supervised"), {})
    assert "Table 2 (supervised)" in text and "paper: SupCon" in text and "paper: InfoNCE" not in text


def test_a_probe_that_could_not_run_is_na_and_a_dead_block_is_warned_about():
    params, pre, ev = sample()
    ev["probes"]["backbone"]["knn200"] = {"1": 0.93, "0.1": None}  # k = 200 over 143 labels: not run
    live = {"positive": 0.4, "uniform_rows": 0.0, "entropy": 0.8, "same_class": 0.3, "same_class_chance": 0.099,
            "other_view": None}
    dead = dict(live, positive=0.0, uniform_rows=1.0, entropy=1.0, same_class=0.099)
    ev["health"] = {"block_1": live, "block_2": dead, "block_3": live}
    text = render(params, pre, ev, {})
    assert "| backbone | knn200 | n/a | 0.9300 |" in text
    assert "| block_2 | 0.0% | 100.0% | 1.000 | 0.099 | dead |" in text
    assert "| block_1 | 40.0% | 0.0% | 0.800 | 0.300 | alive |" in text
    assert "**Warning: block 2 is dead: 0.0% of its pairs have a positive affinity" in text
    assert "block 1 is" not in text and "docs/fusion.md" in text
    ev["health"] = {"block_1": live, "block_2": live, "block_3": live}
    assert "Warning" not in render(params, pre, ev, {})
    params["model"]["depth"] = 0
    assert "Depth 0: no TransFusion block" in render(params, pre, ev, {})


@pytest.mark.parametrize("minutes, text", [(12.34, "12.3"), (1.5, "1.5"), (1.0, "1.0"), (0.35, "0.35"),
                                           (0.0042, "0.0042"), (0.000123, "0.00012")])
def test_short_runs_keep_two_significant_digits_of_their_minutes(minutes, text):
    # a 2-epoch row on a fast machine trains in a fraction of a second: "0.00" would read as no time at all
    assert fmt_minutes(minutes) == text and float(text) > 0


def test_each_representations_own_clusters_are_a_table_and_absent_from_older_evaluations():
    params, pre, ev = sample()
    assert "| representation | NMI | silhouette |" not in render(params, pre, ev, {})  # written before the key existed
    ev["layers"] = {"input": {"nmi": 0.5, "ari": 0.3, "silhouette": 0.05},
                    "block_1": {"nmi": 0.75, "ari": 0.6, "silhouette": None}}
    text = render(params, pre, ev, {})
    assert "| representation | NMI | silhouette |" in text
    assert "| input | 0.5000 | 0.0500 |" in text and "| block_1 | 0.7500 | n/a |" in text
