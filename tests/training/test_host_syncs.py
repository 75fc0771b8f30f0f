"""No host sync inside a lazy step (``measure.OpCounter``: the aten ops that make the host wait on CUDA). Its blind
spot: ``.tolist()`` / ``.numpy()`` of a CPU tensor dispatch no op, so the step's path uses neither."""

from __future__ import annotations

import pytest
import torch

from pipeline.config.model import ModelConfig
from pipeline.core.losses import LOSS_NAMES, SELF_SUPERVISED_ONLY, make_loss
from pipeline.core.model import build_model
from pipeline.core.targets import check_layout
from pipeline.training import measure
from pipeline.training.step import GlobalBatchStep
from tests.training.small import digits, small_loop

B, SHAPE = 8, (1, 8, 8)
LABELS = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])  # supervised: several positives per row


def count(fn) -> list[str]:
    """The syncing ops ``fn`` runs, by reason (``measure.OpCounter``, shared with benchmarks/bench_comm.py)."""
    return measure.count(fn).syncs


# ------------------------------------------------------------------------------------- the counter counts
def test_the_counter_catches_each_kind_of_sync():
    t = torch.tensor([3.0, 0.0, 2.0, 3.0])
    mask = t > 1
    catches = {
        "float": lambda: float(t.sum()), "item": lambda: t[0].item(), "bool": lambda: bool((t > 0).all()),
        "if": lambda: 1 if t.sum() > 0 else 0, "nonzero": lambda: t.nonzero(), "where(cond)": lambda: torch.where(mask),
        "unique": lambda: torch.unique(t), "unique_consecutive": lambda: torch.unique_consecutive(t),
        "repeat_interleave": lambda: torch.repeat_interleave(torch.tensor([1, 2])),
        "repeat_interleave(x, t)": lambda: t.repeat_interleave(torch.tensor([1, 0, 2, 1])),
        "bool-mask index": lambda: t[mask], "masked_select": lambda: t.masked_select(mask),
        "bool-mask assignment": lambda: t.clone().index_put_((mask,), torch.tensor(0.0)),
        "equal": lambda: torch.equal(t, t), "bincount": lambda: torch.bincount(torch.tensor([0, 2])),
    }
    for what, fn in catches.items():
        assert count(fn), what
    # and the sync-free twins are not counted
    free = {
        "repeat_interleave with output_size": lambda: t.repeat_interleave(torch.tensor([1, 0, 2, 1]), output_size=4),
        "repeat_interleave by an int": lambda: t.repeat_interleave(2), "long index": lambda: t[torch.tensor([0, 2])],
        "masked_fill": lambda: t.masked_fill(mask, 0.0), "where": lambda: torch.where(mask, t, 0.0),
        "index_put accumulate": lambda: t.clone().index_put_((torch.tensor([0, 0]),), torch.ones(2), accumulate=True),
        "sort + searchsorted": lambda: torch.searchsorted(t.sort().values, t),
        "nonzero_static": lambda: torch.nonzero_static(mask, size=4),
    }
    for what, fn in free.items():
        assert count(fn) == [], what


# ------------------------------------------------------------------------------------- one lazy step: zero
def make_model(**model) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig(**{"backbone": "cnn_small", "embed_dim": 16, **model}), SHAPE)


