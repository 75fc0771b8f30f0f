"""Tests of pipeline.core.tiled_losses, the one implementation of the pairwise losses: with ``tile=`` narrower
than, as wide as and wider than the batch, values and gradients against the dense path (``tile=None``, which
tests/core/test_losses.py checks against its loops over i, j); the Functions' gradients against finite
differences; what backward keeps, the peak memory and the host syncs."""

from __future__ import annotations

import pytest
import torch

from pipeline.core.losses import SELF_SUPERVISED_ONLY, barlow_twins, dcl, infonce, jsd, make_loss
from pipeline.core.targets import positives, self_supervised_ids
from pipeline.core.tiled_losses import NormalizedAffinityLoss, SoftmaxAffinityLoss, use_tiles
from pipeline.training import measure
from tests.core.test_losses import big_saved

NORMALIZED = ("jsd", "jsd_appendix_e", "kl_relu", "kl_squared")
SOFTMAX = ("kl_softmax", "infonce", "supcon", "dcl")
PAIRWISE = NORMALIZED + SOFTMAX
N, D = 10, 4
SUP_IDS = [2, 0, 1, 0, 2, 1, 3, 0, 1, 2]  # supervised labels; class 3 is a singleton (a row without a positive)
TILES = (1, 3, 4, N, N + 3)  # 4 does not divide n = 10; tile >= n is the dense path, one tile
ROWS = (None, slice(2, 7))


def make_ids(kind: str, n: int = N) -> torch.Tensor:
    return self_supervised_ids(n // 2) if kind == "self" else torch.tensor(SUP_IDS[:n])


def allowed(name: str, kind: str, layout: str | None) -> bool:
    if name in SELF_SUPERVISED_ONLY and (kind == "sup" or layout == "labels"):
        return False  # infonce refuses these (tested below)
    return layout != "two_view" or kind == "self"


CASES = [(name, kind, layout) for name in PAIRWISE for kind in ("self", "sup")
         for layout in (None, "two_view", "labels") if allowed(name, kind, layout)]


def make_qk(seed: int, n: int = N, d: int = D, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(n, d, generator=g, dtype=dtype).requires_grad_() for _ in range(2))


def value_and_grads(name, q, k, ids, temperature=0.1, **kw) -> tuple[torch.Tensor, ...]:
    loss = make_loss(name, temperature=temperature)(q, k, ids, **kw)
    return (loss.detach(), *torch.autograd.grad(loss, (q, k)))


def assert_close(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], tol: float, what: str) -> None:
    """Each tensor of ``got`` within ``tol`` of ``want``, relative to the largest entry of ``want`` (or 1)."""
    for label, x, y in zip(("value", "grad q", "grad k"), got, want, strict=True):
        scale = max(1.0, y.abs().max().item())
        err = (x - y).abs().max().item()
        assert err <= tol * scale, f"{what}: {label} off by {err:.3g} (scale {scale:.3g})"


# ------------------------------------------------------------------------------------- tiled == dense
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("name,kind,layout", CASES)
def test_tiled_equals_dense_fp64(name, kind, layout, rows):
    ids = make_ids(kind)
    q, k = make_qk(seed=len(name) + 7 * (rows is None))
    dense = value_and_grads(name, q, k, ids, rows=rows, layout=layout)
    assert dense[0].abs() > 0  # a loss that can be wrong
    for tile in TILES:
        tiled = value_and_grads(name, q, k, ids, rows=rows, layout=layout, tile=tile)
        if tile >= N:  # the dense path: bit for bit
            assert all(torch.equal(x, y) for x, y in zip(tiled, dense, strict=True)), tile
        else:
            assert_close(tiled, dense, 1e-12, f"tile {tile}")


