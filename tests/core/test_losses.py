"""Tests of pipeline.core.losses against slow float64 references written with explicit loops over i, j."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pipeline.core.losses import (
    EPS,
    LOSS_NAMES,
    LOSSES,
    SELF_SUPERVISED_ONLY,
    barlow_twins,
    dcl,
    infonce,
    jsd,
    jsd_appendix_e,
    kl_softmax,
    make_loss,
    supcon,
)
from pipeline.core.targets import LAYOUTS, check_layout, pairwise_cosine, self_supervised_ids, target_affinity

SIZES = [(4, 3), pytest.param(4, 8, marks=pytest.mark.slow), pytest.param(6, 3, marks=pytest.mark.slow),
         pytest.param(6, 8, marks=pytest.mark.slow), pytest.param(10, 3, marks=pytest.mark.slow), (10, 8)]
# supervised labels, each with a singleton class (a row without a positive); "random": unsorted, negative, gaps
SUP_IDS = {4: [1, 0, 1, 1], 6: [0, 1, 0, 1, 2, 1], 10: [2, 0, 1, 0, 2, 1, 3, 0, 1, 2]}
RANDOM_IDS = [7, -3, 7, 100, 4, 4, -3, 7, 9, 100]  # 9 is a singleton; 100 too at n = 4
TEMPERATURES = {"kl_softmax", "infonce", "supcon", "dcl"}


def make_ids(kind: str, n: int) -> torch.Tensor:
    if kind == "self":
        return self_supervised_ids(n // 2)
    return torch.tensor(SUP_IDS[n] if kind == "sup" else RANDOM_IDS[:n], dtype=torch.int64)


def make_qk(n: int, d: int, seed: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=dtype), torch.randn(n, d, generator=g, dtype=dtype)


def allowed(name: str, kind: str) -> bool:
    return kind == "self" or name not in SELF_SUPERVISED_ONLY


# (loss name, ids kind) pairs the loss accepts (the self-supervised-only losses refuse supervised batches, below)
NAME_KIND = [(name, kind) for name in LOSS_NAMES for kind in ("self", "sup", "random") if allowed(name, kind)]
# hyper-parameter settings (temperature, barlow_lambda); the second only for the losses that take one
NAME_KIND_HYPER = [(name, kind, tau, lam) for name, kind in NAME_KIND for tau, lam in [(0.1, 5e-3), (0.7, 0.05)]
                   if tau == 0.1 or name in TEMPERATURES | {"barlow_twins"}]


def layouts_for(name: str, kind: str) -> list[str | None]:
    """None and the hints a batch of ids ``kind`` may be given to the loss ``name``."""
    hints = ["two_view"] if kind == "self" else []
    return [None, *hints] if name in SELF_SUPERVISED_ONLY else [None, *hints, "labels"]


# ------------------------------------------------------------------------------------- slow references: explicit loops
def ref_cosine(q: torch.Tensor, k: torch.Tensor) -> list[list[float]]:
    qs, ks = q.tolist(), k.tolist()
    n, d = len(qs), len(qs[0])
    qn = [math.sqrt(sum(qs[i][c] ** 2 for c in range(d))) for i in range(n)]
    kn = [math.sqrt(sum(ks[j][c] ** 2 for c in range(d))) for j in range(n)]
    return [[sum(qs[i][c] * ks[j][c] for c in range(d)) / (qn[i] * kn[j]) for j in range(n)] for i in range(n)]


def ref_target(ids: list[int]) -> list[list[float]]:
    n = len(ids)
    return [[1.0 if (ids[i] == ids[j] and i != j) else 0.0 for j in range(n)] for i in range(n)]


def ref_row_loss(name: str, A: list, ids: list[int], i: int, tau: float, log, exp, power: float = 2.0):
    """Per-row loss of row i (all losses but barlow_twins), written straight from the formulas; A holds 0-dim
    tensors (with torch's log / exp), so that autograd gives the reference gradients. ``power``: jsd's."""
    n = len(ids)
    Y = ref_target(ids)
    others = [j for j in range(n) if j != i]
    positives = [j for j in others if Y[i][j] == 1.0]
    npos = len(positives)
    yhat = [Y[i][j] / npos if npos else 0.0 for j in range(n)]

    if name == "jsd_appendix_e":  # diagonal kept as eps / row-sum, Y not normalised, no /2 in the mixture
        s = [0.0 if j == i else A[i][j] ** 2 for j in range(n)]
        tot = sum(s[j] + EPS for j in range(n))
        aff = [(s[j] + EPS) / tot for j in range(n)]
        total = 0.0
        for j in range(n):
            mix = aff[j] + Y[i][j]
            if Y[i][j] > 0:
                total += Y[i][j] * log(Y[i][j] / mix)
            total += aff[j] * log(aff[j] / mix)
        return total

    if npos == 0:
        return 0.0  # documented convention: rows without a positive contribute 0

    if name == "jsd":  # eq. (5)'s normalisation of |A|^power (2 in eq. 5) with Appendix E's epsilon
        tot = sum(abs(A[i][j]) ** power + EPS for j in others)
        total = 0.0
        for j in others:
            p = (abs(A[i][j]) ** power + EPS) / tot
            m = (p + yhat[j]) / 2
            if yhat[j] > 0:
                total += yhat[j] * log(yhat[j] / m)
            total += p * log(p / m)
        return total

    if name in ("kl_relu", "kl_squared"):
        f = (lambda a: a if a > 0 else 0.0 * a) if name == "kl_relu" else (lambda a: a * a)  # ReLU's slope 0 at 0
        tot = sum(f(A[i][j]) + EPS for j in others)
        return sum(yhat[j] * log(yhat[j] / ((f(A[i][j]) + EPS) / tot)) for j in positives)

    denom_all = sum(exp(A[i][a] / tau) for a in others)
    if name == "kl_softmax":
        return sum(yhat[j] * log(yhat[j] / (exp(A[i][j] / tau) / denom_all)) for j in positives)
    if name in ("supcon", "infonce"):
        if name == "infonce":
            assert npos == 1
        return -sum(log(exp(A[i][p] / tau) / denom_all) for p in positives) / npos
    if name == "dcl":
        denom_neg = sum(exp(A[i][a] / tau) for a in others if a not in positives)
        return -sum(A[i][p] / tau for p in positives) / npos + log(denom_neg)
    raise AssertionError(name)


def ref_loss_torch(name: str, q: torch.Tensor, k: torch.Tensor, ids: torch.Tensor, tau: float,
                   power: float = 2.0) -> torch.Tensor:
    """The mean over the rows of :func:`ref_row_loss`, on 0-dim tensors."""
    n = q.shape[0]
    A = [[q[i] @ k[j] / (q[i].norm() * k[j].norm()) for j in range(n)] for i in range(n)]

    def log(x):
        return torch.log(torch.as_tensor(x, dtype=q.dtype))

    def exp(x):
        return torch.exp(torch.as_tensor(x, dtype=q.dtype))

    idl = ids.tolist()
    rows = [ref_row_loss(name, A, idl, i, tau, log, exp, power) for i in range(n)]
    return torch.as_tensor(sum(rows) / n, dtype=q.dtype)


def ref_barlow(q: torch.Tensor, lam: float) -> float:
    z = q.tolist()
    n, d = len(z), len(z[0])
    b = n // 2

    def standardise(rows: list[list[float]]) -> list[list[float]]:
        out = [[0.0] * d for _ in rows]
        for c in range(d):
            mean = sum(r[c] for r in rows) / len(rows)
            var = sum((r[c] - mean) ** 2 for r in rows) / len(rows)  # biased
            for t, r in enumerate(rows):
                out[t][c] = (r[c] - mean) / math.sqrt(var + 1e-5)
        return out

    z1, z2 = standardise(z[:b]), standardise(z[b:])
    total = 0.0
    for a in range(d):
        for c in range(d):
            cc = sum(z1[t][a] * z2[t][c] for t in range(b)) / b
            total += (1.0 - cc) ** 2 if a == c else lam * cc**2
    return total


def appendix_e_transcription(embeddings: torch.Tensor, target_affinity: torch.Tensor) -> torch.Tensor:
    """Appendix E.2 Loss.forward, step by step, with the same tensor operations."""
    unit = F.normalize(embeddings)  # unit rows
    sim = unit @ unit.transpose(-2, -1)  # cosine matrix
    sim = sim**2  # squared affinity
    sim = sim - torch.diag(torch.diagonal(sim))  # zero the diagonal
    sim = (sim + 1e-10) / torch.sum(sim + 1e-10, dim=1, keepdim=True)  # row normalisation with epsilon
    mixture_log = (sim + target_affinity).log()
    out = F.kl_div(mixture_log, target_affinity, reduction="batchmean")
    out = out + F.kl_div(mixture_log, sim, reduction="batchmean")
    return out


# jsd and jsd_appendix_e before the fused Functions (issue 12), verbatim: full (r, n) P, Ŷ, M, log M under autograd;
# benchmarks/bench_loss.py --reference times them, test_fused_keeps_one_n_by_n_tensor_for_backward's control.


def _pre_prepare(q, k, ids, rows):
    """A (r, n), Y (r, n), diagonal mask (r, n) and n, as the pre-fusion ``_prepare``."""
    n = q.shape[0]
    start, stop = rows.indices(n)[:2] if rows is not None else (0, n)
    stop = max(start, stop)
    a = pairwise_cosine(q, k, rows)
    y = target_affinity(ids, rows, dtype=a.dtype)
    diag = torch.arange(start, stop)[:, None] == torch.arange(n)[None, :]
    return a, y, diag, n


def _pre_row_normalize(y):
    return y / y.sum(dim=1, keepdim=True).clamp_min(1.0)


def _pre_normalize_offdiag(s, diag):
    s = (s + EPS).masked_fill(diag, 0.0)
    return s / s.sum(dim=1, keepdim=True)


def _pre_safe_log(x, where):
    return torch.log(torch.where(where, x, torch.ones_like(x)))


def _pre_kl_rows(p, log_q):
    pos = ~(p <= 0)
    terms = p * (_pre_safe_log(p, pos) - torch.where(pos, log_q, torch.zeros_like(log_q)))
    return torch.where(pos, terms, torch.zeros_like(terms)).sum(dim=1)


def reference_jsd(q, k, ids, *, rows=None):
    a, y, diag, n = _pre_prepare(q, k, ids, rows)
    p = _pre_normalize_offdiag(a.square(), diag)
    y_hat = _pre_row_normalize(y)
    m = (p + y_hat) / 2
    log_m = _pre_safe_log(m, m > 0)
    per_row = _pre_kl_rows(y_hat, log_m) + _pre_kl_rows(p, log_m)
    has_pos = y.sum(dim=1) > 0
    return torch.where(has_pos, per_row, torch.zeros_like(per_row)).sum() / n


def reference_jsd_appendix_e(q, k, ids, *, rows=None):
    a, y, diag, n = _pre_prepare(q, k, ids, rows)
    aff = a.square().masked_fill(diag, 0.0)
    aff = (aff + EPS) / (aff + EPS).sum(dim=1, keepdim=True)
    log_mix = (aff + y).log()
    return (F.kl_div(log_mix, y, reduction="sum") + F.kl_div(log_mix, aff, reduction="sum")) / n


def call(name: str, q, k, ids, rows=None, tau: float = 0.1, lam: float = 5e-3, layout=None) -> torch.Tensor:
    hyper = {"temperature": tau} if name in TEMPERATURES else {}
    if name == "barlow_twins":
        hyper["barlow_lambda"] = lam
    return LOSSES[name](q, k, ids, rows=rows, layout=layout, **hyper)


def values_and_grads(fn, q0, k0, *, rows=None, weight: float = 1.0):
    """``fn(q, k, rows)`` and the gradient of ``weight`` times it with respect to q and k."""
    q, k = q0.clone().requires_grad_(True), k0.clone().requires_grad_(True)
    loss = fn(q, k, rows)
    grads = torch.autograd.grad(loss * weight, (q, k), allow_unused=True)
    return loss.detach(), *(torch.zeros_like(t) if g is None else g for g, t in zip(grads, (q0, k0), strict=True))


def assert_same(got, want, tol):
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)


def big_saved(fn, n: int) -> int:
    """How many tensors of n * n / 2 entries or more the graph of ``fn()`` keeps for backward."""
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(1 for size in saved if size >= n * n // 2)


def slices(n: int) -> list[slice | None]:
    return [None, slice(0, 1), slice(1, n // 2), slice(n // 2, None), slice(n - 1, None), slice(n // 3, n - 2)]


# ------------------------------------------------------------------------------------------------- targets and cosines
@pytest.mark.parametrize("kind", ["self", "sup"])
@pytest.mark.parametrize("n", [4, 6, 10])
def test_target_affinity_matches_eq1(kind, n):
    assert self_supervised_ids(3).tolist() == [0, 1, 2, 0, 1, 2] and self_supervised_ids(1).dtype == torch.int64
    ids = make_ids(kind, n)
    Y = ref_target(ids.tolist())
    assert target_affinity(ids).tolist() == Y
    for a, b in [(0, n), (1, n - 1), (n // 2, n), (2, 3)]:
        assert target_affinity(ids, rows=slice(a, b)).tolist() == Y[a:b]


@pytest.mark.parametrize("n,d", SIZES)
def test_pairwise_cosine_matches_loops(n, d):
    q, k = make_qk(n, d, seed=n * d)
    A = torch.tensor(ref_cosine(q, k), dtype=torch.float64)
    torch.testing.assert_close(pairwise_cosine(q, k), A, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(pairwise_cosine(q, k, rows=slice(1, n - 1)), A[1 : n - 1], rtol=1e-12, atol=1e-12)
    # idempotent on unit rows
    torch.testing.assert_close(pairwise_cosine(F.normalize(q), F.normalize(k)), A, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------ every loss vs the slow reference
@pytest.mark.parametrize("name,kind,tau,lam", NAME_KIND_HYPER)
@pytest.mark.parametrize("n,d", SIZES)
def test_loss_matches_loop_reference(name, kind, tau, lam, n, d):
    """Value and gradient (upstream gradient -2.5) through every layout hint the batch allows in fp64, and in fp32."""
    ids = make_ids(kind, n)
    q0, k0 = make_qk(n, d, seed=10 * n + d)
    if name == "barlow_twins":  # the loop's value (its gradient: test_gradcheck)
        want = [torch.tensor(ref_barlow(q0, lam), dtype=torch.float64)]
    else:
        want = values_and_grads(lambda q, k, _: ref_loss_torch(name, q, k, ids, tau), q0, k0, weight=-2.5)
        assert want[1].abs().sum() > 0
    for layout in layouts_for(name, kind):
        got = values_and_grads(lambda q, k, _, lay=layout: call(name, q, k, ids, tau=tau, lam=lam, layout=lay), q0,
                               k0, weight=-2.5)
        assert_same(got[: len(want)], want, 1e-8)
    got32 = values_and_grads(lambda q, k, _: call(name, q, k, ids, tau=tau, lam=lam), q0.float(), k0.float(),
                             weight=-2.5)
    assert got32[0].dtype == torch.float32
    assert_same([t.double() for t in got32[: len(want)]], want, 1e-4)


@pytest.mark.parametrize("power", [1.0, 3.0, 8.0])
@pytest.mark.parametrize("kind", ["self", "sup"])
@pytest.mark.parametrize("n,d", SIZES)
def test_jsd_power_matches_loop_reference(power, kind, n, d):
    """jsd's power (ours; 2 is eq. 5, checked above): value and gradient against the loop, through every layout hint,
    dense and over tiles of 3 columns, on whole batches and row slices (whose losses add up to the whole)."""
    ids = make_ids(kind, n)
    q0, k0 = make_qk(n, d, seed=7 * n + d)
    want = values_and_grads(lambda q, k, _: ref_loss_torch("jsd", q, k, ids, 0.1, power), q0, k0, weight=-2.5)
    assert want[1].abs().sum() > 0
    for layout in layouts_for("jsd", kind):
        for tile in (None, 3):
            def fn(q, k, r, lay=layout, t=tile):
                return jsd(q, k, ids, rows=r, layout=lay, tile=t, power=power)

            assert_same(values_and_grads(fn, q0, k0, weight=-2.5), want, 1e-8)
            parts = [values_and_grads(fn, q0, k0, rows=r, weight=-2.5) for r in (slice(0, n // 2), slice(n // 2, None))]
            assert_same([a + b for a, b in zip(*parts, strict=True)], want, 1e-8)
    sharper = jsd(q0, k0, ids, power=power)
    assert make_loss("jsd", power=power)(q0, k0, ids).item() == pytest.approx(sharper.item(), rel=1e-12)
    assert sharper.item() != pytest.approx(jsd(q0, k0, ids).item(), rel=1e-6)


@pytest.mark.parametrize("kind", ["self", "sup"])
@pytest.mark.parametrize("n,d", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_jsd_appendix_e_matches_transcription(kind, n, d, dtype):
    ids = make_ids(kind, n)
    z, _ = make_qk(n, d, seed=n + d, dtype=dtype)
    z1, z2 = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
    got = jsd_appendix_e(z1, z1, ids)
    want = appendix_e_transcription(z2, target_affinity(ids, dtype=dtype))
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    got.backward()
    want.backward()
    torch.testing.assert_close(z1.grad, z2.grad, rtol=tol * 10, atol=tol * 10)


@pytest.mark.parametrize("name,kind", NAME_KIND)
@pytest.mark.parametrize("n,d", SIZES)
def test_row_slices_add_up(name, kind, n, d):
    """Values and gradients of disjoint row slices add up to the whole batch's, through every layout hint."""
    ids = make_ids(kind, n)
    q0, k0 = make_qk(n, d, seed=7 * n + d)
    for layout in layouts_for(name, kind):
        def fn(q, k, rows, lay=layout):
            return call(name, q, k, ids, rows=rows, tau=0.3, layout=lay)

        full = values_and_grads(fn, q0, k0)
        assert full[1].abs().sum() > 0
        for cuts in ([0, 1, n], [0, n // 2, n], [0, 1, n // 2 + 1, n - 1, n]):
            parts = [values_and_grads(fn, q0, k0, rows=slice(a, b)) for a, b in zip(cuts, cuts[1:], strict=False)]
            assert_same([sum(p[t] for p in parts) for t in range(3)], full, 1e-10)
        per_row = torch.stack([fn(q0, k0, slice(i, i + 1)) for i in range(n)]).sum()
        torch.testing.assert_close(per_row, full[0], rtol=1e-12, atol=1e-12)


def test_input_errors():
    ids = self_supervised_ids(3)
    q, k = make_qk(6, 4, seed=0)
    with pytest.raises(ValueError, match="contiguous"):
        jsd(q, k, ids, rows=slice(0, 6, 2))
    assert jsd(q, k, ids, rows=slice(3, 3)).item() == 0.0  # empty slice
    with pytest.raises(ValueError, match="ids"):
        jsd(q, k, torch.arange(5))
    with pytest.raises(ValueError):
        jsd(q, k[:, :3], ids)
    for bad in (torch.arange(5), torch.tensor([0, 0, 1, 0, 0, 1])):  # odd batch, repeated ids
        with pytest.raises(ValueError, match="two-view"):
            barlow_twins(q[: len(bad)], k[: len(bad)], bad)
    # dcl without a negative: refused; with layout="labels" (no check: it would sync) NaN, which the trainer catches
    with pytest.raises(ValueError, match="negative"):
        dcl(q[:4], k[:4], torch.zeros(4, dtype=torch.int64))
    assert torch.isnan(dcl(q[:4], k[:4], torch.zeros(4, dtype=torch.int64), layout="labels"))


# ----------------------------------------------- Appendix A: KL-softmax with a tied one-layer head is InfoNCE / SupCon
@pytest.mark.parametrize("kind", ["self", "sup"])
@pytest.mark.parametrize("n,d", SIZES)
@pytest.mark.parametrize("tau", [0.1, 0.5])
def test_appendix_a_identity(kind, n, d, tau):
    torch.manual_seed(n * 100 + d)
    ids = make_ids(kind, n)
    x = torch.randn(n, 5, dtype=torch.float64)
    head = torch.nn.Linear(5, d, bias=False).double()  # W_Q = W_K = W

    def value_and_grad(fn):
        head.zero_grad()
        z = head(x)  # (n, d), z = x W
        loss = fn(z, z, ids, temperature=tau)
        loss.backward()
        return loss.detach(), head.weight.grad.clone()

    kl, g_kl = value_and_grad(kl_softmax)
    other, g_other = value_and_grad(infonce if kind == "self" else supcon)
    npos = torch.tensor(ref_target(ids.tolist())).sum(dim=1).tolist()
    const = sum(math.log(p) for p in npos if p > 0) / n  # mean_i log|P(i)|, singletons give 0
    assert (const > 0) == (kind == "sup")
    assert kl.item() == pytest.approx(other.item() - const, rel=1e-10, abs=1e-10)
    torch.testing.assert_close(g_kl, g_other, rtol=1e-9, atol=1e-12)


# ------------------------------------------------------------------------------------------------------- JSD behaviour
@pytest.mark.parametrize("kind", ["self", "sup"])
@pytest.mark.parametrize("n", [4, 6, 10])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_jsd_zero_for_orthogonal_class_embeddings(kind, n, dtype):
    """One orthogonal direction per class makes Normalize(A^2) equal Ŷ: the loss vanishes (up to 1e-10)."""
    ids = make_ids(kind, n)
    z = F.one_hot(ids).to(dtype) * 2.5  # (n, #classes)
    assert jsd(z, z, ids).item() == pytest.approx(0.0, abs=1e-6)
    # The Appendix E code mixes S' + Y without the 1/2 and with Y unnormalised, so it is NOT 0 (nor >= 0)
    # there: a row with m = |P(i)| positives (S' = 1/m on them) gives -m log(1 + 1/m) - log(1 + m).
    npos = [sum(1 for j in range(n) if j != i and ids[j] == ids[i]) for i in range(n)]
    want = sum(-m * math.log(1 + 1 / m) - math.log(1 + m) for m in npos if m > 0) / n
    assert want < 0 and jsd_appendix_e(z, z, ids).item() == pytest.approx(want, abs=1e-6)


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_exact_zeros(name):
    """One-hot embeddings, cosines of exactly 0 and 1 (kl_relu's kink, jsd's P = 1e-10 / T): finite, as the loops."""
    ids = self_supervised_ids(4)
    z = F.one_hot(torch.tensor([0, 1, 2, 3, 0, 1, 2, 2]), 8).double()
    got = values_and_grads(lambda q, k, r: call(name, q, k, ids, rows=r), z, z)
    assert all(torch.isfinite(t).all() for t in got)
    if name != "barlow_twins":
        want = values_and_grads(lambda q, k, _: ref_loss_torch(name, q, k, ids, 0.1), z, z)
        assert_same(got, want, 1e-10)


@pytest.mark.parametrize("name,kind", NAME_KIND)
def test_gradcheck(name, kind):
    """On whole batches and a row slice, through every layout hint the batch allows."""
    ids = make_ids(kind, 6)
    q, k = (t.requires_grad_(True) for t in make_qk(6, 3, seed=11))
    for layout in layouts_for(name, kind):
        for rows in (None, slice(2, 5)):
            fn = lambda a, b, lay=layout, r=rows: call(name, a, b, ids, rows=r, tau=0.5, layout=lay)  # noqa: E731
            assert torch.autograd.gradcheck(fn, (q, k))


# ------------------------------------------------------------------------------------------------------------ registry
@pytest.mark.parametrize("name", LOSS_NAMES)
def test_make_loss_uniform_signature(name):
    ids = self_supervised_ids(3)
    q0, k0 = make_qk(6, 4, seed=5, dtype=torch.float32)
    q, k = q0.clone().requires_grad_(True), k0.clone().requires_grad_(True)
    fn = make_loss(name, temperature=0.2, barlow_lambda=0.01)
    loss = fn(q, k, ids)
    assert loss.dim() == 0 and torch.isfinite(loss) and loss.requires_grad
    loss.backward()
    assert q.grad is not None and torch.isfinite(q.grad).all() and q.grad.abs().sum() > 0
    # the bound hyper-parameters are the ones given
    assert fn(q0, k0, ids).item() == pytest.approx(call(name, q0, k0, ids, tau=0.2, lam=0.01).item(), rel=1e-6)
    if name in TEMPERATURES:
        assert make_loss(name, temperature=0.9)(q0, k0, ids).item() != pytest.approx(loss.item(), rel=1e-3)


def test_registry_and_make_loss_errors():
    assert set(LOSSES) == set(LOSS_NAMES) and len(LOSS_NAMES) == 9
    assert SELF_SUPERVISED_ONLY == frozenset({"infonce", "barlow_twins"})
    with pytest.raises(ValueError) as info:
        make_loss("triplet")
    assert "unknown loss 'triplet'" in str(info.value) and all(name in str(info.value) for name in LOSS_NAMES)
    with pytest.raises(ValueError, match="temperature"):
        make_loss("supcon", temperature=0.0)
    for power in (0.5, 65.0):
        with pytest.raises(ValueError, match=r"power must be in \[1, 64"):
            make_loss("jsd", power=power)


@pytest.mark.parametrize("name", sorted(SELF_SUPERVISED_ONLY))
def test_self_supervised_only_losses_refuse_supervised_batches(name):
    """Also when only a slice of rows is computed, and with layout="labels" even on two-view ids."""
    q, k = make_qk(6, 4, seed=2)
    match = "one positive per row" if name == "infonce" else "Barlow Twins needs the self-supervised two-view"
    for ids, kw in [(torch.tensor([0, 0, 0, 1, 1, 2]), {}), (torch.tensor([0, 0, 0, 1, 1, 2]), {"rows": slice(0, 3)}),
                    (self_supervised_ids(3), {"layout": "labels"})]:
        with pytest.raises(ValueError, match=match):
            make_loss(name)(q, k, ids, **kw)


def test_barlow_ignores_k():
    ids = self_supervised_ids(3)
    q, k = make_qk(6, 4, seed=4)
    assert barlow_twins(q, k, ids).item() == barlow_twins(q, torch.zeros_like(k), ids).item()


@pytest.mark.parametrize("name,layout", [(nm, lay) for nm in LOSS_NAMES for lay in (None, *LAYOUTS)
                                         if lay != "labels" or nm not in SELF_SUPERVISED_ONLY])
def test_nan_embeddings_give_a_nan_loss(name, layout):
    """A NaN must surface (the trainer's non-finite guard relies on it), never be masked to 0."""
    q = torch.randn(8, 4)
    q[0, 0] = float("nan")
    assert torch.isnan(make_loss(name)(q, q, self_supervised_ids(4), layout=layout))


# ------------------------------------ the fused pairwise losses (issue 12): singletons, flat rows, what backward keeps
PAIRWISE = [name for name in LOSS_NAMES if name != "barlow_twins"]


@pytest.mark.parametrize("name", [nm for nm in PAIRWISE if nm != "infonce"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_singleton_rows_have_zero_gradient(name, dtype):
    """A row without a positive contributes 0 and pushes nothing (jsd_appendix_e: 0 by construction)."""
    ids = torch.tensor(SUP_IDS[10])  # row 6 is the only member of class 3
    q0, k0 = make_qk(10, 8, seed=2, dtype=dtype)
    value, gq, gk = values_and_grads(lambda q, k, r: call(name, q, k, ids, rows=r), q0, k0, rows=slice(6, 7))
    assert value.item() == 0.0
    assert gq.abs().max().item() == 0.0 and gk.abs().max().item() == 0.0
    _, gq5, _ = values_and_grads(lambda q, k, r: call(name, q, k, ids, rows=r), q0, k0, rows=slice(5, 6))
    assert gq5.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_kl_relu_all_zero_rows(dtype):
    """A row whose affinities are all <= 0 becomes uniform under ReLU + 1e-10 and gets no gradient."""
    n = 6
    ids = self_supervised_ids(3)
    z = torch.randn(n, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    z[:, 0] = -z[:, 0].abs() - 0.1  # every other row points away from row 0 ...
    z[0] = torch.tensor([1.0, 0.0, 0.0])  # ... so A[0, j] < 0 for all j != 0
    z[3] = torch.tensor([0.0, 1.0, 0.0])  # row 0's positive is orthogonal to it: A[0, 3] = 0 exactly
    assert (pairwise_cosine(z, z, rows=slice(0, 1))[0, 1:] <= 0).all()
    want = values_and_grads(lambda q, k, _: ref_loss_torch("kl_relu", q, k, ids, 0.1), z, z)
    fn = lambda q, k, r: call("kl_relu", q, k, ids, rows=r)  # noqa: E731
    got = values_and_grads(fn, z.to(dtype), z.to(dtype))
    assert_same([t.double() for t in got], want, 1e-10 if dtype == torch.float64 else 1e-5)
    got = values_and_grads(fn, z.to(dtype), z.to(dtype), rows=slice(0, 1))
    assert got[0].item() * n == pytest.approx(math.log(n - 1), rel=1e-6)  # uniform: D(Ŷ || U) = log(n - 1) ...
    assert got[1].abs().max().item() == 0.0 and got[2].abs().max().item() == 0.0  # ... and flat


@pytest.mark.parametrize("name", PAIRWISE)
def test_fused_keeps_one_n_by_n_tensor_for_backward(name):
    """One (r, n) tensor (A or the logits), with the two_view hint too; the pre-fusion jsd kept many."""
    n, d = 64, 4
    g = torch.Generator().manual_seed(n)
    ids = self_supervised_ids(n // 2) if name == "infonce" else torch.randint(0, 12, (n,), generator=g)
    q, k = (t.requires_grad_(True) for t in make_qk(n, d, seed=0, dtype=torch.float32))
    assert big_saved(lambda: call(name, q, k, ids, rows=slice(0, n // 2)), n) == 1  # an (n/2, n) block
    assert big_saved(lambda: call(name, q, k, ids), n) == 1
    assert big_saved(lambda: call(name, q, k, self_supervised_ids(n // 2), layout="two_view"), n) == 1
    assert big_saved(lambda: reference_jsd(q, k, ids), n) >= 2


# -------------- layout hints (no host sync): "two_view" bit for bit the default, "labels" equal up to rounding (above)
@pytest.mark.parametrize("name", LOSS_NAMES)
@pytest.mark.parametrize("n,d", [(2, 3), (10, 8), (130, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_two_view_layout_is_bit_identical(name, n, d, dtype):
    """The cached pairs of the self-supervised layout: the very values and gradients of the validated path."""
    ids = self_supervised_ids(n // 2)
    q0, k0 = make_qk(n, d, seed=n + d, dtype=dtype)
    for rows in slices(n) if n > 2 else [None, slice(0, 1), slice(1, 2)]:
        if name == "dcl" and n == 2:  # a single id: no negative, the validated path refuses
            with pytest.raises(ValueError, match="negative"):
                call(name, q0, k0, ids, rows=rows)
            continue
        for weight in (1.0, -2.5):
            want = values_and_grads(lambda q, k, r: call(name, q, k, ids, rows=r, tau=0.3), q0, k0, rows=rows,
                                    weight=weight)
            got = values_and_grads(lambda q, k, r: call(name, q, k, ids, rows=r, tau=0.3, layout="two_view"),
                                   q0, k0, rows=rows, weight=weight)
            for g, w in zip(got, want, strict=True):
                assert g.dtype == w.dtype and torch.equal(g, w), (rows, weight)


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_layout_errors(name):
    q, k = make_qk(6, 4, seed=2)
    with pytest.raises(ValueError, match="unknown layout 'dense'"):
        make_loss(name)(q, k, self_supervised_ids(3), layout="dense")
    with pytest.raises(ValueError, match="two-view|two_view"):  # the shape is still checked
        make_loss(name)(q[:5], k[:5], torch.arange(5), layout="two_view")


def test_two_view_layout_does_not_read_the_ids():
    """The caller's guarantee: the positives are (i + B) mod 2B whatever ids says (check_layout checks once)."""
    q, k = make_qk(8, 4, seed=6)
    wrong = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    assert torch.equal(supcon(q, k, wrong, layout="two_view"), supcon(q, k, self_supervised_ids(4)))
    with pytest.raises(ValueError, match="two_view"):
        check_layout(wrong, "two_view")


def test_check_layout():
    assert LAYOUTS == ("two_view", "labels")
    for ids in [self_supervised_ids(1), self_supervised_ids(5), torch.tensor([7, -2, 40, 7, -2, 40])]:
        check_layout(ids, "two_view")
    bad = [torch.tensor([0, 1, 2, 0, 1]), torch.tensor([0, 1, 1, 0]), torch.tensor([0, 0, 0, 0]),
           torch.tensor([0, 1, 0, 2]), torch.tensor([], dtype=torch.int64)]
    for ids in bad:
        with pytest.raises(ValueError, match="two_view"):
            check_layout(ids, "two_view")
    for layout in (None, "labels"):  # anything goes, unread
        check_layout(torch.tensor([3, 3, 3]), layout)
    with pytest.raises(ValueError, match="unknown layout"):
        check_layout(self_supervised_ids(2), "self")
    with pytest.raises(ValueError, match="1-D"):
        check_layout(torch.zeros(2, 2, dtype=torch.int64), "two_view")
