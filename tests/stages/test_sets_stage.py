"""The `sets` stage on a params file: its outputs (figure and data only under plots/sets, the report, the metrics),
its MLflow parent run with a child per method and data set, and bad params refused before any work."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.conftest import ROOT, invoke

TINY = ["-S", "sets.datasets=[circles, digits]", "-S", "sets.methods=[pairwise, rbf]", "-S", "sets.seeds=[0, 1]",
        "-S", "sets.steps=2", "-S", "sets.test_sets=2", "-S", "sets.rbf_gammas=[1.0]", "-S", "sets.rbf_select_sets=2",
        "-S", "sets.width=8", "-S", "sets.heads=2"]


@pytest.mark.slow  # ~14 s: a fresh MLflow store and 5 runs
def test_the_stage_writes_its_outputs_and_one_parent_run_with_its_children(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"sets": yaml.safe_load(
        (ROOT / "params.yaml").read_text())["sets"]}))
    result = invoke("sets", "--quiet", *TINY)
    assert result.exit_code == 0, result.output
    assert "sets: circles: " in result.output and "sets: digits: " in result.output
    assert sorted(p.name for p in (tmp_path / "plots/sets").iterdir()) == ["ari.png", "runs.csv", "sets.csv"]
    m = json.loads((tmp_path / "metrics/sets.json").read_text())
    assert set(m["summary"]) == {"circles", "digits"} and set(m["summary"]["digits"]) == {"pairwise", "rbf"}
    assert m["setup"]["steps"] == 2 and m["summary"]["circles"]["pairwise"]["seeds"] == 2
    assert "| digits | RBF spectral |" in (tmp_path / "reports/sets.md").read_text()
    assert len((tmp_path / "plots/sets/runs.csv").read_text().splitlines()) == 1 + 2 * 2 * 2

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("transfusion").experiment_id])
    parent = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parent) == 1 and parent[0].info.run_name == "sets · circles+digits · 2 seeds"
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent[0].info.run_id]
    assert sorted(r.info.run_name for r in children) == ["pairwise · circles", "pairwise · digits", "rbf · circles",
                                                         "rbf · digits"]
    rbf = next(r for r in children if r.info.run_name == "rbf · digits")
    assert rbf.data.metrics["ari_known"] == pytest.approx(m["summary"]["digits"]["rbf"]["ari_known"])
    assert rbf.data.params["dataset"] == "digits" and parent[0].data.params["sets.steps"] == "2"
    assert parent[0].data.metrics["digits.rbf.nmi_known"] == pytest.approx(m["summary"]["digits"]["rbf"]["nmi_known"])


@pytest.mark.parametrize(("override", "named"), [
    ("sets.width=10", "sets.width (10) must be a multiple of sets.heads (4)"),
    ("sets.digits_k=[2, 6]", "sets.digits_k"),
    ("sets.methods=[abc]", "sets.methods"),
    ("sets.datasets=[circles, circles]", "sets.datasets: duplicate"),
])
def test_bad_params_exit_2_naming_the_key_before_any_work(tmp_path, monkeypatch, override, named):
    monkeypatch.chdir(tmp_path)
    result = invoke("sets", "--params", str(ROOT / "params.yaml"), "-S", override)
    assert result.exit_code == 2 and named in result.output, result.output
    assert not (tmp_path / "plots").exists() and not (tmp_path / "metrics").exists()