@pytest.mark.parametrize("name", PAIRWISE)
def test_gradients_finite_at_exact_zeros(name):
    """One-hot embeddings: cosines of exactly 0 and 1 (ties in the running max, zero positives for kl_relu)."""
    ids = self_supervised_ids(4)
    z = torch.nn.functional.one_hot(ids, 8).double().requires_grad_(True)
    for layout in (None, "two_view"):
        loss = make_loss(name)(z, z, ids, layout=layout, tile=3)
        (grad,) = torch.autograd.grad(loss, z)
        dense = torch.autograd.grad(make_loss(name)(z, z, ids, layout=layout), z)[0]
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        torch.testing.assert_close(grad, dense, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name,kind,layout", [("jsd", "self", "two_view"), ("kl_relu", "sup", "labels"),
                                              ("supcon", "sup", None), ("dcl", "self", "labels"),
                                              ("infonce", "self", "two_view"), ("jsd_appendix_e", "sup", None)])
def test_tiled_equals_dense_fp32(name, kind, layout):
    n = 64
    ids = self_supervised_ids(n // 2) if kind == "self" else torch.arange(n) % 7
    q, k = make_qk(seed=3, n=n, d=16, dtype=torch.float32)
    dense = value_and_grads(name, q, k, ids, rows=slice(5, 50), layout=layout)
    tiled = value_and_grads(name, q, k, ids, rows=slice(5, 50), layout=layout, tile=9)
    assert_close(tiled, dense, 1e-5, "fp32")


@pytest.mark.parametrize("name", PAIRWISE)
def test_one_function_dense_keeps_its_block_tiled_keeps_none_and_row_slices_add_up(name):
    """Any tile runs the family's one Function; as wide as the batch it keeps its (r, n) block for backward, narrower
    nothing (r, n). Tiled row slices add up to the whole, as dense ones do."""
    q, k = make_qk(seed=1, n=40)
    ids = self_supervised_ids(20)
    family = NormalizedAffinityLoss if name in NORMALIZED else SoftmaxAffinityLoss
    for tile in (None, 7, 40, 50):
        assert type(make_loss(name)(q, k, ids, tile=tile).grad_fn).__name__ == family.__name__ + "Backward"
    for layout in (None, "two_view"):
        for tile, kept in [(40, 1), (39, 0)]:
            assert big_saved(lambda t=tile, lay=layout: make_loss(name)(q, k, ids, layout=lay, tile=t), 40) == kept
    q, k = make_qk(seed=1)
    whole = make_loss(name)(q, k, make_ids("self"), tile=3)
    parts = sum(make_loss(name)(q, k, make_ids("self"), rows=slice(a, b), tile=3) for a, b in [(0, 4), (4, 4), (4, N)])
    torch.testing.assert_close(parts, whole, rtol=1e-12, atol=1e-12)


def test_empty_row_slice_gives_zero():
    q, k = make_qk(seed=2)
    for name in PAIRWISE:
        loss = make_loss(name)(q, k, make_ids("self"), rows=slice(3, 3), layout="two_view", tile=3)
        loss.backward()
        assert loss.item() == 0.0 and not q.grad.any() and not k.grad.any(), name
        q.grad = k.grad = None


# ------------------------------------------------------------------------------------- arguments
def test_the_argument_checks_are_the_dense_ones():
    q, k = make_qk(seed=5)
    sup = make_ids("sup")
    with pytest.raises(ValueError, match="one positive per row"):
        infonce(q, k, sup, tile=3)  # the None layout's validation still runs
    with pytest.raises(ValueError, match="one positive per row"):
        infonce(q, k, make_ids("self"), layout="labels", tile=3)
    with pytest.raises(ValueError, match="single id"):
        dcl(q, k, torch.zeros(N, dtype=torch.int64), tile=3)
    assert torch.isnan(dcl(q, k, torch.zeros(N, dtype=torch.int64), layout="labels", tile=3))  # unchecked: NaN
    with pytest.raises(ValueError, match="even number"):
        jsd(q[:9], k[:9], sup[:9], layout="two_view", tile=3)
    with pytest.raises(ValueError, match="unknown layout"):
        jsd(q, k, sup, layout="pairs", tile=3)
    for bad in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="tile must be"):
            jsd(q, k, sup, tile=bad)
    assert not use_tiles(None, 5) and use_tiles(4, 5) and not use_tiles(5, 5)


