"""pipeline/evaluation/tables_report.py: the paper's Tables 1-2 as the tables job fills them, and its CSV."""

from __future__ import annotations

import json
import math
import random

import pytest
from scipy import stats

from pipeline.config.params import load_params
from pipeline.evaluation.report import HEADER, NA, PAPER_TABLE_1, PAPER_TABLE_2
from pipeline.evaluation.tables_report import (
    COLUMNS,
    PROBES,
    RISE,
    TEST,
    PairedResult,
    aggregate,
    confidence_interval,
    csv_records,
    curve_columns,
    curve_rows,
    health_table,
    paired_test,
    read_curves,
    read_records,
    render,
    rise_table,
    statistics_table,
    studies_section,
)
from pipeline.io import write_csv
from tests.conftest import ROOT


def params(*overrides: str, path=ROOT / "params.yaml"):
    return load_params(path, overrides)


def record(index, table, name, accs, *, paper=None, batch=128, status="TERMINATED", error="", seed=0, control="",
           logreg=None, history=()):
    ok = status == "TERMINATED"
    return {"index": index, "table": table, "name": name, "paper": paper if paper is not None else name,
            "seed": seed, "control": control, "trial_id": f"t{index}s{seed}", "train.mode": "self_supervised",
            "loss.name": "jsd", "model.depth": 1, "model.backbone": "cnn_small", "train.batch_size": batch,
            "epochs": 2 if ok else 1, **dict(zip(PROBES, accs if ok else (None,) * 4, strict=True)),
            "logreg": logreg if ok else None, "knn_acc": 0.5 if ok else None,
            "train_minutes": 1.5 if ok else None, "fit_seconds": 120.0, "eval_seconds": 3.0, "workers": 2,
            "gpus": 2 if ok else None, "hours": 2 * 120 / 3600 if ok else None, "hours_unit": "GPU-hours",
            "status": status, "error": error, "history": list(history)}


def test_tables_md_puts_each_row_under_the_papers_and_says_n_a_for_what_failed():
    p = params("tables.rows=[{name: InfoNCE, table: 1}, {name: Mine, table: 1}, {name: SupCon, table: 2, params: "
               "{train.mode: supervised, loss.name: supcon}}]")
    records = [record(0, 1, "InfoNCE", (0.61, 0.62, 0.63, 0.64)),
               record(1, 1, "Mine", (0.5, 0.5, 0.5, 0.5), paper=None),
               record(2, 2, "SupCon", (), status="ERROR", error="non_finite: nan (last good epoch 1)")]
    records[1]["paper"] = None
    text = render(records, p, "GPU-hours", "digits")
    t1, t2 = text.split("## Table 1 (self-supervised)")[1].split("## Table 2 (supervised)")
    lines1 = t1.splitlines()
    assert lines1[2] == HEADER + " GPU-hours |"
    at = lines1.index("| **ours: InfoNCE** | 128 | 0.6100 | 0.6200 | 0.6300 | 0.6400 | 1.5 | 0.0667 |")
    assert lines1[at - 1].startswith("| paper: InfoNCE | 128 | 0.3854 |")
    assert sum(line.startswith("| paper: ") for line in lines1) == len(PAPER_TABLE_1)
    assert [line for line in lines1 if line.startswith("| ")][-1].startswith("| **ours: Mine** |")  # no paper row
    lines2 = t2.splitlines()
    at = lines2.index(f"| **ours: SupCon** | 128 | {NA} | {NA} | {NA} | {NA} | {NA} | {NA} |")
    assert lines2[at - 1].startswith("| paper: SupCon | 128 |")  # the batch-128 row, not the 1024 one
    assert sum(line.startswith("| paper: ") for line in lines2) == len(PAPER_TABLE_2)
    assert "- table 2 **SupCon**, seed 0: non_finite: nan (last good epoch 1)" in text


def test_csv_cells_we_could_not_compute_are_n_a():
    out = csv_records([record(0, 1, "A", (0.1, 0.2, 0.3, 0.4)), record(1, 2, "B", (), status="ERROR", error="x")])
    assert (out[0]["ffn"], out[0]["hours"], out[0]["error"]) == (0.1, pytest.approx(0.0667, abs=1e-4), "")
    assert [out[1][k] for k in (*PROBES, "train_minutes", "hours", "gpus")] == [NA] * 7
    assert out[1]["fit_seconds"] == 120.0 and out[1]["status"] == "ERROR"


