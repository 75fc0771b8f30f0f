"""`transfusion tables` end to end: params.yaml's job (the paper's rows) on digits as shipped but for its sizes, through
real Ray Tune and a real MLflow sqlite store; bad rows and missing data refused before Ray."""

from __future__ import annotations

import csv
import json
import re
import shutil

import mlflow
import pytest

from pipeline.evaluation.report import PAPER_TABLE_1, PAPER_TABLE_2
from tests.conftest import invoke, poison_test_split

OURS = re.compile(r"^\| \*\*ours: (?P<name>[^*]+)\*\* \| 128 \| (?P<accs>[^|]+\|[^|]+\|[^|]+\|[^|]+)\| "
                  r"(?P<min>[^|]+) \| (?P<hours>[^|]+) \|$")


def test_bad_rows_exit_2_and_missing_data_exit_1_before_ray(project, ray_starts):
    bad = invoke("tables", "-S", "tables.rows=[{name: A, table: 2}]")  # table 2 is supervised, the base is not
    assert bad.exit_code == 2 and "tables.rows[0]" in bad.output and "train.mode" in bad.output
    no_data = invoke("tables", "-S", "tables.rows=[{name: A, table: 1}]")
    assert no_data.exit_code == 1 and "data/prepared" in no_data.output
    assert not ray_starts and not (project / "reports").exists() and not (project / "mlflow.db").exists()


def snapshot(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(("results", "needle"), [
    ('{"dataset": "digits", "hours_unit": "worker-hou', "JSONDecodeError"),  # cut off mid-write
    ("[1, 2, 3]", "TypeError"),  # a list where the study's record is a mapping
    ('{"dataset": "digits", "hours_unit": "worker-hours", "rows": []}', "KeyError: 'params'"),
    ('{"dataset": "digits", "hours_unit": "worker-hours", "params": {"train": {"lr": "fast"}}, "tables": {}}',
     "ParamsError"),
])
def test_render_of_a_damaged_study_exits_1_naming_the_file_and_changes_nothing(project, results, needle):
    (project / "tables").mkdir()
    (project / "tables/results.json").write_text(results)
    (project / "tables/results.csv").write_text("table,name\n1,InfoNCE\n")
    (project / "reports").mkdir()
    (project / "reports/TABLES.md").write_text("the last good report\n")
    before = snapshot(project)
    result = invoke("tables", "--render")
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "tables/results.json is damaged" in result.output and needle in result.output, result.output
    assert "Traceback" not in result.output and snapshot(project) == before  # nothing written, nothing removed


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_default_job_as_shipped_over_two_seeds(prepared, ray_session):
    """params.yaml's tables job (the paper's 8 rows, the controls, ray.cpus_per_worker: null: all of this machine's
    CPUs less the trial's own) shrunk only in data, epochs and seeds: it fits this machine, a child run per (row,
    seed), tables and curves that render again from the job's outputs."""
    project = prepared
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
    # kNN-200 on 1,293 digits (129 a class: k outnumbers a class) sits at 0.3-0.4; twice chance is far from noise
    assert all(float(r["knn200"]) > 0.2 and 0.3 < float(r["knn_acc"]) <= 1 for r in trained), [
        (r["name"], r["knn200"], r["knn_acc"]) for r in trained]
    with open(project / "tables/curves.csv") as f:
        curves = list(csv.DictReader(f))
    assert len(curves) == 16 * 2  # every epoch; the online kNN where train.knn_every (5) says and after the last
    assert all((float(c["knn_acc"]) > 0) if c["epoch"] == "2" else c["knn_acc"] == "" for c in curves)
    deep = [c for c in curves if c["name"] == "TransFusion 9-Layer"]
    # every block's health, with the online kNN: after the last epoch only here
    assert deep and all(bool(c["block_9.entropy"]) == (c["epoch"] == "2") for c in deep)

    for r in trained:
        assert r["status"] == "TERMINATED" and r["error"] == "" and r["hours_unit"] == "worker-hours"
        assert r["gpus"] == "0" and float(r["hours"]) == pytest.approx(float(r["fit_seconds"]) / 3600)  # 1 worker

    text = (project / "reports/TABLES.md").read_text()
    for caption, paper, n_ours in (("## Table 1 (self-supervised)", PAPER_TABLE_1, 5),
                                   ("## Table 2 (supervised)", PAPER_TABLE_2, 3)):
        lines = text.split(caption)[1].split("\n## ")[0].splitlines()
        assert "| K-NN (k=200) | Time (min) | worker-hours |" in lines[2]  # CPU-only: worker-hours, labelled so
        assert lines[4].startswith("| control: raw pixels | - | ") and lines[5].startswith("| control: random init |")
        ours = [OURS.match(line) for line in lines if line.startswith("| **ours:")]
        assert len(ours) == n_ours and all(ours)
        for m in ours:  # a cell: the mean ± sd over the two seeds
            assert all(re.fullmatch(r"0\.\d{4} ± 0\.\d{4}", a.strip()) for a in m["accs"].split("|"))
            # the hours at four decimals: a 2-epoch row of digits trains for a fraction of a second (0.0000 or so)
            assert float(m["min"]) > 0 and re.fullmatch(r"\d+\.\d{4}", m["hours"].strip()), m.group(0)
            at = lines.index(m.group(0))  # beside the paper's row of the same name
            assert lines[at - 1].startswith(f"| paper: {m['name']} |")
        assert len([line for line in lines if line.startswith("| paper: ")]) == len(paper)
    assert "| TransFusion 9-Layer | 2 | no projector, 9 blocks (fusing 9) | 2/2 | 2 |" in text
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
    # a finished study tested against another row, paired by seed, without training; a name not in it refused
    against = invoke("tables", "--render", "--out", "studies/mine", "--reference", "InfoNCE")
    assert against.exit_code == 0, against.output
    stats = (project / "studies/mine/reports/TABLES.md").read_text().split("## Statistics over seeds")[1]
    assert "Against the reference row **InfoNCE**" in stats and "| DCL | 1 | 2 |" in stats
    unknown = invoke("tables", "--render", "--out", "studies/mine", "--reference", "SimCLR")
    assert unknown.exit_code == 2 and "'SimCLR' is not a row of this job" in unknown.output, unknown.output

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
    assert [m.step for m in client.get_metric_history(child.info.run_id, "loss")] == [1, 2]
    assert [m.step for m in client.get_metric_history(child.info.run_id, "knn_acc")] == [2]  # knn_every 5: the last
    assert parent[0].info.status == "FINISHED" and {c.info.status for c in children} == {"FINISHED"}
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parent[0].info.run_id}
    assert {a.path for a in client.list_artifacts(parent[0].info.run_id)} >= {"TABLES.md", "results.csv",
                                                                            "curves.csv", "curves.png"}
    by_trial = {c.data.tags["trial_id"]: c for c in children}
    for r in rows:
        assert by_trial[r["trial_id"]].data.metrics["probe.ffn"] == pytest.approx(float(r["ffn"]))
    # a finished job is forgotten (only the staged data, content-addressed, stays for the next job)
    assert {p.name for p in (project / "ray_results").iterdir()} <= {"prepared-data"}


