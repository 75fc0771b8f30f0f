"""The example cluster configs the README points at stay valid YAML with the structure their tools expect."""

from __future__ import annotations

import pytest
import yaml

from tests.conftest import ROOT

AWS = yaml.safe_load((ROOT / "deploy/ray-cluster-aws.yaml").read_text())  # the cluster launcher's config
KUBERAY = {d["kind"]: d for d in yaml.safe_load_all((ROOT / "deploy/kuberay-raycluster.yaml").read_text())}


def test_cluster_launcher_config():
    assert AWS["head_node_type"] in AWS["available_node_types"]
    assert AWS["max_workers"] >= max(t.get("max_workers", 0) for t in AWS["available_node_types"].values())
    assert any("/mnt/shared" in c for c in AWS["setup_commands"])  # shared storage on every node
    assert any("pip install" in c and "-e ." in c for c in AWS["setup_commands"])
    assert AWS["head_start_ray_commands"][-1].startswith("ray start --head")


def test_kuberay_cluster_mounts_one_shared_volume_everywhere():
    pvc, cluster = KUBERAY["PersistentVolumeClaim"], KUBERAY["RayCluster"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    pods = [cluster["spec"]["headGroupSpec"]["template"]] + [g["template"] for g in cluster["spec"]["workerGroupSpecs"]]
    for pod in pods:
        claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["spec"]["volumes"]]
        assert claims == [pvc["metadata"]["name"]]
        mounts = [m["mountPath"] for c in pod["spec"]["containers"] for m in c["volumeMounts"]]
        assert mounts == ["/mnt/shared"]


# ---------------------------------------------------------------------------------- recipes x the sweep preset
# A preset trial asks for its function's {CPU: 0.25} (pipeline.config.ray.TRIAL_CPU) and ray.num_workers = 4 workers of
# {CPU: sweep.cpus_per_worker = 3, GPU: 1}. Both recipes give the head 2 Ray CPUs (8 trial functions) and GPU nodes
# of {CPU: 3, GPU: 1} (one worker each, no CPU left over for a trial function), 16 of them at most: 16 GPUs / 4 per
# trial = 4 trials at once, the preset's sweep.max_concurrent_trials (Ray cannot say how far an autoscaler may grow
# the cluster), their functions on the head (1 of its 2 CPUs), every GPU node busy.
AWS_VCPUS = {"m6i.xlarge": 4, "g5.xlarge": 4}  # the recipe's instance types (AWS's instance type pages)


def _recipe(name):
    """(head's Ray CPUs, head's vCPUs), (GPU node's Ray CPUs, its GPUs, its vCPUs, its maximum count)."""
    if name == "aws":
        types = AWS["available_node_types"]
        head, gpu = types[AWS["head_node_type"]], types["gpu_worker"]
        return ((head["resources"]["CPU"], AWS_VCPUS[head["node_config"]["InstanceType"]]),
                (gpu["resources"]["CPU"], gpu["resources"]["GPU"], AWS_VCPUS[gpu["node_config"]["InstanceType"]],
                 min(gpu["max_workers"], AWS["max_workers"])))
    head, (gpu,) = KUBERAY["RayCluster"]["spec"]["headGroupSpec"], KUBERAY["RayCluster"]["spec"]["workerGroupSpecs"]

    def limits(group):
        return group["template"]["spec"]["containers"][0]["resources"]["limits"]

    return ((float(head["rayStartParams"]["num-cpus"]), float(limits(head)["cpu"])),
            (float(gpu["rayStartParams"]["num-cpus"]), float(limits(gpu)["nvidia.com/gpu"]), float(limits(gpu)["cpu"]),
             gpu["maxReplicas"] * gpu.get("numOfHosts", 1)))


@pytest.mark.parametrize("recipe", ["aws", "kuberay"])
def test_recipe_runs_the_preset_trials_at_once_with_every_gpu_node_busy(recipe):
    from pipeline.config.params import load_params
    from pipeline.config.ray import TRIAL_CPU
    from pipeline.config.resources import TrialShape, infeasible

    (head_cpus, _), (node_cpus, node_gpus, _, most) = _recipe(recipe)
    p = load_params(ROOT / "presets/cluster-sweep.yaml")
    trial = TrialShape(p.ray.num_workers, p.sweep.cpus_per_worker, p.ray.use_gpu, TRIAL_CPU)
    assert trial.num_workers == 4 and trial.worker == {"CPU": 3.0, "GPU": 1.0}
    at_once = p.sweep.max_concurrent_trials
    assert at_once * trial.total("GPU") == most * node_gpus == 16  # every GPU node busy at the cluster's largest
    assert at_once * TRIAL_CPU <= head_cpus  # the trials' functions on the head
    assert node_cpus == trial.cpus_per_worker == p.ray.cpus_per_worker  # a worker fills a GPU node's Ray CPUs
    full = [{"CPU": head_cpus}] + [{"CPU": node_cpus, "GPU": node_gpus}] * most
    assert infeasible(full, trial) is None and infeasible(full, TrialShape(4, p.ray.cpus_per_worker, True)) is None
    tables = load_params(ROOT / "presets/paper-tables.yaml")  # one GPU worker a row: every row at once
    assert tables.ray.num_workers == 1 and tables.tables.max_concurrent_trials <= most * node_gpus


