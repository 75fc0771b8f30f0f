"""The `report` stage: REPORT.md from the metrics and the model's config, or the missing file named."""

from __future__ import annotations

import json

from tests.conftest import invoke
from tests.evaluation.test_report import sample


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
