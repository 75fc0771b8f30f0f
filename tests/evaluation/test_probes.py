"""pipeline.evaluation.probes: stratified label fractions, probe construction, probe accuracy on easy / noise data."""

from __future__ import annotations

import math
import warnings
from collections import Counter

import numpy as np
import pytest
import torch
from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.datasets import make_blobs
from sklearn.linear_model import LogisticRegression
from sklearn.neighbors import KNeighborsClassifier
from sklearn.neural_network import MLPClassifier
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.svm import SVC, LinearSVC

import pipeline.evaluation.probes as probes_mod
from pipeline.data.split import stratified_subset
from pipeline.evaluation.probes import MIN_LABELS_PER_CLASS, PROBES, ProbeResult, make_probe, run_probes


def label_fraction_indices(y, fraction, seed=0):
    """The probes' label subset, as ``run_probes`` draws it."""
    return stratified_subset(y, fraction=fraction, min_per_class=MIN_LABELS_PER_CLASS, seed=seed)


# ---------------------------------------------------------------------------------------------------- label fractions
def _expected_count(n_c: int, fraction: float) -> int:
    """The documented rule: round-half-up share, but at least min(2, n_c)."""
    return max(min(2, n_c), int(math.floor(fraction * n_c + 0.5)))


def _labels(sizes: list[int], seed: int) -> np.ndarray:
    """Shuffled labels with class c appearing sizes[c] times (labels need not be contiguous: class c -> 3c + 1)."""
    y = np.concatenate([np.full(s, 3 * c + 1) for c, s in enumerate(sizes)])
    return np.random.default_rng(seed).permutation(y)


@pytest.mark.parametrize("sizes", [[1], [1, 2, 3], [5, 5, 5, 5], [40, 7, 1, 13], [200, 100, 50]])
@pytest.mark.parametrize("fraction", [0.01, 0.1, 0.25, 0.5, 0.75, 0.99])
def test_label_fraction_counts_match_loop(sizes: list[int], fraction: float) -> None:
    y = _labels(sizes, seed=len(sizes))
    idx = label_fraction_indices(y, fraction, seed=3)
    assert idx.dtype == np.int64
    assert list(idx) == sorted(set(idx.tolist())), "indices must be sorted and unique"
    assert all(0 <= i < len(y) for i in idx)
    kept = Counter(int(y[i]) for i in idx.tolist())
    for c, n_c in enumerate(sizes):
        label = 3 * c + 1
        assert kept.get(label, 0) == _expected_count(n_c, fraction), (label, n_c)
    assert sum(kept.values()) == len(idx)


def test_label_fraction_seeded_accepts_torch_and_rejects_bad_fractions() -> None:
    y = _labels([60, 50, 40], seed=0)
    a = label_fraction_indices(y, 0.2, seed=5)
    b = label_fraction_indices(torch.from_numpy(y), 0.2, seed=5)
    c = label_fraction_indices(y, 0.2, seed=6)
    np.testing.assert_array_equal(a, b)
    assert len(a) == len(c)
    assert set(a.tolist()) != set(c.tolist())
    for bad in (0.0, -0.1, 1.5, 2, float("nan")):
        with pytest.raises(ValueError, match=str(bad)):
            label_fraction_indices(np.arange(10) % 2, bad)


@pytest.mark.parametrize("n", [0, 1, 7, 100])
def test_label_fraction_one_returns_all(n: int) -> None:
    y = np.random.default_rng(n).integers(0, 4, size=n)
    np.testing.assert_array_equal(label_fraction_indices(y, 1.0, seed=9), np.arange(n))


# ------------------------------------------------------------------------------------------------------- make_probe
@pytest.mark.parametrize("n_train", [10, 20_000, 20_001, 50_000])
def test_make_probe_svm_rbf_up_to_threshold_then_linear(n_train: int) -> None:
    clf = make_probe("svm", n_train=n_train)[-1]
    if n_train <= 20_000:
        assert type(clf) is SVC and clf.kernel == "rbf" and clf.C == 1.0
    else:
        assert type(clf) is LinearSVC


