"""The row-sharded head (``forward_rows`` through ``GlobalBatchStep``) on 2 gloo workers equals one process's dense
head in fp64, for a covering set of cases run in one process group (head options, losses, caching, tiles, ABC)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from pipeline.core.abc import ABCHead
from pipeline.core.backbones import build_backbone
from pipeline.core.losses import make_loss
from pipeline.core.model import ABCModel, Rows, TransFusion, TransFusionHead, bce_loss
from pipeline.training.step import GlobalBatchStep
from tests.training.ranks import run_ranks, shard
from tests.training.test_step import assert_grads_close

B, SHAPE = 8, (1, 6, 6)  # 8 images, two views each; 4 a worker
LABELS = torch.tensor([0, 1, 2, 0, 1, 2, 0, 3])  # class 3 is a singleton: a row without a positive


@dataclass(frozen=True)
class Case:
    depth: int = 2
    scope: str = "joint"
    truncated: bool = False
    activation: str = "relu"
    qk_init: str = "default"
    loss: str = "jsd"
    mode: str = "self"  # self | sup
    chunk: int | None = None  # gradient caching
    tile: int | None = None  # the head's and the loss's column tile
    compatibility: str = "multiplicative"  # ABC's (loss="bce"), and its kernel and positive weight:
    kernel: str = "logits"
    pos_weight: float | str = "balanced"

    @property
    def layout(self) -> str:
        return "two_view" if self.mode == "self" else "labels"


PAIRWISE = ("jsd", "jsd_appendix_e", "kl_softmax", "kl_relu", "kl_squared", "supcon", "dcl")
CASES = [
    # every head option
    Case(depth=0), Case(depth=1, scope="per_view", qk_init="identity"), Case(depth=3, truncated=True, qk_init="tied"),
    Case(depth=3, scope="per_view", truncated=True), Case(depth=1, activation="softmax"),
    Case(depth=2, activation="sigmoid", scope="per_view"), Case(depth=2, activation="identity"),
    # every loss, both modes
    *[Case(loss=name, mode=mode) for name in PAIRWISE for mode in ("self", "sup")],
    Case(loss="infonce"), Case(loss="barlow_twins"),
    # gradient caching
    Case(chunk=3), Case(chunk=5, truncated=True, loss="supcon", mode="sup"),
    # the head's attention and the loss over column tiles (16 rows: tiles of 3, 4, 5 leave ragged ends)
    Case(tile=5), Case(tile=3, depth=3, truncated=True, scope="per_view", loss="supcon", mode="sup"),
    Case(tile=4, activation="softmax", loss="kl_softmax", mode="sup"),
    Case(tile=4, activation="sigmoid", loss="infonce"), Case(tile=5, chunk=3, loss="dcl"),
    # ABC (depth: its SAB blocks), both compatibilities and kernels, both modes, gradient caching
    Case(loss="bce", mode="sup"), Case(loss="bce", mode="self", depth=1, kernel="paper", pos_weight=2.0),
    Case(loss="bce", mode="sup", compatibility="additive", kernel="paper"),
    Case(loss="bce", mode="self", compatibility="additive", depth=0, pos_weight=1.0, chunk=3),
]


def make_model(case: Case) -> TransFusion:
    torch.manual_seed(0)
    bb, dim = build_backbone("mlp", SHAPE, embed_dim=12, hidden_dim=16)
    if case.loss == "bce":
        return ABCModel(bb, dim, ABCHead(dim, depth=case.depth, heads=2, width=8, compatibility=case.compatibility,
                                         kernel=case.kernel)).double()
    head = TransFusionHead(dim, case.depth, case.activation, truncate_last=case.truncated,
                           fusion_scope=case.scope, qk_init=case.qk_init)
    return TransFusion(bb, dim, head).double()


def make_batch(mode: str):
    g = torch.Generator().manual_seed(1)
    v1 = torch.rand(B, *SHAPE, generator=g, dtype=torch.float64)
    v2 = (v1 + 0.1 * torch.rand(B, *SHAPE, generator=g, dtype=torch.float64)).clamp(0, 1)
    return v1, v2, (torch.arange(B) if mode == "self" else LABELS)


def run_case(case: Case, rank: int, world: int, tile: int | None = None):
    """(loss, {name: grad}) of one step on this rank's shard of the batch."""
    model = make_model(case)
    loss_fn = bce_loss(case.pos_weight) if case.loss == "bce" else make_loss(case.loss)
    step = GlobalBatchStep(model, loss_fn, grad_cache_chunk=case.chunk, layout=case.layout, tile=tile)
    loss = step(*shard(*make_batch(case.mode), rank, world))
    return loss, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def gathered_dtypes(rank: int, world: int) -> list[torch.dtype]:
    """The dtypes the sharded head gathers in one bf16-autocast step of an fp32 model."""
    import pipeline.training.step as step_mod

    seen, gather = [], step_mod.gather_views

    def recording(t, w):
        seen.append(t.dtype)
        return gather(t, w)

    step_mod.gather_views = recording
    try:
        model = make_model(Case(depth=2)).float()
        x, ids = shard(*make_batch("self"), rank, world)
        step = GlobalBatchStep(model, make_loss("jsd"), layout="two_view", autocast_dtype=torch.bfloat16)
        step(x.float(), ids)
    finally:
        step_mod.gather_views = gather
    return seen


