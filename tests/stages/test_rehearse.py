"""Every file of presets/ rehearsed as shipped: its jobs end to end through real Ray, Tune and MLflow, shrunk only in
size (``transfusion rehearse``; the jobs' own flows: their stages' tests, the full flow: tests/test_dvc_pipeline.py);
GPU scheduling on a Ray that declares GPUs, with Ctrl-C of its sweep of multi-worker trials and the rehearsal's resume
(no partial outputs, MLflow's statuses, no finished trial run again, every epoch logged once): the resume through Tune.
"""

from __future__ import annotations

import csv
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import mlflow
import pytest
import torch
import yaml

from tests import faults
from tests.config.test_rehearse import FILES, SETS_FILES
from tests.conftest import ROOT, as_a_foreground_job, invoke
from tests.stages.test_sweep import sweep_runs

AT_ONCE = re.compile(r"\[(sweep|tables)\] \d+ (?:trials|rows) in \d+ s, up to (\d+) training at once \((\d+) allowed\)")
NOISE = ("Traceback", "TrainController", "ActorDiedError", "PlacementGroupCleaner", "Could not re-use actor",
         "Stop signal received", "Tuner.restore", "(raylet)", ") [0x")  # ") [0x": a native backtrace frame


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


OUTPUTS = {"pretrain": "models/pretrain/model.pt", "evaluate": "metrics/evaluate.json", "report": "reports/REPORT.md",
           "sweep": "sweeps/results.csv", "tables": "tables/results.csv"}


def check_outputs(work, output, jobs=("prepare", "pretrain", "evaluate", "report", "sweep", "tables")):
    """What every rehearsal leaves: each job's outputs, every trial and row ended well, MLflow runs FINISHED."""
    for job in jobs:
        assert job == "prepare" or (work / OUTPUTS[job]).is_file(), OUTPUTS[job]
    for path in (OUTPUTS[j] for j in ("sweep", "tables") if j in jobs):
        rows = read_csv(work / path)
        assert rows and {r["status"] for r in rows} == {"TERMINATED"}, rows
    peaks = {m[1]: (int(m[2]), int(m[3])) for m in AT_ONCE.finditer(output)}
    assert set(peaks) == {"sweep", "tables"} & set(jobs)
    assert all(1 <= peak <= allowed for peak, allowed in peaks.values()), peaks
    client = mlflow.MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("transfusion").experiment_id])
    assert runs and {r.info.status for r in runs} == {"FINISHED"}
    return peaks


ON_DECLARED_GPUS = "presets/cluster-sweep.yaml"  # rehearsed end to end on declared GPUs, as shipped (use_gpu: true)
RAY_JOBS = ("prepare", "pretrain", "sweep", "tables")  # its jobs that run on Ray: where the declared GPUs count


def check_controls(name, work):
    """The controls that broke as shipped, kept as shipped in the rehearsal's params."""
    shipped = yaml.safe_load((ROOT / name).read_text())
    rehearsed = yaml.safe_load((work / "params.yaml").read_text())
    for key in ("knn_every", "checkpoint_every"):
        assert rehearsed["train"][key] == shipped["train"][key]
    assert rehearsed["sweep"]["asha"] == shipped["sweep"]["asha"]
    assert rehearsed["ray"]["max_failures"] == shipped["ray"]["max_failures"]


PRESETS = [f for f in FILES if f.startswith("presets/") and f != ON_DECLARED_GPUS]


def jobs_to_rehearse(name: str) -> tuple[str, ...]:
    """All the jobs of ``name``; only prepare and tables for a file that is params.yaml or an earlier preset but for
    its tables (digits-fusion.yaml: params.yaml's; fashion-mnist-head, -regime, -ssl and -temperature.yaml:
    fashion-mnist-fair.yaml's), whose other jobs would run the same params (params.yaml's through `dvc repro`)."""
    from pipeline.config.rehearse import plan

    def rest(path):
        return {k: v for k, v in plan(ROOT / path, cpus=2).raw.items() if k != "tables"}

    jobs = plan(ROOT / name, cpus=2).jobs
    same = ["params.yaml", *PRESETS[:PRESETS.index(name)]]
    return ("prepare", "tables") if any(rest(o) == rest(name) for o in same) else jobs


