"""pipeline.theory.arrays: float64 NumPy from tensors or arrays, orthonormal bases and complements, label checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.theory import arrays as A


def test_np64_takes_tensors_arrays_and_scalars():
    assert A.np64(torch.tensor([1, 2])).dtype == np.float64
    assert A.np64(np.float32(0.5)).shape == () and A.float_or_array(np.array(0.25)) == 0.25
    assert isinstance(A.float_or_array(np.array([0.25, 1.0])), np.ndarray)


@pytest.mark.parametrize("dim,rank", [(3, 1), (6, 2), (10, 4)])
def test_bases_and_complements_are_orthonormal_and_complementary(dim, rank):
    b = np.random.default_rng(dim).standard_normal((dim, rank))
    q, c = A.orth_basis(b), A.orth_complement(b)
    assert q.shape == (dim, rank) and c.shape == (dim, dim - rank)
    assert np.allclose(q.T @ q, np.eye(rank)) and np.allclose(c.T @ c, np.eye(dim - rank))
    assert np.allclose(q.T @ c, 0.0, atol=1e-10)  # together they span R^dim
    assert np.allclose(q @ q.T @ b, b)  # q spans b's columns


def test_labels_are_checked():
    assert A.label_array(torch.tensor([0, 1, 1]), 3).tolist() == [0, 1, 1]
    with pytest.raises(ValueError):
        A.label_array([0, 1], 3)  # one label per sample
    with pytest.raises(ValueError):
        A.check_label_range(np.array([0, 3]), 3)  # K = 3 clusters: labels in [0, 3)
