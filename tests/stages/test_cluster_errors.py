"""What a new user meets when the cluster cannot serve the run: a clear error and an exit code, never a hang.

Each case is the real CLI, as in the issue that found them: a request the cluster can never satisfy exits 2 before
Ray starts (for a local Ray) or before training; an unreachable RAY_ADDRESS and resources that never come free end
after their params-bounded wait with exit 1; a corrupt tracking store is one paragraph.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, invoke

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CPUS = len(os.sched_getaffinity(0))


def one_paragraph(output: str) -> str:
    (error,) = [line for line in output.splitlines() if line.startswith("Error: ")]
    assert "Traceback" not in output, output
    return error


@pytest.mark.parametrize(("overrides", "needles"), [
    (["-S", "ray.num_workers=16"], ["16 workers (ray.num_workers)", f"{CPUS} CPUs", "more than the whole cluster"]),
    (["-S", "ray.cpus_per_worker=64"], ["64 CPUs each (ray.cpus_per_worker)", "no node has 64 CPUs"]),
])
def test_a_request_this_machine_can_never_satisfy_exits_2_before_ray(prepared, ray_starts, monkeypatch, overrides,
                                                                      needles):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    result = invoke("pretrain", *overrides)
    assert result.exit_code == 2, result.output
    error = one_paragraph(result.output)
    for needle in needles:
        assert needle in error, error
    assert ray_starts == [] and not (prepared / "models").exists()


def test_a_sweep_trial_that_can_never_fit_exits_2_before_ray(prepared, ray_starts, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    result = invoke("sweep", "-S", f"sweep.cpus_per_worker={CPUS * 4}")
    assert result.exit_code == 2, result.output
    assert "sweep.cpus_per_worker" in one_paragraph(result.output)
    assert ray_starts == [] and not (prepared / "sweeps").exists()


def test_an_unreachable_ray_address_ends_after_the_connect_timeout(prepared):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RAY_ADDRESS": f"127.0.0.1:{port}"}
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "stages.cli", "pretrain", "-S", "ray.connect_timeout_s=3"],
                         cwd=prepared, env=env, capture_output=True, text=True, timeout=120)
    seconds = time.monotonic() - start
    assert out.returncode == 1, out.stdout + out.stderr
    error = one_paragraph(out.stderr)
    assert f"cannot reach the Ray cluster at 127.0.0.1:{port}" in error and "ray.connect_timeout_s" in error, error
    assert 3 <= seconds < 60, seconds  # the bound, plus the CLI's start-up
    assert not (prepared / "models").exists()


def test_a_garbage_tracking_store_is_one_paragraph(prepared):
    store = prepared / "mlflow.db"
    store.write_bytes(os.urandom(4096))
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{store}"}
    out = subprocess.run([sys.executable, "-m", "stages.cli", "pretrain"], cwd=prepared, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    error = one_paragraph(out.stderr)
    assert "is not an SQLite database" in error and str(store) in error, error
    assert not (prepared / "ray_results").exists()  # before Ray


def test_resources_that_never_come_free_end_after_the_resources_timeout(prepared, ray_session):
    from ray.util.placement_group import placement_group, remove_placement_group

    hog = placement_group([{"CPU": ray_session.cluster_resources()["CPU"]}])  # another job holds every CPU
    assert hog.wait(timeout_seconds=60)
    try:
        start = time.monotonic()
        result = invoke("pretrain", "-S", "ray.num_workers=2", "-S", "ray.resources_timeout_s=3",
                        "-S", "train.epochs=1")
        seconds = time.monotonic() - start
    finally:
        remove_placement_group(hog)
    assert result.exit_code == 1, result.output
    error = one_paragraph(result.output)
    assert re.search(r"waited [34] s for 2 worker\(s\) of .*, 3 s \(ray.resources_timeout_s\) of them with no node "
                     r"on its way", error), error
    assert seconds < 60, seconds
    assert not (prepared / "models").exists()


def test_the_resource_wait_goes_on_while_the_autoscaler_adds_nodes(ray_session):
    """A cold cluster: nodes are on their way for a while (instances boot, mount, install), so the wait goes on past
    ray.resources_timeout_s and says why; once nothing is pending it ends ray.resources_timeout_s later. A real
    placement group that cannot be placed; the autoscaler's answer is the stand-in (no autoscaler runs here)."""
    from pipeline.config.params import load_params
    from pipeline.runs.cluster import ClusterError, pending_nodes, wait_for_workers

    assert pending_nodes() == 0  # a local Ray has no autoscaler: nothing on its way
    params = load_params(ROOT / "params.yaml", ["ray.num_workers=1", "ray.cpus_per_worker=64",
                                                "ray.resources_timeout_s=1.5"])
    start = time.monotonic()
    lines: list[str] = []

    def pending() -> int:
        return 2 if time.monotonic() - start < 4.0 else 0

    with pytest.raises(ClusterError) as caught:
        wait_for_workers(params, gpu=False, pending=pending, poll_s=0.25, say=lines.append)
    seconds = time.monotonic() - start
    assert 4.0 + 1.5 <= seconds < 4.0 + 1.5 + 5, seconds  # past the pending nodes, then the timeout, no longer
    assert lines == ["[ray] waiting for 1 worker(s) of {'CPU': 64.0}: the autoscaler is adding 2 node(s) (0 s so "
                     "far)\n"]
    assert "1.5 s (ray.resources_timeout_s) of them with no node on its way" in str(caught.value)


@pytest.mark.parametrize("stage", ["pretrain", "sweep", "tables"])
def test_storage_under_a_regular_file_is_one_paragraph_before_ray(prepared, ray_starts, stage):
    project = prepared
    (project / "afile").write_text("not a directory")
    result = invoke(stage, "-S", "ray.storage_path=afile/runs")
    assert result.exit_code == 1, result.output
    assert result.output.strip() == (
        f"Error: ray.storage_path: {project / 'afile/runs'} cannot hold the run storage ({project / 'afile'} is a "
        "file, not a directory); point ray.storage_path at a directory this machine can write and, on a cluster, every "
        "node sees (an NFS/EFS mount or s3://bucket/prefix)")
    assert not ray_starts
