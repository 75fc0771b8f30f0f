"""A resource model of a Ray cluster: node types, a trial's bundles, and how many trials fit at once.

Pure (Ray is imported only inside :func:`cluster_from_ray`), so that a recipe can be checked without a cluster.

- :class:`NodeType`: a kind of node (its Ray resources, e.g. ``{"CPU": 8, "GPU": 1}``), how many exist now
  (``count``) and how many the autoscaler may reach (``max_count``).
- :class:`TrialShape`: what one run asks Ray for. Pretraining: ``num_workers`` worker bundles
  ``{"CPU": c, "GPU": 1 or 0}`` (Ray Train V2's worker group; its controller actor takes 0 CPU). A sweep trial:
  the same workers plus the trial function's own bundle ``{"CPU": trial_cpu}`` (Tune's ``with_resources``).
- :func:`packing` / :func:`trials_at_once`: places whole trials, one after another, onto the nodes by first-fit
  decreasing (a trial's bundles largest first; a bundle that needs no GPU tries GPU-less nodes first, as Ray's
  scheduler avoids GPU nodes for CPU-only work). Every bundle must fit one node, so this is the minimum over all
  resource kinds *and* over fragmentation, not a division of totals. Ray's own placement (PACK, per placement
  group, in arrival order) may place the bundles differently, but it never puts more on a node than the node
  has: for the shapes used here (identical worker bundles plus one small trial bundle) it cannot run more trials
  at once than this count.
- :func:`infeasible`: a one-paragraph reason when a request can never fit, even at the cluster's maximum size.
- :func:`cluster_from_ray`, :func:`cluster_from_launcher_yaml`, :func:`cluster_from_kuberay_yaml`: node types
  from a live cluster or from the two deploy recipe formats.
"""

from __future__ import annotations

import decimal
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EPS = 1e-9
KINDS = ("CPU", "GPU")  # the resources a trial asks for; others a node has do not limit it
UNBOUNDED_NODES = 1000  # stands for an autoscaler group without a maximum (max_count -1 in Ray's cluster config)

# vCPUs and GPUs of common EC2 instance types, as Ray's AWS node provider detects them (the launcher fills a node
# type's resources from the instance type, then applies the node type's own ``resources:`` on top)
AWS_INSTANCES: dict[str, dict[str, float]] = {
    "m5.large": {"CPU": 2}, "m5.xlarge": {"CPU": 4}, "m5.2xlarge": {"CPU": 8}, "m5.4xlarge": {"CPU": 16},
    "m6i.large": {"CPU": 2}, "m6i.xlarge": {"CPU": 4}, "m6i.2xlarge": {"CPU": 8}, "m6i.4xlarge": {"CPU": 16},
    "c6i.2xlarge": {"CPU": 8}, "c6i.4xlarge": {"CPU": 16},
    "g4dn.xlarge": {"CPU": 4, "GPU": 1}, "g4dn.2xlarge": {"CPU": 8, "GPU": 1}, "g4dn.12xlarge": {"CPU": 48, "GPU": 4},
    "g5.xlarge": {"CPU": 4, "GPU": 1}, "g5.2xlarge": {"CPU": 8, "GPU": 1}, "g5.4xlarge": {"CPU": 16, "GPU": 1},
    "g5.12xlarge": {"CPU": 48, "GPU": 4}, "g5.48xlarge": {"CPU": 192, "GPU": 8},
    "p3.2xlarge": {"CPU": 8, "GPU": 1}, "p3.8xlarge": {"CPU": 32, "GPU": 4}, "p4d.24xlarge": {"CPU": 96, "GPU": 8},
}




