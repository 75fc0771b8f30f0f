"""Section 3 tools (pipeline/theory/measures.py) against slow references and hand-computed values."""

from __future__ import annotations

import itertools
import math
import warnings

import numpy as np
import pytest
import torch

from pipeline.data import synthetic as S
from pipeline.theory import bound as B
from pipeline.theory import measures as T

# ----------------------------------------------------------------------------------------- helpers


def naive_sharpness(a, labels):
    """Definition 2 literally: inf over (i, j, p, q) of A_ij / A_pq, for a NON-NEGATIVE matrix. Same-cluster pairs
    exclude i == j; a zero denominator is read as 0+ (x / 0+ = +inf if x > 0, 0 if x = 0)."""
    n = len(labels)
    best = math.inf
    for i, j, p, q in itertools.product(range(n), repeat=4):
        if i == j or labels[i] != labels[j] or labels[p] == labels[q]:
            continue
        num, den = float(a[i][j]), float(a[p][q])
        assert num >= 0 and den >= 0, "the naive reference is for non-negative matrices"
        r = num / den if den > 0 else (math.inf if num > 0 else 0.0)
        best = min(best, r)
    return best


def dot(u, v):
    return sum(float(a) * float(b) for a, b in zip(u, v, strict=True))


def naive_min_abs(xs, u):
    return min(abs(dot(x, u)) for x in xs)


def complement_norm(x, basis):
    """||x - B B^T x|| for orthonormal columns B, by explicit loops."""
    m, r = len(basis), len(basis[0])
    coef = [sum(basis[a][c] * x[a] for a in range(m)) for c in range(r)]
    resid = [x[a] - sum(basis[a][c] * coef[c] for c in range(r)) for a in range(m)]
    return math.sqrt(sum(t * t for t in resid))


# --------------------------------------------------------------------------------------- generator
GEN_CASES = [(30, 3, 2, 8, 0.3), (50, 5, 1, 6, 0.1), (64, 2, 4, 9, 0.0), (41, 4, 3, 12, 1.0)]


@pytest.mark.parametrize("n,k,r,m,noise", GEN_CASES)
def test_generator_shapes_units_labels_subspaces_and_noise_bound(n, k, r, m, noise):
    d = S.union_of_subspaces(n, k, r, m, noise, seed=3)
    assert d.x.shape == (n, m) and d.x.dtype == torch.float32
    assert d.clean.shape == (n, m) and d.clean.dtype == torch.float32
    assert d.labels.shape == (n,) and d.labels.dtype == torch.int64
    assert d.bases.shape == (k, m, r)
    for row in itertools.chain(d.x.double().tolist(), d.clean.double().tolist()):
        assert abs(math.sqrt(sum(t * t for t in row)) - 1.0) < 1e-6
    counts = [int((d.labels == c).sum()) for c in range(k)]
    assert sum(counts) == n and max(counts) - min(counts) <= 1
    b = d.bases.double()
    for c, a, e in itertools.product(range(k), range(r), range(r)):  # orthonormal columns
        assert abs(dot(b[c][:, a], b[c][:, e]) - (1.0 if a == e else 0.0)) < 1e-5
    b = b.tolist()
    cos = []
    for i in range(n):
        c = d.clean[i].double().tolist()
        assert complement_norm(c, b[int(d.labels[i])]) < 1e-5  # clean sample lies in its subspace
        cos.append(dot(c, d.x[i].double().tolist()))
    assert min(cos) >= 1 - noise - 1e-6  # eq. (8)
    assert min(cos) <= 1 - 0.8 * noise + 1e-6  # e_i ~ U[0, ε]: the bound is nearly attained
    if noise == 0:
        assert torch.allclose(d.x, d.clean, atol=1e-7)


