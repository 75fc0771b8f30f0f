"""The cluster resource model (pipeline/runs/resources.py) against hand-computed cases, and on the live Ray."""

from __future__ import annotations

import pytest

from pipeline.runs.resources import (
    UNBOUNDED_NODES,
    NodeType,
    TrialShape,
    cluster_from_kuberay_yaml,
    cluster_from_launcher_yaml,
    group_live_nodes,
    infeasible,
    merge_live,
    nodes_from_kuberay,
    nodes_from_launcher_config,
    packing,
    trials_at_once,
)

CPU2 = [NodeType("local", {"CPU": 2})]  # this machine: one node, 2 CPUs, no GPU
GPU_NODE = {"CPU": 4, "GPU": 1}


# ------------------------------------------------------------------------------------------------- packing
@pytest.mark.parametrize("nodes, shape, expected", [
    # 2 CPUs, one 1-CPU worker per run: 2 runs
    (CPU2, TrialShape(1, 1.0), 2),
    # plus the trial function's 0.25: 1.25 per trial, a second one needs 2.5
    (CPU2, TrialShape(1, 1.0, trial_cpu=0.25), 1),
    # 0.5-CPU workers, 2 per trial + 0.25: 1.25 per trial -> 1 (2.5 > 2)
    (CPU2, TrialShape(2, 0.5, trial_cpu=0.25), 1),
    # fragmentation: 3 nodes of 3 CPUs, 2-CPU workers; totals say 9 // 2 = 4, but one per node fits: 3
    ([NodeType("n", {"CPU": 3}, 3)], TrialShape(1, 2.0), 3),
    # GPUs bound: 64 CPUs would hold 8 trials of 2 x 4 CPUs, 2 GPUs hold 1
    ([NodeType("n", {"CPU": 64, "GPU": 2})], TrialShape(2, 4.0, gpu=True), 1),
    # a big CPU-only node runs no GPU trial (the old CPU-only count launched 5 here)
    ([NodeType("big", {"CPU": 96})], TrialShape(4, 4.0, gpu=True, trial_cpu=0.25), 0),
    # the same trial without GPUs: 96 // 16.25 = 5
    ([NodeType("big", {"CPU": 96})], TrialShape(4, 4.0, trial_cpu=0.25), 5),
    # 8 GPU nodes of 4 CPUs, 4 workers of 3 CPUs + the trial's 0.25 on the spare CPU of a GPU node: 2
    ([NodeType("gpu", GPU_NODE, 8)], TrialShape(4, 3.0, gpu=True, trial_cpu=0.25), 2),
])
def test_trials_at_once(nodes, shape, expected):
    assert trials_at_once(nodes, shape) == expected


def test_cap_bounds_the_count():
    nodes = [NodeType("n", {"CPU": 100})]
    assert trials_at_once(nodes, TrialShape(1, 1.0)) == 100
    assert trials_at_once(nodes, TrialShape(1, 1.0), cap=5) == 5


def test_now_versus_at_max():
    nodes = [NodeType("gpu", GPU_NODE, count=2, max_count=8)]
    shape = TrialShape(4, 4.0, gpu=True)
    assert trials_at_once(nodes, shape, at_max=False) == 0  # 2 GPUs now, a trial needs 4
    assert trials_at_once(nodes, shape) == 2  # 8 GPUs at the autoscaler's maximum


def test_trial_function_goes_to_the_gpu_less_node_first():
    head, gpu = NodeType("head", {"CPU": 1}), NodeType("gpu", GPU_NODE, 4)
    p = packing([gpu, head], TrialShape(4, 3.0, gpu=True, trial_cpu=0.25))  # GPU nodes listed first on purpose
    assert p.trials == 1
    assert p.nodes_used == {"gpu": 4, "head": 1}
    # a head without Ray CPUs: the trial function takes a GPU node's spare CPU instead, the head stays unused
    p = packing([NodeType("head", {"CPU": 0}), gpu], TrialShape(4, 3.0, gpu=True, trial_cpu=0.25))
    assert (p.trials, p.types_used) == (1, {"gpu"})


