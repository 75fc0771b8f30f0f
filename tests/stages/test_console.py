"""`transfusion pretrain` prints our progress lines and real errors, not Ray's internal chatter: on Ray Train (two
workers) and in this process (the default's one worker, which starts no Ray at all).

Each test runs the CLI as its own process, as `dvc repro` does, with its own local Ray under a temp ``RAY_TMPDIR`` (so
that Ray's logs can be checked on disk and everything it leaves behind can be stopped) and its own ``HOME`` (no Ray
auth token yet: the first run on a fresh machine, when Ray creates one).
"""

from __future__ import annotations

import contextlib
import csv
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlflow
import psutil
import pytest

from pipeline.runs.tracking_process import DIED
from tests import faults
from tests.conftest import as_a_foreground_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

RUN = ["-S", "train.epochs=2", "-S", "data.limit_train=256", "-S", "train.batch_size=128", "-S", "model.embed_dim=32"]
# Ray's C++ core: "[2026-01-01 12:00:00,123 E 1968 1999] core_worker.cc:2465: ..." (any prefix Ray adds before it)
CPP_LINE = re.compile(r"\[?\d{4}-\d\d-\d\d [\d:,.]+ [DIWEF] \d+ \d+\]? \S+\.(cc|h):\d+")
RAY_INTERNALS = ("core_worker.cc", "gcs_", "raylet", "Token authentication", "Requesting resources",
                 "worker group", "PreemptionWatcher", "TrainController", "Reporting training result",
                 "Cleaning up placement group", "Ray Train Controller actor state")


@pytest.fixture
def sandbox(prepared):
    """The project (data prepared), a short temp root for the run's own Ray (unix socket paths are limited to ~107
    bytes) and an empty HOME; whatever Ray leaves running under them is killed after."""
    project = prepared
    tmp = tempfile.mkdtemp(prefix="tfq", dir="/tmp")
    home = Path(tmp) / "home"
    home.mkdir()
    yield project, tmp, home
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(tmp in part for part in proc.info["cmdline"] or []):
                proc.kill()
    shutil.rmtree(tmp, ignore_errors=True)


def pretrain(project: Path, tmp: str, home: Path, *args: str, **env: str) -> tuple[int, list[str]]:
    """Run `transfusion pretrain` as a user would (no Ray settings of ours in the environment); its console lines."""
    return stage(project, tmp, home, "pretrain", *RUN, *args, **env)


def stage(project: Path, tmp: str, home: Path, *args: str, python: tuple[str, ...] = (),
          **env: str) -> tuple[int, list[str]]:
    """Run `transfusion *args` as a user would (see :func:`pretrain`; ``python``: flags of the interpreter); its
    console lines."""
    out = subprocess.run([sys.executable, *python, "-m", "stages.cli", *args], cwd=project, capture_output=True,
                         text=True, timeout=480, env=user_env(tmp, home, **env))
    return out.returncode, (out.stdout + out.stderr).splitlines()