def test_generator_deterministic_and_private_rng():
    state = torch.get_rng_state()
    a = S.union_of_subspaces(20, 2, 2, 5, 0.2, seed=7)
    b = S.union_of_subspaces(20, 2, 2, 5, 0.2, seed=7)
    c = S.union_of_subspaces(20, 2, 2, 5, 0.2, seed=8)
    assert torch.equal(torch.get_rng_state(), state)  # global RNG untouched
    for f in ("x", "labels", "bases", "clean"):
        assert torch.equal(getattr(a, f), getattr(b, f))
    assert not torch.equal(a.x, c.x) and not torch.equal(a.bases, c.bases)


@pytest.mark.parametrize("kwargs,match", [
    *[(dict(n_clusters=k, rank=r, dim=m), r"\(K - 1\) r") for k, r, m in [(3, 2, 4), (2, 3, 3), (5, 1, 4), (2, 4, 4)]],
    (dict(noise=1.5), r"noise ε must lie in \[0, 1\].*got 1.5"), (dict(noise=-0.1), r"\[0, 1\].*got -0.1"),
    (dict(n=2), "need n >= n_clusters"), (dict(dim=1, n_clusters=1, rank=1), "need dim >= 2")])
def test_generator_rejects_bad_arguments(kwargs, match):
    """Dependent subspaces ((K - 1) r >= m), noise outside [0, 1], too few samples or clusters."""
    with pytest.raises(ValueError, match=match):
        S.union_of_subspaces(**(dict(n=10, n_clusters=3, rank=1, dim=5, noise=0.1) | kwargs))


# --------------------------------------------------------------------------------------- sharpness
def _random_labels(n, k, seed):
    rng = np.random.default_rng(seed)
    return rng.permutation(np.arange(n) % k)


@pytest.mark.parametrize("n,k,seed", [(6, 3, 0), (6, 2, 1), (9, 3, 2), (9, 4, 3), (7, 2, 4)])
def test_sharpness_matches_naive_loop(n, k, seed):
    rng = np.random.default_rng(seed)
    labels = _random_labels(n, k, seed)
    a = rng.uniform(0.0, 1.0, (n, n))
    a[labels[:, None] == labels[None, :]] += 0.3 * seed  # make some of them sharper
    ref = naive_sharpness(a.tolist(), labels.tolist())
    assert T.sharpness(a, labels) == pytest.approx(ref, rel=1e-12)
    assert T.sharpness(torch.from_numpy(a).float(), torch.from_numpy(labels)) == pytest.approx(ref, rel=1e-6)
    a2 = a.copy()
    np.fill_diagonal(a2, -100.0)  # diagonal excluded
    assert T.sharpness(a2, labels) == pytest.approx(ref, rel=1e-12)


@pytest.mark.parametrize("n,k", [(6, 3), (9, 3), (8, 2)])
def test_sharpness_infinite_and_zero(n, k):
    labels = _random_labels(n, k, n)
    same = labels[:, None] == labels[None, :]
    block = np.where(same, 0.5 + np.arange(n * n).reshape(n, n) / (n * n), 0.0)
    assert naive_sharpness(block.tolist(), labels.tolist()) == math.inf
    assert T.sharpness(block, labels) == math.inf
    zero_inside = np.where(same, 0.0, 0.25)  # same-cluster affinity 0 -> sharpness 0
    assert naive_sharpness(zero_inside.tolist(), labels.tolist()) == 0.0
    assert T.sharpness(zero_inside, labels) == 0.0
    assert T.sharpness(np.zeros((n, n)), labels) == 0.0  # 0 / 0+ convention


def test_sharpness_negative_entries_conventions():
    labels = np.array([0, 0, 1, 1])
    a = np.array([[9.0, -0.5, 0.1, 0.25], [2.0, 9.0, 0.2, 0.0], [0.1, 0.2, 9.0, 1.0], [0.0, 0.0, 3.0, 9.0]])
    assert T.sharpness(a, labels) == pytest.approx(-0.5 / 0.25)  # min_same / max_diff, <= 0
    neg = np.array([[0.0, -1.0, -2.0, -2.0], [-1.0, 0.0, -2.0, -2.0], [-2.0, -2.0, 0.0, -1.0], [-2.0, -2.0, -1.0, 0.0]])
    assert T.sharpness(neg, labels) == -math.inf  # negative inside, non-positive across
    pos = -neg
    pos[labels[:, None] != labels[None, :]] = -3.0
    assert T.sharpness(pos, labels) == math.inf  # positive inside, negative across