def seeded_study():
    """Two rows over seeds 0-2 (one seed of the second failed), the two controls: a study's records."""
    raw = [record(-2, 0, "raw pixels", (0.7,) * 4, paper="", control="raw_pixels", logreg=0.8)]
    init = [record(-1, 0, "random init", (0.6 + s / 100,) * 4, paper="", control="random_init", seed=s, logreg=0.7)
            for s in range(3)]
    a = [record(0, 1, "InfoNCE", (0.6, 0.6, 0.6, 0.70 + s / 100), seed=s, logreg=0.8,
                history=[{"epoch": e, "seconds": 10.0, "loss": 1.0 / e, "knn_acc": 0.5 + e / 10,
                          "block_1.entropy": 0.5} for e in (1, 2)]) for s in range(3)]
    b = [record(1, 1, "TransFusion 1-Layer", (0.5, 0.5, 0.5, 0.6), seed=s, logreg=0.75) for s in range(2)]
    b.append(record(1, 1, "TransFusion 1-Layer", (), seed=2, status="ERROR", error="killed"))
    for r in raw + init:
        r["paper"] = None
    for r in a:  # what the job records of a row's head (b: a record from before rows had one)
        r["head"] = "no projector, no head"
    return raw + init + a + b


def test_seeds_become_mean_and_sd_and_the_controls_stand_in_every_table():
    p = params("tables.rows=[{name: InfoNCE, table: 1}, {name: TransFusion 1-Layer, table: 1}]",
               "tables.seeds=[0, 1, 2]")
    records = seeded_study()
    lines = aggregate(records)
    assert [(x["name"], x["seeds"], x["finished"]) for x in lines] == [
        ("raw pixels", [0], [0]), ("random init", [0, 1, 2], [0, 1, 2]), ("InfoNCE", [0, 1, 2], [0, 1, 2]),
        ("TransFusion 1-Layer", [0, 1, 2], [0, 1])]
    infonce = lines[2]
    assert infonce["knn200"] == pytest.approx(0.71) and infonce["knn200_sd"] == pytest.approx(0.01)  # sample sd
    assert lines[3]["failures"] == [(2, "killed")] and lines[3]["status"] == "TERMINATED"
    text = render(records, p, "GPU-hours", "fashion_mnist")
    t1 = text.split("## Table 1 (self-supervised)")[1].split("\n## ")[0].splitlines()
    assert t1[4] == "| control: raw pixels | - | 0.7000 | 0.7000 | 0.7000 | 0.7000 | - | - |"
    assert t1[5].startswith("| control: random init | - | 0.6100 ± 0.0100 |")
    assert "| **ours: InfoNCE** | 128 | 0.6000 ± 0.0000 | 0.6000 ± 0.0000 | 0.6000 ± 0.0000 | 0.7100 ± 0.0100 |" in text
    assert "- table 1 **TransFusion 1-Layer**, seed 2: killed" in text
    every = text.split("## Every probe, mean ± sd over seeds")[1].splitlines()
    assert every[2] == ("| row | table | head | seeds | epochs | 3-FFN | SVM | K-NN (k=50) | K-NN (k=200) | "
                        "logistic regression | online kNN, last epoch | train min / seed |")
    assert "| TransFusion 1-Layer | 1 | n/a | 2/3 | 2 | 0.500 ± 0.000 | 0.500 ± 0.000 | 0.500 ± 0.000 | " \
           "0.600 ± 0.000 | 0.750 ± 0.000 | 0.500 ± 0.000 | 1.5 |" in every
    assert any(line.startswith("| InfoNCE | 1 | no projector, no head | 3/3 |") for line in every)
    assert "| raw pixels | control | - | 1/1 | 2 | 0.700 | 0.700 | 0.700 | 0.700 | 0.800 | - | - |" in every


def test_the_tables_render_again_from_their_csvs(tmp_path):
    p = params("tables.rows=[{name: InfoNCE, table: 1}, {name: TransFusion 1-Layer, table: 1}]")
    records = seeded_study()
    curves = curve_rows(records)
    assert [(c["seed"], c["epoch"], c["seconds"]) for c in curves] == [(s, e, 10.0 * e) for s in range(3)
                                                                          for e in (1, 2)]
    assert curve_columns(curves)[-1] == "block_1.entropy"
    write_csv(tmp_path / "results.csv", csv_records(records), COLUMNS)
    write_csv(tmp_path / "curves.csv", curves, curve_columns(curves))
    again = read_records(tmp_path / "results.csv")
    assert render(again, p, "GPU-hours", "digits") == render(records, p, "GPU-hours", "digits")
    assert read_curves(tmp_path / "curves.csv") == curves


