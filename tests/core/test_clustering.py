"""Tests for pipeline.core.clustering: affinity construction vs loops, spectral NMI / ARI on known structures, the
eigengap estimate of k (vs an eigh reference and the paper's literal formula) and cluster_kernel."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from sklearn.metrics import adjusted_rand_score

from pipeline.core.clustering import (
    cluster,
    cluster_kernel,
    cosine_affinity,
    eigengap_k,
    kernel_spectrum,
    set_kernel,
    spectral_scores,
    symmetric_affinity,
)


def _symmetric_reference(a: np.ndarray) -> list[list[float]]:
    n = len(a)
    return [[0.0 if i == j else (max(float(a[i][j]), 0.0) + max(float(a[j][i]), 0.0)) / 2.0 for j in range(n)]
            for i in range(n)]


def _cosine_reference(z: np.ndarray) -> list[list[float]]:
    n = len(z)
    out = [[0.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            dot = sum(float(x) * float(y) for x, y in zip(z[i], z[j], strict=True))
            ni = math.sqrt(sum(float(x) ** 2 for x in z[i]))
            nj = math.sqrt(sum(float(x) ** 2 for x in z[j]))
            out[i][j] = max(dot / (ni * nj), 0.0) if ni > 0 and nj > 0 else 0.0
    return out


@pytest.mark.parametrize("n", [1, 2, 5, 17])
def test_symmetric_affinity_matches_loop(n: int) -> None:
    a = np.random.default_rng(n).normal(size=(n, n))
    got = symmetric_affinity(a)
    assert got.dtype == np.float64 and got.shape == (n, n)
    np.testing.assert_allclose(got, _symmetric_reference(a), rtol=0, atol=1e-15)
    np.testing.assert_allclose(symmetric_affinity(torch.from_numpy(a).float()), got, atol=1e-6)
    with pytest.raises(ValueError, match="square"):
        symmetric_affinity(np.zeros((n, n + 1)))


@pytest.mark.parametrize(("n", "d"), [(1, 3), (4, 2), (12, 5), (30, 8)])
def test_cosine_affinity_matches_loop(n: int, d: int) -> None:
    z = np.random.default_rng(n * d).normal(size=(n, d))
    if n > 3:
        z[2] = 0.0  # a zero embedding has cosine 0 with everything
    got = cosine_affinity(z)
    np.testing.assert_allclose(got, _cosine_reference(z), rtol=0, atol=1e-12)
    np.testing.assert_array_equal(got, got.T)
    np.testing.assert_allclose(cosine_affinity(torch.from_numpy(z)), got, atol=1e-12)


def _block_affinity(labels: np.ndarray, seed: int, noise: float = 0.0) -> np.ndarray:
    """Random positive weights inside the label blocks, `noise`-scale weights between blocks."""
    rng = np.random.default_rng(seed)
    n = len(labels)
    same = labels[:, None] == labels[None, :]
    a = np.where(same, rng.uniform(0.5, 1.0, size=(n, n)), noise * rng.uniform(size=(n, n)))
    np.fill_diagonal(a, 0.0)
    return a


@pytest.mark.parametrize("assign_labels", ["cluster_qr", "kmeans"])
@pytest.mark.parametrize(("n", "k"), [(12, 2), (40, 4), (90, 6)])
def test_block_diagonal_is_perfect(n: int, k: int, assign_labels: str) -> None:
    labels = np.random.default_rng(n).permutation(np.arange(n) % k)  # blocks interleaved, not sorted
    for noise in (0.0, 0.01):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "graph is not fully connected" warning either
            scores = spectral_scores(_block_affinity(labels, seed=k, noise=noise), labels, assign_labels=assign_labels)
        assert scores["nmi"] == pytest.approx(1.0) and scores["ari"] == pytest.approx(1.0), (noise, scores)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_affinity_is_chance(seed: int) -> None:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 4, size=300)
    scores = spectral_scores(rng.uniform(size=(300, 300)), labels, seed=seed)
    assert abs(scores["ari"]) < 0.05, scores
    assert 0.0 <= scores["nmi"] < 0.1, scores


def test_isolated_sample_and_all_zero_affinity_do_not_crash() -> None:
    labels = np.arange(30) % 3
    a = _block_affinity(labels, seed=2)
    a[5, :] = 0.0
    a[:, 5] = -1.0  # sample 5 has no positive affinity to anyone
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scores = spectral_scores(a, labels)
    assert set(scores) == {"nmi", "ari"}
    assert all(math.isfinite(v) for v in scores.values())
    assert scores["ari"] > 0.8  # the other 29 samples are still clustered by their blocks
    assert all(math.isfinite(v) for v in spectral_scores(np.zeros((20, 20)), np.arange(20) % 4).values())


def test_n_clusters_default_and_override() -> None:
    labels = np.arange(40) % 4
    a = _block_affinity(labels, seed=3)
    assert spectral_scores(a, labels)["ari"] == pytest.approx(1.0)  # default: 4 clusters
    neg = a.copy()
    neg[labels[:, None] != labels[None, :]] = -0.7  # negatives are clipped to 0; tensors are taken
    assert spectral_scores(torch.from_numpy(neg), torch.from_numpy(labels)) == {"nmi": pytest.approx(1.0),
                                                                                "ari": pytest.approx(1.0)}
    merged = spectral_scores(a, labels, n_clusters=2)  # two blocks must share a cluster
    assert merged["ari"] < 0.9 and merged["nmi"] < 0.9
    single = spectral_scores(a, labels, n_clusters=1)
    assert single["ari"] == pytest.approx(0.0) and single["nmi"] == pytest.approx(0.0)
    with pytest.raises(ValueError, match="labels"):
        spectral_scores(np.ones((4, 4)), np.arange(3))
    with pytest.raises(ValueError, match="n_clusters"):
        spectral_scores(np.ones((4, 4)), np.arange(4), n_clusters=5)


# ------------------------------------------------------------------------------------------- eigengap and k
def _planted_kernel(k: int, seed: int, noise: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """A symmetric kernel with k blocks of random sizes 2..12 (shuffled), within-block entries in [0.7, 1] (diagonal
    included), between-block entries in [0, noise]: (kernel (n, n), labels (n,))."""
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.repeat(np.arange(k), rng.integers(2, 13, size=k)))  # (n,)
    n = len(labels)
    same = labels[:, None] == labels[None, :]
    a = np.where(same, rng.uniform(0.7, 1.0, size=(n, n)), noise * rng.uniform(size=(n, n)))
    return 0.5 * (a + a.T), labels


def _normalized_reference(a: np.ndarray) -> np.ndarray:
    """D^-1/2 A D^-1/2 with loops, d_i = sum_j A_ij (diagonal included); zero degree -> zero row and column."""
    n = len(a)
    d = [sum(float(a[i][j]) for j in range(n)) for i in range(n)]
    return np.array([[float(a[i][j]) / math.sqrt(d[i] * d[j]) if d[i] > 0 and d[j] > 0 else 0.0 for j in range(n)]
                     for i in range(n)])


@pytest.mark.parametrize("k", range(2, 11))
def test_eigengap_recovers_planted_blocks(k: int) -> None:
    for seed in range(3):
        a, labels = _planted_kernel(k, seed=100 * k + seed)
        assert eigengap_k(a) == k, (k, seed, len(labels))
        assert eigengap_k(torch.from_numpy(a).float()) == k  # a float32 tensor: symmetric within the tolerance
        assert eigengap_k(a, k_max=k) == k and eigengap_k(a, k_max=k - 1) <= k - 1  # the cap is honoured


@pytest.mark.parametrize(("k", "seed"), [(2, 0), (5, 1), (10, 2)])
def test_kernel_spectrum_matches_eigh_of_the_normalized_kernel(k: int, seed: int) -> None:
    a, _ = _planted_kernel(k, seed=seed)
    ref = np.sort(np.linalg.eigh(_normalized_reference(a))[0])[::-1]
    got = kernel_spectrum(a)
    assert got.shape == (len(a),)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-12)
    assert np.all(np.diff(got) <= 0) and got[0] == pytest.approx(1.0)  # descending, mu_1 = 1 (non-negative)
    gaps = [got[i] - got[i + 1] for i in range(len(got) - 1)]
    assert eigengap_k(a) == 1 + max(range(len(gaps)), key=lambda i: (gaps[i], -i))  # first argmax, 1-based


def test_kernel_spectrum_keeps_the_diagonal_and_an_isolated_row() -> None:
    a, _ = _planted_kernel(3, seed=7)
    a[4, :] = a[:, 4] = 0.0  # a zero-degree row: its row and column of D^-1/2 A D^-1/2 are zero
    np.testing.assert_allclose(kernel_spectrum(a), np.sort(np.linalg.eigh(_normalized_reference(a))[0])[::-1],
                               atol=1e-12)
    b = a.copy()
    np.fill_diagonal(b, 0.0)  # the diagonal counts: zeroing it changes the spectrum
    assert not np.allclose(kernel_spectrum(a), kernel_spectrum(b), atol=1e-3)


@pytest.mark.parametrize("k", [2, 4, 7, 10])
def test_the_papers_literal_formula_returns_n_minus_k(k: int) -> None:
    """Section 4.4 read literally, argmax_i (lambda_i - lambda_{i+1}) over L = I - D^-1/2 A D^-1/2, gives n - k:
    the deviation eigengap_k's docstring states."""
    a, labels = _planted_kernel(k, seed=k)
    n = len(labels)
    lam = np.sort(np.linalg.eigh(np.eye(n) - _normalized_reference(a))[0])[::-1]  # (n,) descending
    literal = 1 + int(np.argmax(lam[:-1] - lam[1:]))
    assert literal == n - k
    assert eigengap_k(a) == k