# ------------------------------------------------------------------------------------------------- model
@dataclass(frozen=True)
class NodeType:
    """A kind of node: its Ray resources, how many exist now, how many the autoscaler may reach.

    ``max_count`` defaults to ``count`` (no autoscaling). ``unbounded`` marks a group without a maximum, whose
    ``max_count`` is then :data:`UNBOUNDED_NODES`.
    """

    name: str
    resources: Mapping[str, float]
    count: int = 1
    max_count: int = -1  # -1: same as count
    unbounded: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "resources", {k: float(v) for k, v in self.resources.items()})
        if self.max_count < 0:
            object.__setattr__(self, "max_count", UNBOUNDED_NODES if self.unbounded else self.count)
        if self.count < 0 or self.max_count < self.count:
            raise ValueError(f"node type {self.name}: need 0 <= count <= max_count, got {self.count}, {self.max_count}")

    def get(self, kind: str) -> float:
        return self.resources.get(kind, 0.0)


@dataclass(frozen=True)
class TrialShape:
    """The bundles one run asks for: ``num_workers`` workers of ``cpus_per_worker`` CPUs (and one GPU each when
    ``gpu``), plus, for a sweep trial, the trial function's own ``{"CPU": trial_cpu}``.

    A shape with ``trial_cpu > 0`` is a sweep trial: its messages name ``sweep.cpus_per_worker``, otherwise
    ``ray.cpus_per_worker``.
    """

    num_workers: int
    cpus_per_worker: float
    gpu: bool = False
    trial_cpu: float = 0.0

    def __post_init__(self) -> None:
        if self.num_workers < 1 or self.cpus_per_worker <= 0 or self.trial_cpu < 0:
            raise ValueError(f"invalid trial shape {self}")

    @property
    def worker(self) -> dict[str, float]:
        """One worker's bundle."""
        return {"CPU": float(self.cpus_per_worker), **({"GPU": 1.0} if self.gpu else {})}

    def bundles(self) -> list[dict[str, float]]:
        """Every bundle of one run, largest first (GPU bundles, then by CPUs)."""
        out = [self.worker] * self.num_workers + ([{"CPU": float(self.trial_cpu)}] if self.trial_cpu > 0 else [])
        return sorted(out, key=lambda b: (b.get("GPU", 0.0), b.get("CPU", 0.0)), reverse=True)

    def total(self, kind: str) -> float:
        return sum(b.get(kind, 0.0) for b in self.bundles())

    @property
    def cpu_key(self) -> str:
        return "sweep.cpus_per_worker" if self.trial_cpu > 0 else "ray.cpus_per_worker"


@dataclass(frozen=True)
class Packing:
    """The result of :func:`packing`: how many whole trials fit, and the nodes of each type that hold a bundle."""

    trials: int
    nodes_used: dict[str, int] = field(default_factory=dict)

    @property
    def types_used(self) -> set[str]:
        return {name for name, n in self.nodes_used.items() if n > 0}


# ----------------------------------------------------------------------------------------------- packing
def _instances(nodes: Sequence[NodeType], at_max: bool, cap: int | None) -> list[tuple[str, dict[str, float]]]:
    out = []
    for t in nodes:
        if at_max and t.unbounded and cap is None:
            raise ValueError(f"node type {t.name} has no maximum count: pass cap (e.g. the number of trials)")
        n = t.max_count if at_max else t.count
        out += [(t.name, {k: t.get(k) for k in KINDS}) for _ in range(n)]
    return out


def _fits(bundle: Mapping[str, float], free: Mapping[str, float]) -> bool:
    return all(free.get(k, 0.0) + EPS >= v for k, v in bundle.items())


def _place_trial(bundles: list[dict[str, float]], free: list[dict[str, float]], order_gpu: list[int],
                 order_cpu: list[int]) -> list[tuple[int, dict[str, float]]] | None:
    """Where each bundle of one trial goes (node index, bundle), first fit; None if one does not fit. ``free`` is
    left unchanged."""
    left = [dict(f) for f in free]
    placed = []
    for b in bundles:
        order = order_gpu if b.get("GPU", 0.0) > 0 else order_cpu
        i = next((i for i in order if _fits(b, left[i])), None)
        if i is None:
            return None
        for k, v in b.items():
            left[i][k] -= v
        placed.append((i, b))
    return placed


