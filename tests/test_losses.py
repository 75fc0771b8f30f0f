"""Tests of pipeline.losses against slow float64 references written with explicit loops over i, j."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pipeline.losses import (
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
    pairwise_cosine,
    self_supervised_ids,
    supcon,
    target_affinity,
)

SIZES = [(4, 3), (4, 8), (6, 3), (6, 8), (10, 3), (10, 8)]
# supervised labels, each with at least one singleton class (rows without a positive)
SUP_IDS = {
    4: [1, 0, 1, 1],
    6: [0, 1, 0, 1, 2, 1],
    10: [2, 0, 1, 0, 2, 1, 3, 0, 1, 2],
}
TEMPERATURES = {"kl_softmax", "infonce", "supcon", "dcl"}
LOG2 = math.log(2.0)


def make_ids(kind: str, n: int) -> torch.Tensor:
    if kind == "self":
        return self_supervised_ids(n // 2)
    return torch.tensor(SUP_IDS[n], dtype=torch.int64)


def make_qk(
    n: int, d: int, seed: int, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, d, generator=g, dtype=dtype)
    k = torch.randn(n, d, generator=g, dtype=dtype)
    return q, k


def allowed(name: str, kind: str) -> bool:
    return not (kind == "sup" and name in SELF_SUPERVISED_ONLY)


# (loss name, ids kind) pairs the loss accepts: supervised batches (with singletons) are excluded for the
# self-supervised-only losses, which are tested to raise on them below.
NAME_KIND = [(name, kind) for name in LOSS_NAMES for kind in ("self", "sup") if allowed(name, kind)]
# hyper-parameter settings (temperature, barlow_lambda); the second only for the losses that take one
NAME_KIND_HYPER = [
    (name, kind, tau, lam)
    for name, kind in NAME_KIND
    for tau, lam in [(0.1, 5e-3), (0.7, 0.05)]
    if tau == 0.1 or name in TEMPERATURES | {"barlow_twins"}
]


# --------------------------------------------------------------------------------------------------
# slow references: plain python floats, explicit loops
# --------------------------------------------------------------------------------------------------


def ref_cosine(q: torch.Tensor, k: torch.Tensor) -> list[list[float]]:
    qs, ks = q.tolist(), k.tolist()
    n, d = len(qs), len(qs[0])
    qn = [math.sqrt(sum(qs[i][c] ** 2 for c in range(d))) for i in range(n)]
    kn = [math.sqrt(sum(ks[j][c] ** 2 for c in range(d))) for j in range(n)]
    return [
        [sum(qs[i][c] * ks[j][c] for c in range(d)) / (qn[i] * kn[j]) for j in range(n)] for i in range(n)
    ]


def ref_target(ids: list[int]) -> list[list[float]]:
    n = len(ids)
    return [[1.0 if (ids[i] == ids[j] and i != j) else 0.0 for j in range(n)] for i in range(n)]


def ref_row_loss(name: str, A: list[list[float]], ids: list[int], i: int, tau: float) -> float:
    """Per-row loss of row i (all losses but barlow_twins), written straight from the formulas."""
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
                total += Y[i][j] * math.log(Y[i][j] / mix)
            total += aff[j] * math.log(aff[j] / mix)
        return total

    if npos == 0:
        return 0.0  # documented convention: rows without a positive contribute 0

    if name == "jsd":  # exact eq. (5) normalisation, no epsilon at all
        tot = sum(A[i][j] ** 2 for j in others)
        total = 0.0
        for j in others:
            p = A[i][j] ** 2 / tot
            m = (p + yhat[j]) / 2
            if yhat[j] > 0:
                total += yhat[j] * math.log(yhat[j] / m)
            if p > 0:
                total += p * math.log(p / m)
        return total

    if name in ("kl_relu", "kl_squared"):
        f = (lambda a: max(a, 0.0)) if name == "kl_relu" else (lambda a: a * a)
        tot = sum(f(A[i][j]) + EPS for j in others)
        return sum(yhat[j] * math.log(yhat[j] / ((f(A[i][j]) + EPS) / tot)) for j in positives)

    denom_all = sum(math.exp(A[i][a] / tau) for a in others)
    if name == "kl_softmax":
        return sum(yhat[j] * math.log(yhat[j] / (math.exp(A[i][j] / tau) / denom_all)) for j in positives)
    if name in ("supcon", "infonce"):
        if name == "infonce":
            assert npos == 1
        return -sum(math.log(math.exp(A[i][p] / tau) / denom_all) for p in positives) / npos
    if name == "dcl":
        denom_neg = sum(math.exp(A[i][a] / tau) for a in others if a not in positives)
        return -sum(A[i][p] / tau for p in positives) / npos + math.log(denom_neg)
    raise AssertionError(name)


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


def ref_loss(name: str, q: torch.Tensor, k: torch.Tensor, ids: torch.Tensor, tau: float, lam: float) -> float:
    if name == "barlow_twins":
        return ref_barlow(q, lam)
    A = ref_cosine(q, k)
    idl = ids.tolist()
    n = len(idl)
    return sum(ref_row_loss(name, A, idl, i, tau) for i in range(n)) / n


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


def call(name: str, q, k, ids, rows=None, tau: float = 0.1, lam: float = 5e-3) -> torch.Tensor:
    hyper = {}
    if name in TEMPERATURES:
        hyper["temperature"] = tau
    if name == "barlow_twins":
        hyper["barlow_lambda"] = lam
    return LOSSES[name](q, k, ids, rows=rows, **hyper)


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def test_self_supervised_ids_layout():
    assert self_supervised_ids(3).tolist() == [0, 1, 2, 0, 1, 2]
    assert self_supervised_ids(1).dtype == torch.int64


@pytest.mark.parametrize("kind", ["self", "sup"])
@pytest.mark.parametrize("n", [4, 6, 10])
def test_target_affinity_matches_eq1(kind, n):
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
    torch.testing.assert_close(
        pairwise_cosine(q, k, rows=slice(1, n - 1)), A[1 : n - 1], rtol=1e-12, atol=1e-12
    )
    # idempotent on unit rows
    torch.testing.assert_close(pairwise_cosine(F.normalize(q), F.normalize(k)), A, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------------------------------
# every loss vs the slow reference
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,kind,tau,lam", NAME_KIND_HYPER)
@pytest.mark.parametrize("n,d", SIZES)
def test_loss_matches_loop_reference(name, kind, tau, lam, n, d):
    ids = make_ids(kind, n)
    q, k = make_qk(n, d, seed=10 * n + d)
    got = call(name, q, k, ids, tau=tau, lam=lam)
    want = ref_loss(name, q, k, ids, tau, lam)
    assert got.dim() == 0
    # jsd's 1e-10 normalisation epsilon is absent from its reference: allow ~1e-9
    assert got.item() == pytest.approx(want, rel=1e-8, abs=1e-8)
    # float32 path agrees too
    got32 = call(name, q.float(), k.float(), ids, tau=tau, lam=lam)
    assert got32.dtype == torch.float32
    assert got32.item() == pytest.approx(want, rel=1e-4, abs=1e-4)


@pytest.mark.parametrize("kind", ["self", "sup"])
@pytest.mark.parametrize("n,d", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_jsd_appendix_e_matches_transcription(kind, n, d, dtype):
    ids = make_ids(kind, n)
    z, _ = make_qk(n, d, seed=n + d, dtype=dtype)
    Y = target_affinity(ids, dtype=dtype)
    z1 = z.clone().requires_grad_(True)
    z2 = z.clone().requires_grad_(True)
    got = jsd_appendix_e(z1, z1, ids)
    want = appendix_e_transcription(z2, Y)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    got.backward()
    want.backward()
    torch.testing.assert_close(z1.grad, z2.grad, rtol=tol * 10, atol=tol * 10)


def test_jsd_appendix_e_differs_from_jsd():
    """Sanity: the code of Appendix E is not the JSD of eq. (4) (no 1/2 in the mixture, Y not normalised)."""
    ids = torch.tensor(SUP_IDS[10])
    q, _ = make_qk(10, 8, seed=3)
    assert abs(jsd(q, q, ids).item() - jsd_appendix_e(q, q, ids).item()) > 1e-3


# --------------------------------------------------------------------------------------------------
# row-slice additivity (values and gradients)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,kind", NAME_KIND)
@pytest.mark.parametrize("n,d", SIZES)
def test_row_slices_add_up(name, kind, n, d):
    ids = make_ids(kind, n)
    q0, k0 = make_qk(n, d, seed=7 * n + d)

    def loss_and_grads(rows):
        q = q0.clone().requires_grad_(True)
        k = k0.clone().requires_grad_(True)
        loss = call(name, q, k, ids, rows=rows, tau=0.3)
        gq, gk = torch.autograd.grad(loss, (q, k), allow_unused=True)
        gq = torch.zeros_like(q0) if gq is None else gq
        gk = torch.zeros_like(k0) if gk is None else gk
        return loss.detach(), gq, gk

    full, gq_full, gk_full = loss_and_grads(None)
    assert gq_full.abs().sum() > 0
    for a in sorted({1, n // 2, n - 1}):
        l1, gq1, gk1 = loss_and_grads(slice(0, a))
        l2, gq2, gk2 = loss_and_grads(slice(a, None))
        torch.testing.assert_close(l1 + l2, full, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gq1 + gq2, gq_full, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(gk1 + gk2, gk_full, rtol=1e-10, atol=1e-12)
    # three slices, and one per row
    parts = [call(name, q0, k0, ids, rows=slice(i, i + 1), tau=0.3) for i in range(n)]
    torch.testing.assert_close(torch.stack(parts).sum(), full, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "name", ["jsd", "jsd_appendix_e", "kl_softmax", "kl_relu", "kl_squared", "supcon", "dcl"]
)
def test_singleton_rows_contribute_zero(name):
    ids = torch.tensor(SUP_IDS[10])  # row 6 is the only member of class 3
    q, k = make_qk(10, 8, seed=1)
    row = call(name, q, k, ids, rows=slice(6, 7))
    assert row.item() == pytest.approx(0.0, abs=1e-12)
    assert call(name, q, k, ids, rows=slice(5, 6)).item() != 0.0


def test_rows_must_be_contiguous():
    ids = self_supervised_ids(3)
    q, k = make_qk(6, 4, seed=0)
    with pytest.raises(ValueError, match="contiguous"):
        jsd(q, k, ids, rows=slice(0, 6, 2))
    assert jsd(q, k, ids, rows=slice(3, 3)).item() == 0.0  # empty slice


# --------------------------------------------------------------------------------------------------
# Appendix A: KL-softmax with a tied one-layer head is InfoNCE / SupCon
# --------------------------------------------------------------------------------------------------


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
    if kind == "self":
        other, g_other = value_and_grad(infonce)
        const = 0.0
    else:
        other, g_other = value_and_grad(supcon)
        Y = torch.tensor(ref_target(ids.tolist()))
        npos = Y.sum(dim=1)
        const = sum(math.log(p) for p in npos.tolist() if p > 0) / n  # mean_i log|P(i)|, singletons give 0
        assert const > 0
    assert kl.item() == pytest.approx(other.item() - const, rel=1e-10, abs=1e-10)
    torch.testing.assert_close(g_kl, g_other, rtol=1e-9, atol=1e-12)


# --------------------------------------------------------------------------------------------------
# JSD behaviour
# --------------------------------------------------------------------------------------------------


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
    assert jsd_appendix_e(z, z, ids).item() == pytest.approx(want, abs=1e-6)
    assert want < 0


@pytest.mark.parametrize("kind", ["self", "sup"])
@pytest.mark.parametrize("n", [4, 6, 10])
def test_jsd_prefers_block_structure(kind, n):
    ids = make_ids(kind, n)
    n_cls = int(ids.max()) + 1
    g = torch.Generator().manual_seed(n)
    for _ in range(5):
        block = F.one_hot(ids, 8).double() * 3.0 + 0.3 * torch.randn(n, 8, generator=g, dtype=torch.float64)
        rand = torch.randn(n, 8, generator=g, dtype=torch.float64)
        assert jsd(block, block, ids) < jsd(rand, rand, ids)
        assert jsd_appendix_e(block, block, ids) < jsd_appendix_e(rand, rand, ids)
        assert n_cls <= 8


@pytest.mark.parametrize("kind", ["self", "sup"])
@pytest.mark.parametrize("n,d", SIZES)
def test_jsd_bounds(kind, n, d):
    ids = make_ids(kind, n)
    for seed in range(10):
        q, k = make_qk(n, d, seed=seed)
        for i in range(n):
            v = jsd(q, k, ids, rows=slice(i, i + 1)).item() * n  # per-row loss
            assert -1e-12 <= v <= 2 * LOG2 + 1e-12


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_gradients_finite_at_exact_zeros(name):
    """One-hot embeddings give cosines of exactly 0 and 1; no loss may produce NaN gradients there."""
    ids = self_supervised_ids(4)
    z = F.one_hot(ids, 8).double().requires_grad_(True)
    loss = call(name, z, z, ids)
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(z.grad).all()


@pytest.mark.parametrize("name,kind", NAME_KIND)
def test_gradcheck(name, kind):
    n = 6
    ids = make_ids(kind, n)
    q, k = make_qk(n, 3, seed=11)
    q.requires_grad_(True)
    k.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: call(name, a, b, ids, tau=0.5), (q, k))


# --------------------------------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------------------------------


def test_registry_contents():
    assert set(LOSSES) == set(LOSS_NAMES)
    assert len(LOSS_NAMES) == 9
    assert SELF_SUPERVISED_ONLY == frozenset({"infonce", "barlow_twins"})
    assert SELF_SUPERVISED_ONLY <= set(LOSS_NAMES)


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
    part = fn(q0, k0, ids, rows=slice(0, 2)) + fn(q0, k0, ids, rows=slice(2, 6))
    torch.testing.assert_close(part, loss.detach(), rtol=1e-5, atol=1e-6)
    # the bound hyper-parameters are the ones given
    assert fn(q0, k0, ids).item() == pytest.approx(
        call(name, q0, k0, ids, tau=0.2, lam=0.01).item(), rel=1e-6
    )
    if name in TEMPERATURES:
        assert make_loss(name, temperature=0.9)(q0, k0, ids).item() != pytest.approx(loss.item(), rel=1e-3)


def test_make_loss_unknown_name_lists_allowed():
    with pytest.raises(ValueError) as info:
        make_loss("triplet")
    msg = str(info.value)
    assert "unknown loss 'triplet'" in msg
    for name in LOSS_NAMES:
        assert name in msg


def test_make_loss_rejects_bad_temperature():
    with pytest.raises(ValueError, match="temperature"):
        make_loss("supcon", temperature=0.0)


@pytest.mark.parametrize("name", sorted(SELF_SUPERVISED_ONLY))
def test_self_supervised_only_losses_refuse_supervised_batches(name):
    ids = torch.tensor([0, 0, 0, 1, 1, 2])
    q, k = make_qk(6, 4, seed=2)
    match = "one positive per row" if name == "infonce" else "Barlow Twins needs the self-supervised two-view"
    with pytest.raises(ValueError, match=match):
        make_loss(name)(q, k, ids)
    with pytest.raises(ValueError, match=match):  # also when only a slice of rows is computed
        make_loss(name)(q, k, ids, rows=slice(0, 3))


def test_barlow_rejects_odd_batch_and_repeated_ids():
    q, k = make_qk(6, 4, seed=2)
    with pytest.raises(ValueError, match="two-view"):
        barlow_twins(q[:5], k[:5], torch.arange(5))
    with pytest.raises(ValueError, match="two-view"):
        barlow_twins(q, k, torch.tensor([0, 0, 1, 0, 0, 1]))


def test_barlow_ignores_k():
    ids = self_supervised_ids(3)
    q, k = make_qk(6, 4, seed=4)
    assert barlow_twins(q, k, ids).item() == barlow_twins(q, torch.zeros_like(k), ids).item()


def test_dcl_needs_a_negative():
    q, k = make_qk(4, 3, seed=0)
    with pytest.raises(ValueError, match="negative"):
        dcl(q, k, torch.zeros(4, dtype=torch.int64))


def test_shape_errors():
    q, k = make_qk(6, 4, seed=0)
    with pytest.raises(ValueError, match="ids"):
        jsd(q, k, torch.arange(5))
    with pytest.raises(ValueError):
        jsd(q, k[:, :3], self_supervised_ids(3))


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_nan_embeddings_give_a_nan_loss(name):
    """A NaN must surface (the trainer's non-finite guard relies on it), never be masked to 0."""
    q = torch.randn(8, 4)
    q[0, 0] = float("nan")
    assert torch.isnan(make_loss(name)(q, q, self_supervised_ids(4)))
