"""Real DVC: `dvc repro` in a temporary git repository holding the project's pipeline files."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def run(cmd: list[str], cwd: Path) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout + proc.stderr


@pytest.fixture
def repo(tmp_path, monkeypatch):
    if shutil.which("dvc") is None:
        pytest.skip("dvc is not installed")
    for name in ("GIT_AUTHOR_NAME", "GIT_COMMITTER_NAME"):
        monkeypatch.setenv(name, "test")
    for name in ("GIT_AUTHOR_EMAIL", "GIT_COMMITTER_EMAIL"):
        monkeypatch.setenv(name, "test@example.invalid")
    monkeypatch.setenv("DVC_NO_ANALYTICS", "1")
    dst = tmp_path / "proj"
    dst.mkdir()
    for name in ("params.yaml", "dvc.yaml", ".gitignore", ".dvcignore"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, dst / name)
    for name in ("pipeline", "stages", ".dvc"):
        shutil.copytree(ROOT / name, dst / name, ignore=shutil.ignore_patterns("__pycache__", "tmp", "cache"))
    run(["git", "init", "-q"], dst)
    run(["git", "add", "-A"], dst)
    run(["git", "commit", "-qm", "init"], dst)
    return dst


def set_param(repo: Path, section: str, key: str, value) -> None:
    path = repo / "params.yaml"
    raw = yaml.safe_load(path.read_text())
    raw[section][key] = value
    path.write_text(yaml.safe_dump(raw, sort_keys=False))


def test_prepare_runs_then_is_a_no_op_and_reruns_only_on_its_params(repo):
    out = run(["dvc", "repro", "prepare"], repo)
    assert "Running stage 'prepare'" in out
    assert (repo / "data/prepared/manifest.json").is_file()
    assert (repo / "dvc.lock").is_file()

    out = run(["dvc", "repro", "prepare"], repo)
    assert "Running stage" not in out

    set_param(repo, "train", "lr", 0.5)  # not read by prepare
    out = run(["dvc", "repro", "prepare"], repo)
    assert "Running stage" not in out

    set_param(repo, "data", "seed", 1)  # read by prepare
    out = run(["dvc", "repro", "prepare"], repo)
    assert "Running stage 'prepare'" in out
    assert os.path.getsize(repo / "data/prepared/train.pt") > 0
