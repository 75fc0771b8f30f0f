"""pipeline.training.comm: buckets in backward order, and 2 gloo workers whose overlapped sums (and the loss riding in a
bucket) equal one coalesced all-reduce bit for bit, with buckets started during the backward, for every backbone
family (BatchNorm included)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipeline.training.comm import GradReducer, buckets_of
from tests.training.ranks import run_ranks, shard
from tests.training.test_step import BACKBONES, B, grads_of, make_batch, make_model


def test_buckets_follow_the_backward_order_and_their_size():
    layers = nn.Sequential(nn.Linear(100, 100), nn.Linear(100, 10), nn.Linear(10, 10))  # 10100, 1010, 110 params
    params = list(layers.parameters())
    one = buckets_of(params, bucket_mb=1.0)
    assert one == [list(reversed(params))]  # all in one bucket, last layer first
    small = buckets_of(params, bucket_mb=4000 / 2**20)  # 4000 bytes = 1000 fp32 values
    assert [p for b in small for p in b] == list(reversed(params))
    assert [sum(p.numel() for p in b) for b in small] == [10 + 100 + 10 + 1000, 100 + 10000]  # closed once full
    mixed = buckets_of([nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3, dtype=torch.float64))])
    assert [[p.dtype for p in b] for b in mixed] == [[torch.float64], [torch.float32]]  # one dtype per bucket


def _worker(rank: int, world: int) -> dict:
    from pipeline.core.batchnorm import convert_batchnorm
    from pipeline.core.losses import make_loss
    from pipeline.training.step import GlobalBatchStep, allreduce_grads

    out = {}
    for backbone, shape in BACKBONES:
        model = convert_batchnorm(make_model(backbone=backbone, shape=shape, dtype=torch.float32))
        x, i = shard(*make_batch("self", shape, torch.float32), rank, world)
        step = GlobalBatchStep(model, make_loss("jsd"), layout="two_view")
        step.reducer = GradReducer(step.params, bucket_mb=0.05)  # small buckets: many start mid-backward
        step.lazy(x, i)  # the first step of a batch size gathers and checks the ids
        total = step.lazy(x, i)  # the second uses the layout's ids; the loss's sum rode in a gradient bucket
        overlapped, early, buckets = grads_of(model), step.reducer.launched_early, len(step.reducer.buckets)
        step.reducer.remove()
        for p in step.params:  # the coalesced sum after the backward, on the same local gradients
            p.grad = None
        loss = step._head_loss(model.backbone(x), i, world, rank)  # noqa: SLF001 (white-box: the head alone)
        summed = loss.detach().clone()
        dist.all_reduce(summed)
        loss.backward()
        allreduce_grads(step.params)
        out[backbone] = (overlapped, grads_of(model), early, buckets, total, summed)
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_overlapped_sums_equal_the_coalesced_all_reduce_bit_for_bit(tmp_path):
    ranks = run_ranks(tmp_path, _worker)
    for backbone, _ in BACKBONES:
        for out in ranks:
            overlapped, coalesced, early, buckets, total, summed = out[backbone]
            assert torch.equal(total, summed), backbone  # the global loss, with no collective of its own
            assert overlapped.keys() == coalesced.keys() and overlapped
            for name in coalesced:
                assert torch.equal(overlapped[name], coalesced[name]), (backbone, name)
            least = 1 if backbone in ("pixels", "mlp") else 2  # the small models fit one bucket
            assert early == buckets >= least, (backbone, early, buckets)  # every bucket started mid-backward
        for name, g in ranks[0][backbone][0].items():  # and every rank holds the same sums
            assert torch.equal(g, ranks[1][backbone][0][name]), (backbone, name)


# ------------------------------------------------------------------------------------- one fixed launch order
@pytest.fixture()
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_buckets_launch_in_index_order_whatever_order_the_hooks_fire(one_rank, seed):
    layers = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])
    reducer = GradReducer(list(layers.parameters()), bucket_mb=300 / 2**20)  # 300 bytes: a bucket per layer or so
    n = len(reducer.buckets)
    assert n >= 4
    params = [p for b in reducer.buckets for p in b.params]
    order = torch.randperm(len(params), generator=torch.Generator().manual_seed(seed)).tolist()
    reducer.start()
    for i in order:  # the hooks, fired in a scrambled order (as another rank's autograd might)
        params[i].grad = torch.full_like(params[i], float(i))
        reducer._ready(params[i])  # noqa: SLF001 (white-box: what a gradient hook calls)
        # a bucket is launched only once every bucket before it is
        assert reducer.launched == list(range(len(reducer.launched)))
    reducer.finish()
    assert reducer.launched == list(range(n)) and reducer.launched_early == n
    for i, p in enumerate(params):
        assert torch.equal(p.grad, torch.full_like(p, float(i)))  # one rank: the sum is the gradient
    reducer.remove()


def test_parameters_without_a_gradient_in_the_first_step_are_dropped(one_rank):
    """The head's bucket waits for the truncated head's unused projection in the first step only (the steps after:
    test_two_ranks_launch_in_the_same_fixed_order_with_a_truncated_head); a dropped parameter's gradient later is
    refused, not silently left out of the sum."""
    model = make_model(truncated=True)  # the last block's value projection is never used
    reducer = GradReducer([p for p in model.parameters()], bucket_mb=0.05)
    x = torch.rand(2 * B, 1, 8, 8, dtype=torch.float64)

    def loss() -> torch.Tensor:
        out = model(x)
        return (out.q * out.k).sum()

    reducer.start()
    loss().backward()
    reducer.finish()
    assert len(reducer.unused) == 2 and reducer.launched_early < len(reducer.buckets)
    reducer.start()
    value = model.head.blocks[1].value
    with pytest.raises(RuntimeError, match="the step's graph changed"):
        (loss() + value(torch.ones(1, value.in_features, dtype=torch.float64)).sum()).backward()
    reducer.remove()


def _order_worker(rank: int, world: int) -> tuple:
    from pipeline.core.batchnorm import convert_batchnorm
    from pipeline.core.losses import make_loss
    from pipeline.training.step import GlobalBatchStep, allreduce_grads

    model = convert_batchnorm(make_model(truncated=True, dtype=torch.float32))
    names = {id(p): n for n, p in model.named_parameters()}
    x, i = shard(*make_batch("self", dtype=torch.float32), rank, world)
    step = GlobalBatchStep(model, make_loss("jsd"), layout="two_view")
    step.reducer = GradReducer(step.params, bucket_mb=0.01)
    steps = []
    for _ in range(3):
        total = step.lazy(x, i)
        r = step.reducer
        steps.append((list(r.launched), r.launched_early, [[names[id(p)] for p in bk.params] for bk in r.buckets]))
    overlapped = grads_of(model)
    unused = sorted(names[id(p)] for p in step.reducer.unused)
    step.reducer.remove()
    for p in step.params:
        p.grad = None
    loss = step._head_loss(model.backbone(x), i, world, rank)  # noqa: SLF001 (white-box: the head alone)
    loss.backward()
    allreduce_grads(step.params)
    return steps, unused, overlapped, grads_of(model), total


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_ranks_launch_in_the_same_fixed_order_with_a_truncated_head(tmp_path):
    ranks = run_ranks(tmp_path, _order_worker)
    assert ranks[0][0] == ranks[1][0]  # the same buckets, launched in the same order, in every step
    for steps, unused, overlapped, coalesced, _ in ranks:
        assert unused == ["head.blocks.1.value.bias", "head.blocks.1.value.weight"]
        for launched, early, buckets in steps[1:]:
            assert launched == list(range(len(buckets))) and early == len(buckets) >= 2
            assert "head.blocks.1.key.weight" in buckets[0]  # the head's bucket, launched during the backward
            assert all(n not in unused for bk in buckets for n in bk)
        assert overlapped.keys() == coalesced.keys() and overlapped
        for name in coalesced:
            assert torch.equal(overlapped[name], coalesced[name]), name
