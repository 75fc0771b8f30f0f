"""A real two-node Ray cluster on this machine that looks like a real one: `ray start --head` + `ray start --address`
on loopback with distinct ports, temp dirs and working directories, the worker node in its own mount namespace where
the project directory does not exist (it is checked out on the head only). The nodes share what the deploy recipes
share: the installed code and one storage mount. `pretrain` runs on it through RAY_ADDRESS with one worker per node."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from tests.conftest import pretrain_curve

pytestmark = [pytest.mark.slow]

if shutil.which("ray") is None:  # pragma: no cover - ray[default] ships the CLI
    pytest.skip("the `ray` command is not installed", allow_module_level=True)


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports (bound together, so none repeats)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def stop_processes(popens: list[subprocess.Popen], marker: str) -> None:
    """Stop what this test started and nothing else (`ray stop` would end every Ray on the machine): the
    `ray start --block` process groups, then any process whose command line names this cluster's temp dir. SIGKILL at
    once: the nodes' state is thrown away with their temp dirs (a graceful `ray start --block` stop took 30 s of this
    test's teardown, and SIGTERM then 5 s of waiting)."""
    for p in popens:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    for p in popens:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(marker in part for part in proc.info["cmdline"] or []):
                proc.kill()


def wait_for_nodes(address: str, n: int, env: dict, timeout: float = 120) -> None:
    """Until the cluster at ``address`` has ``n`` alive nodes. One probe process imports Ray, connects and polls; a new
    one only while the head does not answer yet (it was a new process every 2 s)."""
    probe = ("import ray, sys, time; ray.init(address=sys.argv[1], logging_level='ERROR'); end = float(sys.argv[3])\n"
             "while sum(1 for x in ray.nodes() if x['Alive']) < int(sys.argv[2]) and time.time() < end:\n"
             "    time.sleep(0.5)\n"
             "print(sum(1 for x in ray.nodes() if x['Alive']))")
    deadline = time.time() + timeout
    alive = 0
    while time.time() < deadline:
        out = subprocess.run([sys.executable, "-c", probe, address, str(n), str(deadline)], env=env,
                             capture_output=True, text=True, timeout=timeout + 60)
        if out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == [str(n)]:
            return
        alive = out.stdout.strip()[-20:]
        time.sleep(2)
    raise AssertionError(f"the cluster did not reach {n} alive nodes (last: {alive!r})")


def _unshare_works() -> bool:
    try:
        return subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True,
                              timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.fixture