def test_eigengap_edge_cases_and_bad_kernels() -> None:
    assert eigengap_k(np.ones((1, 1))) == 1
    assert eigengap_k(np.eye(6)) == 1  # all singletons: no gap, the documented limit
    assert eigengap_k(_planted_kernel(4, seed=3)[0], k_max=10_000) == 4  # clipped to n - 1
    a, _ = _planted_kernel(3, seed=5)
    asym = a.copy()
    asym[0, 1] += 0.1
    with pytest.raises(ValueError, match="symmetric"):
        eigengap_k(asym)
    for bad in (np.nan, np.inf):
        b = a.copy()
        b[2, 3] = b[3, 2] = bad
        with pytest.raises(ValueError, match="NaN or inf"):
            eigengap_k(b)
    for x, match in [(np.ones((3, 4)), "square"), (-np.ones((4, 4)), "negative degrees"), (np.zeros((0, 0)), "empty")]:
        with pytest.raises(ValueError, match=match):
            eigengap_k(x)
    for k_max in (0, 2.5, True):
        with pytest.raises(ValueError, match="k_max"):
            eigengap_k(a, k_max=k_max)


@pytest.mark.parametrize("k", [2, 3, 6, 9])
def test_cluster_kernel_recovers_clean_blocks(k: int) -> None:
    a, labels = _planted_kernel(k, seed=k, noise=0.0)  # exactly block-diagonal: disconnected, connected by eps
    for given in (k, None):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            pred, k_hat = cluster_kernel(a, k=given, seed=1)
        assert k_hat == k and pred.shape == labels.shape and pred.dtype == np.int64
        assert adjusted_rand_score(labels, pred) == 1.0
        assert set(pred.tolist()) == set(range(k))
    # an asymmetric affinity with negative entries is symmetrised first
    a, labels = _planted_kernel(5, seed=11)
    a = a * np.random.default_rng(0).uniform(0.8, 1.2, size=a.shape) - 0.3 * (labels[:, None] != labels[None, :])
    pred, k_hat = cluster_kernel(torch.from_numpy(a), seed=0)
    assert k_hat == 5 and adjusted_rand_score(labels, pred) == 1.0