def test_sharpness_errors_and_per_layer():
    with pytest.raises(ValueError, match="two clusters"):
        T.sharpness(np.ones((3, 3)), [1, 1, 1])
    with pytest.raises(ValueError, match="singleton"):
        T.sharpness(np.ones((3, 3)), [0, 1, 2])
    labels = [0, 0, 1, 1, 2, 2]
    rng = np.random.default_rng(0)
    mats = [rng.uniform(size=(6, 6)) for _ in range(3)]
    out = T.sharpness_per_layer([mats[0], torch.from_numpy(mats[1]), mats[2]], labels)
    assert all(isinstance(s, float) for s in out)
    assert out == pytest.approx([naive_sharpness(m.tolist(), labels) for m in mats])


# ------------------------------------------------------------------------------- cluster integrity
@pytest.mark.parametrize("theta", [0.3, math.pi / 4, 1.2, math.pi / 2])
def test_integrity_two_lines_in_the_plane(theta):
    # U_1 = span(e1), U_2 = span((cos θ, sin θ)); the complement of each line is one direction
    b = np.array([[[1.0], [0.0]], [[math.cos(theta)], [math.sin(theta)]]])
    c, s = math.cos(theta), math.sin(theta)
    x = np.array([[1.0, 0.0], [-1.0, 0.0], [c, s], [-c, -s]])
    rho_k = T.cluster_integrity_per_cluster(x, [0, 0, 1, 1], b)
    assert rho_k == pytest.approx([math.sin(theta)] * 2, abs=1e-12)
    rho = T.cluster_integrity(torch.from_numpy(x), torch.tensor([0, 0, 1, 1]), torch.from_numpy(b))
    assert rho == pytest.approx(math.sin(theta), abs=1e-7)


@pytest.mark.parametrize("k", [2, 3, 4])
def test_integrity_coordinate_axes(k):
    # K coordinate axes in R^{K+1}; u ⊥ e_k must make |u_j| >= ρ for the K-1 other axes: ρ = 1/sqrt(K-1)
    axes = np.eye(k + 1)[:k]  # (K, K + 1): U_c = span(e_c)
    xs = np.repeat(axes, 3, axis=0) * np.tile([1.0, -1.0, 1.0], k)[:, None]  # +e_c, -e_c, +e_c for each cluster
    rho = T.cluster_integrity(xs, np.repeat(np.arange(k), 3), axes[:, :, None])
    assert rho == pytest.approx(1 / math.sqrt(k - 1), abs=1e-3)
    assert rho <= 1 / math.sqrt(k - 1) + 1e-12  # a lower bound, never above the truth


@pytest.mark.parametrize("alpha", [math.pi / 3, 0.5, 1.2])
def test_integrity_orthogonal_planes_with_arcs(alpha):
    # U_1 = span(e1, e2), U_2 = span(e3, e4), each cluster's samples on an arc of angle α < π/2:
    # ρ_k = max over unit v in the other plane of min_φ |cos(φ - ψ)| = cos(α/2)
    phis = np.linspace(0.0, alpha, 7)
    x1 = np.stack([np.cos(phis), np.sin(phis), 0 * phis, 0 * phis], 1)
    x2 = np.stack([0 * phis, 0 * phis, np.cos(phis), -np.sin(phis)], 1)
    b = np.zeros((2, 4, 2))
    b[0, 0, 0] = b[0, 1, 1] = b[1, 2, 0] = b[1, 3, 1] = 1.0
    rho_k = T.cluster_integrity_per_cluster(np.vstack([x1, x2]), [0] * 7 + [1] * 7, b)
    assert rho_k == pytest.approx([math.cos(alpha / 2)] * 2, abs=1e-3)


