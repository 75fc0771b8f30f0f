"""The example cluster configs the README points at stay valid YAML with the structure their tools expect."""

from __future__ import annotations

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
