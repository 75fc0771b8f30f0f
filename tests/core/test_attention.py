"""fuse_rows, dense and tiled, against a slow loop over (i, j) and against each other; the fp16 dead row;
fuse_rows_bytes against a measured peak."""

from __future__ import annotations

import functools
import time

import pytest
import torch
import torch.nn.functional as F

from pipeline.config.model import ACTIVATIONS, AFFINITY_EPS
from pipeline.core.attention import fuse_rows, fuse_rows_bytes
from pipeline.training.measure import count, peak_bytes

EPS = AFFINITY_EPS


pytestmark = pytest.mark.usefixtures("one_thread")  # small matrices: one thread beats two contending ones


def reference(q, k, v, diag, activation):
    """out_i = Σ_j w_ij v_j, w_ij = (raw_ij + ε) / Σ_t (raw_it + ε), raw = act(q_i·k_j) with raw_i,diag(i) = 0,
    one scalar at a time (0-d tensors, so autograd gives the reference gradients too). diag: list of columns."""
    r, n = q.shape[0], k.shape[0]
    rows = []
    for i in range(r):
        s = [q[i] @ k[j] for j in range(n)]
        if activation == "relu":
            a = [torch.relu(t) for t in s]
        elif activation == "softmax":
            z = sum(torch.exp(t) for t in s)
            a = [torch.exp(t) / z for t in s]
        elif activation == "sigmoid":
            a = [1 / (1 + torch.exp(-t)) for t in s]
        else:
            a = s
        raw = [a[j] * 0 if j == diag[i] else a[j] for j in range(n)]
        total = sum(raw[t] + EPS for t in range(n))
        rows.append(sum((raw[j] + EPS) / total * v[j] for j in range(n)))
    return torch.stack(rows)


def inputs(r, n, h, m, dtype, seed, offset=0.5):
    """Unit q (r, h), k (n, h), values v (n, m), an upstream gradient g (r, m). ``offset`` tilts the cosines
    positive, so that identity's row sums stay away from 0 while relu still sees negative scores."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(r, h, generator=gen, dtype=torch.float64) + offset, dim=-1)
    k = F.normalize(torch.randn(n, h, generator=gen, dtype=torch.float64) + offset, dim=-1)
    v = torch.randn(n, m, generator=gen, dtype=torch.float64)
    g = torch.randn(r, m, generator=gen, dtype=torch.float64)
    return [t.to(dtype).requires_grad_(i < 3) for i, t in enumerate((q, k, v, g))]


def value_and_grads(fn, q, k, v, g):
    """fn(q, k, v) and its gradients w.r.t. q, k, v (with v None: fn(q, k) and w.r.t. q, k)."""
    args = (q, k) if v is None else (q, k, v)
    out = fn(*args)
    return (out.detach(), *torch.autograd.grad(out, args, g))


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


# (r, n, diag): all rows; rows in two separate slices, given by index; a contiguous block of rows, given by start
CASES = [(7, 7, 0), (5, 13, [0, 1, 2, 9, 10]), (4, 13, 6)]


def as_diag(diag):
    return torch.tensor(diag) if isinstance(diag, list) else diag


def diag_list(diag, r):
    return diag if isinstance(diag, list) else list(range(diag, diag + r))


@functools.cache
def loop_value_and_grads(r, n, diag: tuple[int, ...], activation):
    """The loop's output and gradients (once for the five tiles of test_tiled_and_dense_equal_the_loop_in_fp64)."""
    q, k, v, g = inputs(r, n, 4, 3, torch.float64, seed=r * 100 + n)
    return value_and_grads(lambda *a: reference(*a, diag, activation), q, k, v, g)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("tile", [1, 3, 4, "n", 20])  # 3, 4 divide neither 7 nor 13; "n" one tile; 20 > n