@pytest.mark.parametrize("name", PROBES)
def test_make_probe_structure(name: str) -> None:
    pipe = make_probe(name, n_train=1000, seed=4)
    assert isinstance(pipe, Pipeline)
    first = pipe.steps[0][1]
    if name.startswith("knn"):
        assert len(pipe.steps) == 1 and isinstance(first, KNeighborsClassifier)
        assert first.metric == "cosine" and first.algorithm == "brute"
        assert first.n_neighbors == {"knn50": 50, "knn200": 200}[name]
    else:
        assert isinstance(first, StandardScaler)
    if name == "ffn":
        assert isinstance(pipe[-1], MLPClassifier)
        assert pipe[-1].hidden_layer_sizes == (256, 128, 64) and pipe[-1].random_state == 4
    if name == "logreg":
        assert isinstance(pipe[-1], LogisticRegression) and pipe[-1].max_iter == 2000


def test_make_probe_knn_clips_k_and_unknown_name() -> None:
    assert make_probe("knn200", n_train=100)[-1].n_neighbors == 100
    assert make_probe("knn50", n_train=7)[-1].n_neighbors == 7
    with pytest.raises(ValueError, match="knn200"):
        make_probe("resnet", n_train=10)


@pytest.mark.parametrize("n_train,n_classes,early", [(499, None, False), (500, None, True), (249, 5, False),
                                                      (250, 5, True)])
def test_make_probe_ffn_early_stopping_rule(n_train: int, n_classes, early: bool) -> None:
    assert make_probe("ffn", n_train=n_train, n_classes=n_classes)[-1].early_stopping is early


# ------------------------------------------------------------------------------------------------- kNN vs reference
def _knn_reference(train_z: np.ndarray, train_y: np.ndarray, test_z: np.ndarray, k: int) -> list[int | None]:
    """Slow cosine kNN with a majority vote; None where the data has a tie (distance at the k-th place or vote)."""

    def cos_dist(a, b) -> float:
        dot = sum(float(x) * float(y) for x, y in zip(a, b, strict=True))
        na = math.sqrt(sum(float(x) ** 2 for x in a))
        nb = math.sqrt(sum(float(x) ** 2 for x in b))
        return 1.0 - dot / (na * nb)

    out: list[int | None] = []
    for q in test_z:
        dists = sorted((cos_dist(q, x), j) for j, x in enumerate(train_z))
        if k < len(dists) and dists[k][0] - dists[k - 1][0] < 1e-9:
            out.append(None)
            continue
        votes: dict[int, int] = {}
        for _, j in dists[:k]:
            votes[int(train_y[j])] = votes.get(int(train_y[j]), 0) + 1
        ranked = sorted(votes.values(), reverse=True)
        if len(ranked) > 1 and ranked[0] == ranked[1]:
            out.append(None)
            continue
        out.append(max(votes, key=votes.get))
    return out


@pytest.mark.parametrize(("name", "n_train"), [("knn50", 120), ("knn50", 30), ("knn200", 260)])
def test_knn_probe_matches_reference(name: str, n_train: int) -> None:
    rng = np.random.default_rng(n_train)
    centers = rng.normal(size=(3, 4))
    train_y = rng.integers(0, 3, size=n_train)
    train_z = centers[train_y] + 1.2 * rng.normal(size=(n_train, 4))  # overlapping classes: votes vary
    test_z = rng.normal(size=(80, 4)) * 1.5
    k = min({"knn50": 50, "knn200": 200}[name], n_train)
    expected = _knn_reference(train_z, train_y, test_z, k)
    keep = [i for i, e in enumerate(expected) if e is not None]  # data "without ties": tied points left out
    assert len(keep) >= 50
    pred = make_probe(name, n_train=n_train).fit(train_z, train_y).predict(test_z[keep])
    assert pred.tolist() == [expected[i] for i in keep]
    assert len(set(pred.tolist())) >= 2 or n_train == 30  # the comparison is not trivially one label


# ------------------------------------------------------------------------------------------------------- run_probes
def _blobs(n_train: int, n_test: int, seed: int = 0):
    """5 Gaussian blobs in 16-d around centres of norm 10 in random directions (so cosine kNN separates them too)."""
    centers = np.random.default_rng(seed).normal(size=(5, 16))
    centers *= 10.0 / np.linalg.norm(centers, axis=1, keepdims=True)
    z, y = make_blobs(n_samples=n_train + n_test, centers=centers, cluster_std=1.0, random_state=seed)
    return z[:n_train], y[:n_train], z[n_train:], y[n_train:]


