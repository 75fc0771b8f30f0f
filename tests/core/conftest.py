"""Fixtures of the tests/core tests."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import pipeline.core.batchnorm as bn


@pytest.fixture
def world_of_one(tmp_path, monkeypatch):
    """A real 1-rank gloo group, with GlobalBatchNorm's global branch forced (world_size says 2): the collectives
    run and are the identity."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    monkeypatch.setattr(bn, "world_size", lambda group: 2)
    yield
    dist.destroy_process_group()