@pytest.mark.parametrize("n,k,r,m,noise", [(24, 3, 2, 8, 0.0), (30, 2, 3, 7, 0.2), (32, 4, 1, 6, 0.1)])
def test_integrity_random_data_bracketed(n, k, r, m, noise):
    d = S.union_of_subspaces(n, k, r, m, noise, seed=11)
    x, labels = d.x.double().tolist(), d.labels.tolist()
    rho_k, u = T.cluster_integrity_directions(d.x, d.labels, d.bases)
    b = d.bases.double().numpy()
    for c in range(k):
        others = [x[i] for i in range(n) if labels[i] != c]
        # witness: unit, orthogonal to U_c, and its exact value is the reported ρ_c
        assert abs(dot(u[c], u[c]) - 1.0) < 1e-9
        assert np.abs(b[c].T @ u[c]).max() < 1e-6
        assert rho_k[c] == pytest.approx(naive_min_abs(others, u[c].tolist()), abs=1e-9)
        # upper bound: |x^T u| <= ||P_{U_c^⊥} x|| for every unit u ⊥ U_c
        assert rho_k[c] <= min(complement_norm(o, b[c].tolist()) for o in others) + 1e-9
        # a max over u: at least as good as explicitly constructed feasible directions
        comp = np.linalg.svd(b[c], full_matrices=True)[0][:, r:]
        for o in others:
            v = comp @ (comp.T @ np.array(o))
            assert rho_k[c] >= naive_min_abs(others, (v / np.linalg.norm(v)).tolist()) - 1e-9
        for g in np.random.default_rng(c).standard_normal((20, m - r)):
            assert rho_k[c] >= naive_min_abs(others, (comp @ g / np.linalg.norm(g)).tolist()) - 1e-9
    rho = T.cluster_integrity(d.x, d.labels, d.bases)
    assert 0.0 <= rho <= 1.0 and rho == pytest.approx(rho_k.min())
    assert rho <= T.cluster_integrity_upper_bound(d.x, d.labels, d.bases) + 1e-9