def two_node_cluster(project):
    """Head and worker node, 1 CPU each, on 127.0.0.1, each with its own temp dir and working directory; the worker
    node runs in its own mount namespace where the project directory is an empty tmpfs, as on a real cluster where
    the project is checked out on the head only. What both see: the installed code, and ``shared`` (the stand-in for
    the NFS/EFS mount of the deploy recipes). Yields (address, env for clients, shared dir); torn down after."""
    if not _unshare_works():  # pragma: no cover - needs root (CI and the dev machines run as root)
        pytest.fail("`unshare -m` is not permitted here: the multi-node test needs a private mount namespace")
    tmp = tempfile.mkdtemp(prefix="tfc", dir="/tmp")  # short: Ray's unix sockets live under it
    shared = tempfile.mkdtemp(prefix="tfc-shared-", dir="/tmp")
    worker_home = tempfile.mkdtemp(prefix="tfc-worker-", dir="/tmp")
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0"}
    for key in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI"):  # the worker node knows nothing of the driver's settings
        env.pop(key, None)
    gcs, dash, client, *rest = free_ports(13)
    common = ["--block", "--num-cpus=1", "--node-ip-address=127.0.0.1", "--disable-usage-stats"]

    def node_ports(k: int, base: int) -> list[str]:
        nm, om, agent, agent_grpc, runtime_env = rest[5 * k: 5 * k + 5]
        return [f"--node-manager-port={nm}", f"--object-manager-port={om}", f"--dashboard-agent-listen-port={agent}",
                f"--dashboard-agent-grpc-port={agent_grpc}", f"--runtime-env-agent-port={runtime_env}",
                f"--min-worker-port={base}", f"--max-worker-port={base + 199}"]

    started: list[subprocess.Popen] = []
    try:
        head = subprocess.Popen(
            ["ray", "start", "--head", f"--port={gcs}", f"--dashboard-port={dash}",
             f"--ray-client-server-port={client}", f"--temp-dir={tmp}", *common, *node_ports(0, 23000)],
            env=env, cwd=project, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        started.append(head)
        address = f"127.0.0.1:{gcs}"
        wait_for_nodes(address, 1, env)
        start_worker = " ".join(["ray", "start", f"--address={address}", *common, *node_ports(1, 23400)])
        hide = f"mount -t tmpfs -o size=1m tfc-hidden {project} && cd {worker_home} && exec {start_worker}"
        worker = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", hide],
                                  env={**env, "TMPDIR": worker_home}, start_new_session=True,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        started.append(worker)
        wait_for_nodes(address, 2, env)
        yield address, env, shared
    finally:
        stop_processes(started, tmp)
        stop_processes([], worker_home)
        for d in (tmp, shared, worker_home):
            shutil.rmtree(d, ignore_errors=True)


def _pretrain(project, env, *overrides: str) -> tuple[subprocess.CompletedProcess, float]:
    cli = [sys.executable, "-m", "stages.cli"]
    start = time.time()
    out = subprocess.run(
        [*cli, "pretrain", "-S", "ray.num_workers=2", "-S", "ray.cpus_per_worker=1", "-S", "train.epochs=2",
         "-S", "train.batch_size=64", "-S", "model.embed_dim=16", "-S", "ray.resources_timeout_s=120", *overrides],
        cwd=project, env=env, capture_output=True, text=True, timeout=600)
    return out, time.time() - start


@pytest.mark.timeout(900)
def test_pretrain_on_two_nodes_that_share_only_the_storage(project, two_node_cluster):
    address, env, shared = two_node_cluster
    env = {**env, "RAY_ADDRESS": address, "MLFLOW_TRACKING_URI": f"sqlite:///{project / 'mlflow.db'}",
           "MLFLOW_SKIP_PIP_REQUIREMENTS_CHECK": "true"}
    cli = [sys.executable, "-m", "stages.cli"]
    out = subprocess.run([*cli, "prepare", "-S", "data.limit_train=256"], cwd=project, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr

    # 1. Ray's storage inside the project (the default, ray_results/): the worker node cannot see the staged data
    out, seconds = _pretrain(project, env)
    log = out.stdout + out.stderr
    assert out.returncode == 1, log
    error = next(line for line in out.stderr.splitlines() if line.startswith("Error: "))  # click's one paragraph
    assert "cannot see the prepared data at" in error and str(project / "ray_results") in error, error
    assert "ray.storage_path must be storage that every node sees" in error, error
    assert re.search(r"rank [01]: node [0-9a-f]{12} ", error) and "Traceback" not in error, error
    print(f"not shared: clear error after {seconds:.0f} s")

    # 2. Ray's storage on the shared mount: trains with one worker per node
    out, seconds = _pretrain(project, env, "-S", f"ray.storage_path={shared}/ray_results")
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    assert "[pretrain] 2 worker(s) on 2 node(s)" in log, log  # 1 CPU per node: one worker on each
    assert [int(r["epoch"]) for r in pretrain_curve(project)] == [1, 2]
    assert json.loads((project / "metrics/pretrain.json").read_text())["epochs"] == 2
    print(f"shared: trained in {seconds:.0f} s")

    # the tracking store (on the head's disk only) is complete: every epoch, the model, FINISHED
    import mlflow
    import mlflow.pytorch

    client = mlflow.MlflowClient(env["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("transfusion")
    runs = client.search_runs([exp.experiment_id], filter_string="tags.stage = 'pretrain'",
                              order_by=["attributes.start_time DESC"])
    # one run: the failed attempt's run (FAILED, no epochs) is continued by the rerun of the same pretraining
    assert [r.info.status for r in runs] == ["FINISHED"]
    done = runs[0]
    assert [m.step for m in client.get_metric_history(done.info.run_id, "loss")] == [1, 2]
    assert [m.step for m in client.get_metric_history(done.info.run_id, "knn_acc")] == [2]  # knn_every 5: the last
    artifacts = {a.path for a in client.list_artifacts(done.info.run_id)}
    assert {"config.json", "pretrain.json", "pretrain.csv"} <= artifacts, artifacts
    mlflow.set_tracking_uri(env["MLFLOW_TRACKING_URI"])
    assert mlflow.pytorch.load_model(f"runs:/{done.info.run_id}/model") is not None