def test_unbounded_group_needs_a_cap():
    nodes = [NodeType("gpu", GPU_NODE, 0, unbounded=True)]
    assert nodes[0].max_count == UNBOUNDED_NODES
    with pytest.raises(ValueError, match="cap"):
        trials_at_once(nodes, TrialShape(4, 4.0, gpu=True))
    assert trials_at_once(nodes, TrialShape(4, 4.0, gpu=True), cap=240) == 240


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError):
        NodeType("n", {"CPU": 1}, count=3, max_count=2)
    with pytest.raises(ValueError):
        TrialShape(0, 1.0)
    with pytest.raises(ValueError):
        TrialShape(1, 0.0)


# ---------------------------------------------------------------------------------------------- infeasible
@pytest.mark.parametrize("kwargs, says", [
    # `transfusion pretrain -S ray.num_workers=16` on this machine (ray.cpus_per_worker 1.0 by default)
    ({"num_workers": 16, "cpus_per_worker": 1.0},
     ["16 workers (ray.num_workers)", "1 CPU each (ray.cpus_per_worker)", "ray.use_gpu", "16 CPUs",
      "2 CPUs and 0 GPUs on 1 node", "largest node: 2 CPUs", "more than the whole cluster has"]),
    # `transfusion pretrain -S ray.cpus_per_worker=64`
    ({"num_workers": 1, "cpus_per_worker": 64.0},
     ["1 worker (ray.num_workers)", "64 CPUs each (ray.cpus_per_worker)", "2 CPUs and 0 GPUs on 1 node",
      "no node has 64 CPUs", "lower ray.cpus_per_worker"]),
    # a GPU run where no GPU exists
    ({"num_workers": 1, "cpus_per_worker": 1.0, "gpu": True},
     ["1 GPU each (ray.use_gpu)", "No node has a GPU"]),
    # a sweep trial names the sweep's key
    ({"num_workers": 2, "cpus_per_worker": 1.0, "trial_cpu": 0.25},
     ["a sweep trial", "(sweep.cpus_per_worker)", "plus 0.25 CPUs for the trial itself", "2.25 CPUs"]),
])
def test_infeasible_on_a_2_cpu_machine(kwargs, says):
    message = infeasible(CPU2, **kwargs)
    assert message is not None and "\n" not in message
    for s in says:
        assert s in message, (s, message)


def test_infeasible_by_fragmentation_and_feasible_cases():
    two = [NodeType("n", {"CPU": 3}, 2)]  # 6 CPUs in all, but three 2-CPU workers fit only two nodes
    assert "do not pack" in infeasible(two, TrialShape(3, 2.0))
    assert infeasible(two, TrialShape(2, 2.0)) is None
    assert infeasible(CPU2, num_workers=2, cpus_per_worker=1.0) is None
    # what the autoscaler can reach counts: no GPU node now, 8 at most
    assert infeasible([NodeType("gpu", GPU_NODE, 0, 8)], TrialShape(4, 4.0, gpu=True, trial_cpu=0.25)) is None
    with pytest.raises(TypeError):
        infeasible(CPU2)


# ------------------------------------------------------------------------------------------------- recipes
def test_launcher_config_resources_and_counts():
    cfg = {"max_workers": 8, "head_node_type": "head", "available_node_types": {
        "head": {"resources": {"CPU": 2}, "node_config": {"InstanceType": "m6i.xlarge"}},
        "gpu": {"resources": {}, "min_workers": 1, "max_workers": 20, "node_config": {"InstanceType": "g5.xlarge"}},
        "big": {"resources": {"CPU": 3}, "node_config": {"InstanceType": "g5.2xlarge"}},  # max: the global 8
        "custom": {"resources": {"CPU": 16, "GPU": 2}, "max_workers": 2, "node_config": {"InstanceType": "x9.odd"}},
    }}
    nodes = {t.name: t for t in nodes_from_launcher_config(cfg)}
    assert (nodes["head"].resources, nodes["head"].count, nodes["head"].max_count) == ({"CPU": 2.0}, 1, 1)
    assert (nodes["gpu"].resources, nodes["gpu"].count, nodes["gpu"].max_count) == ({"CPU": 4.0, "GPU": 1.0}, 1, 8)
    assert (nodes["big"].resources, nodes["big"].max_count) == ({"CPU": 3.0, "GPU": 1.0}, 8)
    assert (nodes["custom"].resources, nodes["custom"].max_count) == ({"CPU": 16.0, "GPU": 2.0}, 2)
    cfg["available_node_types"]["bad"] = {"resources": {}, "node_config": {"InstanceType": "x9.odd"}}
    with pytest.raises(ValueError, match="x9.odd"):
        nodes_from_launcher_config(cfg)