def test_integrity_edge_cases():
    b = np.zeros((2, 3, 1))
    b[0, 0, 0] = b[1, 1, 0] = 1.0
    x = np.array([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    rho_k = T.cluster_integrity_per_cluster(x, [0, 0], b)  # nothing outside cluster 0
    assert rho_k[0] == math.inf and rho_k[1] == pytest.approx(1.0)
    full = np.eye(3)[None].repeat(2, 0)
    with pytest.raises(ValueError, match="spans"):
        T.cluster_integrity(x, [0, 1], full)
    with pytest.raises(ValueError, match="labels"):
        T.cluster_integrity(x, [0, 2], b)


# ----------------------------------------------------------------------------------------- Theorem 1
@pytest.mark.parametrize("n,k,r,m", [(12, 2, 1, 4), (30, 3, 2, 8), (28, 4, 3, 13), (25, 5, 1, 5)])
def test_theorem1_block_diagonal(n, k, r, m):
    d = S.union_of_subspaces(n, k, r, m, 0.0, seed=2)
    w = B.theorem1_weights(d.bases, d.labels, d.x)
    assert isinstance(w, torch.Tensor) and w.shape == (m, n) and w.dtype == torch.float32
    a = B.affinity_from_weights(d.x, w)
    assert isinstance(a, torch.Tensor) and a.shape == (n, n)
    x, wl, labels = d.x.double().tolist(), w.double().T.tolist(), d.labels.tolist()
    xw = [[dot(x[i], wl[j]) for j in range(n)] for i in range(n)]  # (XW)_ij = x_i^T w_j
    ref = [[sum(xw[i][t] * xw[j][t] for t in range(n)) for j in range(n)] for i in range(n)]
    top = max(abs(v) for row in ref for v in row)
    assert np.allclose(a.double().numpy(), np.array(ref), atol=1e-5 * top)
    for i, j in itertools.product(range(n), repeat=2):
        assert abs(dot(wl[j], wl[j]) - 1.0) < 1e-5
        if labels[i] != labels[j]:
            assert abs(xw[i][j]) < 1e-5  # w_j ⊥ every other subspace
            assert abs(ref[i][j]) <= 1e-5 * top and abs(float(a[i, j])) <= 1e-5 * top
    assert all(ref[i][i] > 0 for i in range(n))
    x64 = d.x.double().numpy()
    a_np = B.affinity_from_weights(x64, B.theorem1_weights(d.bases, d.labels, x64))
    assert isinstance(a_np, np.ndarray)
    a_np[d.labels.numpy()[:, None] != d.labels.numpy()[None, :]] = 0.0  # float64 round-off across clusters
    assert T.sharpness(np.abs(a_np), d.labels) == math.inf


@pytest.mark.parametrize("n,m", [(4, 4), (10, 4), (9, 7)])
def test_theorem1_paper_rank1_example_bound(n, m):
    # two rank-1 subspaces, sign-aligned samples x_i = +u_{c_i} (section 3.1's example when n = m = 4)
    d = S.union_of_subspaces(n, 2, 1, m, 0.0, seed=n)
    labels = d.labels.numpy()
    x = d.bases.double().numpy()[labels, :, 0]  # (n, m)
    rho = T.cluster_integrity(x, labels, d.bases)
    a = B.affinity_from_weights(x, B.theorem1_weights(d.bases, labels, x))
    nu = np.bincount(labels)[labels]
    same = labels[:, None] == labels[None, :]
    for i, j in zip(*np.nonzero(same), strict=True):
        assert a[i, j] >= nu[i] * rho**2 - 1e-6  # Theorem 1, eq. (12)
    # ... attained with equality: the printed strict ">" does not hold
    assert np.min(a[same] - (nu[:, None] * rho**2 * np.ones((n, n)))[same]) == pytest.approx(0.0, abs=1e-6)
    x_flip = x.copy()
    x_flip[np.flatnonzero(labels == 0)[0]] *= -1  # one sample along -u_1: same-cluster entries go negative
    a_flip = B.affinity_from_weights(x_flip, B.theorem1_weights(d.bases, labels, x_flip))
    assert a_flip[same].min() < 0


def test_theorem1_bound_fails_with_three_clusters():
    # three lines in R^3 ((K-1) r = 2 < 3): u_3 nearly in span(u_1, u_2) but far from each of them
    t = 0.05
    c = math.cos(t) / math.sqrt(2)
    u = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [c, c, math.sin(t)]])
    bases = u[:, :, None]
    labels = np.array([0, 0, 1, 1, 2, 2])
    x = u[labels]
    rho = T.cluster_integrity(x, labels, bases)  # a lower bound of the true ρ
    assert rho > 0.5
    a = B.affinity_from_weights(x, B.theorem1_weights(bases, labels, x))
    assert a[4, 5] == pytest.approx(2 * math.sin(t) ** 2)  # = ν ||P u_3||², far below ν ρ²
    assert a[4, 5] < 2 * rho**2


def test_theorem1_rejects_sample_in_span_of_others():
    u = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.6, 0.8, 0.0]])
    with pytest.raises(ValueError, match="span"):
        B.theorem1_weights(u[:, :, None], [0, 1, 2], u)


# --------------------------------------------------------------------------------- δ, Δ and Theorem 2
def test_noise_bounds_hand_values():
    # ρ = 0.6, ε = 0.5: 1 - ε = 0.5, δ = sqrt(1 - 0.25) = sqrt(0.75);
    # Δ = 0.5 * 0.6 - sqrt(0.75 * 0.64) = 0.3 - 0.8 sqrt(0.75)
    delta, big = B.noise_bounds(0.6, 0.5)
    assert isinstance(delta, float) and isinstance(big, float)
    assert delta == pytest.approx(math.sqrt(0.75)) and big == pytest.approx(0.3 - 0.8 * math.sqrt(0.75))
    # ρ = 1: Δ = 1 - ε exactly (no cross term); ρ = 0: Δ = -δ
    assert B.noise_bounds(1.0, 0.25)[1] == pytest.approx(0.75)
    d0, b0 = B.noise_bounds(0.0, 0.25)
    assert b0 == pytest.approx(-d0) and d0 == pytest.approx(math.sqrt(1 - 0.75**2))
    rho = np.linspace(0, 1, 11)
    delta, big = B.noise_bounds(rho, 0.0)  # ε = 0: δ = 0, Δ = ρ exactly
    assert np.all(delta == 0.0) and np.array_equal(big, rho)
    with pytest.raises(ValueError):
        B.noise_bounds(1.2, 0.1)


