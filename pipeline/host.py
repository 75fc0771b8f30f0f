"""The ground floor's view of this machine: the CPUs this process may use, a device's memory, one thread for a block
of small-matrix work. Imports nothing from ``pipeline``."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

T = TypeVar("T")


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


def use_threads(n: int) -> None:
    """This process's torch and BLAS / OpenMP pools on ``n`` threads from now on: a Ray worker's, where Ray has set
    ``OMP_NUM_THREADS`` to the whole part of its CPUs (1 for a 1.75-CPU tables trial, whose probes then ran NumPy's
    and scikit-learn's BLAS on one thread). torch and threadpoolctl are imported on first use."""
    import torch
    from threadpoolctl import threadpool_limits  # a dependency of scikit-learn

    torch.set_num_threads(n)
    threadpool_limits(limits=n)


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


def spawned_map(fn: Callable[..., T], cells: Sequence[tuple], workers: int, on_done: Callable[[int, T], None],
                order: Sequence[int] | None = None) -> None:
    """``fn(*cell)`` for every cell, on ``workers`` spawned processes (1: in this process, in order), calling
    ``on_done(index, result)`` in this process as each ends; ``order``: the submission order (e.g. slowest first).
    Spawned, not forked: a fork of a process whose OpenMP pool has run can hang. ``fn`` must be importable (a module's
    function), and the program's entry point guarded by ``if __name__ == "__main__"``."""
    if workers == 1:
        for i, cell in enumerate(cells):
            on_done(i, fn(*cell))
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(fn, *cells[i]): i for i in (range(len(cells)) if order is None else order)}
        for future in as_completed(futures):
            on_done(futures[future], future.result())