def _group(name, params=None, limits=None, requests=None, **extra):
    res = {k: v for k, v in (("limits", limits), ("requests", requests)) if v}
    return {"groupName": name, "rayStartParams": params or {},
            "template": {"spec": {"containers": [{"name": "ray", "resources": res}]}}, **extra}


def test_kuberay_resources_and_counts():
    cluster = {"spec": {
        "headGroupSpec": _group("head", {"num-cpus": "2"}, {"cpu": "4"}),
        "workerGroupSpecs": [
            _group("a", {}, {"cpu": "8", "nvidia.com/gpu": "1"}, replicas=2, minReplicas=0, maxReplicas=8),
            _group("b", {"num-cpus": "3", "num-gpus": "2"}, {"cpu": "8"}, replicas=1, maxReplicas=2),
            _group("c", {}, None, {"cpu": "1500m"}, replicas=1, maxReplicas=3, numOfHosts=2),  # requests, rounded up
            _group("d", {}, {"cpu": "8"}, replicas=0, maxReplicas=1, resources={"CPU": "5", "GPU": "1"}),
        ]}}
    got = {t.name: (t.resources, t.count, t.max_count) for t in nodes_from_kuberay(cluster)}
    assert got == {"head": ({"CPU": 2.0}, 1, 1), "a": ({"CPU": 8.0, "GPU": 1.0}, 2, 8),
                   "b": ({"CPU": 3.0, "GPU": 2.0}, 1, 2), "c": ({"CPU": 2.0}, 2, 6),
                   "d": ({"CPU": 5.0, "GPU": 1.0}, 0, 1)}


# the recipes as they were before issue 10, with the preset's old trial: 0.25 + 4 x {CPU 4, GPU 1}
OLD_AWS = """
max_workers: 8
head_node_type: head
available_node_types:
  head: {resources: {CPU: 0}, node_config: {InstanceType: m6i.xlarge}}
  gpu_worker: {min_workers: 0, max_workers: 8, resources: {}, node_config: {InstanceType: g5.xlarge}}
"""
OLD_KUBERAY = """
apiVersion: ray.io/v1
kind: RayCluster
metadata: {name: transfusion}
spec:
  headGroupSpec:
    rayStartParams: {num-cpus: "0"}
    template: {spec: {containers: [{name: ray-head, resources: {limits: {cpu: "4", memory: 16Gi}}}]}}
  workerGroupSpecs:
    - groupName: gpu
      replicas: 2
      minReplicas: 0
      maxReplicas: 8
      rayStartParams: {}
      template: {spec: {containers: [{name: w, resources: {limits: {cpu: "8", nvidia.com/gpu: "1"}}}]}}
"""
OLD_TRIAL = TrialShape(4, 4.0, gpu=True, trial_cpu=0.25)


def test_regression_old_aws_recipe_takes_5_nodes_per_trial(tmp_path):
    path = tmp_path / "aws.yaml"
    path.write_text(OLD_AWS)
    nodes = cluster_from_launcher_yaml(path)
    # the head has no Ray CPU: the trial's 0.25 CPU takes a fifth g5.xlarge (each worker fills one: 4 vCPUs)
    assert packing(nodes, OLD_TRIAL, cap=1).nodes_used == {"head": 0, "gpu_worker": 5}
    assert trials_at_once(nodes, OLD_TRIAL) == 1  # 2 trials would need 10 of the 8 nodes


