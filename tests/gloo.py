"""The tests' multi-process gloo groups, started as forks of one server that has imported torch and the pipeline.

``torch.multiprocessing.spawn`` starts each rank as a fresh interpreter that imports torch and the pipeline again:
3.8 CPU-s and 2 s of wall for each start of 2 ranks on the 2-core dev machine, paid 21 times by the suite. Here the
ranks are forked from Python's forkserver, which imports :data:`PRELOAD` once per test process: 0.07 CPU-s per start
of 2 ranks after the first (measured: 4 starts of 2 ranks that init and destroy a gloo group, 1.51 CPU-s for the first
one, which starts the server, then 0.07, 0.07, 0.06). A rank still starts from a clean state: the server only
imported modules, it never ran torch, so no thread pool or RNG state is inherited; and what a test patches in its own
process does not reach the ranks, as with spawn.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

#: What the forkserver imports once: torch, the pipeline's training modules and the test modules whose functions the
#: ranks run (unpickling a rank's function imports its module). A module that fails to import is skipped by Python.
PRELOAD = ["torch", "torch.distributed", "torch.nn.functional", "pipeline.core.model", "pipeline.core.losses",
           "pipeline.core.batchnorm", "pipeline.training.step", "pipeline.training.comm", "pipeline.training.loop",
           "tests.training.test_step", "tests.training.test_comm", "tests.training.test_loop",
           "tests.training.test_sharded_head", "tests.core.test_batchnorm_passes"]


def spawn(fn: Callable[..., Any], args: tuple, nprocs: int = 2) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs, join=True)``, the ranks forked from the preloaded server: each
    rank runs ``fn(rank, *args)``; an exception in any rank is raised here."""
    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts (the first call), ignored after
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")
