"""Tests for pipeline.core.clustering: affinity construction vs loops, spectral NMI / ARI on known structures."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from pipeline.core.clustering import cosine_affinity, spectral_scores, symmetric_affinity


def _symmetric_reference(a: np.ndarray) -> list[list[float]]:
    n = len(a)
    out = [[0.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(n):
            if i != j:
                out[i][j] = (max(float(a[i][j]), 0.0) + max(float(a[j][i]), 0.0)) / 2.0
    return out


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


def test_symmetric_affinity_rejects_non_square() -> None:
    with pytest.raises(ValueError, match="square"):
        symmetric_affinity(np.zeros((3, 4)))


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


def test_block_diagonal_torch_input_and_negative_entries() -> None:
    labels = np.arange(30) % 3
    a = _block_affinity(labels, seed=1)
    a[labels[:, None] != labels[None, :]] = -0.7  # negatives are clipped to 0
    scores = spectral_scores(torch.from_numpy(a), torch.from_numpy(labels))
    assert scores == {"nmi": pytest.approx(1.0), "ari": pytest.approx(1.0)}


@pytest.mark.parametrize("seed", [0, 1])
def test_random_affinity_is_chance(seed: int) -> None:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 4, size=300)
    scores = spectral_scores(rng.uniform(size=(300, 300)), labels, seed=seed)
    assert abs(scores["ari"]) < 0.05, scores
    assert 0.0 <= scores["nmi"] < 0.1, scores


def test_isolated_sample_does_not_crash() -> None:
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


def test_all_zero_affinity_does_not_crash() -> None:
    scores = spectral_scores(np.zeros((20, 20)), np.arange(20) % 4)
    assert all(math.isfinite(v) for v in scores.values())


def test_n_clusters_default_and_override() -> None:
    labels = np.arange(40) % 4
    a = _block_affinity(labels, seed=3)
    assert spectral_scores(a, labels)["ari"] == pytest.approx(1.0)  # default: 4 clusters
    merged = spectral_scores(a, labels, n_clusters=2)  # two blocks must share a cluster
    assert merged["ari"] < 0.9 and merged["nmi"] < 0.9
    single = spectral_scores(a, labels, n_clusters=1)
    assert single["ari"] == pytest.approx(0.0) and single["nmi"] == pytest.approx(0.0)


def test_spectral_scores_validates() -> None:
    with pytest.raises(ValueError, match="labels"):
        spectral_scores(np.ones((4, 4)), np.arange(3))
    with pytest.raises(ValueError, match="n_clusters"):
        spectral_scores(np.ones((4, 4)), np.arange(4), n_clusters=5)
