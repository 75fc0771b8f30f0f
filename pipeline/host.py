"""The ground floor's view of this machine: the CPUs this process may use, a device's memory, one thread for a block
of small-matrix work. Imports nothing from ``pipeline``."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, else the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def device_memory(device) -> int:
    """Bytes of memory of ``device`` (a ``torch.device``): a GPU's total memory; elsewhere the host RAM available now.
    torch and psutil are imported on first use (the ground floor stays cheap to import)."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(device).total_memory)
    import psutil

    return int(psutil.virtual_memory().available)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch and the BLAS / OpenMP pools on one thread for the block (small matrices: threads cost more than they
    give); the previous torch setting is restored. torch and threadpoolctl are imported on first use."""
    import torch
    from threadpoolctl import threadpool_limits  # a dependency of scikit-learn

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with threadpool_limits(limits=1):
            yield
    finally:
        torch.set_num_threads(before)
