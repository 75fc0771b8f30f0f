"""Measuring what a step does, on the CPU: peak memory, collectives and their bytes, host syncs.

The numbers the benchmarks print and the tests assert come from here, so that both count the same way:

- :func:`best_time`: the fastest of a few timed calls, after a warm-up.
- :func:`peak_bytes`: the highest running total of the CPU allocator's allocations minus frees while a function
  runs (``torch.profiler`` with ``profile_memory=True``: one ``[memory]`` event per allocation and free).
- :class:`OpCounter`: a ``TorchDispatchMode`` that sees every aten and c10d op run inside it (forward and
  backward) and records the collectives (``c10d.*``, with the bytes of their tensors) and the ops that make the
  host wait for a CUDA device (:func:`sync_reason`), by name. The same ops run on the CPU, so a CPU run counts
  what the step would do on a GPU.

Pure torch; no Ray, no MLflow.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# the value is read on the host
READS = {"_local_scalar_dense", "item", "is_nonzero", "equal", "allclose"}
# the output's size depends on the values
SIZES = {"nonzero", "argwhere", "nonzero_numpy", "masked_select", "bincount", "histc"}
INDEXING = {"index", "index_put", "index_put_", "_index_put_impl_"}  # with a boolean index: a nonzero inside


def sync_reason(func, args, kwargs) -> str | None:
    """Why ``func(*args, **kwargs)`` syncs the host with a CUDA device, or None if it does not: reading a value
    (``item``, ``bool``, ``float``, ``torch.equal``), an output shape that depends on values (``nonzero``,
    ``unique*``, boolean-mask indexing, ``masked_select``, ``repeat_interleave`` without ``output_size``,
    ``bincount``), a device -> host copy. Blind spot: ``.tolist()`` / ``.numpy()`` of a CPU tensor dispatch no op
    (on CUDA they start with a counted device -> host copy)."""
    name = func.overloadpacket.__name__
    if name in READS or name in SIZES or name.startswith(("unique", "_unique")):
        return name
    if name == "repeat_interleave" and kwargs.get("output_size") is None:
        return "repeat_interleave without output_size"
    if name in INDEXING and any(
        isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in args[1]
    ):
        return f"{name} with a boolean index"
    if name == "_to_copy" and args[0].device.type != "cpu" and kwargs.get("device") == torch.device("cpu"):
        return "device -> host copy"  # only on a device (never on a CPU run)
    if name == "copy_" and args[0].device.type == "cpu" and args[1].device.type != "cpu":
        return "device -> host copy"
    return None


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


class OpCounter(TorchDispatchMode):
    """``with OpCounter() as c: ...``; then ``c.syncs`` lists the syncing ops run inside (by reason),
    ``c.collectives`` the collectives (``allreduce_``, ``_allgather_base_``, ...) and ``c.collective_bytes`` the
    bytes of the tensors they were given (for an all-gather: its input, what this rank sends).

    ``device``: the device the run stands for. None (a CPU run standing in for a GPU run): every read counts.
    Given (a test puts the model on ``meta`` to stand for a GPU), a read whose tensors are all on the CPU is a read
    of host memory and does not wait for the device, so it is not counted.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.device = None if device is None else torch.device(device)
        self.syncs: list[str] = []
        self.collectives: list[str] = []
        self.collective_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            name = func.overloadpacket.__name__
            self.collectives.append(name)
            sent = args[1] if "allgather" in name or "reduce_scatter" in name else args[0]
            self.collective_bytes += sum(t.numel() * t.element_size() for t in _tensors(sent))
        else:
            why = sync_reason(func, args, kwargs)
            if why is not None and self.device is not None and self.device.type != "cpu" and all(
                t.device.type == "cpu" for t in _tensors(list(args))
            ):
                why = None  # a read of host memory while the run is on a device
            if why is not None:
                self.syncs.append(why)
        return func(*args, **kwargs)


def best_time(fn: Callable[[], Any], repeats: int = 3) -> float:
    """The fastest of ``repeats`` timed calls of ``fn``, in seconds, after one untimed warm-up call."""
    import time

    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def count(fn: Callable[[], Any], device: torch.device | str | None = None) -> OpCounter:
    """Run ``fn`` under an :class:`OpCounter` (standing for ``device``) and return the counter."""
    with OpCounter(device) as counter:
        fn()
    return counter


def peak_bytes(fn: Callable[[], Any]) -> int:
    """The highest running total of CPU allocations minus frees while ``fn`` runs (the CPU allocator, through
    ``torch.profiler``); tensors allocated before and freed after are not counted."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's own start/stop lines, off
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    total = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        total += event.nbytes()
        peak = max(peak, total)
    return peak
