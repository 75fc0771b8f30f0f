"""The resource model (pipeline/config/resources.py) against hand-computed cases, and on the live Ray."""

from __future__ import annotations

import pytest

from pipeline.config.resources import TrialShape, infeasible, places, trials_at_once

CPU2 = [{"CPU": 2.0}]  # this machine: one node, 2 CPUs, no GPU
GPU_NODE = {"CPU": 4.0, "GPU": 1.0}


# ------------------------------------------------------------------------------------------------- one run
@pytest.mark.parametrize("nodes, shape, fits", [
    (CPU2, TrialShape(2, 1.0), True),  # 2 CPUs hold two 1-CPU workers
    (CPU2, TrialShape(2, 1.0, trial_cpu=0.25), False),  # plus the trial function's 0.25: 2.25 > 2
    (CPU2, TrialShape(2, 0.5, trial_cpu=0.25), True),
    ([{"CPU": 3.0}] * 2, TrialShape(3, 2.0), False),  # 6 CPUs in all, but a 2-CPU worker per node: two, not three
    ([{"CPU": 3.0}] * 3, TrialShape(3, 2.0), True),
    ([{"CPU": 64.0}], TrialShape(1, 1.0, gpu=True), False),  # no GPU anywhere
    ([GPU_NODE] * 4, TrialShape(4, 4.0, gpu=True), True),  # each worker fills a GPU node
    ([GPU_NODE] * 4, TrialShape(4, 4.0, gpu=True, trial_cpu=0.25), False),  # and leaves no CPU for the function
    ([GPU_NODE] * 4 + [{"CPU": 1.0}], TrialShape(4, 4.0, gpu=True, trial_cpu=0.25), True),  # a CPU node holds it
])
def test_places_one_run_bundle_by_bundle(nodes, shape, fits):
    assert places(nodes, shape) is fits


@pytest.mark.parametrize("workers, cpus", [(0, 1.0), (1, 0.0)], ids=["no-worker", "no-cpu"])
def test_bad_shapes_are_refused(workers, cpus):
    with pytest.raises(ValueError):
        TrialShape(workers, cpus)


# ---------------------------------------------------------------------------------------------- infeasible
@pytest.mark.parametrize("kwargs, says", [
    # ray.num_workers=16 and ray.cpus_per_worker=64 through the CLI: tests/stages/test_cluster_errors.py
    # a GPU run where no GPU exists
    ({"num_workers": 1, "cpus_per_worker": 1.0, "gpu": True},
     ["1 GPU each (ray.use_gpu)", "No node has a GPU"]),
    # a sweep trial names the sweep's key
    ({"num_workers": 2, "cpus_per_worker": 1.0, "trial_cpu": 0.25, "cpu_key": "sweep.cpus_per_worker"},
     ["a Tune trial", "(sweep.cpus_per_worker)", "plus 0.25 CPUs for the trial itself", "2.25 CPUs"]),
    # a tables row's workers are ray.cpus_per_worker's
    ({"num_workers": 1, "cpus_per_worker": 2.0, "trial_cpu": 0.25},
     ["a Tune trial", "2 CPUs each (ray.cpus_per_worker)", "plus 0.25 CPUs for the trial itself", "2.25 CPUs",
      "lower ray.num_workers or ray.cpus_per_worker"]),
])
def test_infeasible_on_a_2_cpu_machine(kwargs, says):
    message = infeasible(CPU2, TrialShape(**kwargs))
    assert message is not None and "\n" not in message
    for s in says:
        assert s in message, (s, message)


def test_infeasible_by_fragmentation_and_feasible_cases():
    two = [{"CPU": 3.0}] * 2  # 6 CPUs in all, but three 2-CPU workers fit only two nodes
    assert "do not pack" in infeasible(two, TrialShape(3, 2.0))
    assert "on 2 nodes (largest node: 3 CPUs, 0 GPUs)" in infeasible(two, TrialShape(3, 2.0))
    assert infeasible(two, TrialShape(2, 2.0)) is None
    assert infeasible(CPU2, TrialShape(2, 1.0)) is None
    # the rehearsal's local Ray declaring 1 GPU, the GPU preset's 2 workers of a GPU each
    one_gpu = infeasible([{"CPU": 2.0, "GPU": 1.0}], TrialShape(2, 0.25, gpu=True))
    assert "2 GPUs in all" in one_gpu and "1 GPU on 1 node" in one_gpu and "more than the whole cluster" in one_gpu


# ------------------------------------------------------------------------------------------ trials at once
@pytest.mark.parametrize("totals, shape, cap, expected", [
    ({"CPU": 2.0}, TrialShape(1, 0.5, trial_cpu=0.25), 8, 2),  # 0.75 a trial: 2 / 0.75 = 2.7
    ({"CPU": 2.0}, TrialShape(2, 0.5, trial_cpu=0.25), 8, 1),  # 1.25 a trial
    ({"CPU": 64.0}, TrialShape(2, 0.5, trial_cpu=0.25), 100, 51),
    ({"CPU": 64.0}, TrialShape(2, 0.5, trial_cpu=0.25), 8, 8),  # never more than the trials there are
    ({"CPU": 0.5}, TrialShape(1, 0.5, trial_cpu=0.25), 8, 1),  # never 0: the trial waits for the cluster to grow
    # GPUs bound it, not CPUs: 2 workers of (0.5 CPU, 1 GPU) per trial, 64 CPUs and 4 GPUs
    ({"CPU": 64.0, "GPU": 4.0}, TrialShape(2, 0.5, gpu=True, trial_cpu=0.25), 100, 2),
    # the GPU rehearsal: 2 CPUs and 4 declared GPUs, 2 workers of (0.25 CPU, 1 GPU) + 0.25: both bound it at 2
    ({"CPU": 2.0, "GPU": 4.0}, TrialShape(2, 0.25, gpu=True, trial_cpu=0.25), 4, 2),
    # a cold autoscaling cluster (no GPU node yet): 1, until sweep.max_concurrent_trials says otherwise
    ({"CPU": 2.0}, TrialShape(4, 3.0, gpu=True, trial_cpu=0.25), 240, 1),
])
def test_trials_at_once_by_the_limiting_resource(totals, shape, cap, expected):
    assert trials_at_once(totals, shape, cap) == expected


# ------------------------------------------------------------------------------------------------ live Ray
@pytest.mark.slow
def test_the_live_nodes_are_this_sessions_ray(ray_session):
    from pipeline.runs.cluster import live_nodes

    nodes = live_nodes()
    assert nodes == [{"CPU": 2.0, "GPU": 0.0}]
    assert "16 workers (ray.num_workers)" in infeasible(nodes, TrialShape(16, 1.0))
    assert trials_at_once(ray_session.cluster_resources(), TrialShape(1, 0.5, trial_cpu=0.25), 8) == 2