def test_the_report_shows_each_recorded_study_of_its_data_set(tmp_path):
    """studies/<name>/tables/ as the tables job writes them: the report's section lists those on its data set."""
    assert studies_section("fashion_mnist", tmp_path) == ""
    p = params("tables.rows=[{name: InfoNCE, table: 1}, {name: TransFusion 1-Layer, table: 1}]",
               "data.limit_train=10000")
    for name, dataset in (("b-study", "fashion_mnist"), ("a-study", "fashion_mnist"), ("other", "digits")):
        (tmp_path / name / "tables").mkdir(parents=True)
        write_csv(tmp_path / name / "tables/results.csv", csv_records(seeded_study()), COLUMNS)
        (tmp_path / name / "tables/results.json").write_text(json.dumps({"dataset": dataset,
                                                                         "params": p.model_dump()}))
    (tmp_path / "b-study/plots/tables").mkdir(parents=True)
    (tmp_path / "b-study/plots/tables/curves.png").write_bytes(b"png")
    text = studies_section("fashion_mnist", tmp_path, link="../")
    assert text.startswith("## Recorded studies on fashion_mnist")
    head = f"### a-study: 10,000 training images, {p.train.epochs} epochs, batch {p.train.batch_size}\n"
    assert head in text and text.index(head) < text.index("### b-study")
    assert "other" not in text and text.count("![") == 1
    assert f"](../{tmp_path / 'b-study/plots/tables/curves.png'})" in text
    assert text.count("| TransFusion 1-Layer | 1 | n/a | 2/3 | 2 | 0.500 ± 0.000 |") == 2


def curve(name, seed, epoch, knn, **blocks):
    """A tables/curves.csv line; ``blocks``: ``block_1=(positive, uniform_rows, entropy, same_class, other_view)``."""
    health = {f"{b}.{k}": v for b, values in blocks.items()
              for k, v in zip(("positive", "uniform_rows", "entropy", "same_class", "other_view"), values, strict=True)}
    return {"table": 1, "name": name, "seed": seed, "epoch": epoch, "seconds": 10.0 * epoch, "loss": 1.0,
            "knn_acc": knn, **health}


@pytest.mark.parametrize("knn, best, stops", [
    ([0.50, 0.60, 0.70], "0.700 (epoch 3)", "3 (still rising)"),  # every epoch beats the last by more than RISE
    ([0.50, 0.70, 0.704, 0.702], "0.704 (epoch 3)", "2"),  # epochs 3-4 add at most RISE to epoch 2
    ([0.60, 0.70, 0.65, 0.66], "0.700 (epoch 2)", "2"),  # a fall after the best
    ([0.70, 0.70, 0.70], "0.700 (epoch 1)", "1"),
])
def test_the_online_knn_stops_rising_where_no_later_epoch_beats_it(knn, best, stops):
    assert RISE == 0.005
    # two seeds whose mean is knn: the row's curve is the mean over its seeds
    curves = [curve("TF", s, e + 1, k + (0.01 if s else -0.01)) for s in (0, 1) for e, k in enumerate(knn)]
    header, rule, line = rise_table(curves)
    assert line == f"| TF | 1 | {len(knn)} | {knn[0]:.3f} | {best} | {knn[-1]:.3f} | {stops} |"
    assert rise_table([curve("TF", 0, 1, 0.5)]) == []  # one epoch says nothing about a budget


def test_the_health_table_reads_each_seeds_last_epoch():
    curves = [curve("TF-2", 0, 1, 0.5, block_1=(0.9, 0.0, 0.5, 0.5, 0.5), block_2=(0.9, 0.0, 0.5, 0.5, 0.5)),
              curve("TF-2", 0, 2, 0.6, block_1=(0.40, 0.1, 0.80, 0.2, 0.01), block_2=(0.005, 0.9, 0.99, 0.1, 0.02)),
              curve("TF-2", 1, 2, 0.6, block_1=(0.60, 0.3, 0.70, 0.3, 0.03), block_2=(0.20, 0.1, 0.95, 0.3, None)),
              curve("no head", 0, 2, 0.6)]
    header, rule, line = health_table(curves)
    assert header.count("|") == rule.count("|") == line.count("|") == 10
    # the last block (block_2) at epoch 2 of seeds 0 and 1; the weakest block's positive pairs per seed: 0.005, 0.20;
    # the most uniform: 0.9, 0.3; seed 0's block_2 is dead (< 1 %); seed 1's other view unknown: one seed's value
    assert line == ("| TF-2 | 1 | 2 | 0.970 ± 0.028 | 0.020 | 0.200 ± 0.141 | 0.103 ± 0.138 | 0.600 ± 0.424 | 1/2 |")
    assert health_table([curve("no head", 0, 2, 0.6)]) == []


