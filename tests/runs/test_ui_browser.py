"""End to end in a real browser: the tiny pipeline's pretrain runs, as `transfusion ui` shows them in Chromium.

The runs table shows each run by its name and dataset; the saved view `transfusion ui` prints adds a metric column
and params, and the documented search and a run's `#/runs/<id>` address work, all without opening a run.

Needs Debian's Chromium (`.ci/install-browser`) and Playwright for Python (never `playwright install`: the
system browser is used). ``TRANSFUSION_SCREENSHOT_DIR=docs`` (relative to the repo) keeps the comparison
screenshot as ``docs/mlflow-compare.png``; by default it goes to the test's temp dir.
"""

from __future__ import annotations

import json
import os
import re
import urllib.parse
from pathlib import Path

import mlflow
import pytest

from tests.conftest import invoke
from tests.ui_server import UiProcess, free_port

VIEW = re.compile(r"main params as columns: (?P<url>\S+)")
SEARCH = "params.train.seed = '1'"  # the form docs/tracking.md documents (`params.model.depth = '3'`)

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
if not CHROMIUM.exists():
    pytest.skip(f"{CHROMIUM} is missing (install it with .ci/install-browser)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api",
                               reason="the playwright package is missing (pip install -e '.[dev]')")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TINY = ["-S", "train.epochs=2", "-S", "train.batch_size=128", "-S", "data.limit_train=256",
        "-S", "model.embed_dim=32", "-S", "train.knn_every=1"]
SEEDS = (0, 1)
SLOW_UI_MS = 120_000  # first page load: the UI's JavaScript bundle and first queries, on 2 busy cores
UI_MS = 30_000


def pretrain_runs(project: Path) -> list[dict]:
    """Two pretrain runs that differ only in their seed: MLflow name and id, final kNN accuracy, dataset of each."""
    client = mlflow.MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    runs = []
    for seed in SEEDS:
        result = invoke("pretrain", *TINY, "-S", f"train.seed={seed}")
        assert result.exit_code == 0, result.output
        config = json.loads((project / "models/pretrain/config.json").read_text())
        metrics = json.loads((project / "metrics/pretrain.json").read_text())
        run = client.get_run(config["mlflow_run_id"])
        assert run.info.run_name == f"pretrain · cnn_small · depth 1 · jsd · b128 · s{seed}"
        assert run.data.tags["identity"] == config["run_name"]  # the hash the stage resumes by
        data = run.inputs.dataset_inputs[0].dataset
        runs.append({"name": run.info.run_name, "id": config["mlflow_run_id"], "knn_acc": metrics["knn_acc"],
                     "seed": seed, "dataset": f"{data.name} ({data.digest})"})
    return runs


def experiment_id(project: Path) -> str:
    return mlflow.MlflowClient(f"sqlite:///{project / 'mlflow.db'}").get_experiment_by_name("transfusion").experiment_id


def rounded(value: float) -> list[str]:
    """How the compare page may print a metric (3 decimals)."""
    return list({f"{value:.3f}", str(round(value, 3))})


def close_assistant(page) -> None:
    """The MLflow Assistant side panel opens in every fresh browser; it hides table columns."""
    panel = page.get_by_text("Ask questions about your experiments", exact=False)
    if panel.first.is_visible():
        page.get_by_role("button", name="Close").first.click()
        sync_api.expect(panel).to_have_count(0, timeout=UI_MS)


