"""Tests for pipeline.data.sets: Algorithm 1's sets (k distinct classes in the range, every class >= 1 element, no
element twice, determinism), the class sizes' distribution against an enumeration, and the refusals."""

from __future__ import annotations

import collections
import itertools

import numpy as np
import pytest
import torch

from pipeline.data.sets import composition_counts, k_bounds, sample_sets


def _labels(sizes: list[int], seed: int = 0) -> torch.Tensor:
    """Shuffled labels with class c holding sizes[c] elements: (sum(sizes),) int64."""
    y = np.repeat(np.arange(len(sizes)), sizes)
    return torch.from_numpy(np.random.default_rng(seed).permutation(y))


@pytest.mark.parametrize(
    ("sizes", "set_size", "k_range"),
    [([20] * 10, 20, (2, 10)), ([5, 9, 3, 30, 12, 7, 1, 8], 16, (4, 8)), ([50] * 3, 7, (1, 3)), ([4] * 40, 30, None)],
)
def test_every_set_has_k_distinct_classes_and_no_repeat(sizes, set_size, k_range) -> None:
    y = _labels(sizes)
    n_sets = 200
    index = sample_sets(y, n_sets, set_size, k_range=k_range, seed=1)
    assert index.shape == (n_sets, set_size) and index.dtype == torch.int64
    assert int(index.min()) >= 0 and int(index.max()) < len(y)
    lo, hi = k_range if k_range is not None else (8, min(len(sizes), set_size))  # None: (max(2, k_min = 8), C)
    seen_k = set()
    for row in index.tolist():
        assert len(set(row)) == set_size  # no element twice within a set
        classes, counts = np.unique(y[row].numpy(), return_counts=True)
        assert lo <= len(classes) <= hi and counts.min() >= 1
        for c, m in zip(classes, counts, strict=True):
            assert m <= sizes[c]
        seen_k.add(len(classes))
    assert seen_k == set(range(lo, hi + 1))  # 200 sets visit every k of the range


def test_deterministic_by_seed() -> None:
    y = _labels([6] * 12)
    a, b = sample_sets(y, 30, 10, seed=5), sample_sets(y, 30, 10, seed=5)
    assert torch.equal(a, b)
    assert not torch.equal(a, sample_sets(y, 30, 10, seed=6))
    assert torch.equal(a, sample_sets(y.numpy(), 30, 10, seed=5))  # numpy labels: the same sets


def _compositions(caps: list[int], total: int) -> list[tuple[int, ...]]:
    """Every (n_1, ..., n_k) with 1 <= n_i <= caps[i] summing to total, by enumeration."""
    return [c for c in itertools.product(*(range(1, b + 1) for b in caps)) if sum(c) == total]


@pytest.mark.parametrize(("caps", "total"), [([3, 5, 2], 7), ([1, 4, 4, 6], 9), ([10, 10], 10), ([2, 2], 4)])
def test_composition_counts_match_enumeration(caps: list[int], total: int) -> None:
    w = composition_counts(np.array(caps), total)
    assert w.shape == (len(caps) + 1, total + 1)
    for j in range(len(caps)):
        ref = np.array([len(_compositions(caps[j:], s)) for s in range(total + 1)], dtype=float)
        np.testing.assert_allclose(w[j], ref / ref.max(), rtol=1e-12, atol=0)


def test_class_sizes_are_uniform_over_the_feasible_compositions() -> None:
    # classes of 2, 3 and 40 elements, sets of 8 from all 3: n_0 in 1..2, n_1 in 1..3, n_2 = 8 - n_0 - n_1: the
    # 6 feasible (n_0, n_1, n_2) each with probability 1/6
    y = _labels([2, 3, 40])
    index = sample_sets(y, 3000, 8, k_range=(3, 3), seed=0)
    counts = torch.stack([(y[index] == c).sum(1) for c in range(3)], dim=1)  # (S, 3)
    seen = collections.Counter(map(tuple, counts.tolist()))
    assert set(seen) == set(_compositions([2, 3, 40], 8))
    for n in seen.values():  # 3000 / 6 = 500, sd ~ 20
        assert abs(n - 500) < 100, seen


def test_a_class_smaller_than_a_share_is_used_within_its_size() -> None:
    y = _labels([1, 2, 30, 30])  # k_min = 2: any two classes hold >= 3 elements
    index = sample_sets(y, 300, 3, k_range=(2, 3), seed=2)
    for row in index.tolist():
        assert len(set(row)) == 3
        labels = y[row].tolist()
        assert labels.count(0) <= 1 and labels.count(1) <= 2
    assert (y[index] == 0).any(1).float().mean() > 0.3  # the single-element class is chosen, not avoided


def test_refusals() -> None:
    """What sample_sets checks itself; the class sizes' and k_range's refusals are k_bounds' (below)."""
    y = _labels([2, 3, 10])
    with pytest.raises(ValueError, match=r"k >= 2 .* raise k_range\[0\] to >= 2"):
        sample_sets(y, 5, 5, k_range=(1, 3))  # one class of 2 cannot fill a set of 5, any two classes can
    assert sample_sets(y, 5, 5).shape == (5, 5)  # the default range starts at k_min
    with pytest.raises(ValueError, match="integer"):
        sample_sets(torch.rand(10), 5, 3)
    for bad in ({"n_sets": 0}, {"set_size": 0}, {"n_sets": 2.5}):
        with pytest.raises(ValueError, match="must be an integer >= 1"):
            sample_sets(y, **{"n_sets": 3, "set_size": 3, **bad})


def test_k_bounds_check_a_plan_without_drawing() -> None:
    """What sample_sets would refuse, refused from the class sizes alone (a check before any work)."""
    assert k_bounds([2, 3, 10], 5) == (2, 3) and k_bounds(np.array([2, 3, 10]), 5, (2, 3)) == (2, 3)
    with pytest.raises(ValueError, match=r"min\(C, L\) = min\(3, 5\) = 3"):
        k_bounds([2, 3, 10], 5, (2, 4))  # only 3 classes
    with pytest.raises(ValueError, match="k_range must satisfy"):
        k_bounds([2, 3, 10], 2, (2, 3))  # 3 classes cannot fit in 2 elements
    with pytest.raises(ValueError, match=r"k >= 3 .* raise k_range\[0\] to >= 3"):
        k_bounds([2, 2, 10], 5, (2, 3))
    with pytest.raises(ValueError, match="need at least 20 labelled elements, got 15"):
        k_bounds([2, 3, 10], 20)
    with pytest.raises(ValueError, match="got none"):
        k_bounds([], 4)
