"""Global BatchNorm in one process: conversion keeps checkpoints, world size 1 is nn.BatchNorm, the math is exact.

The two-worker equality (global statistics, gradients, running statistics) is in tests/training/test_step.py; the fused
(CUDA) path, run on CPU with reference kernels, and the passes over the activations in test_batchnorm_passes.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeline.core.backbones import build_backbone
from pipeline.core.batchnorm import GlobalBatchNorm, GlobalBatchNormFn, convert_batchnorm, has_batchnorm


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 6),
                         nn.BatchNorm1d(6, momentum=None), nn.BatchNorm1d(6, affine=False)).double()


def test_conversion_keeps_parameters_buffers_and_checkpoints():
    net = _net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    params = list(net.parameters())
    convert_batchnorm(net)
    assert [type(m) for m in net if "BatchNorm" in type(m).__name__] == [GlobalBatchNorm] * 3
    assert list(net.parameters()) == params and all(a is b for a, b in zip(net.parameters(), params, strict=True))
    after = net.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert net[5].momentum is None and not net[6].affine and net[6].weight is None
    plain = _net()  # a checkpoint of the converted model loads into a plain model, strictly
    with torch.no_grad():
        net[1].running_mean.add_(1.5)
    plain.load_state_dict(net.state_dict(), strict=True)
    assert torch.equal(plain[1].running_mean, net[1].running_mean)


def test_conversion_of_a_resnet_and_of_a_bare_batchnorm():
    bb, _ = build_backbone("resnet18_cifar", (3, 8, 8))
    n_bn = sum(isinstance(m, nn.BatchNorm2d) for m in bb.modules())
    convert_batchnorm(bb)
    assert n_bn == 20 and sum(isinstance(m, GlobalBatchNorm) for m in bb.modules()) == n_bn
    assert not any(type(m) is nn.BatchNorm2d for m in bb.modules())
    bare = nn.BatchNorm2d(3)
    assert isinstance(convert_batchnorm(bare), GlobalBatchNorm)
    assert has_batchnorm(bb) and not has_batchnorm(build_backbone("cnn_small", (1, 8, 8), 16)[0])


@pytest.mark.parametrize("training", [True, False])
def test_world_of_one_is_exactly_nn_batchnorm(training):
    plain, glob = _net(), convert_batchnorm(_net())
    plain.train(training), glob.train(training)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):  # running statistics over several steps, momentum 0.1 and None (cumulative)
        x = torch.randn(5, 2, 6, 6, generator=g, dtype=torch.float64) * 2 + 1
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = plain(xa), glob(xb)
        assert torch.equal(ya, yb)
        ya.square().sum().backward(), yb.square().sum().backward()
        assert torch.equal(xa.grad, xb.grad)
    for (k, a), (_, b) in zip(plain.state_dict().items(), glob.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    for a, b in zip(plain.parameters(), glob.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("shape", [(7, 3), (4, 3, 5, 5)])
def test_global_function_matches_batch_norm_in_a_world_of_one(world_of_one, shape):
    """The custom autograd Function (collectives included) against F.batch_norm: values and every gradient."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, dtype=torch.float64) * 3 + 2
    w = torch.rand(3, generator=g, dtype=torch.float64) + 0.5
    b = torch.randn(3, generator=g, dtype=torch.float64)
    up = torch.randn(*shape, generator=g, dtype=torch.float64)
    xs, ws, bs = ([t.clone().requires_grad_() for _ in range(2)] for t in (x, w, b))
    ref = F.batch_norm(xs[0], None, None, ws[0], bs[0], training=True, eps=1e-5)
    ours, mean, var, count = GlobalBatchNormFn.apply(xs[1], ws[1], bs[1], 1e-5, None)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    dims = [0, *range(2, x.dim())]
    torch.testing.assert_close(mean, x.mean(dims)), torch.testing.assert_close(var, x.var(dims, correction=0))
    assert int(count) == x.numel() // 3
    (ref * up).sum().backward(), (ours * up).sum().backward()
    for a, c in ((xs, "x"), (ws, "weight"), (bs, "bias")):
        torch.testing.assert_close(a[1].grad, a[0].grad, rtol=1e-10, atol=1e-12, msg=c)
    assert torch.autograd.gradcheck(lambda x_, w_, b_: GlobalBatchNormFn.apply(x_, w_, b_, 1e-5, None)[0],
                                    (x.clone().requires_grad_(), w.clone().requires_grad_(),
                                     b.clone().requires_grad_()))


def test_fp32_statistics_do_not_cancel_with_a_large_mean(world_of_one):
    """Post-ReLU-like activations with |mean| >> std: Σx²/N − μ² in fp32 would lose the variance."""
    g = torch.Generator().manual_seed(0)
    x64 = 1000.0 + 0.01 * torch.randn(64, 4, 3, 3, generator=g, dtype=torch.float64)
    _, _, var, _ = GlobalBatchNormFn.apply(x64.float(), None, None, 1e-5, None)
    true = x64.var([0, 2, 3], correction=0)
    naive = (x64.float().square().mean([0, 2, 3]) - x64.float().mean([0, 2, 3]).square())  # the sums form
    assert float(((var.double() - true) / true).abs().max()) < 1e-2
    assert float(((naive.double() - true) / true).abs().max()) > 1.0  # what the centred moments avoid
