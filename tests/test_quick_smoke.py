"""Fast tests for the modules whose other tests are all slow (or absent), so the quick loop
(``pytest -m "not slow" -n 2 --cov``) exercises every module of pipeline/ and stages/ (its floor:
[tool.coverage.report] in pyproject.toml)."""

from __future__ import annotations

import json

import click
import pytest
import torch
from click.testing import CliRunner

from pipeline.config.params import load_params
from pipeline.evaluation.health import KEYS, block_health, dead_blocks, flat, head_health, unflat, verdict, warnings_for
from stages._common import check_weights, params_options, runtime_errors
from tests.conftest import invoke
from tests.evaluation.test_report import sample


# ------------------------------------------------------------------------------------------------- stages._common
@click.command()
@params_options(load_params)
@runtime_errors(FileNotFoundError)
def _cmd(params) -> None:
    if params.model.depth == 4:
        raise FileNotFoundError("no such thing")
    click.echo(f"depth {params.model.depth}")


def test_common_options_bad_params_exit_2_runtime_errors_exit_1(project):
    ok = CliRunner().invoke(_cmd, ["-S", "model.depth=3"])
    assert ok.exit_code == 0 and "depth 3" in ok.output
    bad = CliRunner().invoke(_cmd, ["-S", "model.depth=-2"])
    assert bad.exit_code == 2 and "model.depth" in bad.output
    missing = CliRunner().invoke(_cmd, ["-S", "model.depth=4"])
    assert missing.exit_code == 1 and "Error: no such thing" in missing.output and "Traceback" not in missing.output


RESNET = ["model.backbone=resnet18", "model.embed_dim=null"]


def test_common_check_weights(project):
    from pipeline.config.params import load_params

    check_weights(load_params("params.yaml").model.weights)  # model.weights: null
    with pytest.raises(click.ClickException, match="nope.pt does not exist"):
        check_weights(load_params("params.yaml", RESNET + ["model.weights=nope.pt"]).model.weights)
    torch.save({"w": torch.zeros(2)}, project / "other.pt")
    with pytest.raises(click.ClickException, match="not a resnet18 state_dict"):
        check_weights(load_params("params.yaml", RESNET + ["model.weights=other.pt"]).model.weights)


# ----------------------------------------------------------------------------------------------- stages.report
def test_report_stage_writes_the_report(project):
    missing = invoke("report")
    assert missing.exit_code == 1 and "metrics/pretrain.json is missing" in missing.output
    params, pre, ev = sample()
    for path, data in (("metrics/pretrain.json", pre), ("metrics/evaluate.json", ev),
                       ("models/pretrain/config.json", {"params": params})):
        (project / path).parent.mkdir(parents=True, exist_ok=True)
        (project / path).write_text(json.dumps(data))
    result = invoke("report")
    assert result.exit_code == 0, result.output
    text = (project / "reports/REPORT.md").read_text()
    assert "ours on digits" in text and "Table 1 (self-supervised)" in text


# ----------------------------------------------------------------------------------------------- stages.tables
def test_tables_stage_refuses_bad_rows_and_missing_data_before_ray(project, ray_starts):
    bad = invoke("tables", "-S", "tables.rows=[{name: A, table: 2}]")  # table 2 is supervised, the base is not
    assert bad.exit_code == 2 and "tables.rows[0]" in bad.output and "train.mode" in bad.output
    no_data = invoke("tables", "-S", "tables.rows=[{name: A, table: 1}]")
    assert no_data.exit_code == 1 and "data/prepared" in no_data.output
    assert not ray_starts and not (project / "reports").exists()


# ------------------------------------------------------------------------------------------ pipeline.evaluation.health
def test_health_of_a_dead_and_a_live_block():
    n = 4
    dead = torch.zeros(n, n)
    live = torch.ones(n, n) - torch.eye(n)
    labels, other = torch.tensor([0, 0, 1, 1]), torch.tensor([1, 0, 3, 2])
    h = head_health([dead, live], labels, other)
    assert h["block_1"]["positive"] == 0 and h["block_1"]["uniform_rows"] == 1
    assert h["block_1"]["entropy"] == pytest.approx(1.0, abs=1e-6)  # uniform over n (the diagonal's ε included)
    assert h["block_2"]["positive"] == 1 and h["block_2"]["uniform_rows"] == 0
    assert h["block_2"]["same_class"] == pytest.approx(1 / 3)  # uniform over the 3 others, 1 of them same class
    assert h["block_2"]["same_class_chance"] == pytest.approx(1 / 4)  # chance: (n_y - 1) / n
    assert h["block_2"]["other_view"] == pytest.approx(1 / 3)
    assert verdict(h["block_1"]) == "dead" and verdict(h["block_2"]) is None
    assert dead_blocks(h) == ["block_1"] and len(warnings_for(h)) == 1 and "block 1 is dead" in warnings_for(h)[0]
    assert unflat(flat(h)) == {b: {k: hb[k] for k in KEYS} for b, hb in h.items()}
    assert block_health(dead)["same_class"] is None
    with pytest.raises(ValueError, match="at least 2 rows"):
        block_health(torch.zeros(1, 1))