@pytest.mark.parametrize("rho,eps,n,expected,meaningful", [
    # ε = 0: δ = 0, Δ = ρ = 1: γ = (1 - 0)² * 2 / (1 * n³ * (1 + 1) * 1) = 1 / n³
    (1.0, 0.0, 2, 1 / 8, True),
    (1.0, 0.0, 4, 1 / 64, True),
    # ε = 0, ρ = 0.8: γ = 0.512² * 2 / (0.64 * 1 * 1.64 * 1) = 0.524288 / 1.0496
    (0.8, 0.0, 1, 0.524288 / 1.0496, True),
    # ρ = 1, ε = 0.4: δ = 0.8, Δ = 0.6, n = 1: n²(δ + δ²) = 1.44, Δ³ = 0.216, num = (0.216 - 1.44)² * 2.8 = 4.1948928;
    # Δ² + 1 + δ = 2.16; den = 0.36 * 2.16 * (1 + 0.8 * 2.16) = 2.1212928
    (1.0, 0.4, 1, 4.1948928 / 2.1212928, False),
    # ρ = 0.6, ε = 1: δ = 1, Δ = -0.8, n = 2: n²(δ + δ²) = 8; num = (-0.512 - 8)² * 3 = 217.362432;
    # Δ² + 1 + δ = 2.64; den = 0.64 * 8 * 2.64 * (1 + 2.64) = 49.201152
    (0.6, 1.0, 2, 217.362432 / 49.201152, False),
])
def test_theorem2_hand_values(rho, eps, n, expected, meaningful):
    t = B.theorem2(rho, eps, n)
    assert float(t.gamma) == pytest.approx(expected, rel=1e-9)
    assert bool(t.meaningful) is meaningful


def test_theorem2_singularity_at_delta_zero():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no floating-point warnings may escape
        t = B.theorem2(1.0, 1.0, np.array([1, 2, 64]))  # Δ = 0 * 1 - sqrt(1 * 0) = 0 exactly, δ = 1
        assert np.all(t.Delta == 0) and np.all(np.isposinf(t.gamma)) and not t.meaningful.any()
        origin = B.theorem2(0.0, 0.0, 8)  # Δ = δ = 0: the formula is 0 / 0
        assert np.isnan(origin.gamma) and not origin.meaningful
    # γ blows up as Δ -> 0+ at fixed ε (δ = 0.8 at ε = 0.4, so Δ = 0 at ρ = 0.8)
    gammas = [float(B.theorem2(0.8 + 10.0**-p, 0.4, 16).gamma) for p in range(2, 7)]
    assert all(g2 > g1 for g1, g2 in zip(gammas[:-1], gammas[1:], strict=True)) and gammas[-1] > 1e6


def test_theorem2_broadcasting_matches_scalar_calls():
    rho, eps, ns = np.linspace(0, 1, 5), np.linspace(0, 1, 4), np.array([1.0, 3.0, 50.0])
    t = B.theorem2(rho[None, :, None], eps[None, None, :], ns[:, None, None])
    assert t.gamma.shape == t.delta.shape == t.Delta.shape == t.meaningful.shape == (3, 5, 4)
    for a, b, c in itertools.product(range(3), range(5), range(4)):
        s = B.theorem2(rho[b], eps[c], ns[a])
        for f in ("delta", "Delta", "gamma", "meaningful"):
            np.testing.assert_equal(getattr(t, f)[a, b, c], getattr(s, f))
    with pytest.raises(ValueError, match="n"):
        B.theorem2(0.5, 0.1, 0)


