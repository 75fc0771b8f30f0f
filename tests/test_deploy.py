"""The example cluster configs the README points at stay valid YAML with the structure their tools expect."""

from __future__ import annotations

import pytest
import yaml

from tests.conftest import ROOT


def test_cluster_launcher_config():
    cfg = yaml.safe_load((ROOT / "deploy/ray-cluster-aws.yaml").read_text())
    assert cfg["head_node_type"] in cfg["available_node_types"]
    assert cfg["max_workers"] >= max(t.get("max_workers", 0) for t in cfg["available_node_types"].values())
    assert any("/mnt/shared" in c for c in cfg["setup_commands"])  # shared storage on every node
    assert any("pip install" in c and "-e ." in c for c in cfg["setup_commands"])
    assert cfg["head_start_ray_commands"][-1].startswith("ray start --head")


def test_kuberay_cluster_mounts_one_shared_volume_everywhere():
    docs = list(yaml.safe_load_all((ROOT / "deploy/kuberay-raycluster.yaml").read_text()))
    pvc = next(d for d in docs if d["kind"] == "PersistentVolumeClaim")
    cluster = next(d for d in docs if d["kind"] == "RayCluster")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    pods = [cluster["spec"]["headGroupSpec"]["template"]] + [g["template"] for g in cluster["spec"]["workerGroupSpecs"]]
    for pod in pods:
        claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["spec"]["volumes"]]
        assert claims == [pvc["metadata"]["name"]]
        mounts = [m["mountPath"] for c in pod["spec"]["containers"] for m in c["volumeMounts"]]
        assert mounts == ["/mnt/shared"]


# ---------------------------------------------------------------------------------- recipes x the sweep preset
# A preset trial asks for its function's {CPU: 0.25} (pipeline.sweep.TRIAL_CPU) and ray.num_workers = 4 workers of
# {CPU: sweep.cpus_per_worker = 3, GPU: 1}. Both recipes give the head 2 Ray CPUs (8 trial functions) and GPU nodes
# of {CPU: 3, GPU: 1} (one worker each, no CPU left over for a trial function), 16 of them at most: 16 GPUs / 4 per
# trial = 4 trials at once, their functions on the head (1 of its 2 CPUs), every GPU node busy. At start the
# launcher has no GPU worker (min_workers 0): 0 trials until the autoscaler adds nodes; KubeRay starts 4 pods
# (replicas): 1 trial.
def _preset_shapes():
    from pipeline.config import load_params
    from pipeline.resources import TrialShape
    from pipeline.sweep import TRIAL_CPU

    p = load_params(ROOT / "presets/cluster-sweep.yaml")
    sweep = TrialShape(p.ray.num_workers, p.sweep.cpus_per_worker, p.ray.use_gpu, TRIAL_CPU)
    pretrain = TrialShape(p.ray.num_workers, p.ray.cpus_per_worker, p.ray.use_gpu)
    return sweep, pretrain


def _recipe(name):
    from pipeline.resources import cluster_from_kuberay_yaml, cluster_from_launcher_yaml

    if name == "aws":
        return cluster_from_launcher_yaml(ROOT / "deploy/ray-cluster-aws.yaml")
    return cluster_from_kuberay_yaml(ROOT / "deploy/kuberay-raycluster.yaml")


@pytest.mark.parametrize("recipe, gpu_type, at_start", [("aws", "gpu_worker", 0), ("kuberay", "gpu", 1)])
def test_recipe_runs_the_preset_several_trials_at_once_on_every_node_type(recipe, gpu_type, at_start):
    from pipeline.resources import infeasible, packing, trials_at_once

    nodes = _recipe(recipe)
    sweep, pretrain = _preset_shapes()
    assert sweep.num_workers == 4 and sweep.worker == {"CPU": 3.0, "GPU": 1.0} and sweep.trial_cpu == 0.25
    assert {t.name: (t.resources, t.max_count) for t in nodes} == {
        "head": ({"CPU": 2.0}, 1), gpu_type: ({"CPU": 3.0, "GPU": 1.0}, 16)}
    at_max = packing(nodes, sweep, cap=240)
    assert at_max.trials == 4
    assert at_max.nodes_used == {"head": 1, gpu_type: 16}  # every node type used, every GPU node busy
    assert packing(nodes, sweep, cap=1).nodes_used == {"head": 1, gpu_type: 4}  # a trial: 4 GPU nodes, not 5
    assert trials_at_once(nodes, sweep, at_max=False) == at_start
    # pretraining with the preset (no trial function) fits too, and a worker fits a GPU node exactly
    assert infeasible(nodes, pretrain) is None and trials_at_once(nodes, pretrain) == 4
    gpu_node = next(t for t in nodes if t.name == gpu_type)
    assert gpu_node.resources["CPU"] == pretrain.cpus_per_worker == sweep.cpus_per_worker


def test_recipes_leave_ray_a_cpu_on_gpu_nodes():
    """Ray's CPUs on a GPU node are fewer than the node's vCPUs (one left to Ray's own processes), and the head
    keeps vCPUs beyond its Ray CPUs for the DVC driver and the MLflow server."""
    from pipeline.resources import AWS_INSTANCES

    cfg = yaml.safe_load((ROOT / "deploy/ray-cluster-aws.yaml").read_text())
    for name, spec in cfg["available_node_types"].items():
        vcpus = AWS_INSTANCES[spec["node_config"]["InstanceType"]]["CPU"]
        assert spec["resources"]["CPU"] < vcpus, name
    cluster = next(d for d in yaml.safe_load_all((ROOT / "deploy/kuberay-raycluster.yaml").read_text())
                   if d["kind"] == "RayCluster")
    groups = [cluster["spec"]["headGroupSpec"]] + cluster["spec"]["workerGroupSpecs"]
    for g in groups:
        limit = float(g["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"])
        assert float(g["rayStartParams"]["num-cpus"]) < limit