def packing(nodes: Sequence[NodeType], shape: TrialShape, cap: int | None = None, *, at_max: bool = True) -> Packing:
    """Place whole trials of ``shape`` onto the nodes, one trial after another, until the next one does not fit.

    ``at_max``: use every node type at ``max_count`` (what the autoscaler can reach), else at ``count`` (now).
    ``cap``: stop after this many trials (e.g. the size of the sweep). First-fit decreasing: each trial's bundles
    largest first, each onto the first node with room; a bundle without GPU tries nodes without GPUs first.
    """
    free = _instances(nodes, at_max, cap)
    order_gpu = list(range(len(free)))
    order_cpu = sorted(order_gpu, key=lambda i: free[i][1]["GPU"] > 0)  # stable: GPU-less nodes first
    holds = [False] * len(free)
    bundles = shape.bundles()
    trials = 0
    while cap is None or trials < cap:
        placed = _place_trial(bundles, [f for _, f in free], order_gpu, order_cpu)
        if placed is None:
            break
        for i, b in placed:
            for k, v in b.items():
                free[i][1][k] -= v
            holds[i] = True
        trials += 1
    used: dict[str, int] = {t.name: 0 for t in nodes}
    for (name, _), h in zip(free, holds, strict=True):
        used[name] += int(h)
    return Packing(trials=trials, nodes_used=used)


def trials_at_once(nodes: Sequence[NodeType], shape: TrialShape, cap: int | None = None, *,
                   at_max: bool = True) -> int:
    """How many trials of ``shape`` run at once on ``nodes`` (at their max counts unless ``at_max=False``), at most
    ``cap``; 0 when not even one fits. :func:`packing` gives the node types it uses as well."""
    return packing(nodes, shape, cap, at_max=at_max).trials


# ---------------------------------------------------------------------------------------------- feasible
def _n(x: float) -> str:
    return f"{x:g}"


def _plural(x: float, word: str) -> str:
    return f"{_n(x)} {word}{'' if x == 1 else 's'}"