@pytest.mark.parametrize("recipe", ["aws", "kuberay"])
def test_recipes_leave_ray_a_cpu_on_gpu_nodes(recipe):
    """Ray's CPUs on a GPU node are fewer than the node's vCPUs (one left to Ray's own processes), and the head
    keeps vCPUs beyond its Ray CPUs for the DVC driver and the MLflow server."""
    (head_cpus, head_vcpus), (node_cpus, _, node_vcpus, _) = _recipe(recipe)
    assert head_cpus < head_vcpus and node_cpus < node_vcpus


# ---------------------------------------------------------------------------------- what a cluster needs to boot
def test_the_launcher_copies_only_the_code_to_every_node():
    """`file_mounts` rsyncs `.` to every node: the venv (GBs), data, stores and git's objects stay behind (they live on
    /mnt/shared or are rebuilt there), and .gitignore is honoured."""
    from fnmatch import fnmatch

    assert "." in AWS["file_mounts"].values()
    excluded = AWS["rsync_exclude"]
    heavy = [".venv", "data", "models", "mlflow.db", "mlartifacts", "mlruns", "ray_results", ".git", ".dvc/cache",
             "pipeline/__pycache__", "transfusion_pipeline.egg-info"]
    for path in heavy:
        assert any(fnmatch(path, pattern) for pattern in excluded), path
    for path in ("pipeline", "stages", "params.yaml", "dvc.yaml", "presets", "deploy", "pyproject.toml"):
        assert not any(fnmatch(path, pattern) for pattern in excluded), path  # the code goes
    assert AWS["rsync_filter"] == [".gitignore"]


def test_every_node_installs_the_tested_versions():
    """Nodes install with deploy/constraints.txt, exact pins of every package the project needs (Ray, torch and all
    beneath them), each within pyproject's range; CI installs with the same file, so the pins are what the tests ran."""
    import tomllib
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    from deploy.constraints import FILE, read

    pins = read(FILE)
    assert any("pip install" in c and "-c deploy/constraints.txt" in c for c in AWS["setup_commands"])
    assert "-c deploy/constraints.txt" in (ROOT / ".ci/run").read_text()
    assert "deploy/constraints.txt" in (ROOT / "deploy/kuberay-raycluster.yaml").read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for line in project["dependencies"]:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        assert name in pins, f"{name} is not pinned in {FILE.name}"
        assert req.specifier.contains(pins[name]), f"{name}=={pins[name]} is outside pyproject's {req.specifier}"
    for name in ("ray", "torch", "torchvision", "mlflow", "dvc", "numpy"):
        assert pins[canonicalize_name(name)].count(".") >= 1
    assert all(line.startswith("#") or "==" in line for line in FILE.read_text().splitlines() if line.strip())
    assert KUBERAY["RayCluster"]["spec"]["rayVersion"] == pins["ray"]  # KubeRay's operator speaks the nodes' Ray


def test_the_installed_versions_are_the_pinned_ones():
    """Under CI (`.ci/run` installs with it) the environment is exactly deploy/constraints.txt (`python
    deploy/constraints.py` rewrites it after a dependency change); elsewhere it may differ: skipped, naming them."""
    import os

    from deploy.constraints import FILE, closure, read

    installed, pins = closure(), read(FILE)
    diff = sorted(f"{k}: pinned {pins.get(k, '-')}, installed {installed.get(k, '-')}"
                  for k in set(installed) | set(pins) if installed.get(k) != pins.get(k))
    if diff and not os.environ.get("TRANSFUSION_CONSTRAINED"):
        pytest.skip(f"this environment differs from {FILE.name}: " + "; ".join(diff[:5]))
    assert diff == [], "; ".join(diff)


@pytest.mark.slow
def test_cluster_presets_wait_for_a_cold_start():
    """A preset asking for GPUs waits at least a cold start for its workers, the wait going on while the autoscaler
    adds nodes (pipeline.runs.cluster.wait_for_workers, tests/stages/test_cluster_errors.py)."""
    from pipeline.config.base import read_params_file
    from pipeline.config.params import load_params

    cold_start_s = sum({  # a g5.xlarge from nothing, as the AWS recipe sets it up
        "instance boot and ssh": 180, "EFS mount": 30, "pip install (torch with CUDA, Ray)": 600, "ray start": 30,
    }.values())
    params_files = [p for p in sorted((ROOT / "presets").glob("*.yaml")) if set(read_params_file(p)) != {"sets"}]
    gpu_presets = [p for p in params_files if load_params(p).ray.use_gpu]  # (the set study's file has no Ray jobs)
    assert gpu_presets
    for path in gpu_presets:
        assert load_params(path).ray.resources_timeout_s >= cold_start_s, path.name
