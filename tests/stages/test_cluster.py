"""A real two-node Ray cluster on this machine (`ray start --head` + `ray start --address`, loopback, distinct ports
and temp dirs): the `pretrain` stage runs on it through RAY_ADDRESS with one worker per node."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

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
    `ray start --block` process groups, then any process whose command line names this cluster's temp dir."""
    for p in popens:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    for p in popens:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    time.sleep(1)
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(marker in part for part in proc.info["cmdline"] or []):
                proc.kill()


def wait_for_nodes(address: str, n: int, env: dict, timeout: float = 120) -> None:
    probe = ("import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
             "print(sum(1 for x in ray.nodes() if x['Alive']))")
    deadline = time.time() + timeout
    alive = 0
    while time.time() < deadline:
        out = subprocess.run([sys.executable, "-c", probe, address], env=env, capture_output=True, text=True,
                             timeout=60)
        if out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == [str(n)]:
            return
        alive = out.stdout.strip()[-20:]
        time.sleep(2)
    raise AssertionError(f"the cluster did not reach {n} alive nodes (last: {alive!r})")


@pytest.fixture
def two_node_cluster():
    """Head and worker node, 1 CPU each, on 127.0.0.1; yields (address, env for clients); torn down after."""
    tmp = tempfile.mkdtemp(prefix="tfc", dir="/tmp")  # short: Ray's unix sockets live under it
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
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
            env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        started.append(head)
        address = f"127.0.0.1:{gcs}"
        wait_for_nodes(address, 1, env)
        worker = subprocess.Popen(
            ["ray", "start", f"--address={address}", *common, *node_ports(1, 23400)],
            env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        started.append(worker)
        wait_for_nodes(address, 2, env)
        yield address, env
    finally:
        stop_processes(started, tmp)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.timeout(900)
def test_pretrain_runs_on_a_two_node_cluster_one_worker_per_node(project, two_node_cluster):
    address, env = two_node_cluster
    env = {**env, "RAY_ADDRESS": address}
    cli = [sys.executable, "-m", "pipeline.cli"]
    out = subprocess.run([*cli, "prepare", "-S", "data.limit_train=256"], cwd=project, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    out = subprocess.run(
        [*cli, "pretrain", "-S", "ray.num_workers=2", "-S", "ray.cpus_per_worker=1", "-S", "train.epochs=2",
         "-S", "train.batch_size=64", "-S", "model.embed_dim=16"],
        cwd=project, env=env, capture_output=True, text=True, timeout=600)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    # 1 CPU per node: one worker on each (a local Ray started by mistake would have one node)
    assert "[pretrain] 2 worker(s) on 2 node(s)" in log, log
    with open(project / "plots/pretrain.csv") as f:
        assert [int(r["epoch"]) for r in csv.DictReader(f)] == [1, 2]
    assert json.loads((project / "metrics/pretrain.json").read_text())["epochs"] == 2