def test_barlow_twins_ignores_tile():
    q, k = make_qk(seed=6)
    ids = make_ids("self")
    assert torch.equal(barlow_twins(q, k, ids, tile=3), barlow_twins(q, k, ids))
    assert torch.equal(make_loss("barlow_twins")(q, k, ids, rows=slice(0, 4), tile=2),
                       barlow_twins(q, k, ids, rows=slice(0, 4)))


# ------------------------------------------------------------------------------------- gradcheck
@pytest.mark.parametrize("tile", [4, 6, 9])  # narrower than, as wide as and wider than n = 6
@pytest.mark.parametrize("layout", ["two_view", "labels", None])
@pytest.mark.parametrize("kind,power", [(kind, 2.0) for kind in PAIRWISE] + [("jsd", 1.5), ("jsd", 5.0)])
def test_gradcheck_of_the_functions(kind, power, layout, tile):
    n, start, stop = 6, 1, 5
    ids = self_supervised_ids(3) if layout == "two_view" or kind == "infonce" else torch.tensor([0, 1, 0, 2, 1, 0])
    pos = positives(ids, start, stop, layout, use_tiles(tile, n))
    q, k = make_qk(seed=8, n=n, d=3)
    q = q[start:stop].detach().requires_grad_()
    if kind in NORMALIZED:
        fn = lambda a, b: NormalizedAffinityLoss.apply(a, b, pos, start, n, kind, tile, power)  # noqa: E731
    else:
        fn = lambda a, b: SoftmaxAffinityLoss.apply(a, b, pos, start, n, kind, tile, 0.5)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k), eps=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------- host syncs
@pytest.mark.parametrize("name,layout", [(name, layout) for name in PAIRWISE for layout in ("two_view", "labels", None)
                                         if layout == "two_view" or name not in SELF_SUPERVISED_ONLY
                                         and (layout == "labels" or name != "dcl")] + [("barlow_twins", "two_view")])
def test_tiled_layouts_have_no_host_sync(name, layout):
    """Forward and backward on whole batches and row slices (measure.OpCounter), dense with a layout hint and tiled;
    tiled, the None layout reads no pairs either (infonce's and dcl's validation syncs: left out)."""
    ids = self_supervised_ids(6) if layout == "two_view" else torch.tensor([0, 1, 2, 0] * 3)
    q, k = make_qk(seed=9, n=12, d=5)
    fn = make_loss(name)
    for tile in (None, 5) if layout else (5,):
        for rows in [None, slice(0, 5), slice(5, None), slice(3, 3)]:
            syncs = measure.count(lambda r=rows, t=tile: fn(q, k, ids, rows=r, layout=layout, tile=t).backward()).syncs
            assert syncs == [], (tile, rows, syncs)
    if layout is None:  # the control: the dense None layout reads the ids (one sync for the number of pairs)
        assert measure.count(lambda: fn(q, k, ids, layout=None).backward()).syncs


# ------------------------------------------------------------------------------------- memory and time
@pytest.mark.slow
@pytest.mark.parametrize("name,layout", [("jsd", "two_view"), ("jsd", None), ("infonce", "two_view"),
                                         ("infonce", None)])
def test_tiled_peak_memory(name, layout):
    """r = n = 4096, d = 128, tile 256: the tiled forward + backward peaks below 0.15 of the dense one's (fp32).
    Measured (measure.peak_bytes, CPU): jsd 8.2 MiB / 136.2 MiB (two_view), 13.1 / 132.2 (None); infonce 10.2 /
    132.1 (two_view), 15.2 / 132.2 (None)."""
    n, d = 4096, 128
    q, k = make_qk(seed=10, n=n, d=d, dtype=torch.float32)
    ids = self_supervised_ids(n // 2)
    fn = make_loss(name)

    def step(tile):
        q.grad = k.grad = None
        fn(q, k, ids, layout=layout, tile=tile).backward()

    dense, tiled = measure.peak_bytes(lambda: step(None)), measure.peak_bytes(lambda: step(256))
    assert dense > 2 * n * n * 4  # the dense path holds two (n, n) fp32 buffers
    assert tiled < 0.15 * dense, (tiled, dense)