@pytest.mark.slow
def test_a_preset_that_is_anothers_but_for_its_rows_rehearses_its_tables():
    assert PRESETS == ["presets/digits-fusion.yaml", "presets/fashion-mnist-fair.yaml",
                       "presets/fashion-mnist-figure5.yaml", "presets/fashion-mnist-head.yaml",
                       "presets/fashion-mnist-regime.yaml", "presets/fashion-mnist-ssl.yaml",
                       "presets/fashion-mnist-temperature.yaml", "presets/paper-tables.yaml"]
    assert [len(jobs_to_rehearse(name)) for name in PRESETS] == [2, 6, 6, 2, 2, 2, 2, 6]


def rows_to_rehearse(name: str) -> list[dict]:
    """Of the rows ``name``'s rehearsal runs, those it runs through Ray here (``tables.rows`` is a grid: a subset is a
    size): each table's first row, the ``tables.reference`` row, and the first row with a ``space`` when none of
    those has one (the tuning phase). Every row's own settings train and probe in
    :func:`test_every_row_of_a_shipped_file_trains_and_probes_in_one_process`."""
    from pipeline.config.rehearse import plan

    raw = plan(ROOT / name, cpus=2).raw
    rows = raw["tables"]["rows"]
    picked = [next(r for r in rows if r["table"] == t) for t in sorted({r["table"] for r in rows})]
    picked += [r for r in rows if r["name"] == raw["tables"].get("reference")]
    if not any(r.get("space") for r in picked):
        picked += [r for r in rows if r.get("space")][:1]
    return [r for r in rows if r in picked]


def rows_setting(rows: list[dict]) -> str:
    """``tables.rows=<rows>`` as ``-S`` takes it (YAML's flow style, on one line)."""
    return "tables.rows=" + yaml.safe_dump(rows, default_flow_style=True, width=1 << 20).strip()


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", PRESETS)
def test_shipped_preset_rehearses_end_to_end(name, tmp_path, ray_session):
    """Every preset (one added later is in FILES: the test lists presets/ itself) but ON_DECLARED_GPUS, which the
    last test rehearses on a Ray that declares its GPUs; params.yaml's jobs run through `dvc repro`
    (tests/test_dvc_pipeline.py) and `transfusion tables` (tests/stages/test_tables.py). Its tables: the rows of
    :func:`rows_to_rehearse`."""
    work, jobs = tmp_path / "rehearsal", jobs_to_rehearse(name)
    result = invoke("rehearse", "--params", str(ROOT / name), "--dir", str(work), "--jobs", ",".join(jobs),
                    "-S", rows_setting(rows_to_rehearse(name)))
    assert result.exit_code == 0, result.output
    assert f"[rehearse] {ROOT / name}: {', '.join(jobs)} passed" in result.output
    check_outputs(work, result.output, jobs)
    check_controls(name, work)


@pytest.mark.slow
@pytest.mark.parametrize("name", FILES)
def test_every_row_of_a_shipped_file_trains_and_probes_in_one_process(name, one_thread):
    """Every row of every tables job a shipped file runs (its tuning phase's points included), on the rehearsal's
    sizes, trained and probed as a one-worker trial of the job does (``train_and_probe``) without Ray: what each row's
    own settings do (a loss, a head, a projector, a depth). The probes and epochs are a file's settings, not a row's:
    kNN-50 after one epoch here (a row's own epochs kept), the file's own in its rehearsal."""
    from pipeline.config.params import validate_params
    from pipeline.config.rehearse import plan
    from pipeline.data.sources import load_dataset
    from pipeline.evaluation.tables_rows import resolve_rows, trial_configs, trial_row_params, tuning_rows
    from pipeline.training.rows import train_and_probe

    p = validate_params(plan(ROOT / name, cpus=2).raw)
    p = p.model_copy(update={"probe": p.probe.model_copy(update={"probes": ["knn50"]}),
                             "train": p.train.model_copy(update={"epochs": 1})})  # a row's own epochs stay
    data, rows = load_dataset(p.data), resolve_rows(p)
    configs = [c for c in trial_configs(p, rows) if not c["control"]]
    if p.tables.tuning:  # the tuning phase's points, with its seed (as pipeline.runs.tables.tune_rows runs them)
        configs += [t.config(p.tables.tuning.seed) for t in tuning_rows(p, rows)]
    assert configs
    for config in configs:
        row = trial_row_params(p, config)
        done = train_and_probe(row, data, torch.device("cpu"))
        assert len(done.history) == row.train.epochs, config["name"]
        assert all(math.isfinite(h["loss"]) for h in done.history), (config["name"], done.history)
        assert set(done.accuracies) == {"knn50"} and done.accuracies["knn50"] > 0.2, (config["name"], done)