@pytest.mark.parametrize("r,n,diag", CASES)
def test_tiled_and_dense_equal_the_loop_in_fp64(r, n, diag, tile, activation):
    tile = n if tile == "n" else tile
    q, k, v, g = inputs(r, n, 4, 3, torch.float64, seed=r * 100 + n)
    want = loop_value_and_grads(r, n, tuple(diag_list(diag, r)), activation)
    dense = value_and_grads(lambda *a: fuse_rows(*a, as_diag(diag), activation), q, k, v, g)
    tiled = value_and_grads(lambda *a: fuse_rows(*a, as_diag(diag), activation, tile), q, k, v, g)
    for name, w, d, t in zip(("out", "dq", "dk", "dv"), want, dense, tiled, strict=True):
        torch.testing.assert_close(d, w, rtol=1e-12, atol=1e-12, msg=f"dense {name}")
        torch.testing.assert_close(t, w, rtol=1e-12, atol=1e-12, msg=f"tiled {name}")


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("tile", [1, 16, 48, 100])
def test_tiled_equals_dense_in_fp32(tile, activation):
    r, n, diag = 24, 100, torch.cat([torch.arange(10, 22), torch.arange(70, 82)])  # two separate slices
    q, k, v, g = inputs(r, n, 16, 8, torch.float32, seed=tile)
    q64, k64, v64, _ = (t.detach().double().requires_grad_() for t in (q, k, v, g))
    want = value_and_grads(lambda *a: fuse_rows(*a, diag, activation), q64, k64, v64, g.double())
    dense = value_and_grads(lambda *a: fuse_rows(*a, diag, activation), q, k, v, g)
    tiled = value_and_grads(lambda *a: fuse_rows(*a, diag, activation, tile), q, k, v, g)
    for name, w, d, t in zip(("out", "dq", "dk", "dv"), want, dense, tiled, strict=True):
        assert t.dtype == torch.float32
        assert rel_err(t, d) < 1e-5, name
        assert rel_err(t, w) < 1e-5, name


def test_keys_and_values_may_be_column_slices_of_one_gathered_tensor():
    """The row-sharded head gathers [K | V] as one (n, h + m) tensor and passes its column slices (strided views)."""
    q, k, v, g = inputs(6, 30, 8, 5, torch.float64, seed=11)
    kv = torch.cat([k, v], dim=1)  # (n, h + m)
    diag = torch.tensor([3, 4, 5, 20, 21, 22])
    want = value_and_grads(lambda q, kv: fuse_rows(q, kv[:, :8].contiguous(), kv[:, 8:].contiguous(), diag, "relu"),
                           q, kv, None, g)
    got = value_and_grads(lambda q, kv: fuse_rows(q, kv[:, :8], kv[:, 8:], diag, "relu", 7), q, kv, None, g)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_tiled_gradcheck(activation):
    q, k, v, _ = inputs(3, 5, 3, 2, torch.float64, seed=7)
    diag = torch.tensor([4, 0, 2])
    assert torch.autograd.gradcheck(lambda q, k, v: fuse_rows(q, k, v, diag, activation, 2), (q, k, v))


def dead_row_inputs(dtype):
    """Row 0's query points away from every key (all keys in the positive orthant): its raw row is all 0."""
    gen = torch.Generator().manual_seed(3)
    n, h, m = 16, 8, 4
    k = F.normalize(torch.rand(n, h, generator=gen) + 0.1, dim=-1)
    q = F.normalize(torch.randn(n, h, generator=gen), dim=-1)
    q[0] = -F.normalize(torch.ones(h), dim=0)
    v = torch.randn(n, m, generator=gen)
    g = torch.randn(n, m, generator=gen)
    assert (q[0] @ k.T).max() < 0
    return [t.to(dtype).requires_grad_(i < 3) for i, t in enumerate((q, k, v, g))]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tile", [None, 5])
def test_half_dead_row_is_finite_and_right(tile, dtype):
    q, k, v, g = dead_row_inputs(dtype)
    got = value_and_grads(lambda *a: fuse_rows(*a, 0, "relu", tile), q, k, v, g)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = value_and_grads(lambda *a: fuse_rows(*a, 0, "relu"), q64, k64, v64, g.double())
    assert got[0].dtype == dtype and got[1].dtype == dtype and got[3].dtype == dtype
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert torch.isfinite(a).all(), name
        assert rel_err(a, b) < 2e-2, name
    torch.testing.assert_close(got[0][0].double(), v64.detach().mean(0), rtol=1e-2, atol=1e-2)  # a dead row: mean v