def test_the_health_table_reads_a_shallower_row_back_from_the_csv(tmp_path):
    """curves.csv has the deepest row's block columns: a one-block row's block_2 cells are empty, not a block."""
    curves = [curve("TF-1", 0, 1, 0.5, block_1=(0.5, 0.0, 0.8, 0.3, 0.02)),
              curve("TF-2", 0, 1, 0.5, block_1=(0.4, 0.1, 0.9, 0.2, 0.01), block_2=(0.3, 0.2, 0.9, 0.2, 0.01))]
    write_csv(tmp_path / "curves.csv", curves, curve_columns(curves))
    back = read_curves(tmp_path / "curves.csv")
    assert health_table(back) == health_table(curves)
    assert [line.split(" | ")[:3] for line in health_table(back)[2:]] == [["| TF-1", "1", "1"], ["| TF-2", "1", "2"]]


# ------------------------------------------------------------------------------------- statistics over seeds
T_975 = {1: 12.706205, 2: 4.302653, 4: 2.776445, 9: 2.262157}  # t(0.975, df), from a printed table


def slow_mean_sd(values):
    """The mean and the sample standard deviation, by hand."""
    total = 0.0
    for v in values:
        total += v
    mean = total / len(values)
    square = 0.0
    for v in values:
        square += (v - mean) ** 2
    return mean, math.sqrt(square / (len(values) - 1))


@pytest.mark.parametrize("n", [df + 1 for df in T_975])
def test_the_confidence_interval_is_the_student_t_interval_of_the_mean(n):
    values = [random.Random(n).uniform(0.6, 0.8) for _ in range(n)]
    mean, sd = slow_mean_sd(values)
    half = T_975[n - 1] * sd / math.sqrt(n)
    low, high = confidence_interval(values)
    assert (low, high) == (pytest.approx(mean - half, abs=1e-6), pytest.approx(mean + half, abs=1e-6))
    assert confidence_interval([0.7]) is None and confidence_interval([]) is None


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_the_paired_test_is_the_t_test_of_the_per_seed_differences(n):
    rng = random.Random(n)
    a = {s: rng.uniform(0.6, 0.8) for s in range(n)} | {100: 0.9}  # seed 100: the row's only, left out
    b = {s: rng.uniform(0.6, 0.8) for s in range(n)} | {200: 0.1}
    diffs = [a[s] - b[s] for s in range(n)]
    mean, sd = slow_mean_sd(diffs)
    t = mean / (sd / math.sqrt(n))
    p = 2 * stats.t.sf(abs(t), n - 1)
    result = paired_test(a, b)
    assert (result.n, result.diff, result.p) == (n, pytest.approx(mean), pytest.approx(p))
    assert result.word == ("tie" if p >= 0.05 else "ahead" if mean > 0 else "behind")


@pytest.mark.parametrize(("a", "b", "expected"), [
    ({0: 0.8, 1: 0.9, 2: 0.85}, {0: 0.7, 1: 0.79, 2: 0.76}, "ahead"),  # +0.10, +0.11, +0.09
    ({0: 0.7, 1: 0.79, 2: 0.76}, {0: 0.8, 1: 0.9, 2: 0.85}, "behind"),
    ({0: 0.8, 1: 0.7, 2: 0.75}, {0: 0.7, 1: 0.8, 2: 0.76}, "tie"),  # +0.10, -0.10, -0.01
])
def test_the_verdict_is_ahead_behind_or_tie_at_5_percent(a, b, expected):
    assert paired_test(a, b).word == expected


@pytest.mark.parametrize(("a", "b", "expected"), [
    ({0: 0.8}, {0: 0.7}, PairedResult(1, pytest.approx(0.1), None, NA)),  # one pair: no spread to test
    ({0: 0.8, 1: 0.8}, {2: 0.7, 3: 0.7}, PairedResult(0, None, None, NA)),  # no seed in common
    ({0: 0.8, 1: 0.9}, {0: 0.7, 1: 0.8}, PairedResult(2, pytest.approx(0.1), None, NA)),  # the same +0.1 twice
    ({0: 0.8, 1: 0.9}, {0: 0.8, 1: 0.9}, PairedResult(2, 0.0, None, "tie")),  # equal on every seed
])
def test_the_paired_test_has_no_p_value_where_it_is_undefined(a, b, expected):
    assert paired_test(a, b) == expected