def make_batch(mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x (2B, ...) = [view 1; view 2] and ids (2B,) as ``PretrainLoop`` makes them."""
    g = torch.Generator().manual_seed(1)
    v1 = torch.rand(B, *SHAPE, generator=g)
    v2 = (v1 + 0.1 * torch.rand(B, *SHAPE, generator=g)).clamp(0, 1)
    ids = torch.arange(B) if mode == "self_supervised" else LABELS
    return torch.cat([v1, v2]), torch.cat([ids, ids])


def layout_of(mode: str) -> str:
    return "two_view" if mode == "self_supervised" else "labels"


MODES = [(name, mode) for name in LOSS_NAMES for mode in ("self_supervised", "supervised")
         if mode == "self_supervised" or name not in SELF_SUPERVISED_ONLY]


@pytest.mark.parametrize("name,mode", MODES)
def test_lazy_step_has_no_host_sync(name, mode):
    step = GlobalBatchStep(make_model(), make_loss(name), layout=layout_of(mode))
    x, ids = make_batch(mode)
    first = count(lambda: step.lazy(x, ids))  # the first step checks the ids against the layout, once
    assert first == count(lambda: check_layout(ids, layout_of(mode)))
    assert count(lambda: step.lazy(x, ids)) == []
    assert count(lambda: step.lazy(x, ids)) == []


@pytest.mark.parametrize("name,mode", [("jsd", "self_supervised"), ("supcon", "supervised"),
                                       ("barlow_twins", "self_supervised")])
@pytest.mark.parametrize("variant", ["truncated", "per_view", "grad_cache", "autocast"])
def test_lazy_step_has_no_host_sync_in_every_configuration(name, mode, variant):
    model = {"truncated": {"head": "truncated", "depth": 2}, "per_view": {"fusion_scope": "per_view"}}
    step = GlobalBatchStep(make_model(**model.get(variant, {})), make_loss(name), layout=layout_of(mode),
                           grad_cache_chunk=5 if variant == "grad_cache" else None,
                           autocast_dtype=torch.bfloat16 if variant == "autocast" else None)
    x, ids = make_batch(mode)
    step.lazy(x, ids)
    assert count(lambda: step.lazy(x, ids)) == []


@pytest.mark.parametrize("name,mode", [("jsd", "self_supervised"), ("supcon", "supervised")])
def test_without_a_layout_the_step_syncs(name, mode):
    """The control: the ids-reading default path does sync, so the zeros above are the layouts' doing."""
    step = GlobalBatchStep(make_model(), make_loss(name))
    x, ids = make_batch(mode)
    step.lazy(x, ids)
    assert count(lambda: step.lazy(x, ids))


# ------------------------------------------------------------------------------------- the loop passes the layout
@pytest.mark.parametrize("mode,loss", [("self_supervised", "jsd"), ("supervised", "supcon")])
def test_the_loops_step_has_no_host_sync(mode, loss):
    from pipeline.data.split import to_float

    data = digits(64, 16)
    loop = small_loop(f"train.mode={mode}", f"loss.name={loss}", "train.batch_size=16", "model.embed_dim=16",
                      data=data, defer_sync=True)
    assert loop.step.layout == layout_of(mode)
    x = to_float(data.train.x[:16])
    ids = torch.arange(16) if mode == "self_supervised" else data.train.y[:16]
    x, ids = torch.cat([x, x.flip(-1)]), torch.cat([ids, ids])
    loop.step.lazy(x, ids)
    assert count(lambda: loop.step.lazy(x, ids)) == []


# ------------------------------------------------------------------------------------- the epoch's health: one read
@pytest.mark.parametrize("depth", [2])
def test_the_loops_health_reads_its_numbers_once(monkeypatch, depth):
    """Rank 0's per-epoch health (other ranks wait at the report meanwhile): no syncing op, and one
    ``read_health`` of every block's numbers (on CPU its ``.cpu().tolist()`` is the counter's blind spot; on a GPU
    it is the one device -> host copy). Before, each slice of rows of each block read 2-3 ``int()``."""
    from pipeline.training import loop as loop_module

    loop = small_loop("train.batch_size=16", "model.embed_dim=16", f"model.depth={depth}", data=digits(64, 16))
    reads = []
    real = loop_module.read_health
    monkeypatch.setattr(loop_module, "read_health", lambda stats: reads.append(len(stats)) or real(stats))
    health = {}
    assert count(lambda: health.update(loop.health(chunk=8))) == []
    assert reads == [depth] and len(health) == depth * 5
    assert all(isinstance(v, float) for k, v in health.items() if not k.endswith(("same_class", "other_view")))
