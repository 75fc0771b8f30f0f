"""Real DVC: `dvc repro` in a temporary git repository holding the project's pipeline files."""

from __future__ import annotations

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


def git_dvc_env(monkeypatch: pytest.MonkeyPatch) -> None:
    if shutil.which("dvc") is None:
        pytest.skip("dvc is not installed")
    for name in ("GIT_AUTHOR_NAME", "GIT_COMMITTER_NAME"):
        monkeypatch.setenv(name, "test")
    for name in ("GIT_AUTHOR_EMAIL", "GIT_COMMITTER_EMAIL"):
        monkeypatch.setenv(name, "test@example.invalid")
    monkeypatch.setenv("DVC_NO_ANALYTICS", "1")


def make_repo(dst: Path) -> Path:
    """A git repository holding the project's pipeline files (params, dvc.yaml, the code), committed."""
    dst.mkdir()
    for name in ("params.yaml", "dvc.yaml", ".gitignore", ".dvcignore"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, dst / name)
    for name in ("pipeline", "stages", ".dvc"):
        shutil.copytree(ROOT / name, dst / name, ignore=shutil.ignore_patterns("__pycache__", "tmp", "cache"))
    # the recorded studies: the circles' CSV (the sets stage's data dependency), the studies' figures (dvc.yaml's plots)
    plots = [p for p in yaml.safe_load((ROOT / "dvc.yaml").read_text())["plots"] if isinstance(p, str)]
    recorded = [p for p in plots if p.startswith(("benchmarks/results/", "studies/"))]
    for study in ["benchmarks/results/circles.csv", *recorded]:
        (dst / study).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / study, dst / study)
    run(["git", "init", "-q"], dst)
    run(["git", "add", "-A"], dst)
    run(["git", "commit", "-qm", "init"], dst)
    return dst


def set_param(repo: Path, section: str, key: str, value) -> None:
    path = repo / "params.yaml"
    raw = yaml.safe_load(path.read_text())
    raw[section][key] = value
    path.write_text(yaml.safe_dump(raw, sort_keys=False))


TINY = {
    ("data", "limit_train"): 400,
    ("model", "embed_dim"): 16,
    ("train", "epochs"): 2,
    ("train", "batch_size"): 100,
    ("probe", "probes"): ["svm", "knn50"],
    ("probe", "label_fractions"): [1.0],
    ("probe", "tsne_points"): 120,
    ("probe", "affinity_points"): 100,
    ("sweep", "depth"): [1],
    ("sweep", "batch_size"): [50, 100],
    ("sweep", "strength"): [1.0],
    ("sweep", "epochs"): 1,
    ("theory", "formula_points"): 9,
    ("theory", "formula_log_points"): 3,
    ("theory", "formula_eps_min"): 1.0e-6,
    ("theory", "formula_n"): [8, 32],
    ("theory", "n"): [8],
    ("theory", "eps"): [0.0, 0.5],
    ("theory", "depth"): [1],
    ("theory", "steps"): 5,
    ("theory", "n_clusters"): 2,
    ("theory", "rank"): 1,
    ("theory", "dim"): 6,
    ("theory", "seeds"): [0],
    ("sets", "datasets"): ["circles", "digits"],
    ("sets", "seeds"): [0, 1],
    ("sets", "steps"): 3,
    ("sets", "test_sets"): 2,
    ("sets", "rbf_gammas"): [1.0],
    ("sets", "rbf_select_sets"): 2,
}


def ran(out: str) -> set[str]:
    import re

    return set(re.findall(r"Running stage '(\w+)'", out))


@pytest.fixture(scope="module")
def tiny_repro(tmp_path_factory):
    """One `dvc repro` of the whole pipeline with the TINY params, shared by this module's tests: (repo, output).

    Its environment (git identity, the MLflow store in the repo) stays set while the module's tests run.
    """
    with pytest.MonkeyPatch.context() as mp:
        git_dvc_env(mp)
        repo = make_repo(tmp_path_factory.mktemp("tiny") / "proj")
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{repo / 'mlflow.db'}")
        mp.setenv("MLFLOW_SKIP_PIP_REQUIREMENTS_CHECK", "true")
        for (section, key), value in TINY.items():
            set_param(repo, section, key, value)
        run(["git", "commit", "-qam", "tiny params"], repo)
        yield repo, run(["dvc", "repro"], repo)