def infeasible(nodes: Sequence[NodeType], shape: TrialShape | None = None, *, num_workers: int | None = None,
               cpus_per_worker: float | None = None, gpu: bool = False, trial_cpu: float = 0.0,
               what: str | None = None) -> str | None:
    """Why a run of ``shape`` can never start on ``nodes`` even at their max counts, as one paragraph; None if
    it fits.

    Pass a :class:`TrialShape`, or its fields as keywords (``num_workers``, ``cpus_per_worker``, ``gpu``,
    ``trial_cpu``). ``what`` names the run in the message ("pretraining", "a sweep trial"; by default from
    ``trial_cpu``). The message names what was asked (``ray.num_workers``, ``ray.cpus_per_worker`` or
    ``sweep.cpus_per_worker``, ``ray.use_gpu``) and what exists (CPUs, GPUs, nodes, the largest node).
    """
    if shape is None:
        if num_workers is None or cpus_per_worker is None:
            raise TypeError("infeasible() needs a TrialShape or num_workers and cpus_per_worker")
        shape = TrialShape(num_workers, cpus_per_worker, gpu, trial_cpu)
    if packing(nodes, shape, cap=1).trials >= 1:
        return None
    what = what or ("a sweep trial" if shape.trial_cpu > 0 else "pretraining")
    worker = shape.worker
    gpus_each = "1 GPU each (ray.use_gpu)" if shape.gpu else "no GPU (ray.use_gpu: false)"
    asked = (f"{what} asks for {_plural(shape.num_workers, 'worker')} (ray.num_workers) of "
             f"{_plural(shape.cpus_per_worker, 'CPU')} each ({shape.cpu_key}) and {gpus_each}")
    if shape.trial_cpu > 0:
        asked += f", plus {_plural(shape.trial_cpu, 'CPU')} for the trial itself"
    asked += f": {_plural(shape.total('CPU'), 'CPU')} and {_plural(shape.total('GPU'), 'GPU')} in all"
    live = [t for t in nodes if t.max_count > 0]
    n_nodes = sum(t.max_count for t in live)
    cpus = sum(t.get("CPU") * t.max_count for t in live)
    gpus = sum(t.get("GPU") * t.max_count for t in live)
    biggest = max(live, key=lambda t: (t.get("CPU"), t.get("GPU")), default=None)
    exists = f"the cluster, even at the largest size it can reach, has {_plural(cpus, 'CPU')} and " \
             f"{_plural(gpus, 'GPU')} on {_plural(n_nodes, 'node')}"
    if biggest is not None:
        exists += f" (largest node: {_plural(biggest.get('CPU'), 'CPU')}, {_plural(biggest.get('GPU'), 'GPU')})"
    worker_fits = any(_fits(worker, t.resources) for t in live)
    if shape.gpu and gpus == 0:
        why = "No node has a GPU"
        fix = "set ray.use_gpu: false and train.device: cpu, or add GPU nodes"
    elif not worker_fits:
        why = ("A worker's CPUs" + (" and GPU" if shape.gpu else "") + " must all come from one node, and no node "
               f"has {_plural(shape.cpus_per_worker, 'CPU')}" + (" and a GPU" if shape.gpu else ""))
        fix = f"lower {shape.cpu_key}, or add larger nodes"
    elif shape.total("CPU") > cpus + EPS or shape.total("GPU") > gpus + EPS:
        why = "That is more than the whole cluster has"
        fix = f"lower ray.num_workers or {shape.cpu_key}, or add nodes"
    else:
        why = "The bundles do not pack onto the nodes: each must fit within one node"
        fix = f"lower ray.num_workers or {shape.cpu_key} so that the workers fill the nodes evenly"
    return f"{asked}; but {exists}. {why}. It would wait forever: {fix}."


# ------------------------------------------------------------------------------------------------ recipes
def nodes_from_launcher_config(cfg: Mapping[str, Any]) -> list[NodeType]:
    """Node types of a cluster launcher config (``available_node_types``), at start (``min_workers``) and at
    their maximum (the type's ``max_workers``, by default and at most the global ``max_workers``, default 2).

    A type's resources: its instance type's vCPUs and GPUs (:data:`AWS_INSTANCES`), overridden key by key by
    its ``resources:`` (as Ray's AWS provider does). The head type counts one node. The global ``max_workers``
    caps each type alone here; with several worker types it also caps their sum, which this does not model.
    """
    global_max = int(cfg.get("max_workers", 2))
    head = cfg.get("head_node_type")
    out = []
    for name, spec in cfg["available_node_types"].items():
        instance = (spec.get("node_config") or {}).get("InstanceType")
        given = dict(spec.get("resources") or {})
        if instance in AWS_INSTANCES:
            resources = {**AWS_INSTANCES[instance], **given}
        elif "CPU" in given:
            resources = given
        else:
            raise ValueError(f"node type {name}: unknown instance type {instance!r} and no resources: CPU given")
        if name == head:
            out.append(NodeType(name, resources, 1, 1))
        else:
            top = min(int(spec.get("max_workers", global_max)), global_max)
            out.append(NodeType(name, resources, min(int(spec.get("min_workers", 0)), top), top))
    return out


def cluster_from_launcher_yaml(path: str | Path) -> list[NodeType]:
    """Node types of a Ray cluster launcher YAML (``ray up``): see :func:`nodes_from_launcher_config`."""
    import yaml

    return nodes_from_launcher_config(yaml.safe_load(Path(path).read_text()))


def _quantity(q: Any) -> float:
    """A Kubernetes quantity as a number of units (``"500m"`` -> 0.5, ``"4"`` -> 4)."""
    s = str(q).strip()
    if s.endswith("m"):
        return float(decimal.Decimal(s[:-1]) / 1000)
    return float(decimal.Decimal(s))


