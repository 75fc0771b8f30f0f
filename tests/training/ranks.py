"""Gloo ranks that each return a result (forked by tests.gloo): the training tests' two-worker harness."""

from __future__ import annotations

import pickle
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from tests import gloo


def _rank(rank: int, world: int, out_dir: str, fn, args: tuple) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("error", FutureWarning)  # no deprecated collective (torch 2.14 deprecates several)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/init", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def run_ranks(tmp_path: Path, fn, *args, world: int = 2) -> list:
    """``fn(rank, world, *args)`` on each of ``world`` gloo ranks of one thread; what each returned, by rank."""
    out = tempfile.mkdtemp(dir=tmp_path)
    gloo.spawn(_rank, (world, out, fn, args), nprocs=world)
    return [pickle.loads(Path(out, f"rank{r}.pkl").read_bytes()) for r in range(world)]


def shard(v1: torch.Tensor, v2: torch.Tensor, ids: torch.Tensor, rank: int, world: int) -> tuple:
    """This rank's rows of a two-view batch: (its views of ``v1`` then of ``v2``, their ids), as ``PretrainLoop``."""
    b = len(ids) // world
    mine = slice(rank * b, (rank + 1) * b)
    return torch.cat([v1[mine], v2[mine]]), torch.cat([ids[mine], ids[mine]])