def declared_plots(repo: Path) -> list[str]:
    """The ids `dvc plots show` gives the top-level plots of dvc.yaml: the name or path, characters other than word
    characters and "-" -> _ (``studies/head-cpu-10k-3epochs/plots/tables/curves.png`` -> ``studies_head-cpu-…``)."""
    import re

    plots = yaml.safe_load((repo / "dvc.yaml").read_text())["plots"]
    names = [p if isinstance(p, str) else next(iter(p)) for p in plots]
    return [re.sub(r"[^\w-]", "_", n) for n in names]


# Stands in for vega-embed (the page loads it from a CDN this test never reaches): records each call's target and spec
RECORD_VEGA = "window.__vega = []; window.vegaEmbed = (el, spec) => { window.__vega.push([el, spec]); };"


@pytest.mark.timeout(900)
@pytest.mark.xdist_group("tiny_repro")  # one repro for both, in one test process
def test_dvc_plots_show_renders_every_declared_plot_once(tiny_repro, tmp_path):
    """`dvc plots show` loads every plot, and in Chromium the page shows each plot of dvc.yaml exactly once: the
    images loaded, the Vega-Lite plots with data in the field they plot. Nothing else is on the page."""
    from tests.runs.test_ui_browser import CHROMIUM, CHROMIUM_ARGS, sync_api  # skips without Chromium or Playwright

    repo, _ = tiny_repro
    out = run(["dvc", "plots", "show", "-o", str(tmp_path / "dvc_plots")], repo)
    assert "failed to load" not in out and "could not find provided field" not in out, out
    index = tmp_path / "dvc_plots" / "index.html"
    declared = declared_plots(repo)
    assert len(set(declared)) == len(declared), declared

    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.route("http*://**", lambda route: route.abort())  # no network: only the file and its static/
            page.add_init_script(RECORD_VEGA)
            page.goto(index.as_uri())
            page.wait_for_load_state("load")
            blocks = page.eval_on_selector_all("body > div[id]", "els => els.map(e => e.id)")
            images = page.eval_on_selector_all(
                "body > div[id]", "els => Object.fromEntries(els.filter(e => e.querySelector('img')).map(e => "
                "[e.id, [...e.querySelectorAll('img')].map(i => i.complete && i.naturalWidth > 0)]))")
            vega = page.evaluate("window.__vega")
        finally:
            browser.close()
    assert sorted(blocks) == sorted(declared), f"on the page: {sorted(blocks)}\ndeclared: {sorted(declared)}"
    for name, loaded in images.items():
        assert loaded == [True], f"{name}: images loaded {loaded}"
    assert sorted(el for el, _ in vega) == sorted(f"#{n}" for n in declared if n not in images)
    plotted = {el: spec for el, spec in vega}
    for el, spec in plotted.items():
        field = spec.get("encoding", {}).get("y", {}).get("field") if spec else None
        values = (spec or {}).get("data", {}).get("values", [])
        if field is None:  # layered specs: the first layer's y
            layer = (spec or {}).get("layer", [{}])[0]
            field = layer.get("encoding", {}).get("y", {}).get("field")
        assert values and field and all(field in v for v in values), f"{el}: no data for {field!r}"