def test_regression_old_kuberay_recipe_ran_one_trial_at_a_time(tmp_path):
    path = tmp_path / "kuberay.yaml"
    path.write_text("kind: PersistentVolumeClaim\n---\n" + OLD_KUBERAY)
    nodes = cluster_from_kuberay_yaml(path)
    # at start: 2 pods x (8 CPUs, 1 GPU); the old count, max(1, 16 CPUs // 16.25), said 1; by packing not even
    # one trial fits now (2 GPUs of 4), so "1" only came from the clamp; the autoscaler's 8 pods hold 2 trials
    assert trials_at_once(nodes, OLD_TRIAL, at_max=False) == 0
    p = packing(nodes, OLD_TRIAL)
    assert p.trials == 2
    assert p.types_used == {"gpu"}  # the head (num-cpus 0) was never used


# ------------------------------------------------------------------------------------------------ live Ray
def test_group_and_merge_live_nodes():
    raw = [{"Alive": True, "Resources": {"CPU": 2.0, "memory": 1e9, "node:10.0.0.1": 1.0}},
           {"Alive": True, "Resources": {"CPU": 3.0, "GPU": 1.0, "accelerator_type:A10G": 1.0}},
           {"Alive": True, "Resources": {"CPU": 3.0, "GPU": 1.0}},
           {"Alive": False, "Resources": {"CPU": 3.0, "GPU": 1.0}}]
    live = group_live_nodes(raw)
    assert sorted((t.resources["CPU"], t.get("GPU"), t.count, t.max_count) for t in live) == [
        (2.0, 0.0, 1, 1), (3.0, 1.0, 2, 2)]
    merged = {t.name: (t.count, t.max_count) for t in merge_live(live, [NodeType("gpu", {"CPU": 3, "GPU": 1}, 0, 16)])}
    assert merged["gpu"] == (2, 16)  # the config's maximum, the live count
    assert sorted(merged.values()) == [(1, 1), (2, 16)]  # the head, absent from the config, kept as it is


@pytest.fixture
def cluster_config(ray_session):
    """Publish a ClusterConfig in the GCS, as a managed autoscaler does; removed again after the test."""
    from ray.core.generated import autoscaler_pb2

    gcs = ray_session._private.worker.global_worker.gcs_client

    def publish(groups):
        config = autoscaler_pb2.ClusterConfig()
        for name, resources, max_count in groups:
            g = config.node_group_configs.add()
            g.name, g.max_count = name, max_count
            for k, v in resources.items():
                g.resources[k] = v
        gcs.report_cluster_config(config.SerializeToString())

    yield publish
    gcs.report_cluster_config(autoscaler_pb2.ClusterConfig().SerializeToString())
    assert ray_session._private.state.state.get_cluster_config() is None


@pytest.mark.slow
def test_cluster_from_ray_live_nodes(ray_session):
    from pipeline.runs.resources import autoscaler_limits, cluster_from_ray

    nodes = cluster_from_ray()
    assert [(t.resources, t.count, t.max_count) for t in nodes] == [({"CPU": 2.0}, 1, 1)]
    assert autoscaler_limits() == ([], "live nodes")
    message = infeasible(nodes, num_workers=16, cpus_per_worker=1.0)
    assert "16 workers (ray.num_workers)" in message and "2 CPUs and 0 GPUs on 1 node" in message


@pytest.mark.slow
def test_cluster_from_ray_reads_the_autoscalers_maximum(cluster_config):
    from pipeline.runs.resources import autoscaler_limits, cluster_from_ray

    cluster_config([("head", {"CPU": 2}, 1), ("gpu", {"CPU": 3, "GPU": 1}, 16), ("spot", {"CPU": 8}, -1)])
    assert autoscaler_limits()[1] == "gcs-cluster-config"
    nodes = {t.name: t for t in cluster_from_ray()}
    assert (nodes["head"].count, nodes["head"].max_count) == (1, 1)  # the live 2-CPU node is the head group
    assert (nodes["gpu"].count, nodes["gpu"].max_count) == (0, 16)
    assert nodes["spot"].unbounded
    shape = TrialShape(4, 3.0, gpu=True, trial_cpu=0.25)
    assert trials_at_once([nodes["head"], nodes["gpu"]], shape) == 4
    assert infeasible(list(nodes.values()), shape) is None