def _worker(rank, world, cases):
    return [run_case(c, rank, world, tile=c.tile) for c in cases] + [gathered_dtypes(rank, world)]


def assert_same(got, want, rtol=1e-9):
    (loss, grads), (ref_loss, ref_grads) = got, want
    assert loss == pytest.approx(ref_loss, rel=rtol, abs=1e-12)
    assert_grads_close(grads, ref_grads, rtol)


@pytest.mark.slow
def test_two_sharded_workers_equal_one_dense_process(tmp_path):
    ranks = run_ranks(tmp_path, _worker, CASES)
    for i, case in enumerate(CASES):
        want = run_case(case, 0, 1)  # one process, the dense head on the whole batch
        for r in range(2):
            assert_same(ranks[r][i], want), (case, r)
    # under bf16 autocast the keys and values (one gather a block) and the loss's embeddings go in bf16, not fp32
    assert ranks[0][-1] == ranks[1][-1] == [torch.bfloat16] * 3


HEAD_OPTIONS = [Case(depth=0), Case(depth=1, scope="per_view", qk_init="identity"),
                Case(depth=3, truncated=True, qk_init="tied"), Case(depth=2, activation="softmax"),
                Case(depth=2, activation="sigmoid", scope="per_view", truncated=True),
                Case(depth=2, activation="identity")]


@pytest.mark.parametrize("tile", [None, 1, 3, 64])
@pytest.mark.parametrize("case", HEAD_OPTIONS, ids=str)
def test_the_row_path_on_one_process_equals_the_dense_head(case, tile):
    """forward_rows over all rows (Rows.whole), dense or in tiles: the dense head's q and k and their gradients."""
    model = make_model(case)
    z = torch.randn(10, 12, dtype=torch.float64, requires_grad=True)
    full = model.head(z, views=2)
    rows = model.head.forward_rows(z, Rows.whole(10), views=2, tile=tile)
    for got, want in ((rows.q, full.q), (rows.k, full.k)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    w = torch.randn_like(full.q)
    grads = [torch.autograd.grad(((o.q + 2 * o.k) * w).sum(), [z, *model.head.parameters()], allow_unused=True)
             for o in (full, rows)]
    for a, b in zip(*grads, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


def test_rows_that_do_not_split_into_the_views_are_refused():
    head = TransFusionHead(4, 1, fusion_scope="per_view")
    with pytest.raises(ValueError, match="fusion groups"):
        head.forward_rows(torch.randn(3, 4), Rows.whole(3), views=2)
