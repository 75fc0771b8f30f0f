"""The ``ray`` section: where the Ray cluster is, how many workers, their resources, storage and timeouts.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field

from pipeline.config.base import Section

TRIAL_CPU = 0.25  # a Tune trial's own CPUs (its function's; a one-worker trial also holds its worker's bundle)


def torch_threads(cpus_per_worker: float) -> int:
    """A worker's torch threads: its CPUs rounded up, at least 1. A tables row on a 2-core machine has a worker of
    1.75 CPUs beside its trial's own 0.25 (``TRIAL_CPU``), which is idle while the worker trains: 2 threads."""
    return max(1, math.ceil(cpus_per_worker - 1e-9))


class RayConfig(Section):
    address: str | None = None
    num_workers: int = Field(1, ge=1, le=100_000)
    use_gpu: bool = False
    # what each worker asks Ray for; its torch threads: torch_threads. None: this machine's CPUs over num_workers
    # on a Ray started here (a lone pretraining uses every core), 1 on a cluster (runs.cluster.with_worker_cpus)
    cpus_per_worker: float | None = Field(None, gt=0.0, le=1024.0)
    storage_path: str = "ray_results"  # every node must see it (NFS/EFS mount, or s3://...): checkpoints, staged data
    max_failures: int = Field(0, ge=-1)
    connect_timeout_s: float = Field(30.0, gt=0.0, le=86_400.0)  # wait for ray.address / RAY_ADDRESS to answer
    resources_timeout_s: float = Field(300.0, gt=0.0, le=604_800.0)  # wait for the workers' resources to be free
    # torch.distributed backend of Ray Train's workers: auto = Ray's choice (nccl on GPUs, gloo otherwise); gloo
    # trains on the CPU even where CUDA sees GPUs (pipeline.runs.train.worker_device), which also lets a
    # GPU-scheduled worker on a node that declares GPUs it does not have train there (rehearsals)
    backend: Literal["auto", "nccl", "gloo"] = "auto"


__all__ = ['TRIAL_CPU', 'RayConfig', 'torch_threads']