@pytest.mark.parametrize("tile", [None, 8])
def test_autocast_scores_in_bf16_sums_in_fp32(tile):
    q, k, v, g = inputs(12, 20, 8, 4, torch.float32, seed=5)
    want = fuse_rows(q, k, v, 4, "relu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fuse_rows(q, k, v, 4, "relu", tile)
    assert got.dtype == torch.bfloat16
    assert rel_err(got, want) < 3e-2
    dq, dk, dv = torch.autograd.grad(got, (q, k, v), g)
    assert dq.dtype == dk.dtype == dv.dtype == torch.float32  # autograd casts back to the inputs' dtype
    assert all(torch.isfinite(t).all() for t in (dq, dk, dv))


@pytest.mark.parametrize("tile", [None, 4])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_no_host_sync_forward_or_backward(activation, tile):
    """Nothing in either path reads a value on the host (the same ops run on a GPU: no stall per tile)."""
    q, k, v, g = inputs(6, 10, 4, 3, torch.float32, seed=2)
    diag = torch.tensor([0, 1, 2, 7, 8, 9])
    counter = count(lambda: torch.autograd.grad(fuse_rows(q, k, v, diag, activation, tile), (q, k, v), g))
    assert counter.syncs == []


def test_bad_arguments_raise():
    q, k, v, _ = inputs(4, 6, 3, 2, torch.float64, seed=0)
    for bad, match in [(lambda: fuse_rows(q, k, v, 0, "gelu", 2), "gelu"), (lambda: fuse_rows(q, k[:, :2], v), "need"),
                       (lambda: fuse_rows(q, k, v, 0, "relu", 0), "tile"),
                       (lambda: fuse_rows(q, k, v, 3), "does not fit"),
                       (lambda: fuse_rows(q, k, v, torch.tensor([0, 1]), "relu", 2), "LongTensor"),
                       (lambda: fuse_rows(q, k, v, 0, "relu", 2, return_raw=True), "dense"),
                       (lambda: fuse_rows(q[None], k[None], v[None], 0, "relu", 2), "2-D")]:
        with pytest.raises(ValueError, match=match):
            bad()


def fwd_bwd(r, n, h, m, tile, dtype=torch.float32):
    q, k, v, g = inputs(r, n, h, m, dtype, seed=0)

    def step():
        torch.autograd.grad(fuse_rows(q, k, v, 0, "relu", tile), (q, k, v), g)

    return step


@pytest.mark.parametrize("tile", [None, 64])
def test_bytes_estimate_is_within_a_quarter_of_the_measured_peak(tile):
    measured = peak_bytes(fwd_bwd(512, 512, 64, 64, tile))
    assert abs(fuse_rows_bytes(512, 512, 64, 64, tile, 4) / measured - 1) < 0.25


@pytest.mark.slow
def test_tiled_peak_is_a_tenth_of_dense_at_4096():
    """r = n = 4096, h = m = 64, T = 256, fp32 relu, forward + backward; prints the peak and time ratios (one thread,
    the median of 3 runs) that pipeline.core.attention's docstring quotes."""
    n, h, tile = 4096, 64, 256
    peaks, seconds = {}, {}
    for name, t in (("dense", None), ("tiled", tile)):
        step = fwd_bwd(n, n, h, h, t)
        peaks[name] = peak_bytes(step)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        seconds[name] = sorted(times)[1]  # the median of 3
        assert abs(fuse_rows_bytes(n, n, h, h, t, 4) / peaks[name] - 1) < 0.25, name
    print(f"peak tiled/dense {peaks['tiled'] / peaks['dense']:.4f} ({peaks['tiled']} / {peaks['dense']} bytes), "
          f"time tiled/dense {seconds['tiled'] / seconds['dense']:.2f}")
    assert peaks["tiled"] < 0.1 * peaks["dense"]
