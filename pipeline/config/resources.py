"""What one run asks of Ray, whether nodes of known size can ever hold it, and how many Tune trials to start at once.

Pure (no Ray import), so that a request is checked before Ray starts.

- :class:`TrialShape`: the bundles one run asks for. Pretraining: ``num_workers`` worker bundles
  ``{"CPU": c, "GPU": 1 or 0}`` (Ray Train V2's worker group; its controller actor takes 0 CPU). A sweep trial: the
  same workers plus the trial function's own ``{"CPU": trial_cpu}`` (Tune's ``with_resources``).
- :func:`infeasible`: why a run can never start on ``nodes`` (each node's resources, e.g. ``{"CPU": 8, "GPU": 1}``),
  as one paragraph; None if it fits. Only for nodes that are all there is: this machine before the local Ray starts,
  or a local Ray (no autoscaler). There Ray would wait for the run forever; on a cluster an autoscaler may still add
  nodes, and the bounded wait (``pipeline.runs.cluster.wait_for_workers``) ends a request that never comes free.
- :func:`trials_at_once`: Ray's own rule for Tune trials that each launch a Ray Train run (Ray Train's user guide,
  "Set max_concurrent_trials to limit the number of Ray Train driver processes"): the limiting resource's total over
  what one trial needs. It need not be exact: a trial beyond what fits waits, Tune holding it pending until its own
  bundles fit, Ray Train until its workers' do; the limit only keeps waiting trials from taking the CPUs that running
  ones' workers need.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipeline.config.base import ParamsError
from pipeline.config.params import Params

EPS = 1e-9
KINDS = ("CPU", "GPU")  # the resources a run asks for; others a node has do not limit it


@dataclass(frozen=True)
class TrialShape:
    """The bundles one run asks for: ``num_workers`` workers of ``cpus_per_worker`` CPUs (and one GPU each when
    ``gpu``), plus, for a sweep trial, the trial function's own ``{"CPU": trial_cpu}``.

    ``cpu_key``: the params key the workers' CPUs come from, which messages name (``sweep.cpus_per_worker`` for a
    sweep trial).
    """

    num_workers: int
    cpus_per_worker: float
    gpu: bool = False
    trial_cpu: float = 0.0
    cpu_key: str = "ray.cpus_per_worker"

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


def _fits(bundle: Mapping[str, float], free: Mapping[str, float]) -> bool:
    return all(free.get(k, 0.0) + EPS >= v for k, v in bundle.items())


def places(nodes: Sequence[Mapping[str, float]], shape: TrialShape) -> bool:
    """One run of ``shape`` fits on ``nodes``: its bundles, largest first, each on the first node with room."""
    free = [{k: float(n.get(k, 0.0)) for k in KINDS} for n in nodes]
    for b in shape.bundles():
        i = next((i for i in range(len(free)) if _fits(b, free[i])), None)
        if i is None:
            return False
        for k, v in b.items():
            free[i][k] -= v
    return True


def _plural(x: float, word: str) -> str:
    return f"{x:g} {word}{'' if x == 1 else 's'}"


def infeasible(nodes: Sequence[Mapping[str, float]], shape: TrialShape, what: str | None = None) -> str | None:
    """Why a run of ``shape`` can never start on ``nodes`` (all the nodes there will be), as one paragraph; None if
    it fits.

    ``what`` names the run in the message ("pretraining", "a sweep trial"; by default from ``shape.trial_cpu``). The
    message names what was asked (``ray.num_workers``, ``ray.cpus_per_worker`` or ``sweep.cpus_per_worker``,
    ``ray.use_gpu``) and what exists (CPUs, GPUs, nodes, the largest node).
    """
    if places(nodes, shape):
        return None
    what = what or ("a Tune trial" if shape.trial_cpu > 0 else "pretraining")
    gpus_each = "1 GPU each (ray.use_gpu)" if shape.gpu else "no GPU (ray.use_gpu: false)"
    asked = (f"{what} asks for {_plural(shape.num_workers, 'worker')} (ray.num_workers) of "
             f"{_plural(shape.cpus_per_worker, 'CPU')} each ({shape.cpu_key}) and {gpus_each}")
    if shape.trial_cpu > 0:
        asked += f", plus {_plural(shape.trial_cpu, 'CPU')} for the trial itself"
    asked += f": {_plural(shape.total('CPU'), 'CPU')} and {_plural(shape.total('GPU'), 'GPU')} in all"
    cpus = sum(n.get("CPU", 0.0) for n in nodes)
    gpus = sum(n.get("GPU", 0.0) for n in nodes)
    exists = f"the cluster has {_plural(cpus, 'CPU')} and {_plural(gpus, 'GPU')} on {_plural(len(nodes), 'node')}"
    if nodes:
        biggest = max(nodes, key=lambda n: (n.get("CPU", 0.0), n.get("GPU", 0.0)))
        exists += (f" (largest node: {_plural(biggest.get('CPU', 0.0), 'CPU')}, "
                   f"{_plural(biggest.get('GPU', 0.0), 'GPU')})")
    if shape.gpu and gpus == 0:
        why = "No node has a GPU"
        fix = "set ray.use_gpu: false and train.device: cpu, or add GPU nodes"
    elif not any(_fits(shape.worker, n) for n in nodes):
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


def trials_at_once(totals: Mapping[str, float], shape: TrialShape, cap: int) -> int:
    """How many trials of ``shape`` to start at once on a cluster with ``totals`` (``ray.cluster_resources()``): for
    each resource a trial needs, the cluster's total over the trial's, the smallest of them; at most ``cap`` (the
    trials there are), at least 1 (the rest wait, also for nodes an autoscaler adds)."""
    counts = [int(totals.get(k, 0.0) / shape.total(k) + EPS) for k in KINDS if shape.total(k) > 0]
    return max(1, min([cap, *counts]))


def max_concurrent(fixed: int | None, shape: TrialShape, totals: dict[str, float], n_trials: int) -> int:
    """``fixed`` (``sweep.max_concurrent_trials``, ``tables.max_concurrent_trials``) if set, else as many trials of
    ``shape`` as the cluster's resources now (``totals``) hold by their limiting resource
    (``pipeline.config.resources.trials_at_once``), never more than the trials there are, at least 1. Set it on a
    cluster that autoscales: it grows for the trials Tune starts."""
    return fixed if fixed is not None else trials_at_once(totals, shape, cap=max(1, n_trials))


def use_gpu(params: Params, gpus: float) -> bool:
    """Train on GPUs when asked (``ray.use_gpu``, ``train.device: cuda``), or when the cluster has GPUs (``gpus``)
    and ``train.device: auto``. Decided from the cluster, not from the driver's node."""
    if params.train.device == "cpu":
        return False
    return params.ray.use_gpu or params.train.device == "cuda" or gpus > 0


def trial_shape(params: Params, gpu: bool, cpus_per_worker: float | None = None, trial_cpu: float = 0.0) -> TrialShape:
    """What one run of ``params`` asks for: ``ray.num_workers`` workers of ``cpus_per_worker`` (a sweep's
    ``sweep.cpus_per_worker``; default ``ray.cpus_per_worker``) CPUs, a GPU each when ``gpu``, plus a trial's own
    ``trial_cpu``."""
    key = "ray.cpus_per_worker" if cpus_per_worker is None else "sweep.cpus_per_worker"
    return TrialShape(params.ray.num_workers, cpus_per_worker or params.ray.cpus_per_worker, gpu, trial_cpu, key)


def check_request(params: Params, nodes: list[dict[str, float]], *, gpu: bool, cpus_per_worker: float | None = None,
                  trial_cpu: float = 0.0, what: str = "pretraining") -> None:
    """Raise :class:`ParamsError` if ``ray.num_workers`` workers (plus a trial's own bundle) can never fit on
    ``nodes``, all the nodes there will be."""
    reason = infeasible(nodes, trial_shape(params, gpu, cpus_per_worker, trial_cpu), what=what)
    if reason:
        raise ParamsError(reason)