def user_env(tmp: str, home: Path, **env: str) -> dict[str, str]:
    """This environment without Ray settings of ours, Ray's temp dir ``tmp``, ``HOME`` ``home``, and ``env``."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("RAY_AUTH", "RAY_DEDUP", "RAY_BACKEND", "RAY_SCHEDULER")) and k != "RAY_ADDRESS"}
    return {**base, "RAY_TMPDIR": tmp, "HOME": str(home), **env}


def ray_chatter(lines: list[str]) -> list[str]:
    return [line for line in lines if CPP_LINE.search(line) or any(word in line for word in RAY_INTERNALS)]


# Every line a default run may print: our progress lines ("[pretrain] ...", from the worker, as printed: with the
# job's logging config Ray adds no "(RayTrainWorker pid=N) " prefix, nor colour codes), the closing line, the one line
# about a new MLflow store, and our warnings.
OURS = re.compile(r"^\[pretrain\] "
                  r"|^pretrained \d+ epochs: "
                  r"|^\[mlflow\] new tracking store ")


def not_ours(lines: list[str]) -> list[str]:
    return [line for line in lines if line.strip() and not OURS.match(line)]


def session_logs(tmp: str) -> Path:
    sessions = sorted(Path(tmp).glob("**/session_2*/logs"))
    assert len(sessions) == 1, sessions
    return sessions[0]


def test_the_default_one_worker_trains_in_this_process_and_starts_no_ray(sandbox):
    """The default (one worker, no cluster) trains in the stage's own process: our lines only, no Ray session, no
    Ray process; the same outputs and MLflow run as on Ray Train. The stage's process never imports MLflow (its
    ``-X importtime`` lines): its tracking process logs the run."""
    project, tmp, home = sandbox
    code, lines = pretrain(project, tmp, home, python=("-X", "importtime"))
    imports = [line for line in lines if line.startswith("import time:")]
    lines = [line for line in lines if not line.startswith("import time:")]
    console = "\n".join(lines)
    assert code == 0, console
    assert any(line.endswith("| torch") for line in imports), imports[:5]  # the stage's own imports, all of them
    assert not [line for line in imports if "mlflow" in line or "sqlalchemy" in line], console
    assert not not_ours(lines), console
    assert "[pretrain] 1 worker in this process, no Ray (" in console, console
    assert "start (imports, checks, MLflow run)" in console and "the run in this process" in console, console
    assert not list(Path(tmp).glob("**/session_*")), console  # Ray never started
    assert (project / "models" / "pretrain" / "model.pt").is_file()
    client = mlflow.MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("transfusion").experiment_id])
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2]


def test_ctrl_c_ends_the_run_killed_and_a_killed_stage_leaves_it_failed(sandbox):
    """Ctrl-C (SIGINT to the terminal's foreground group: the stage; its tracking process is in a session of its
    own) ends the run KILLED with its epochs and checkpoints kept, exit 1. The rerun resumes the same run; killed with
    SIGKILL (no Python left to end anything), its tracking process ends that run FAILED, naming why."""
    project, tmp, home = sandbox
    client = mlflow.MlflowClient(f"sqlite:///{project / 'mlflow.db'}")

    def run_until_epoch(epoch: int) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", "stages.cli", "pretrain", *RUN, "-S", "train.epochs=400"],
                                cwd=project, env=user_env(tmp, home), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                preexec_fn=as_a_foreground_job)
        for line in proc.stdout:
            if line.startswith(f"[pretrain] epoch {epoch}/400 "):
                return proc
        raise AssertionError(f"the stage ended before epoch {epoch}: exit {proc.wait()}")

    proc = run_until_epoch(6)  # after the checkpoint of epoch 5 (train.checkpoint_every)
    os.killpg(proc.pid, signal.SIGINT)
    rest = proc.stdout.read()
    assert proc.wait(timeout=120) == 1, rest
    (run,) = client.search_runs([client.get_experiment_by_name("transfusion").experiment_id])
    assert run.info.status == "KILLED", rest
    logged = [m.step for m in client.get_metric_history(run.info.run_id, "loss")]
    assert len(logged) >= 2 and logged == list(range(1, len(logged) + 1)), logged  # the epoch at Ctrl-C: maybe
    assert list((project / "ray_results").glob("pretrain-*/checkpoint_*")), rest

    proc = run_until_epoch(len(logged) + 2)  # resumed after the last checkpoint
    proc.kill()
    proc.wait(timeout=60)
    end = time.monotonic() + 60
    while client.get_run(run.info.run_id).info.status == "RUNNING" and time.monotonic() < end:
        time.sleep(0.2)
    (again,) = client.search_runs([client.get_experiment_by_name("transfusion").experiment_id])
    assert again.info.run_id == run.info.run_id and again.info.status == "FAILED"
    assert again.data.tags["error"] == DIED


def test_a_ray_train_run_prints_our_lines_and_ray_keeps_its_own_logs(sandbox):
    """Two workers train on Ray Train. Also: a Ray killed without `ray stop` left <Ray temp
    dir>/ray/ray_current_cluster naming a dead address, which ray.init() without an address would retry for minutes;
    with ray.address null the stage names it in one line and trains on a fresh local Ray."""
    project, tmp, home = sandbox
    os.makedirs(os.path.join(tmp, "ray"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    Path(tmp, "ray", "ray_current_cluster").write_text(f"127.0.0.1:{dead}")
    start = time.monotonic()
    code, lines = pretrain(project, tmp, home, *TWO_WORKERS)
    console = "\n".join(lines)
    assert code == 0, console
    assert time.monotonic() - start < 150, console
    stale = (f"[ray] the local Ray cluster recorded at 127.0.0.1:{dead} ({tmp}/ray/ray_current_cluster) does not "
             "answer (a Ray stopped without `ray stop`); starting a fresh local Ray for this run")
    assert lines.count(stale) == 1, console
    lines.remove(stale)
    assert not ray_chatter(lines), console
    assert not not_ours(lines), console  # nothing else either: no MLflow, alembic or torch chatter, no colour codes
    assert sum(line.startswith("[mlflow] new tracking store ") for line in lines) == 1, console  # a fresh store
    assert any("[pretrain] epoch 1/2 loss" in line for line in lines), console
    assert any("[pretrain] epoch 2/2 loss" in line for line in lines), console
    assert sum("[pretrain] head sharded over 2 workers (" in line for line in lines) == 1, console
    assert any(line.startswith("pretrained 2 epochs: loss") for line in lines), console
    assert any(line.startswith("[pretrain] ") and " s in all: " in line for line in lines), console  # where time went
    # token authentication is still on (Ray created the token for this fresh HOME), only not announced
    assert (home / ".ray" / "auth_token").is_file()
    # what the console no longer shows is on disk, in Ray's session logs
    logs = session_logs(tmp)
    controller = "".join(p.read_text() for p in logs.glob("train/ray-train-sys-controller-*.log"))
    assert "worker group" in controller
    assert any("core_worker.cc" in p.read_text(errors="replace") for p in logs.glob("python-core-worker-*.log"))


def test_a_worker_error_reaches_the_console_as_one_line_that_says_to_rerun(sandbox):
    """Rank 0 raises after epoch 2 (its checkpoint persisted): the process exits 1 with one error line that says to
    rerun, and the MLflow run is FAILED with the epochs it logged (the resume: tests/stages/test_faults.py)."""
    project, tmp, home = sandbox
    code, lines = pretrain(project, tmp, home, "-S", "train.epochs=3", **faults.environment(crash_at_epoch=2))
    console = "\n".join(lines)
    assert code == 1, console
    error = [line for line in lines if line.startswith("Error: ")]
    assert len(error) == 1 and "RuntimeError: injected crash after epoch 2 (tests.faults)" in error[0], console
    assert "rerun the stage to resume" in error[0], console
    assert any("[pretrain] epoch 2/3 loss" in line for line in lines), console
    assert not ray_chatter(lines), console
    assert not (project / "models").exists()
    client = mlflow.MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("transfusion").experiment_id])
    assert run.info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2]


# A worker's native crash dump (Ray's failure-signal handler, Python's faulthandler): ~60 lines a worker
DUMP = ("Fatal Python error", "SIGABRT received", "(most recent call first)", "Extension modules: ")
TWO_WORKERS = ["-S", "ray.num_workers=2", "-S", "ray.cpus_per_worker=0.5"]


def dump_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if any(word in line for word in DUMP)
            or re.search(r"@ +0x[0-9a-f]+ |\) \[0x[0-9a-f]+\]", line)]  # the signal handler's, glibc backtrace frames


def test_a_worker_aborting_mid_epoch_keeps_its_native_dump_in_rays_logs(sandbox):
    """Rank 1 of 2 aborts (SIGABRT) at the second step of epoch 1 while rank 0 waits for it in a collective: the run
    fails with its error line; the dump is in the worker's ``worker-*.err``, not on the console."""
    project, tmp, home = sandbox
    code, lines = pretrain(project, tmp, home, *TWO_WORKERS, **faults.environment(abort_at=(1, 2, 1)))
    console = "\n".join(lines)
    assert code == 1, console
    assert sum(line.startswith("Error: ") for line in lines) == 1, console
    assert not dump_lines(lines), console  # Ray's one "(raylet) A worker died ..." notice stays: a real crash
    errs = {p.name: p.read_text(errors="replace") for p in session_logs(tmp).glob("worker-*.err")}
    assert any("Fatal Python error: Aborted" in e and "SIGABRT received" in e for e in errs.values()), (console, errs)


