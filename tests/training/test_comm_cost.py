"""benchmarks/bench_comm.py's cost model (global BN's collectives queue behind the gradient buckets on NCCL's one
communicator), its trace checked against the model's own buckets and BatchNorm layers."""

from __future__ import annotations

import importlib.util

import pytest

from tests.conftest import ROOT


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_comm", ROOT / "benchmarks" / "bench_comm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # ~30 s: resnet18_cifar's step under the FLOP counter
def test_with_global_batchnorm_the_buckets_hide_nothing_on_nccl(bench):
    from torch import nn

    total, start, ready, bn_backward, grads = bench.backward_trace(2)
    model = bench.build(1, bench.torch.device("cpu")).model
    assert len(bn_backward) == sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) == 20
    assert len(ready) == 2 and grads > 40e6  # two buckets of ~25 MB
    assert start < min(ready) < total and ready == sorted(ready)
    # what one stream per kind could hide, and what NCCL's one stream does: nothing after any bucket's launch
    assert total - min(ready) > 0.5 * (total - start)
    for r in ready:
        assert min([b for b in bn_backward if b >= r] + [total]) == r