def test_cluster_kernel_validates() -> None:
    a, _ = _planted_kernel(3, seed=2)
    for k in (0, len(a) + 1, 1.5):
        with pytest.raises(ValueError, match="k must be"):
            cluster_kernel(a, k=k)
    with pytest.raises(ValueError, match="NaN or inf"):
        cluster_kernel(np.full((3, 3), np.nan))
    pred, k_hat = cluster_kernel(a, k=1)
    assert k_hat == 1 and not pred.any()


@pytest.mark.parametrize("k", [2, 4, 7])
def test_cluster_finds_the_blocks_of_a_kernel_and_of_a_trained_head(k):
    """`cluster(kernel)` on a noisy block kernel returns the blocks and k̂ = k; `cluster(x, head)` goes through the
    head's kernel: an ABC head whose kernel is that of its input is the same clustering."""
    rng = np.random.default_rng(k)
    y = rng.permutation(np.arange(6 * k) % k)
    kern = (y[:, None] == y[None, :]) * 0.8 + rng.uniform(0, 0.1, (6 * k, 6 * k))
    labels, k_hat = cluster(kern)
    assert k_hat == k and adjusted_rand_score(y, labels) == pytest.approx(1.0)
    labels, k_hat = cluster(kern, k=k - 1 if k > 2 else 3)
    assert k_hat == (k - 1 if k > 2 else 3)
    assert cluster(kern, k_max=1)[1] == 1

    class Echo(torch.nn.Module):  # a "head" whose kernel is its input
        def forward(self, x):
            return type("Out", (), {"kernel": x})()

    x = torch.from_numpy(0.5 * (kern + kern.T))
    np.testing.assert_array_equal(set_kernel(Echo(), x), x.numpy())
    assert cluster(x, Echo())[1] == k
