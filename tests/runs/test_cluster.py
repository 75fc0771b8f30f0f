"""The cluster helpers without a cluster: addresses, the GPU decision, Ray Train's failures in one paragraph."""

from __future__ import annotations

import pytest

from pipeline.config.params import load_params
from pipeline.config.resources import use_gpu
from pipeline.data.types import DatasetError
from pipeline.runs.cluster import host_port, local_nodes
from pipeline.runs.job import error_reason
from tests.conftest import ROOT


def params(*overrides: str):
    return load_params(ROOT / "params.yaml", overrides)


@pytest.mark.parametrize(("address", "expected"), [
    ("127.0.0.1:6379", ("127.0.0.1", 6379)), ("ray://head.example.com:10001", ("head.example.com", 10001)),
    ("auto", None), ("local", None), ("head-without-port", None)])
def test_explicit_addresses_are_probed_others_left_to_ray(address, expected):
    assert host_port(address) == expected


@pytest.mark.parametrize(("overrides", "gpus", "expected"), [
    ((), 0, False),                                           # auto on a CPU-only cluster
    ((), 8, True),                                            # auto: the *cluster's* GPUs, not the driver's
    (("train.device=cpu",), 8, False),
    (("train.device=cuda",), 0, True),                        # asked for: check_request then says none exist
    (("ray.use_gpu=true",), 0, True),
])
def test_gpu_training_is_decided_from_the_cluster(overrides, gpus, expected):
    assert use_gpu(params(*overrides), gpus) is expected


def test_the_local_node_is_this_machine():
    import os

    (node,) = local_nodes()
    assert node["CPU"] == len(os.sched_getaffinity(0)) and node["GPU"] >= 0


def test_worker_failures_become_one_line_per_rank():
    from ray.train import ControllerError, WorkerGroupError

    exc = WorkerGroupError("Rank 1 Error Snippet: ...\nTraceback ...", {
        1: DatasetError("node 0123456789ab (b) cannot see the prepared data at /x"),
        0: RuntimeError("first line\nlast line"),
    })
    # another library's error is named by its type; ours (DatasetError) carry a message written for the user, as is
    one_line = "rank 0: RuntimeError: first line; rank 1: node 0123456789ab (b) cannot see the prepared data at /x"
    assert error_reason(exc) == one_line
    assert error_reason(ControllerError(ValueError("scheduling failed"))) == "ValueError: scheduling failed"
    trial = RuntimeError("the trial's Ray Train run failed")  # a trial of several workers: its run's ranks
    trial.__cause__ = exc
    assert error_reason(trial) == one_line


@pytest.mark.parametrize(("overrides", "env", "cpus", "expected"), [
    ((), None, 2, 2.0),                               # the default: a lone pretraining takes every core here
    (("ray.num_workers=2",), None, 2, 1.0),           # two workers share them
    (("ray.num_workers=4",), None, 3, 0.75),          # in quarters, rounded down
    (("ray.num_workers=16",), None, 2, 0.25),         # never below a quarter (the preflight then refuses 16 x 0.25)
    (("ray.address=local",), None, 8, 8.0),
    (("ray.address=10.0.0.1:6379",), None, 8, 1.0),   # a cluster: Ray Train's default
    ((), "auto", 8, 1.0),                             # RAY_ADDRESS names one too
    (("ray.cpus_per_worker=0.5",), None, 8, 0.5),     # a number is kept
])
def test_worker_cpus_when_null(monkeypatch, overrides, env, cpus, expected):
    from pipeline.runs import cluster

    monkeypatch.setattr(cluster, "usable_cpus", lambda: cpus)
    if env is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", env)
    params = load_params(ROOT / "params.yaml", list(overrides))
    assert params.ray.cpus_per_worker == (0.5 if "ray.cpus_per_worker=0.5" in overrides else None)
    assert cluster.with_worker_cpus(params).ray.cpus_per_worker == expected


@pytest.mark.parametrize(("workers", "cpus", "expected", "threads"), [
    (1, 2, 1.75, 2),     # a tables row on this machine: 1.75 + the trial's 0.25 = every core, 2 torch threads
    (2, 2, 0.75, 1),     # two workers: (2 - 0.25) / 2 in quarters
    (1, 16, 15.75, 16),  # a GPU machine's 16 cores
])
def test_worker_cpus_of_a_tune_trial_leave_the_trials_own(monkeypatch, workers, cpus, expected, threads):
    from pipeline.config.ray import TRIAL_CPU, torch_threads
    from pipeline.config.resources import TrialShape, infeasible
    from pipeline.runs import cluster

    monkeypatch.setattr(cluster, "usable_cpus", lambda: cpus)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    params = load_params(ROOT / "params.yaml", [f"ray.num_workers={workers}"])
    each = cluster.with_worker_cpus(params, TRIAL_CPU).ray.cpus_per_worker
    assert each == expected and torch_threads(each) == threads
    assert infeasible([{"CPU": float(cpus)}], TrialShape(workers, each, trial_cpu=TRIAL_CPU)) is None  # it fits
    # without the trial's share it would not: what `transfusion tables` did with ray.cpus_per_worker: null
    assert infeasible([{"CPU": float(cpus)}], TrialShape(workers, cluster.with_worker_cpus(params).ray.cpus_per_worker,
                                                         trial_cpu=TRIAL_CPU)) is not None
