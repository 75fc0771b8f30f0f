"""End to end in a real browser: the tiny pipeline's pretrain runs, as `transfusion ui` shows them in Chromium.

Needs Debian's Chromium (`.ci/install-browser`) and Playwright for Python (never `playwright install`: the
system browser is used). ``TRANSFUSION_SCREENSHOT_DIR=docs`` (relative to the repo) keeps the comparison
screenshot as ``docs/mlflow-compare.png``; by default it goes to the test's temp dir.
"""

from __future__ import annotations

import json
import os
import urllib.parse
from pathlib import Path

import mlflow
import pytest
from click.testing import CliRunner

from stages.cli import main
from tests.ui_server import READY, UiProcess, free_port

ROOT = Path(__file__).resolve().parents[1]
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


def invoke(*args: str):
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


def pretrain_runs(project: Path) -> list[dict]:
    """Two pretrain runs that differ only in their seed: name, MLflow id and final kNN accuracy of each."""
    invoke("prepare", "-S", "data.limit_train=256")
    runs = []
    for seed in SEEDS:
        invoke("pretrain", *TINY, "-S", f"train.seed={seed}")
        config = json.loads((project / "models/pretrain/config.json").read_text())
        metrics = json.loads((project / "metrics/pretrain.json").read_text())
        runs.append({"name": config["run_name"], "id": config["mlflow_run_id"], "knn_acc": metrics["knn_acc"]})
    assert len({r["name"] for r in runs}) == len(SEEDS)
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
        expect = sync_api.expect
        expect(panel).to_have_count(0, timeout=UI_MS)


def scroll_until_visible(page, locator, steps: int = 40) -> None:
    """Scroll the chart grid (MLflow draws a chart only once it is scrolled into view) until ``locator`` shows.

    Each run logs the blocks' health per epoch too (``block_1.positive``, ...), so a metric's chart may sit below
    the first screen."""
    expect = sync_api.expect
    page.mouse.move(1000, 600)
    for _ in range(steps):
        try:
            expect(locator).to_be_visible(timeout=3_000)
            return
        except AssertionError:
            page.mouse.wheel(0, 500)
    expect(locator).to_be_visible(timeout=UI_MS)


def screenshot_path(tmp_path: Path) -> Path:
    where = os.environ.get("TRANSFUSION_SCREENSHOT_DIR")
    path = (ROOT / where if where else tmp_path) / "mlflow-compare.png"  # ROOT / an absolute dir = that dir
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def test_runs_table_and_run_comparison_in_chromium(project, ray_session, tmp_path):
    expect = sync_api.expect
    runs = pretrain_runs(project)
    exp_id = experiment_id(project)

    ui = UiProcess("--port", str(free_port()), cwd=project)
    try:
        url = ui.wait_for(READY, timeout=300)["url"]
        base, _, fragment = url.partition("/#")
        assert fragment == f"/experiments/{exp_id}/runs?workflowType=machine_learning", url

        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1600, "height": 1000})

                # the runs table the command printed: experiment, both runs, and their kNN accuracy
                page.goto(url)
                for run in runs:
                    expect(page.get_by_text(run["name"], exact=True).first).to_be_visible(timeout=SLOW_UI_MS)
                expect(page.get_by_role("link", name="transfusion").first).to_be_visible(timeout=UI_MS)
                close_assistant(page)
                page.get_by_role("button", name="Columns").click()
                page.get_by_text("knn_acc", exact=True).click()
                page.keyboard.press("Escape")
                expect(page.get_by_role("columnheader", name="knn_acc").first).to_be_visible(timeout=UI_MS)
                for run in runs:
                    expect(page.get_by_text(str(run["knn_acc"]), exact=True).first).to_be_visible(timeout=UI_MS)

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
                page.goto(f"{url}&compareRunsMode=CHART")
                for metric in ("knn_acc", "loss"):
                    for run in runs:
                        legend = page.get_by_text(f"{run['name']} ({metric})", exact=True).first
                        scroll_until_visible(page, legend)
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