@pytest.mark.slow
def test_a_gpu_preset_on_too_few_declared_gpus_exits_2_before_ray(tmp_path, ray_starts):
    refused = invoke("rehearse", "--params", str(ROOT / ON_DECLARED_GPUS), "--gpus", "1", "--dir",
                     str(tmp_path / "one"), "--jobs", "prepare,pretrain")
    assert refused.exit_code == 2, refused.output
    assert "1 GPU" in refused.output and "ray.num_workers" in refused.output
    assert not ray_starts


@pytest.mark.slow
@pytest.mark.parametrize("name", SETS_FILES)
def test_set_study_rehearses_end_to_end(name, tmp_path):
    work = tmp_path / "sets"
    result = invoke("rehearse", "--params", str(ROOT / name), "--dir", str(work))
    assert result.exit_code == 0, result.output
    assert f"[rehearse] {ROOT / name}: sets passed" in result.output
    metrics = yaml.safe_load((work / "metrics/sets.json").read_text())
    assert metrics["setup"]["steps"] == 3 and set(metrics["summary"]) == {"circles", "subspaces", "digits"}
    assert (work / "plots/sets/ari.png").stat().st_size > 0 and (work / "reports/sets.md").is_file()
    runs = mlflow.MlflowClient(f"sqlite:///{work / 'mlflow.db'}").search_runs(
        [mlflow.MlflowClient(f"sqlite:///{work / 'mlflow.db'}").get_experiment_by_name("transfusion").experiment_id])
    assert len(runs) == 1 + 3 * 5  # the parent and a child per data set and method, in the rehearsal's own store


