"""Global-batch fusion: 2 gloo workers give the gradients of one process on the concatenated batch."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeline.backbones import build_backbone
from pipeline.losses import make_loss
from pipeline.model import TransFusion, TransFusionHead
from pipeline.step import GlobalBatchStep, NonFiniteLossError, local_rows

B, SHAPE = 8, (1, 8, 8)  # 8 images, two views each


def make_model(seed: int = 0, depth: int = 2, truncated: bool = False) -> TransFusion:
    torch.manual_seed(seed)
    bb, dim = build_backbone("cnn_small", SHAPE, embed_dim=16)
    return TransFusion(bb, dim, TransFusionHead(dim, depth, truncate_last=truncated)).double()


def make_batch(mode: str):
    g = torch.Generator().manual_seed(1)
    v1 = torch.rand(B, *SHAPE, generator=g, dtype=torch.float64)
    v2 = (v1 + 0.1 * torch.rand(B, *SHAPE, generator=g, dtype=torch.float64)).clamp(0, 1)
    labels = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    img_ids = torch.arange(B) if mode == "self" else labels
    return v1, v2, img_ids


def grads_of(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def single_process(loss_name: str, mode: str, chunk=None, truncated=False):
    model = make_model(truncated=truncated)
    v1, v2, ids = make_batch(mode)
    step = GlobalBatchStep(model, make_loss(loss_name), grad_cache_chunk=chunk)
    loss = step(torch.cat([v1, v2]), torch.cat([ids, ids]))
    return loss, grads_of(model)


def _worker(rank, world, init_file, out_dir, loss_name, mode, chunk, no_gather, truncated):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        if no_gather:  # the control: a step that forgets to gather sees only its shard
            import pipeline.step as step_mod

            step_mod.gather_views = lambda z, w: z
            step_mod.gather_ids = lambda i, w: i
            step_mod.local_rows = lambda r, b, w: (slice(0, b), slice(b, 2 * b))
        model = make_model(truncated=truncated)
        v1, v2, ids = make_batch(mode)
        b = B // world
        mine = slice(rank * b, (rank + 1) * b)
        step = GlobalBatchStep(model, make_loss(loss_name), grad_cache_chunk=chunk)
        loss = step(torch.cat([v1[mine], v2[mine]]), torch.cat([ids[mine], ids[mine]]))
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump((loss, grads_of(model)), f)
    finally:
        dist.destroy_process_group()


def two_workers(tmp_path, loss_name, mode, chunk=None, no_gather=False, truncated=False):
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path), loss_name, mode, chunk, no_gather, truncated),
             nprocs=2, join=True)
    results = []
    for r in range(2):
        with open(tmp_path / f"rank{r}.pkl", "rb") as f:
            results.append(pickle.load(f))
    return results


def assert_grads_close(a, b, rtol=1e-5):
    """Every tensor within rtol, relative to itself and (for ~0 tensors) to the largest gradient."""
    assert a.keys() == b.keys()
    top = max(float(g.abs().max()) for g in b.values())
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=rtol, atol=rtol * top, msg=name)


CASES = [("jsd", "self", None, False), ("supcon", "sup", None, False), ("barlow_twins", "self", None, False),
         ("jsd_appendix_e", "self", 3, True)]


@pytest.mark.parametrize("loss_name,mode,chunk,truncated", CASES)
def test_two_gloo_workers_equal_one_process(tmp_path, loss_name, mode, chunk, truncated):
    ref_loss, ref_grads = single_process(loss_name, mode, truncated=truncated)
    results = two_workers(tmp_path, loss_name, mode, chunk=chunk, truncated=truncated)
    for loss, grads in results:
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert_grads_close(grads, ref_grads)


def test_without_the_gather_the_gradients_differ(tmp_path):
    _, ref_grads = single_process("jsd", "self")
    (loss0, grads0), _ = two_workers(tmp_path, "jsd", "self", no_gather=True)
    with pytest.raises(AssertionError):
        assert_grads_close(grads0, ref_grads)


@pytest.mark.parametrize("loss_name,mode", [("jsd", "self"), ("supcon", "sup"), ("barlow_twins", "self")])
@pytest.mark.parametrize("chunk", [1, 3, 5])
def test_grad_cache_equals_plain_step(loss_name, mode, chunk):
    loss, grads = single_process(loss_name, mode)
    loss_c, grads_c = single_process(loss_name, mode, chunk=chunk)
    assert loss_c == pytest.approx(loss, rel=1e-10)
    assert_grads_close(grads_c, grads, rtol=1e-9)


def test_local_rows_partition_the_global_batch():
    rows = [r for rank in range(4) for r in local_rows(rank, 3, 4)]
    covered = sorted(i for r in rows for i in range(r.start, r.stop))
    assert covered == list(range(24))


def test_non_finite_loss_raises_before_touching_grads():
    model = make_model()
    v1, v2, ids = make_batch("self")
    x = torch.cat([v1, v2])
    x[0, 0, 0, 0] = float("nan")
    step = GlobalBatchStep(model, make_loss("jsd"))
    with pytest.raises(NonFiniteLossError, match="non-finite"):
        step(x, torch.cat([ids, ids]))
    assert all(p.grad is None for p in model.parameters())