# ---------------------------------------------------------------------------------------------- the tuning phase
TUNED_ROWS = ("tables.rows=[{name: InfoNCE, table: 1, params: {loss.name: infonce}, "
              "space: {loss.temperature: [0.05, 0.5]}}, "
              "{name: JSD, table: 1, params: {loss.name: jsd}, space: {loss.power: [1.0, 4.0, 16.0]}}, "
              "{name: DCL, table: 1, params: {loss.name: dcl}}]")
TUNED = ("-S", TUNED_ROWS, "-S", "tables.tuning={trials: 2, epochs: 2, seed: 3}", "-S", "tables.seeds=[0]",
         "-S", "tables.controls=[]", "-S", "train.epochs=1", "-S", "probe.probes=[knn200]",
         "-S", "tables.reference=DCL")


def read_csv(path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_rows_are_tuned_on_the_same_budget_on_validation_and_the_test_split_never_moves_a_choice(prepared,
                                                                                                ray_session):
    """Two searched rows and an untuned one: the tuning phase gives each searched row the same budget (its own record
    says so: 2 trials of 2 epochs, seed 3), picks each row's best validation kNN, then the final rows run with the
    chosen points and are probed on test; MLflow tells the phases apart. With the test split replaced by noise, every
    tuning score and choice is the same; only the final test probes move."""
    clean = invoke("tables", *TUNED)
    assert clean.exit_code == 0, clean.output
    tuning = read_csv(prepared / "tables/tuning.csv")
    assert [(r["name"], r["status"]) for r in tuning] == [("InfoNCE", "TERMINATED")] * 2 + [("JSD", "TERMINATED")] * 2
    for name in ("InfoNCE", "JSD"):  # the budget, from the job's own record: the same trials x epochs x seed
        mine = [r for r in tuning if r["name"] == name]
        assert len(mine) == 2 and {(r["epochs"], r["seed"]) for r in mine} == {("2", "3")}
    assert [json.loads(r["point"]) for r in tuning[:2]] == [{"loss.temperature": 0.05}, {"loss.temperature": 0.5}]
    finals = {r["name"]: r for r in read_csv(prepared / "tables/results.csv")}
    assert set(finals) == {"InfoNCE", "JSD", "DCL"} and all(r["epochs"] == "1" for r in finals.values())
    report = (prepared / "reports/TABLES.md").read_text()
    assert "## Tuning on the validation split" in report
    assert "Untuned (run as written, no space): DCL (table 1)" in report
    assert "at the edge of its grid" in report  # a choice among two values always is
    best = {name: max((r for r in tuning if r["name"] == name), key=lambda r: float(r["knn_acc"]))["point"]
            for name in ("InfoNCE", "JSD")}
    for name, point in best.items():
        assert f"| {name} |" in report and f"`{point}`" in report  # the rows table: the chosen point
    client = mlflow.MlflowClient(f"sqlite:///{prepared / 'mlflow.db'}")  # this project's store, not the process's
    runs = client.search_runs([client.get_experiment_by_name("transfusion").experiment_id],
                              filter_string="tags.stage = 'tables-row'")
    assert sorted(r.data.tags["phase"] for r in runs) == ["final"] * 3 + ["tuning"] * 4

    data = prepared / "data/prepared"
    poison_test_split(data)
    shutil.rmtree(prepared / "tables")
    poisoned = invoke("tables", *TUNED)  # a new job: the data's digests changed
    assert poisoned.exit_code == 0, poisoned.output
    again = read_csv(prepared / "tables/tuning.csv")
    assert [(r["point"], r["knn_acc"]) for r in again] == [(r["point"], r["knn_acc"]) for r in tuning]
    moved = {r["name"]: r for r in read_csv(prepared / "tables/results.csv")}
    assert all(float(moved[n]["knn200"]) < float(finals[n]["knn200"]) - 0.2 for n in finals)  # noise: near chance
