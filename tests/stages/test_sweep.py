"""The `sweep` stage end to end on real Ray Tune over Ray Train and a real MLflow sqlite store (tiny digits runs)."""

from __future__ import annotations

import csv
import json

import mlflow
import pytest

from tests.conftest import invoke

pytestmark = [pytest.mark.slow]

TINY = ["-S", "model.embed_dim=16", "-S", "sweep.depth=[1]", "-S", "sweep.batch_size=[32,64]",
        "-S", "sweep.strength=[0.0,1.0]"]


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def sweep_runs(project):
    client = mlflow.MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    exp = client.get_experiment_by_name("transfusion")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.data.tags.get("stage") == "sweep"]
    children = [r for r in runs if r.data.tags.get("stage") == "sweep-trial"]
    return client, parents, children


def started(log) -> list[str]:
    return [line.split()[0] for line in log.read_text().splitlines()] if log.exists() else []


def check_sweep(project, rows, epochs):
    """results.csv, best.json, phase plot, MLflow parent + a child per trial, and nothing left behind."""
    best = json.loads((project / "sweeps/best.json").read_text())
    finished = [r for r in rows if r["status"] == "TERMINATED"]
    assert best["knn_acc"] == max(float(r["knn_acc"]) for r in finished)
    assert best["trial_id"] in {r["trial_id"] for r in rows}
    for r in rows:
        assert 1 <= int(r["epochs"]) <= epochs and 0.0 <= float(r["knn_acc"]) <= 1.0
        assert r["stopped_early"] == str(int(r["epochs"]) < epochs)
        assert (float(r["view_noise"]) > 0.0) == (r["augment.strength"] == "1.0")  # measured ε of the views
    assert (project / "plots/sweep/phase.png").read_bytes()[:4] == b"\x89PNG"
    curves = read_csv(project / "plots/sweep/curves.csv")
    for r in rows:  # every epoch of every trial exactly once, also for a resumed trial
        epochs_logged = [int(c["epoch"]) for c in curves if c["trial_id"] == r["trial_id"]]
        assert epochs_logged == list(range(1, int(r["epochs"]) + 1))

    client, parents, children = sweep_runs(project)
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    parent = parents[0]
    assert parent.data.metrics["best.knn_acc"] == pytest.approx(best["knn_acc"])
    assert parent.data.metrics["trials"] == len(rows)
    assert parent.data.params["sweep.depth"] == "[1]"
    assert {"results.csv", "best.json", "phase.png"} <= {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert len(children) == len(rows)
    by_trial = {c.data.tags["trial_id"]: c for c in children}
    for r in rows:
        child = by_trial[r["trial_id"]]
        assert child.info.status == "FINISHED"
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert child.data.params["train.batch_size"] == r["train.batch_size"]
        assert child.data.params["augment.strength"] == r["augment.strength"]
        assert child.data.tags["stopped_early"] == r["stopped_early"]
        history = client.get_metric_history(child.info.run_id, "knn_acc")
        assert sorted({m.step for m in history}) == list(range(1, int(r["epochs"]) + 1))
        assert max(history, key=lambda m: m.step).value == pytest.approx(float(r["knn_acc"]))
    # a finished sweep is forgotten so that `dvc repro -f` sweeps again
    assert [p.name for p in (project / "ray_results").iterdir()] == ["prepared-data"]  # the staged data stays
    assert not (project / ".transfusion").exists() or not any((project / ".transfusion").iterdir())


@pytest.mark.timeout(600)
def test_four_trial_sweep_with_asha_end_to_end(prepared, ray_session, install_faults):
    log = prepared / "trials.log"
    install_faults(count_file=str(log))
    result = invoke("sweep", *TINY, "-S", "sweep.epochs=3", "-S", "sweep.asha=true", "-S", "sweep.grace_period=1")
    assert result.exit_code == 0, result.output
    assert "swept 4 trials (0 failed)" in result.output
    rows = read_csv(prepared / "sweeps/results.csv")
    assert len(rows) == 4 and len(started(log)) == 4
    assert {(r["train.batch_size"], r["augment.strength"]) for r in rows} == {
        ("32", "0.0"), ("32", "1.0"), ("64", "0.0"), ("64", "1.0")}
    assert {r["model.depth"] for r in rows} == {"1"}
    check_sweep(prepared, rows, epochs=3)


@pytest.mark.timeout(300)
def test_a_diverged_trial_is_failed_with_its_reason(prepared, ray_session, install_faults, capsys):
    """A NaN at epoch 2 of 2 in one of two trials: that trial is ERROR / FAILED with the reason, not stopped early."""
    install_faults(nan_at_epoch=2, trial={"train.batch_size": 32})  # only the batch-32 trial diverges
    result = invoke("sweep", "-S", "model.embed_dim=16", "-S", "sweep.depth=[1]", "-S", "sweep.batch_size=[32,64]",
                    "-S", "sweep.strength=[1.0]", "-S", "sweep.epochs=2", "--out", "studies/diverged")
    assert result.exit_code == 0, result.output
    assert "swept 2 trials (1 failed)" in result.output
    study = prepared / "studies/diverged"  # --out: a recorded study's folder, the stage's own outputs untouched
    assert not (prepared / "sweeps").exists() and (study / "plots/sweep/lr.png").is_file()
    rows = {r["train.batch_size"]: r for r in read_csv(study / "sweeps/results.csv")}
    bad, good = rows["32"], rows["64"]
    assert bad["status"] == "ERROR" and bad["stopped_early"] == "False" and bad["epochs"] == "1"
    reason = bad["error"]  # the worker's status: kind, message, the last epoch that trained
    assert reason.startswith("non_finite: non-finite loss") and reason.endswith("(last good epoch 1)")
    assert good["status"] == "TERMINATED" and good["error"] == "" and good["epochs"] == "2"
    assert json.loads((study / "sweeps/best.json").read_text())["trial_id"] == good["trial_id"]
    assert f"trial {bad['trial_id']} failed: {reason}" in result.output + capsys.readouterr().out
    client, parents, children = sweep_runs(prepared)
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert parents[0].data.metrics["trials_failed"] == 1
    by_trial = {c.data.tags["trial_id"]: c for c in children}
    failed, finished = by_trial[bad["trial_id"]], by_trial[good["trial_id"]]
    assert failed.info.status == "FAILED" and failed.data.tags["error"] == reason
    assert failed.data.tags["stopped_early"] == "False"
    assert [m.step for m in client.get_metric_history(failed.info.run_id, "loss")] == [1]  # the epoch before the NaN
    assert finished.info.status == "FINISHED" and "error" not in finished.data.tags


@pytest.mark.timeout(300)
def test_the_test_split_never_moves_a_sweeps_choice(prepared, ray_session):
    """Tune's metric, every trial's online kNN and the sweep's best.json read the validation split: with the test
    split replaced by noise (a new job: the data's digests changed), each is the same."""
    from tests.conftest import poison_test_split

    point = [*TINY[:2], "-S", "sweep.depth=[0,1]", "-S", "sweep.batch_size=[32]", "-S", "sweep.strength=[1.0]",
             "-S", "sweep.epochs=2"]
    clean = invoke("sweep", *point)
    assert clean.exit_code == 0, clean.output
    rows, best = read_csv(prepared / "sweeps/results.csv"), (prepared / "sweeps/best.json").read_text()
    poison_test_split(prepared / "data/prepared")
    poisoned = invoke("sweep", *point)
    assert poisoned.exit_code == 0, poisoned.output
    again = read_csv(prepared / "sweeps/results.csv")
    key = ("model.depth", "knn_acc", "best_knn_acc", "epochs", "loss")
    assert sorted(tuple(r[k] for k in key) for r in again) == sorted(tuple(r[k] for k in key) for r in rows)
    chosen = json.loads((prepared / "sweeps/best.json").read_text())
    assert [chosen[k] for k in key] == [json.loads(best)[k] for k in key] and chosen["trial_id"] != json.loads(best)[
        "trial_id"]  # the same choice, by a new job