def test_run_probes_separable_blobs() -> None:
    # 200 train samples per class: a class holding > k/2 of the k = 200 neighbours wins the kNN vote for sure
    train_z, train_y, test_z, test_y = _blobs(1000, 250)
    lines: list[str] = []
    results = run_probes(train_z, train_y, test_z, test_y, fractions=(1.0, 0.1), seed=0, progress=lines.append)
    assert len(results) == len(PROBES) * 2 == len(lines)
    assert [(r.fraction, r.probe) for r in results] == [(f, p) for f in (1.0, 0.1) for p in PROBES]
    counts = np.bincount(train_y)
    for r in results:
        assert isinstance(r, ProbeResult) and r.seconds >= 0.0
        expected_n = len(train_y) if r.fraction == 1.0 else sum(_expected_count(int(c), 0.1) for c in counts)
        assert r.n_train == expected_n
        if r.fraction == 1.0:
            assert r.accuracy >= 0.95, r
    assert lines[0].startswith("ffn @ 100%: ") and lines[len(PROBES)].startswith("ffn @ 10%: ")
    assert float(lines[0].split(": ")[1]) == pytest.approx(results[0].accuracy, abs=1e-4)


def test_run_probes_noise_labels_near_chance() -> None:
    rng = np.random.default_rng(1)
    train_z, test_z = rng.normal(size=(300, 16)), rng.normal(size=(300, 16))
    train_y, test_y = rng.integers(0, 5, size=300), rng.integers(0, 5, size=300)
    results = run_probes(train_z, train_y, test_z, test_y, seed=1)
    assert [r.probe for r in results] == list(PROBES)
    for r in results:
        assert r.accuracy < 0.5, r  # chance is 0.2


def test_run_probes_small_train_knn200_and_torch_inputs() -> None:
    train_z, train_y, test_z, test_y = _blobs(100, 60, seed=2)
    results = run_probes(torch.from_numpy(train_z).float(), torch.from_numpy(train_y), torch.from_numpy(test_z).float(),
                         torch.from_numpy(test_y), probes=("knn200", "svm"))
    assert [r.probe for r in results] == ["knn200", "svm"]
    assert all(r.n_train == 100 for r in results)
    # k = 200 >= 100 labelled samples: every one would vote and the "accuracy" would be the majority class's
    # share, so the probe is not run: n/a (None), not a number
    assert results[0].accuracy is None and results[0].seconds == 0.0
    assert results[1].accuracy >= 0.95
    lines: list[str] = []
    run_probes(train_z, train_y, test_z, test_y, probes=("knn50", "knn200"), progress=lines.append)
    assert lines[0].startswith("knn50 @ 100%: 0.") and lines[1].startswith("knn200 @ 100%: n/a (k = 200 needs")


def test_run_probes_validates_inputs() -> None:
    train_z, train_y, test_z, test_y = _blobs(50, 20)
    with pytest.raises(ValueError, match="resnet"):
        run_probes(train_z, train_y, test_z, test_y, probes=("svm", "resnet"))
    with pytest.raises(ValueError, match="1.5"):
        run_probes(train_z, train_y, test_z, test_y, fractions=(1.0, 1.5))
    with pytest.raises(ValueError, match="dims"):
        run_probes(train_z, train_y, test_z[:, :3], test_y)
    with pytest.raises(ValueError, match="labels"):
        run_probes(train_z, train_y[:-1], test_z, test_y)


class _WarningClassifier(ClassifierMixin, BaseEstimator):
    """Predicts the first class; warns a UserWarning when fitted."""

    def fit(self, x, y):
        warnings.warn("a warning that must reach the caller", UserWarning, stacklevel=2)
        self.classes_ = np.unique(y)
        return self

    def predict(self, x):
        return np.full(len(x), self.classes_[0])


def test_run_probes_silences_only_convergence_warnings(monkeypatch) -> None:
    train_z, train_y, test_z, test_y = _blobs(100, 20)

    def fake_make_probe(name, *, n_train, seed=0, n_classes=None):
        if name == "logreg":  # one lbfgs iteration certainly does not converge -> ConvergenceWarning
            return Pipeline([("scale", StandardScaler()), ("clf", LogisticRegression(max_iter=1))])
        return Pipeline([("clf", _WarningClassifier())])

    monkeypatch.setattr(probes_mod, "make_probe", fake_make_probe)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_probes(train_z, train_y, test_z, test_y, probes=("logreg",))
    assert not caught
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_probes(train_z, train_y, test_z, test_y, probes=("svm",))
    assert any("must reach the caller" in str(w.message) for w in caught)