def screenshot_path(tmp_path: Path) -> Path:
    where = os.environ.get("TRANSFUSION_SCREENSHOT_DIR")
    path = (ROOT / where if where else tmp_path) / "mlflow-compare.png"  # ROOT / an absolute dir = that dir
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def test_runs_table_and_run_comparison_in_chromium(prepare_digits, ray_session, tmp_path):
    project = prepare_digits(256)
    expect = sync_api.expect
    runs = pretrain_runs(project)
    exp_id = experiment_id(project)

    ui = UiProcess("--port", str(free_port()), cwd=project)
    try:
        url = ui.wait_ready(timeout=300)
        base, _, fragment = url.partition("/#")
        assert fragment == f"/experiments/{exp_id}/runs?workflowType=machine_learning", url

        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1600, "height": 1000})

                # the runs table the command printed: experiment, both runs by name, their dataset
                page.goto(url)
                for run in runs:
                    expect(page.get_by_text(run["name"], exact=True).first).to_be_visible(timeout=SLOW_UI_MS)
                expect(page.get_by_role("link", name="transfusion").first).to_be_visible(timeout=UI_MS)
                close_assistant(page)
                expect(page.get_by_role("columnheader", name="Dataset").first).to_be_visible(timeout=UI_MS)
                expect(page.get_by_text(runs[0]["dataset"], exact=True)).to_have_count(len(runs), timeout=UI_MS)

                # the saved view the command printed: a metric and the params as columns, without opening a run
                view = ui.wait_for(VIEW, timeout=10)["url"]
                page.goto(view)
                for run in runs:
                    expect(page.get_by_text(run["name"], exact=True).first).to_be_visible(timeout=SLOW_UI_MS)
                close_assistant(page)
                for column in ("Dataset", "knn_acc", "model.depth", "train.seed"):
                    expect(page.get_by_role("columnheader", name=column).first).to_be_visible(timeout=UI_MS)
                for run in runs:
                    expect(page.get_by_text(str(run["knn_acc"]), exact=True).first).to_be_visible(timeout=UI_MS)
                    expect(page.get_by_text(run["dataset"], exact=True).first).to_be_visible(timeout=UI_MS)

                # the documented search (docs/tracking.md), as the table's URL keeps it: only the seed-1 run
                page.goto(f"{url}&{urllib.parse.urlencode({'searchFilter': SEARCH})}")
                expect(page.get_by_text("1 matching runs").or_(page.get_by_text("1 matching run"))).to_be_visible(
                    timeout=SLOW_UI_MS)
                expect(page.get_by_text(runs[1]["name"], exact=True).first).to_be_visible(timeout=UI_MS)
                expect(page.get_by_text(runs[0]["name"], exact=True)).to_have_count(0, timeout=UI_MS)

                # a run by its id alone (the mlflow_run_id of metrics/*.json and `dvc exp show`)
                page.goto(f"{base}/#/runs/{runs[0]['id']}")
                expect(page.get_by_text(runs[0]["name"], exact=True).first).to_be_visible(timeout=SLOW_UI_MS)

                # the compare page of the two runs: their names and the knn_acc row with both values
                query = urllib.parse.urlencode({"runs": json.dumps([r["id"] for r in runs]),
                                                "experiments": json.dumps([exp_id])})
                page.goto(f"{base}/#/compare-runs?{query}")
                expect(page.get_by_text(f"Comparing {len(runs)} Runs")).to_be_visible(timeout=SLOW_UI_MS)
                for run in runs:
                    expect(page.get_by_text(run["name"], exact=True).first).to_be_visible(timeout=UI_MS)
                    shown = page.get_by_text(rounded(run["knn_acc"])[0], exact=True)
                    for other in rounded(run["knn_acc"])[1:]:
                        shown = shown.or_(page.get_by_text(other, exact=True))
                    expect(shown.first).to_be_visible(timeout=UI_MS)
                expect(page.get_by_text("knn_acc", exact=True).first).to_be_attached(timeout=UI_MS)

                # the runs' metric charts side by side (the experiment page's chart comparison): the screenshot
                # (the charts' own search, a regular expression, keeps the two of them: the grid draws a chart only
                # once it is scrolled into view, and the blocks' health charts come first)
                page.goto(f"{url}&compareRunsMode=CHART")
                charts = page.get_by_role("searchbox", name="Search metric charts")
                expect(charts).to_be_visible(timeout=SLOW_UI_MS)
                charts.fill("knn_acc|loss")
                for metric in ("knn_acc", "loss"):
                    for run in runs:
                        legend = page.get_by_text(f"{run['name']} ({metric})", exact=True).first
                        expect(legend).to_be_visible(timeout=UI_MS)
                close_assistant(page)
                page.wait_for_timeout(1000)  # let the charts finish drawing
                shot = screenshot_path(tmp_path)
                page.screenshot(path=str(shot))
                assert shot.stat().st_size > 20_000
            finally:
                browser.close()
    finally:
        ui.stop()
    assert ui.proc.returncode == 0, ui.output
