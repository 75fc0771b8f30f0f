"""`transfusion tables` end to end: the paper-tables preset shrunk to digits, through real Ray Tune over Ray Train and
a real MLflow sqlite store."""

from __future__ import annotations

import csv
import json
import re
import shutil

import mlflow
import pytest
import yaml

from pipeline.evaluation.report import PAPER_TABLE_1, PAPER_TABLE_2
from tests.conftest import ROOT, invoke

pytestmark = [pytest.mark.slow]

PRESET = str(ROOT / "presets/paper-tables.yaml")
# the preset's job on digits: a small CNN, 2 epochs, 256 training images, batch 32, one 0.5-CPU worker per row
SHRINK = ["-S", "data.dataset=digits", "-S", "data.limit_train=256", "-S", "model.backbone=cnn_small",
          "-S", "model.embed_dim=16", "-S", "train.epochs=2", "-S", "train.batch_size=32", "-S", "train.knn_every=1",
          "-S", "train.checkpoint_every=1", "-S", "ray.use_gpu=false", "-S", "ray.cpus_per_worker=0.5",
          "-S", "ray.storage_path=ray_results", "-S", "ray.max_failures=0", "-S", "train.device=cpu",
          "-S", "probe.device=cpu"]
# four of the preset's eight rows, as the preset defines them (all eight: tests/runs/test_tables.py): a baseline
# and the 9-layer TransFusion of Table 1, SupCon and the 1-layer TransFusion of Table 2 (2 rows at a time on 2 cores)
PICK = [(1, "BarlowTwins"), (1, "TransFusion 9-Layer"), (2, "SupCon"), (2, "TransFusion 1-Layer")]
ROWS = [r for r in yaml.safe_load(open(PRESET))["tables"]["rows"] if (r["table"], r["name"]) in PICK]
ROW = re.compile(r"^\| \*\*ours: (?P<name>[^*]+)\*\* \| 32 \| (?P<accs>[^|]+\|[^|]+\|[^|]+\|[^|]+)\| (?P<min>[^|]+) \| "
                 r"(?P<hours>[^|]+) \|$")


@pytest.mark.timeout(600)
def test_paper_tables_job_on_digits(project, ray_session):
    assert len(ROWS) == 4
    assert invoke("prepare", "--params", PRESET, *SHRINK).exit_code == 0
    result = invoke("tables", "--params", PRESET, *SHRINK, "-S", f"tables.rows={json.dumps(ROWS)}")
    assert result.exit_code == 0, result.output
    assert "tables: 6 runs (0 failed)" in result.output  # 4 rows x 1 seed and the 2 controls
    assert result.output.count("· seed 0: ffn ") == 6  # a progress line per evaluated row

    text = (project / "reports/TABLES.md").read_text()
    for caption, paper, n_ours in (("## Table 1 (self-supervised)", PAPER_TABLE_1, 2),
                                   ("## Table 2 (supervised)", PAPER_TABLE_2, 2)):
        section = text.split(caption)[1].split("\n## ")[0]
        lines = section.splitlines()
        assert "| K-NN (k=200) | Time (min) | worker-hours |" in lines[2]  # CPU-only: worker-hours, labelled so
        ours = [ROW.match(line) for line in lines if line.startswith("| **ours:")]
        assert len(ours) == n_ours and all(ours)
        for m in ours:
            accs = [float(a) for a in m["accs"].split("|")]
            assert all(0.0 <= a <= 1.0 for a in accs) and max(accs) > 0.3  # learned something on digits
            assert float(m["min"]) > 0 and float(m["hours"]) > 0
            # beside the paper's row of the same name: the line above is the paper's (or our row before it)
            at = lines.index(m.group(0))
            assert lines[at - 1].startswith(f"| paper: {m['name']} |")
        assert len([line for line in lines if line.startswith("| paper: ")]) == len(paper)

    with open(project / "tables/results.csv") as f:
        rows = list(csv.DictReader(f))
    controls, rows = rows[:2], rows[2:]  # the controls first, probed in trials of their own
    assert [(c["name"], c["control"], c["epochs"], c["status"]) for c in controls] == [
        ("raw pixels", "raw_pixels", "0", "TERMINATED"), ("random init", "random_init", "0", "TERMINATED")]
    assert [(int(r["table"]), r["name"]) for r in rows] == PICK
    for r in rows:
        assert r["status"] == "TERMINATED" and r["error"] == "" and r["epochs"] == "2"
        assert r["hours_unit"] == "worker-hours" and r["gpus"] == "0" and float(r["hours"]) > 0
        assert float(r["hours"]) == pytest.approx(float(r["fit_seconds"]) / 3600)  # 1 worker x the run's wall time
    assert [(r["loss.name"], r["model.depth"], r["train.mode"]) for r in rows] == [
        ("barlow_twins", "0", "self_supervised"), ("jsd", "9", "self_supervised"), ("supcon", "0", "supervised"),
        ("jsd", "1", "supervised")]
    saved = json.loads((project / "tables/results.json").read_text())
    assert saved["hours_unit"] == "worker-hours" and len(saved["rows"]) == 6

    client = mlflow.MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("transfusion").experiment_id])
    parents = [r for r in runs if r.data.tags.get("stage") == "tables"]
    children = [r for r in runs if r.data.tags.get("stage") == "tables-row"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert {a.path for a in client.list_artifacts(parents[0].info.run_id)} >= {"TABLES.md", "results.csv"}
    assert len(children) == 6 and {c.info.status for c in children} == {"FINISHED"}
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parents[0].info.run_id}
    by_trial = {c.data.tags["trial_id"]: c for c in children}
    for r in rows:
        child = by_trial[r["trial_id"]]
        assert child.data.params["row"] == r["name"] and child.data.params["loss.name"] == r["loss.name"]
        assert child.data.metrics["probe.ffn"] == pytest.approx(float(r["ffn"]))
        assert child.data.metrics["hours"] == pytest.approx(float(r["hours"]))
        assert child.data.tags["hours_unit"] == "worker-hours"
        assert [m.step for m in client.get_metric_history(child.info.run_id, "loss")] == [1, 2]
    # a finished job is forgotten (only the staged data, content-addressed, stays for the next job)
    assert {p.name for p in (project / "ray_results").iterdir()} <= {"prepared-data"}


