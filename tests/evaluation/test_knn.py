"""Tests for pipeline.evaluation.knn: k-NN vote vs a python-loop reference, chunking, clusters, sklearn cross-check."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sklearn.neighbors import KNeighborsClassifier

from pipeline.evaluation.knn import knn_accuracy, knn_predict


def _knn_reference(train_z: torch.Tensor, train_y: torch.Tensor, test_z: torch.Tensor, k: int, n_classes: int,
                   temperature: float | None) -> list[int]:
    """Slow k-NN: python float64 cosine similarities, sort per test point, explicit vote count."""
    tr = train_z.double().tolist()
    te = test_z.double().tolist()
    ys = [int(y) for y in train_y.tolist()]

    def cos(a: list[float], b: list[float]) -> float:
        na = math.sqrt(sum(x * x for x in a))
        nb = math.sqrt(sum(x * x for x in b))
        return sum(x * y for x, y in zip(a, b, strict=True)) / (na * nb)

    preds = []
    for q in te:
        sims = [(cos(q, x), j) for j, x in enumerate(tr)]
        sims.sort(key=lambda t: -t[0])
        votes = [0.0] * n_classes
        for s, j in sims[: min(k, len(tr))]:
            votes[ys[j]] += 1.0 if temperature is None else math.exp(s / temperature)
        best = 0
        for c in range(n_classes):
            if votes[c] > votes[best]:  # strict: ties keep the smallest label
                best = c
        preds.append(best)
    return preds


def _data(n_train: int, n_test: int, d: int, n_classes: int, seed: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    train_z = torch.randn(n_train, d, generator=g, dtype=dtype)
    test_z = torch.randn(n_test, d, generator=g, dtype=dtype)
    train_y = torch.randint(0, n_classes, (n_train,), generator=g)
    test_y = torch.randint(0, n_classes, (n_test,), generator=g)
    return train_z, train_y, test_z, test_y


@pytest.mark.parametrize("n_train,n_test,d,n_classes", [(1, 1, 2, 1), (5, 3, 3, 2), (30, 17, 4, 3), (60, 25, 8, 5)])
@pytest.mark.parametrize("k", [1, 2, 5, 20])
@pytest.mark.parametrize("temperature", [None, 0.1, 0.5])
def test_knn_matches_reference(n_train: int, n_test: int, d: int, n_classes: int, k: int, temperature) -> None:
    """Predictions, in float64 and float32, and the accuracy they give (k = 20 beyond 5 training points: all vote)."""
    train_z, train_y, test_z, test_y = _data(n_train, n_test, d, n_classes, seed=n_train + k)
    got = knn_predict(train_z, train_y, test_z, k=k, n_classes=n_classes, temperature=temperature, chunk=4)
    expected = _knn_reference(train_z, train_y, test_z, k, n_classes, temperature)
    assert got.dtype == torch.int64 and got.shape == (n_test,)
    assert got.tolist() == expected
    acc = knn_accuracy(train_z, train_y, test_z, test_y, k=k, temperature=temperature)
    assert isinstance(acc, float)
    assert acc == pytest.approx(sum(int(p == y) for p, y in zip(expected, test_y.tolist(), strict=True)) / n_test)
    if n_train == 30:
        z32 = [t.float() for t in (train_z, test_z)]
        assert knn_predict(z32[0], train_y, z32[1], k=k, temperature=temperature).tolist() == _knn_reference(
            z32[0], train_y, z32[1], k, n_classes, temperature)


@pytest.mark.parametrize("temperature", [None, 0.1])
@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_knn_chunking_is_exact(temperature, chunk: int) -> None:
    train_z, train_y, test_z, _ = _data(80, 29, 6, 5, seed=11)
    full = knn_predict(train_z, train_y, test_z, k=9, temperature=temperature, chunk=29)
    part = knn_predict(train_z, train_y, test_z, k=9, temperature=temperature, chunk=chunk)
    assert torch.equal(full, part)


def test_knn_majority_tie_goes_to_smallest_label() -> None:
    # k = 2: one neighbour of label 3 (the nearest) and one of label 1 -> a 1-1 tie -> label 1
    train_z = torch.tensor([[1.0, 0.0], [0.8, 0.6], [-1.0, 0.0]])
    train_y = torch.tensor([3, 1, 0])
    test_z = torch.tensor([[1.0, 0.1]])
    assert knn_predict(train_z, train_y, test_z, k=2).tolist() == [1]
    # with a weighted vote the nearer neighbour (label 3) wins instead
    assert knn_predict(train_z, train_y, test_z, k=2, temperature=0.1).tolist() == [3]
    # k = 1: just the nearest neighbour
    assert knn_predict(train_z, train_y, test_z, k=1).tolist() == [3]


def test_knn_tiny_temperature_does_not_overflow() -> None:
    train_z, train_y, test_z, _ = _data(30, 10, 4, 3, seed=5, dtype=torch.float32)
    got = knn_predict(train_z, train_y, test_z, k=10, temperature=1e-4)
    assert torch.equal(got, knn_predict(train_z, train_y, test_z, k=1))  # T -> 0: the nearest neighbour dominates


def test_knn_n_classes_labels_arguments_and_shapes() -> None:
    train_z, train_y, test_z, _ = _data(20, 8, 3, 3, seed=4)
    a = knn_predict(train_z, train_y, test_z, k=3)
    assert torch.equal(a, knn_predict(train_z, train_y, test_z, k=3, n_classes=10))  # extra empty classes: no change
    for labels, kwargs in ((train_y, {"n_classes": 2}), (train_y.double(), {}), (train_y - 5, {})):
        with pytest.raises(ValueError):
            knn_predict(train_z, labels, test_z, k=3, **kwargs)
    train_z, train_y, test_z, test_y = _data(10, 4, 3, 2, seed=0)
    for kwargs in ({"k": 0}, {"chunk": 0}, {"temperature": 0.0}, {"temperature": -1.0}):
        with pytest.raises(ValueError):
            knn_predict(train_z, train_y, test_z, **kwargs)
    for args in ((train_z, train_y, test_z[:, :2]), (train_z, train_y[:5], test_z), (train_z[:0], train_y[:0], test_z)):
        with pytest.raises(ValueError):
            knn_predict(*args)
    with pytest.raises(ValueError):
        knn_accuracy(train_z, train_y, test_z, test_y[:2])
    out = knn_predict(train_z, train_y, test_z[:0])  # an empty test set is fine
    assert out.shape == (0,) and out.dtype == torch.int64


@pytest.mark.parametrize("n_train,n_test,d,n_classes,k",
                         [(50, 40, 4, 3, 1), (200, 100, 8, 5, 7), (300, 80, 16, 10, 20)])
def test_knn_majority_matches_sklearn(n_train: int, n_test: int, d: int, n_classes: int, k: int) -> None:
    # random float64 data: no two similarities tie, so the neighbour sets are unique
    rng = np.random.default_rng(n_train)
    train_z = rng.normal(size=(n_train, d))
    test_z = rng.normal(size=(n_test, d))
    train_y = rng.integers(0, n_classes, size=n_train)
    clf = KNeighborsClassifier(n_neighbors=k, metric="cosine", algorithm="brute").fit(train_z, train_y)
    expected = clf.predict(test_z)
    got = knn_predict(torch.from_numpy(train_z), torch.from_numpy(train_y), torch.from_numpy(test_z), k=k, chunk=32)
    np.testing.assert_array_equal(got.numpy(), expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("temperature", [None, 0.1])
def test_knn_cuda_matches_cpu(temperature) -> None:
    train_z, train_y, test_z, _ = _data(100, 50, 8, 5, seed=1)
    cpu = knn_predict(train_z, train_y, test_z, k=10, temperature=temperature, chunk=16)
    gpu = knn_predict(train_z.cuda(), train_y.cuda(), test_z.cuda(), k=10, temperature=temperature, chunk=16)
    assert gpu.device.type == "cuda"
    assert torch.equal(cpu, gpu.cpu())
