"""The `sets` stage: bad params refused before any work (its outputs and MLflow runs: the full flow,
tests/test_dvc_pipeline.py, and the set study's rehearsal, tests/stages/test_rehearse.py)."""

from __future__ import annotations

import pytest

from tests.conftest import ROOT, invoke


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
