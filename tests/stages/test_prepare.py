"""The `prepare` stage through the real `transfusion` command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from click.testing import CliRunner

from pipeline.datasets import load_prepared
from stages.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_help_lists_the_stages():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0 and "prepare" in result.output


def test_prepare_writes_tensors_and_manifest(project):
    result = CliRunner().invoke(main, ["prepare"])
    assert result.exit_code == 0, result.output
    assert "prepared digits" in result.output
    out = project / "data" / "prepared"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["dataset"] == "digits" and manifest["n_train"] + manifest["n_test"] == 1797
    assert manifest["params"]["data"]["seed"] == 0
    ds = load_prepared(out)
    assert ds.train.x.shape[1:] == (1, 8, 8) and len(ds.classes) == 10
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "test.pt", "train.pt"]
    assert not [p for p in project.rglob("*.tmp*")]


def test_overrides_and_params_file_option(project):
    alt = project / "alt.yaml"
    alt.write_text((project / "params.yaml").read_text().replace("dataset: digits", "dataset: synthetic"))
    result = CliRunner().invoke(main, ["prepare", "--params", str(alt), "-S", "model.backbone=mlp",
                                       "-S", "data.synthetic.n_samples=200", "--out", "syn"])
    assert result.exit_code == 0, result.output
    ds = load_prepared(project / "syn")
    assert ds.name == "synthetic" and ds.train.x.shape[1] == 64
    assert ds.train.x.shape[0] + ds.test.x.shape[0] == 200
    assert torch.allclose(ds.train.x.norm(dim=1), torch.ones(ds.train.x.shape[0]), atol=1e-5)


def test_bad_params_exit_2_and_write_nothing(project):
    result = CliRunner().invoke(main, ["prepare", "-S", "data.dataset=cifar"])
    assert result.exit_code == 2
    assert "data.dataset" in result.output and "digits" in result.output
    assert not (project / "data").exists()


def test_missing_dataset_exit_1_with_instructions(project):
    result = CliRunner().invoke(main, ["prepare", "-S", "data.dataset=cifar10", "-S", "data.root=nowhere",
                                       "-S", "model.backbone=resnet18_cifar", "-S", "model.embed_dim=null"])
    assert result.exit_code == 1
    assert "nowhere" in result.output and "download" in result.output
    assert "Traceback" not in result.output
    assert not (project / "data" / "prepared").exists()


def test_console_script_exit_code(project):
    """The installed entry point, as DVC runs it."""
    proc = subprocess.run([sys.executable, "-m", "stages.cli", "prepare", "-S", "model.depth=-2"],
                          capture_output=True, text=True, cwd=project)
    assert proc.returncode == 2 and "model.depth" in proc.stderr


def test_check_validates_without_running(project):
    ok = CliRunner().invoke(main, ["check", "-S", "model.depth=4"])
    assert ok.exit_code == 0 and "model.depth = 4" in ok.output and "params OK" in ok.output
    bad = CliRunner().invoke(main, ["check", "-S", "loss.name=nope"])
    assert bad.exit_code == 2 and "loss.name" in bad.output and "jsd" in bad.output
    assert sorted(p.name for p in project.iterdir()) == ["params.yaml"]