@pytest.mark.timeout(900)
@pytest.mark.xdist_group("tiny_repro")
def test_full_pipeline_no_op_rerun_selective_rerun_and_experiments(tiny_repro):
    import json

    import mlflow

    from pipeline.config.names import data_digest

    repo, out = tiny_repro
    assert ran(out) == {"prepare", "pretrain", "evaluate", "report", "sweep", "theory", "sets"}
    results = (repo / "sweeps/results.csv").read_text().splitlines()
    assert len(results) == 3 and json.loads((repo / "sweeps/best.json").read_text())["epochs"] == 1
    for name in ("sweep/phase.png", "sweep/phase.csv", "sweep/curves.csv", "theory/theory.png"):
        assert (repo / "plots" / name).stat().st_size > 0, name
    assert "## Verdict" in (repo / "reports/theory.md").read_text()
    assert not [p for p in (repo / "plots").rglob("*") if p.suffix == ".md"]  # dvc plots show would fail on them
    assert json.loads((repo / "metrics/theory.json").read_text())["empirical"]["runs"] == 2
    evaluation = json.loads((repo / "metrics/evaluate.json").read_text())
    assert set(evaluation["probes"]) == {"input", "backbone", "block_1"}
    assert 0.5 < evaluation["probes"]["input"]["svm"]["1"] <= 1.0  # raw digits pixels: ~0.98
    assert set(evaluation["layers"]) == {"input", "backbone", "block_1"}  # each one's own clusters (Figure 4)
    assert all(-1 <= v["silhouette"] <= 1 and 0 <= v["nmi"] <= 1 for v in evaluation["layers"].values())
    for name in ("tsne.png", "tsne.csv", "sharpness.png", "sharpness.csv", "curves.png", "probes.csv"):
        assert (repo / "plots/evaluate" / name).stat().st_size > 0, name
    report = (repo / "reports/REPORT.md").read_text()
    assert "| Model | Batch Size | 3-FFN | SVM | K-NN (k=50) | K-NN (k=200) | Time (min) |" in report
    assert "paper: TransFusion 9-Layer" in report and "../plots/evaluate/tsne.png" in report
    # the set-clustering study: its table (2 data sets x 5 methods) beside ABC's published numbers, in the report
    assert "## Set clustering" in report and "| Omniglot (Table 2) | ABC multiplicative | 0.893 | 0.874 |" in report
    assert sum(line.startswith(("| circles |", "| digits |")) for line in report.splitlines()) == 10
    assert json.loads((repo / "metrics/sets.json").read_text())["summary"]["digits"]["rbf"]["seeds"] == 2

    assert ran(run(["dvc", "repro"], repo)) == set()  # nothing changed: nothing runs

    set_param(repo, "probe", "label_fractions", [0.5, 1.0])  # only evaluate and report read probe.*
    assert ran(run(["dvc", "repro"], repo)) == {"evaluate", "report"}
    # data.*, theory.* and sets.*: what DVC would run (`--dry`: their stages ran above and run again only in the time
    # they take; what follows them follows by their outputs), then the params as they were
    for section, key, value in (("data", "seed", 1), ("theory", "steps", 6), ("sets", "test_sets", 3)):
        was = yaml.safe_load((repo / "params.yaml").read_text())[section][key]
        set_param(repo, section, key, value)
        assert ran(run(["dvc", "repro", "--dry"], repo)) == {"prepare" if section == "data" else section}
        set_param(repo, section, key, was)  # only that stage reads its section
    # model.depth: pretraining (and, by its outputs, what follows it), not the sweep, which sets each trial's depth
    depth = yaml.safe_load((repo / "params.yaml").read_text())["model"]["depth"]
    set_param(repo, "model", "depth", depth + 1)
    assert ran(run(["dvc", "repro", "--dry"], repo)) == {"pretrain"}
    set_param(repo, "model", "depth", depth)
    assert ran(run(["dvc", "repro"], repo)) == set()
    evaluation = json.loads((repo / "metrics/evaluate.json").read_text())
    assert set(evaluation["probes"]["backbone"]["svm"]) == {"0.5", "1"}

    # MLflow: the evaluate runs are children of the pretraining run that made the model
    client = mlflow.MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    exp = client.get_experiment_by_name("transfusion")
    runs = client.search_runs([exp.experiment_id])
    pretrain = [r for r in runs if r.data.tags.get("stage") == "pretrain"]
    evaluate = [r for r in runs if r.data.tags.get("stage") == "evaluate"]
    assert len(pretrain) == 1 and len(evaluate) == 2
    sweeps = [r for r in runs if r.data.tags.get("stage") == "sweep"]
    trials = [r for r in runs if r.data.tags.get("stage") == "sweep-trial"]
    assert len(sweeps) == 1 and sweeps[0].info.status == "FINISHED" and len(trials) == 2
    sets = [r for r in runs if r.data.tags.get("stage") == "sets"]  # the study: a parent and 10 children
    parents = [r for r in sets if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1 and len(sets) == 11
    assert {r.info.run_name for r in sets if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id} == {
        f"{m} · {d}" for m in ("abc_multiplicative", "abc_additive", "transfusion", "pairwise", "rbf")
        for d in ("circles", "digits")}
    rbf = next(r for r in sets if r.info.run_name == "rbf · digits")  # a child's metrics: the study's numbers
    summary = json.loads((repo / "metrics/sets.json").read_text())["summary"]["digits"]["rbf"]
    assert rbf.data.metrics["ari_known"] == pytest.approx(summary["ari_known"])
    assert rbf.data.params["dataset"] == "digits"
    assert all(r.data.tags["mlflow.parentRunId"] == sweeps[0].info.run_id for r in trials)
    assert all(r.data.tags["mlflow.parentRunId"] == pretrain[0].info.run_id for r in evaluate)
    latest = max(evaluate, key=lambda r: r.info.start_time)
    assert latest.data.metrics["backbone.svm.100pct"] == pytest.approx(evaluation["probes"]["backbone"]["svm"]["1"])

    # runs named by what they are, the identity hash a tag, the prepared data each run's dataset input
    config = json.loads((repo / "models/pretrain/config.json").read_text())
    assert pretrain[0].info.run_name == "pretrain · cnn_small · depth 1 · jsd · b100 · s0"
    assert pretrain[0].data.tags["identity"] == config["run_name"]
    assert sweeps[0].info.run_name == "sweep · 2 trials · batch"
    assert sweeps[0].data.tags["identity"].startswith("sweep-")
    assert sorted(r.info.run_name for r in trials) == ["depth 1 · b100 · strength 1.0", "depth 1 · b50 · strength 1.0"]
    assert {r.info.run_name for r in evaluate} == {"evaluate · 2 probes · labels 100%",
                                                  "evaluate · 2 probes · labels 50%, 100%"}
    digest = data_digest(json.loads((repo / "data/prepared/manifest.json").read_text()))[:8]
    for r in pretrain + evaluate + sweeps + trials:
        assert [(i.dataset.name, i.dataset.digest) for i in r.inputs.dataset_inputs] == [("digits", digest)], r
        assert "dvc.exp_name" not in r.data.tags  # `dvc repro` is no experiment

    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "baseline"], repo)
    baseline = run(["git", "rev-parse", "HEAD"], repo).strip()
    # an experiment that re-runs the stages of the probes only (one that retrains is the --dry check above)
    out = run(["dvc", "exp", "run", "-S", "probe.label_fractions=[0.25,1.0]"], repo)
    assert ran(out) == {"evaluate", "report"}
    shown = run(["dvc", "exp", "show", "--json"], repo)
    assert '"label_fractions": [0.25, 1.0]' in shown.replace("'", '"')
    runs = client.search_runs([exp.experiment_id], filter_string="params.probe.label_fractions = '[0.25, 1.0]'")
    assert len(runs) == 1 and runs[0].data.tags["stage"] == "evaluate"

    # DVC -> MLflow: the experiment's metrics carry the run ids; MLflow -> DVC: its runs carry its name and baseline
    name, metrics = experiment_metrics(json.loads(shown), "metrics/evaluate.json", "probe.label_fractions", [0.25, 1.0])
    tagged = client.search_runs([exp.experiment_id], filter_string=f"tags.dvc.exp_name = '{name}'")
    assert [r.data.tags["stage"] for r in tagged] == ["evaluate"]  # the stages it ran, and only those
    assert all(r.data.tags["dvc.exp_baseline"] == baseline for r in tagged)
    assert metrics["mlflow_run_id"] == runs[0].info.run_id == tagged[0].info.run_id
    assert metrics["pretrain_mlflow_run_id"] == pretrain[0].info.run_id  # the model it probed, from the baseline
    assert runs[0].info.run_name == "evaluate · 2 probes · labels 25%, 100%"
    listed = run(["dvc", "exp", "show", "--csv", "--drop", ".*", "--keep", "Experiment|.*mlflow_run_id"], repo)
    assert any(name in line and runs[0].info.run_id in line for line in listed.splitlines()), listed  # docs/tracking.md


def experiment_metrics(shown: list[dict], path: str, param: str, value) -> tuple[str, dict]:
    """From ``dvc exp show --json``: (name, the metrics file ``path``) of the experiment whose param ``param`` (dotted,
    in params.yaml) is ``value``."""
    found = []

    def walk(node):
        if isinstance(node, dict):
            data = node.get("data") or {}
            params = ((data.get("params") or {}).get("params.yaml") or {}).get("data") or {}
            section, key = param.split(".")
            if node.get("name") and node.get("rev") != "workspace" and params.get(section, {}).get(key) == value:
                found.append((node["name"], data["metrics"][path]["data"]))
            for child in node.values():
                walk(child)
        elif isinstance(node, list):
            for child in node:
                walk(child)

    walk(shown)
    assert len(found) == 1, found
    return found[0]