def verdicts(lines):
    """``{(row, table): (difference, p, test, verdict)}`` of a statistics_table's lines."""
    cells = [line.strip("|").split(" | ") for line in lines[2:]]
    return {(c[0].strip(), c[1]): tuple(x.strip() for x in c[5:]) for c in cells}


def test_each_row_is_tested_against_the_reference_of_its_own_table():
    """Table 1: TF, a row ahead of it, one behind, one level with it; table 2: its own TF (table 1's ahead) and a row
    that is table 1's TF; table 3 has no TF. The control stands in every table, against each table's TF."""
    tf, ahead, behind, tie = (0.70, 0.72, 0.71), (0.80, 0.83, 0.81), (0.60, 0.61, 0.615), (0.72, 0.70, 0.715)
    rows = [(1, "TF", tf), (1, "Ahead", ahead), (1, "Behind", behind), (1, "Tie", tie), (2, "TF", ahead),
            (2, "Other", tf), (3, "Alone", (0.5, 0.6, 0.7))]
    records = [record(-1, 0, "random init", (0.5, 0.5, 0.5, 0.5 + s / 100), control="random_init", seed=s)
               for s in range(3)]
    records += [record(i, table, name, (0.5, 0.5, 0.5, v), seed=s)
                for i, (table, name, values) in enumerate(rows) for s, v in enumerate(values)]
    lines = statistics_table(records, "knn200", "TF")
    assert lines[0] == ("| row | table | seeds | mean ± sd | 95 % CI | difference from TF | p | test | "
                        "verdict at 5 % |")
    got = verdicts(lines)
    assert {k: v[3] for k, v in got.items()} == {
        ("control: random init", "1"): "behind", ("TF", "1"): "reference", ("Ahead", "1"): "ahead",
        ("Behind", "1"): "behind", ("Tie", "1"): "tie",
        ("control: random init", "2"): "behind", ("TF", "2"): "reference", ("Other", "2"): "behind",
        ("control: random init", "3"): NA, ("Alone", "3"): NA}
    assert paired_test(dict(enumerate(ahead)), dict(enumerate(tf))).p == pytest.approx(0.00104, abs=1e-5)
    assert got["Ahead", "1"][:3] == ("+0.1033", "0.00104", f"{TEST}, 3 seeds")
    assert got["Behind", "1"][:2] == ("-0.1017", "0.00188")
    assert got["Alone", "3"] == (NA, NA, "no reference row in this table", NA)
    low, high = confidence_interval(tie)
    assert f"| Tie | 1 | 3 | 0.7117 ± 0.0104 | [{low:.4f}, {high:.4f}] |" in "\n".join(lines)


def test_tables_md_has_the_statistics_of_the_headline_probes():
    rows = "tables.rows=[{name: InfoNCE, table: 1}, {name: TransFusion 1-Layer, table: 1}]"
    records = seeded_study()
    text = render(records, params(rows, "tables.seeds=[0, 1, 2]", "tables.reference=InfoNCE"), "GPU-hours", "digits")
    knn = text.split("## Statistics over seeds (K-NN (k=200))\n")[1].split("\n## ")[0]
    assert f"the {TEST};" in knn and "reference row **InfoNCE** (`tables.reference`)" in knn
    assert "| InfoNCE | 1 | 3 | 0.7100 ± 0.0100 | [0.6852, 0.7348] | - | - | - | reference |" in knn
    # TransFusion 1-Layer: seeds 0-1 finished, 0.6 against InfoNCE's 0.70, 0.71
    assert f"| TransFusion 1-Layer | 1 | 2 | 0.6000 ± 0.0000 | [0.6000, 0.6000] | -0.1050 | 0.0303 | {TEST}, 2 seeds " \
           "| behind |" in knn
    assert "| control: raw pixels | 1 | 1 | 0.7000 | n/a | +0.0000 | n/a | none: 1 seed in common | n/a |" in knn
    assert "## Statistics over seeds (logistic regression)" in text
    plain = render(records, params(rows, "tables.seeds=[0, 1, 2]"), "GPU-hours", "digits")
    knn = plain.split("## Statistics over seeds (K-NN (k=200))\n")[1].split("\n## ")[0]
    assert "Set `tables.reference` to a row's name" in knn and "| row | table | seeds | mean ± sd | 95 % CI |\n" in knn
    assert "| InfoNCE | 1 | 3 | 0.7100 ± 0.0100 | [0.6852, 0.7348] |\n" in knn