def run(args, env=None, **kw):
    return subprocess.run([sys.executable, "-m", "stages.cli", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, **kw)


def started(log) -> list[str]:
    return [line.split()[0] for line in log.read_text().splitlines()] if log.exists() else []


def interrupt_mid_sweep(args, env, cwd) -> tuple[str, set[str], float, list[float], int]:
    """Run ``transfusion *args`` and press Ctrl-C (SIGINT to its whole foreground group, as a terminal does) once a
    sweep trial has ended and another one is training (its epoch 2): (console, ended trial ids, seconds from Ctrl-C to
    exit, seconds from each ended trial to the next one's start, exit code)."""
    proc = subprocess.Popen([sys.executable, "-m", "stages.cli", *args], cwd=cwd, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=as_a_foreground_job)
    lines, sent, ended, gaps, last_end = [], None, set(), [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            end = re.match(r"\[sweep\] trial (\S+) (finished|stopped early)", line)
            if end:
                ended.add(end[1])
                last_end = time.monotonic()
            if re.match(r"\[sweep\] \d+/\d+ done; trial \S+ started", line) and last_end is not None:
                gaps.append(time.monotonic() - last_end)  # an ended trial's slot taken by the next one
                last_end = None
            epoch = re.match(r"\[sweep\] trial (\S+) epoch 2/", line)
            if sent is None and ended and epoch and epoch[1] not in ended:
                os.killpg(proc.pid, signal.SIGINT)
                sent = time.monotonic()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = "".join(lines)
    assert sent is not None, out
    return out, ended, time.monotonic() - sent, gaps, proc.returncode


@pytest.mark.slow
@pytest.mark.first  # the suite's longest test: started first, beside the rest
@pytest.mark.timeout(900)
def test_gpu_preset_on_declared_gpus_ctrl_c_mid_sweep_then_resume(tmp_path):
    """cluster-sweep.yaml's Ray jobs (pretrain, sweep, tables: every check of the test above; evaluate and report run on
    the driver, rehearsed by every other preset) on a Ray that declares 4 GPUs (none exist: ray.backend gloo), so with
    ray.use_gpu as shipped: each worker its own GPU, the sweep and the tables as many trials at once as
    pipeline.config.resources computes, probes on a worker's GPU bundle (the tables: one trained row, the controls).
    Ctrl-C while its sweep of two-worker trials runs ends the rehearsal in 30 s, with no partial sweep outputs and
    MLflow's sweep run KILLED; the command it prints resumes it: the unfinished trials only, every epoch logged once,
    the same MLflow run."""
    from pipeline.config.ray import TRIAL_CPU
    from pipeline.config.resources import TrialShape, trials_at_once

    assert ON_DECLARED_GPUS in FILES
    work, log = tmp_path / "gpu", tmp_path / "trials.log"
    env = faults.environment(count_file=str(log))
    shipped = str(ROOT / ON_DECLARED_GPUS)
    row = rows_setting(rows_to_rehearse(ON_DECLARED_GPUS)[:1])  # one trained row (table 1's) beside the controls
    out, ended, waited, gaps, code = interrupt_mid_sweep(
        ["rehearse", "--params", shipped, "-S", row, "--gpus", "4", "--dir", str(work), "--jobs", ",".join(RAY_JOBS)],
        env, tmp_path)
    assert gaps and max(gaps) < 30, f"the next trial started {gaps} s after one ended\n{out}"
    assert waited < 30, f"{waited:.0f} s after Ctrl-C\n{out}"
    assert code == 1, out
    after = out.split("epoch 2/")[-1].splitlines()[1:]
    assert not [line for line in after if any(n in line for n in NOISE)], out
    assert re.search(r"Error: rehearsal: `transfusion sweep` failed: the sweep was interrupted with \d+ of 4 trials "
                     r"unfinished; rerun the stage to resume", out), out
    again = ("to continue the rehearsal from there: " + shlex.join(
        ["transfusion", "rehearse", "--params", shipped, "-S", row, "--gpus", "4", "--dir", str(work), "--jobs",
         "sweep,tables", "--resume"]))
    assert again in out, out
    placed = re.search(r"\[pretrain\] 2 worker\(s\) on 1 node\(s\): rank 0 .*GPU (\d)\), rank 1 .*GPU (\d)\)", out)
    assert placed and placed[1] != placed[2], out  # each worker its own GPU
    first = started(log)
    assert not (work / "sweeps/results.csv").exists() and not (work / "plots/sweep").exists()  # no partial outputs
    _, parents, children = sweep_runs(work)
    assert len(parents) == 1 and parents[0].info.status == "KILLED"
    assert {c.info.status for c in children if c.data.tags["trial_id"] in ended} == {"FINISHED"}

    resumed = run(shlex.split(again.split(": ", 1)[1])[1:], env=env, cwd=tmp_path, timeout=840)
    out = out + resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out
    assert "[sweep] resuming" in resumed.stdout
    assert f"[rehearse] {shipped}: sweep, tables passed" in resumed.stdout
    check_outputs(work, out, RAY_JOBS)
    check_controls(ON_DECLARED_GPUS, work)
    assert yaml.safe_load((work / "params.yaml").read_text())["ray"]["use_gpu"] is True
    trials = read_csv(work / "sweeps/results.csv")
    assert len(trials) == 4
    for t in trials:
        ids = t["gpu_ids"].split()
        assert len(ids) == 2 and len(set(ids)) == 2 and t["status"] == "TERMINATED", t
    sweep = {t["trial_id"].split("_")[0] for t in trials}  # the sweep's Tune run (the tables job's trials start too)
    rerun = [t for t in started(log)[len(first):] if t.split("_")[0] in sweep]
    assert not set(rerun) & ended, "finished trials were run again"
    assert set(rerun) == {t["trial_id"] for t in trials} - ended  # the unfinished ones, and only those
    _, parents, children = sweep_runs(work)  # the same parent run, now finished, and a finished child per trial
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert sorted(c.data.tags["trial_id"] for c in children if c.info.status == "FINISHED") == sorted(
        t["trial_id"] for t in trials)
    curves = read_csv(work / "plots/sweep/curves.csv")
    for t in trials:  # every epoch of every trial exactly once, also for a resumed trial
        logged = [int(c["epoch"]) for c in curves if c["trial_id"] == t["trial_id"]]
        assert logged == list(range(1, int(t["epochs"]) + 1)), (t["trial_id"], logged)
    computed = trials_at_once({"CPU": 2, "GPU": 4}, TrialShape(2, 0.25, True, TRIAL_CPU), len(trials))
    peaks = {m[1]: (int(m[2]), int(m[3])) for m in AT_ONCE.finditer(resumed.stdout)}
    assert computed == 2 and peaks["sweep"] == (computed, computed), out  # two unfinished trials at least
    assert peaks["tables"] == (1, 2), out  # one trained row (the controls train nothing)
    rows = read_csv(work / "tables/results.csv")
    assert {(r["control"], r["hours_unit"], r["gpus"], r["probe_cpus"], r["probe_gpus"]) for r in rows} == {
        ("", "GPU-hours", "2", "0.25", "1.0"),  # each row's probes on one worker's bundle, not the trial's 0.25 CPU
        ("raw_pixels", "GPU-hours", "0", "0.25", "1.0"), ("random_init", "GPU-hours", "0", "0.25", "1.0")}  # untrained
    lines = resumed.stdout.splitlines()
    noise = [i for i, line in enumerate(lines) if any(n in line for n in NOISE)]
    assert not noise, "\n".join(lines[max(noise[0] - 5, 0):noise[0] + 40])  # the first noise, in context