@pytest.mark.parametrize("n", [1, 2, 8, 64, 256])
def test_learnable_region_monotone_and_empty(n):
    rho, eps = np.linspace(0, 1, 201), np.linspace(0, 1, 201)
    region = B.learnable_region(rho[:, None], eps[None, :], n)
    assert region.shape == (201, 201)
    # shrinking ε never leaves the region at fixed ρ, n
    assert not (region[:, 1:] & ~region[:, :-1]).any()
    # ... vacuously: the region is empty, γ <= 2Δ⁴/n³ <= 1 wherever the bound is meaningful
    t = B.theorem2(rho[:, None], eps[None, :], n)
    assert np.all(t.gamma[t.meaningful] <= 2 * t.Delta[t.meaningful] ** 4 / n**3 + 1e-12)
    assert not region.any()


def test_printed_gamma_region_favours_noise():
    rho, eps = np.linspace(0, 1, 201), np.linspace(0, 1, 201)
    regions = {n: B.printed_gamma_region(rho[:, None], eps[None, :], n) for n in (2, 8, 64)}
    for n, reg in regions.items():
        assert reg.any() and not reg[:, 0].any()  # never at ε = 0
        assert not (reg[:, :-1] & ~reg[:, 1:]).any()  # growing ε never leaves it
        assert not (~reg[:-1, :] & reg[1:, :]).any()  # growing ρ never enters it
        assert not (reg & B.theorem2(rho[:, None], eps[None, :], n).meaningful).any()
    assert not (regions[2] & ~regions[8]).any() and not (regions[8] & ~regions[64]).any()  # grows with n


@pytest.mark.parametrize("n", [5, 8])
def test_affinity_contrast_matches_a_loop(n):
    rng = np.random.default_rng(n)
    a = rng.random((n, n))
    y = np.arange(n) % 2
    same = [a[i, j] for i in range(n) for j in range(n) if i != j and y[i] == y[j]]
    diff = [a[i, j] for i in range(n) for j in range(n) if y[i] != y[j]]
    assert T.affinity_contrast(a, y) == pytest.approx((sum(same) / len(same)) / (sum(diff) / len(diff)))
    block = (y[:, None] == y[None, :]).astype(float)
    assert T.affinity_contrast(block, y) == float("inf")


@pytest.mark.parametrize("n", [6, 11, 40])
@pytest.mark.parametrize("q", [0.0, 0.1, 0.25])
def test_quantile_sharpness_matches_sorted_pairs(n, q):
    rng = np.random.default_rng(n)
    a = np.maximum(rng.normal(size=(n, n)), 0.0)  # ReLU-like: many exact zeros
    y = np.arange(n) % 3
    same = sorted(a[i, j] for i in range(n) for j in range(n) if i != j and y[i] == y[j])
    diff = sorted(a[i, j] for i in range(n) for j in range(n) if y[i] != y[j])

    def quantile(v, p):  # linear interpolation between order statistics, NumPy's default
        pos = p * (len(v) - 1)
        lo = int(math.floor(pos))
        return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (pos - lo)

    lo, hi = quantile(same, q), quantile(diff, 1 - q)
    want = lo / hi if hi > 0 else (math.inf if lo > 0 else 0.0)
    assert T.quantile_sharpness(a, y, q) == pytest.approx(want)
    if q == 0.0:
        assert T.quantile_sharpness(a, y, 0.0) == T.sharpness(a, y)  # q = 0 is Definition 2


def test_quantile_sharpness_discriminates_where_definition_2_is_zero():
    y = np.repeat(np.arange(4), 8)  # (32,)
    a = np.where(y[:, None] == y[None, :], 0.8, 0.05)
    np.fill_diagonal(a, 0.0)
    a[0, 1] = 0.0  # one dead same-class pair: Definition 2 drops to 0
    assert T.sharpness(a, y) == 0.0
    assert T.quantile_sharpness(a, y, 0.1) == pytest.approx(0.8 / 0.05)
    with pytest.raises(ValueError, match="0.5"):
        T.quantile_sharpness(a, y, 0.5)