def test_invalid_rows_exit_2_before_any_work(project):
    bad = "tables.rows=[{name: A, table: 2, params: {loss.name: infonce, train.mode: supervised}}]"
    result = invoke("tables", "--params", PRESET, *SHRINK, "-S", bad)
    assert result.exit_code == 2
    assert "tables.rows[0] ('A', table 2)" in result.output and "loss.name: infonce" in result.output
    assert not (project / "ray_results").exists() and not (project / "mlflow.db").exists()


@pytest.mark.timeout(600)
def test_the_default_job_as_shipped_over_two_seeds(prepare_digits, ray_session):
    """params.yaml's tables job (the paper's 8 rows, the controls, ray.cpus_per_worker: null: all of this machine's
    CPUs less the trial's own) shrunk only in data, epochs and seeds: it fits this machine, a child run per (row,
    seed), tables and curves that render again from the job's outputs."""
    project = prepare_digits(256)
    result = invoke("tables", "-S", "train.epochs=2", "-S", "tables.seeds=[0, 1]")
    assert result.exit_code == 0, result.output
    assert "tables: 19 runs (0 failed)" in result.output  # 8 rows x 2 seeds, random init x 2, raw pixels once
    assert "stopped early" not in result.output
    with open(project / "tables/results.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["probe_cpus"] for r in rows} == {"1.75"}  # a worker of 2 - 0.25 CPUs, its probes in its bundle
    assert [(r["name"], r["seed"]) for r in rows[:3]] == [("raw pixels", "0"), ("random init", "0"),
                                                          ("random init", "1")]
    trained = rows[3:]
    assert len(trained) == 16 and {r["epochs"] for r in trained} == {"2"}
    assert all(float(r["knn200"]) > 0.3 and 0 < float(r["knn_acc"]) <= 1 for r in trained)
    with open(project / "tables/curves.csv") as f:
        curves = list(csv.DictReader(f))
    assert len(curves) == 16 * 2 and all(float(c["knn_acc"]) > 0 for c in curves)
    deep = [c for c in curves if c["name"] == "TransFusion 9-Layer"]
    assert deep and all(c["block_9.entropy"] for c in deep)  # every block's health, per epoch

    text = (project / "reports/TABLES.md").read_text()
    assert re.search(r"^\| \*\*ours: TransFusion 1-Layer\*\* \| 128 \| 0\.\d{4} ± 0\.\d{4} \|", text, re.M)
    assert text.count("| control: random init | - | ") == 2  # in both tables
    assert "| TransFusion 9-Layer | 2 | 2/2 | 2 |" in text
    figure = project / "plots/tables/curves.png"
    assert figure.stat().st_size > 10_000
    (project / "reports/TABLES.md").unlink()
    figure.unlink()
    again = invoke("tables", "--render")  # from the job's files, no training: the same report
    assert again.exit_code == 0, again.output
    assert (project / "reports/TABLES.md").read_text() == text and figure.is_file()
    shutil.copytree(project / "tables", project / "studies/mine/tables")  # a recorded study's folder
    assert invoke("tables", "--render", "--out", "studies/mine").exit_code == 0
    assert (project / "studies/mine/reports/TABLES.md").read_text() == text
    assert (project / "studies/mine/plots/tables/curves.png").is_file()

    client = mlflow.MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("transfusion").experiment_id])
    parent = [r for r in runs if r.data.tags.get("stage") == "tables"]
    children = [r for r in runs if r.data.tags.get("stage") == "tables-row"]
    assert len(parent) == 1 and len(children) == 19
    assert parent[0].data.params["tables.seeds"] == "[0, 1]"
    names = {c.info.run_name for c in children}
    assert {"TransFusion 1-Layer (table 1) · seed 1", "raw pixels (control) · seed 0"} <= names
    child = next(c for c in children if c.info.run_name == "InfoNCE (table 1) · seed 1")
    assert child.data.params["seed"] == "1" and "probe.logreg" in child.data.metrics
    assert [m.step for m in client.get_metric_history(child.info.run_id, "knn_acc")] == [1, 2]