def test_asha_stopping_a_two_worker_trial_mid_epoch_prints_no_crash_dump(sandbox):
    """Two trials of 2 workers, each a Ray Train run reporting through Tune. The one without augmentation is slowed
    (its rank 1 sleeps 1 s before each step, rank 0 waits in the step's collectives: 16 s an epoch, more than the two
    trials' starts can differ by on 2 cores; 0.3 s a step can let it reach the rung first), so it reaches ASHA's first
    rung second, and is the worse one there (measured: validation kNN 0.63 vs 0.68 on this data): ASHA stops it while
    its workers are mid-epoch, inside a collective. The augmented one diverges at its last epoch: that trial alone
    fails, with its reason."""
    project, tmp, home = sandbox
    code, lines = stage(project, tmp, home, "sweep", "-S", "model.embed_dim=16", "-S", "ray.num_workers=2",
                        "-S", "sweep.depth=[1]", "-S", "sweep.batch_size=[32]", "-S", "sweep.strength=[0.0,1.0]",
                        "-S", "sweep.epochs=3", "-S", "sweep.asha=true", "-S", "sweep.grace_period=1",
                        "-S", "sweep.cpus_per_worker=0.25",
                        **faults.environment(slow_rank=(1, 1.0), trial={"augment.strength": 0.0},
                                             also=[{"nan_at_epoch": 3, "trial": {"augment.strength": 1.0}}]))
    console = "\n".join(lines)
    assert code == 0, console
    assert any(" stopped early at epoch 1 " in line for line in lines), console
    assert not dump_lines(lines), console
    assert not ray_chatter(lines), console
    rows = {r["augment.strength"]: r for r in csv.DictReader((project / "sweeps/results.csv").open())}
    stopped, bad = rows["0.0"], rows["1.0"]
    assert stopped["status"] == "TERMINATED" and stopped["stopped_early"] == "True" and stopped["epochs"] == "1"
    assert float(bad["view_noise"]) > 0 == float(stopped["view_noise"])  # the views, measured on the workers
    assert bad["status"] == "ERROR" and bad["error"].startswith("non_finite: ") and bad["epochs"] == "2"
    assert bad["error"].endswith("(last good epoch 2)")
    assert any(f"trial {bad['trial_id']} failed: {bad['error']}" in line for line in lines), console
    curves = list(csv.DictReader((project / "plots/sweep/curves.csv").open()))
    assert [c["epoch"] for c in curves if c["trial_id"] == stopped["trial_id"]] == ["1"]
    assert [c["epoch"] for c in curves if c["trial_id"] == bad["trial_id"]] == ["1", "2"]
