"""pipeline/evaluation/tables_report.py: the paper's Tables 1-2 as the tables job fills them, and its CSV."""

from __future__ import annotations

import pytest

from pipeline.config.params import load_params
from pipeline.evaluation.report import HEADER, NA, PAPER_TABLE_1, PAPER_TABLE_2
from pipeline.evaluation.tables_report import PROBES, csv_records, render
from tests.conftest import ROOT


def params(*overrides: str, path=ROOT / "params.yaml"):
    return load_params(path, overrides)


def record(index, table, name, accs, *, paper=None, batch=128, status="TERMINATED", error=""):
    ok = status == "TERMINATED"
    return {"index": index, "table": table, "name": name, "paper": paper if paper is not None else name,
            "trial_id": f"t{index}", "train.mode": "self_supervised", "loss.name": "jsd", "model.depth": 1,
            "model.backbone": "cnn_small", "train.batch_size": batch, "epochs": 2 if ok else 1,
            **dict(zip(PROBES, accs if ok else (None,) * 4, strict=True)),
            "train_minutes": 1.5 if ok else None, "fit_seconds": 120.0, "eval_seconds": 3.0, "workers": 2,
            "gpus": 2 if ok else None, "hours": 2 * 120 / 3600 if ok else None, "hours_unit": "GPU-hours",
            "status": status, "error": error}


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
    assert "- table 2 **SupCon**: non_finite: nan (last good epoch 1)" in text


def test_csv_cells_we_could_not_compute_are_n_a():
    out = csv_records([record(0, 1, "A", (0.1, 0.2, 0.3, 0.4)), record(1, 2, "B", (), status="ERROR", error="x")])
    assert (out[0]["ffn"], out[0]["hours"], out[0]["error"]) == (0.1, pytest.approx(0.0667, abs=1e-4), "")
    assert [out[1][k] for k in (*PROBES, "train_minutes", "hours", "gpus")] == [NA] * 7
    assert out[1]["fit_seconds"] == 120.0 and out[1]["status"] == "ERROR"