def _kuberay_group(group: Mapping[str, Any], name: str) -> dict[str, float]:
    """Ray resources of a KubeRay group: the group's ``resources``, else ``rayStartParams`` num-cpus / num-gpus,
    else the Ray container's limits (then requests), CPUs rounded up (what KubeRay's autoscaler assumes)."""
    given = group.get("resources") or {}
    params = group.get("rayStartParams") or {}
    k8s = (group["template"]["spec"]["containers"][0].get("resources")) or {}
    pools = [k8s.get("limits") or {}, k8s.get("requests") or {}]
    if "CPU" in given:
        cpu = float(math.ceil(_quantity(given["CPU"])))
    elif "num-cpus" in params:
        cpu = _quantity(params["num-cpus"])
    else:
        cpu = next((float(math.ceil(_quantity(p["cpu"]))) for p in pools if "cpu" in p), None)
        if cpu is None:
            raise ValueError(f"KubeRay group {name}: no CPU count (rayStartParams num-cpus or a cpu limit)")
    if "GPU" in given:
        gpu = _quantity(given["GPU"])
    elif "num-gpus" in params:
        gpu = _quantity(params["num-gpus"])
    else:
        gpu = next((_quantity(v) for p in pools for k, v in p.items() if k.endswith("gpu")), 0.0)
    return {"CPU": cpu, **({"GPU": gpu} if gpu else {})}


def nodes_from_kuberay(cluster: Mapping[str, Any]) -> list[NodeType]:
    """Node types of a ``RayCluster`` resource: the head (one pod) and each worker group at ``replicas`` (now)
    and ``maxReplicas`` (times ``numOfHosts``), the autoscaler's bound (``minReplicas``/``maxReplicas``)."""
    spec = cluster["spec"]
    out = [NodeType("head", _kuberay_group(spec["headGroupSpec"], "head"), 1, 1)]
    for g in spec.get("workerGroupSpecs", []):
        hosts = int(g.get("numOfHosts", 1))
        top = int(g.get("maxReplicas", g.get("replicas", 0))) * hosts
        now = min(int(g.get("replicas", g.get("minReplicas", 0))) * hosts, top)
        out.append(NodeType(g["groupName"], _kuberay_group(g, g["groupName"]), now, top))
    return out


def cluster_from_kuberay_yaml(path: str | Path) -> list[NodeType]:
    """Node types of the ``RayCluster`` in a KubeRay manifest (other documents are skipped)."""
    import yaml

    docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d and d.get("kind") == "RayCluster"]
    if len(docs) != 1:
        raise ValueError(f"{path}: expected one RayCluster, found {len(docs)}")
    return nodes_from_kuberay(docs[0])


# ----------------------------------------------------------------------------------------------- live Ray
BOOTSTRAP_CONFIG = "~/ray_bootstrap_config.yaml"  # where `ray up` leaves the autoscaling config on the head


def _plain(resources: Mapping[str, float]) -> dict[str, float]:
    return {k: float(v) for k, v in resources.items() if k in KINDS and v}


def group_live_nodes(nodes: Iterable[Mapping[str, Any]]) -> list[NodeType]:
    """``ray.nodes()`` entries -> node types: alive nodes grouped by equal CPU/GPU, count = max_count = how many."""
    groups: dict[tuple, int] = {}
    for n in nodes:
        if n.get("Alive", n.get("alive")):
            key = tuple(sorted(_plain(n.get("Resources", {})).items()))
            groups[key] = groups.get(key, 0) + 1
    return [NodeType(f"live-{i}", dict(key), c, c) for i, (key, c) in enumerate(groups.items())]


