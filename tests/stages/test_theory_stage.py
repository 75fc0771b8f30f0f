"""The `theory` stage: run() with a params-like object, and the click command on a params file."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from click.testing import CliRunner

from pipeline.config.params import Params
from pipeline.config.theory import TheoryConfig
from stages.theory import grids, run, theory_cmd

ROOT = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TINY = dict(formula_points=9, formula_log_points=3, formula_eps_min=1e-6, formula_n=[2, 8], n=[8], eps=[0.0, 0.5],
            depth=[1], steps=5, lr=0.01, n_clusters=2, rank=1, dim=6, seeds=[0], learned_nmi=0.9)
INTEGRATED = "theory" in Params.model_fields
needs_integration = pytest.mark.skipif(
    not INTEGRATED, reason="params.theory is not in pipeline/config/params.py yet (the lead integrates TheoryConfig)")


def check_outputs(plots: Path, metrics: Path, runs: int, report: Path) -> dict:
    names = sorted(p.name for p in plots.iterdir())
    assert names == ["empirical.csv", "formula.csv", "measured_gain.csv", "measured_gain.png", "measured_nmi.csv",
                     "measured_nmi.png", "table.csv", "theory.png"]  # no Markdown: DVC renders this directory
    assert (plots / "theory.png").read_bytes()[:8] == PNG_SIGNATURE
    m = json.loads(metrics.read_text())
    assert m["empirical"]["runs"] == runs and m["seconds"] > 0
    assert set(m["formula"]) == {"2", "8"} and all(v["overlap"] == 0 for v in m["formula"].values())
    assert "## Verdict" in report.read_text()
    leftovers = [p for p in plots.parent.rglob("*") if p.name.startswith(".")]
    assert not leftovers, leftovers
    return m


@pytest.mark.slow
def test_run_with_a_params_like_object(tmp_path):
    params = SimpleNamespace(theory=SimpleNamespace(**TINY))
    plots, metrics = tmp_path / "plots" / "theory", tmp_path / "metrics" / "theory.json"
    lines = []
    report = tmp_path / "reports" / "theory.md"
    m = run(params, plots, metrics, progress=lines.append, report=report)
    check_outputs(plots, metrics, runs=2, report=report)
    assert len(lines) == 2 and m["empirical"]["runs"] == 2
    (plots / "stale.txt").write_text("old")  # the directory is swapped whole on a re-run
    run(params, plots, metrics, progress=None)
    assert not (plots / "stale.txt").exists()


def test_grids_name_the_section_on_bad_values():
    with pytest.raises(ValueError, match="^theory: .*2 \\* n_clusters"):
        grids(SimpleNamespace(**{**TINY, "n": [2]}))
    tg, eg = grids(SimpleNamespace(**TINY))
    assert tg.n == (2, 8) and len(tg.rho) == 9 and len(tg.eps) == 12
    assert eg.n == (8,) and eg.steps == 5 and eg.dim == 6
    assert grids(TheoryConfig(**TINY)) == (tg, eg)  # a validated section, used as it is


def test_missing_section_is_a_usage_error(tmp_path, monkeypatch):
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw.pop("theory", None)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(theory_cmd, [])
    assert result.exit_code == 2, result.output
    assert "theory" in result.output
    assert not (tmp_path / "plots").exists() and not (tmp_path / "metrics").exists()


@needs_integration
def test_cli_writes_plots_and_metrics(project):
    overrides = [arg for k, v in TINY.items() for arg in ("-S", f"theory.{k}={json.dumps(v)}")]
    result = CliRunner().invoke(theory_cmd, [*overrides, "--quiet"])
    assert result.exit_code == 0, result.output
    assert "learned in" in result.output and "plots/theory" in result.output
    assert "reports/theory.md" in result.output
    check_outputs(project / "plots" / "theory", project / "metrics" / "theory.json", runs=2,
                  report=project / "reports" / "theory.md")