def merge_live(live: Sequence[NodeType], limits: Sequence[NodeType]) -> list[NodeType]:
    """Node types of an autoscaling config (``limits``) with their current counts taken from the live nodes (each
    live node counts toward the first type with the same CPU/GPU); live nodes that match no type (e.g. a head
    the config leaves out) are kept as they are."""
    out = {t.name: t for t in limits}
    counts = {t.name: 0 for t in limits}
    rest = []
    for t in live:
        match = next((m for m in limits if _plain(m.resources) == _plain(t.resources)), None)
        if match is None:
            rest.append(t)
        else:
            counts[match.name] += t.count
    merged = [NodeType(t.name, t.resources, counts[t.name], max(t.max_count, counts[t.name]), t.unbounded)
              for t in out.values()]
    return merged + rest


def nodes_from_cluster_config(config: Any) -> list[NodeType]:
    """Node types of Ray's ``autoscaler_pb2.ClusterConfig`` (``node_group_configs``: name, resources, min_count,
    max_count; max_count -1 = no maximum)."""
    out = []
    for g in config.node_group_configs:
        unbounded = g.max_count == -1
        out.append(NodeType(g.name or f"group-{len(out)}", _plain(dict(g.resources)), 0,
                            -1 if unbounded else int(g.max_count), unbounded))
    return out


def autoscaler_limits() -> tuple[list[NodeType], str]:
    """What the running cluster says about its maximum size, and where that came from ([] if nothing)."""
    import ray

    try:  # Ray's cluster config in the GCS: what Ray Train V2 checks worker groups against
        from ray._private.state import state

        config = state.get_cluster_config()
        if config is not None and len(config.node_group_configs):
            return nodes_from_cluster_config(config), "gcs-cluster-config"
    except Exception:  # noqa: BLE001 - a private API: absent or changed means "not exposed"
        pass
    path = Path(os.path.expanduser(BOOTSTRAP_CONFIG))
    here = ray.util.get_node_ip_address()
    on_head = any(n.get("Alive") and "node:__internal_head__" in n.get("Resources", {})
                  and n.get("NodeManagerAddress") == here for n in ray.nodes())
    if on_head and path.exists():  # launched by `ray up`: its autoscaling config, on the head
        try:
            return cluster_from_launcher_yaml(path), str(path)
        except (ValueError, KeyError, TypeError, OSError):
            pass
    name = os.environ.get("RAY_CLUSTER_NAME")
    if os.environ.get("KUBERNETES_SERVICE_HOST") and name:  # KubeRay: the RayCluster the autoscaler reads
        try:
            from ray.autoscaler._private.kuberay.autoscaling_config import AutoscalingConfigProducer

            ns = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace").read_text().strip()
            return nodes_from_launcher_config(AutoscalingConfigProducer(name, ns)()), f"RayCluster {ns}/{name}"
        except Exception:  # noqa: BLE001 - no API access from this pod: fall back to the live nodes
            pass
    return [], "live nodes"


def cluster_from_ray() -> list[NodeType]:
    """The connected Ray cluster as node types: alive nodes (``ray.nodes()``) now, and the maximum it can reach.

    Ray 2.60 exposes an autoscaler's maximum in one place: the cluster config in the GCS
    (``ray._private.state.state.get_cluster_config()``, an ``autoscaler_pb2.ClusterConfig`` of node groups with
    resources and ``max_count``, which Ray Train V2 reads in ``WorkerGroup._check_cluster_resources_and_raise_if_
    insufficient``). Open-source Ray only has the binding that writes it (``InnerGcsClient.report_cluster_config``)
    and neither autoscaler calls it, so it is often empty. Then, in order: the launcher's autoscaling config on the
    head (``~/ray_bootstrap_config.yaml``, only when this process runs on the head node); on KubeRay, the RayCluster
    read through the Kubernetes API as KubeRay's autoscaler does (needs the pod's service account to be allowed to
    read it); and finally the live nodes alone (max_count = count: a cluster that may still grow is treated as its
    current size). :func:`autoscaler_limits` tells which of these was used.
    """
    import ray

    live = group_live_nodes(ray.nodes())
    limits, _ = autoscaler_limits()
    return merge_live(live, limits) if limits else live
