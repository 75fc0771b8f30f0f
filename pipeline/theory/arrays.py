"""Array helpers of the theory modules: tensors or arrays in, float64 NumPy out, orthonormal bases and label checks.
Shapes: n samples, m ambient dimension, K clusters, r rank."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

ArrayLike = torch.Tensor | np.ndarray


# --------------------------------------------------------------------------------------------- helpers
def np64(a: ArrayLike | Sequence[float] | float) -> np.ndarray:
    """Any torch tensor / numpy array / nested list -> float64 numpy array (detached, on CPU)."""
    if isinstance(a, torch.Tensor):
        return a.detach().to("cpu", torch.float64).numpy()
    return np.asarray(a, dtype=np.float64)


def label_array(labels: ArrayLike | Sequence[int], n: int) -> np.ndarray:
    """Cluster labels -> int64 numpy array of shape (n,)."""
    y = labels.detach().cpu().numpy() if isinstance(labels, torch.Tensor) else np.asarray(labels)
    if y.shape != (n,):
        raise ValueError(f"labels must have shape ({n},), got {tuple(y.shape)}")
    if not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"labels must be integers, got dtype {y.dtype}")
    return y.astype(np.int64)


def orth_basis(b: np.ndarray, tol: float = 1e-10) -> np.ndarray:
    """Orthonormal basis of the column span of b: (m, k) -> (m, rank)."""
    if b.shape[1] == 0:
        return np.zeros((b.shape[0], 0))
    u, s, _ = np.linalg.svd(b, full_matrices=False)
    return u[:, s > tol * max(1.0, s.max(initial=0.0))]


def orth_complement(b: np.ndarray, tol: float = 1e-10) -> np.ndarray:
    """Orthonormal basis of the orthogonal complement of span(b): (m, k) -> (m, m - rank)."""
    m = b.shape[0]
    if b.shape[1] == 0:
        return np.eye(m)
    u, s, _ = np.linalg.svd(b, full_matrices=True)
    rank = int((s > tol * max(1.0, s.max(initial=0.0))).sum())
    return u[:, rank:]


def basis_array(bases: ArrayLike, dim: int) -> np.ndarray:
    """Subspace bases -> float64 (K, dim, r)."""
    b = np64(bases)
    if b.ndim != 3 or b.shape[1] != dim:
        raise ValueError(f"bases must have shape (K, {dim}, r), got {tuple(b.shape)}")
    return b


def check_label_range(y: np.ndarray, k: int) -> None:
    if y.size and (y.min() < 0 or y.max() >= k):
        raise ValueError(f"labels must lie in [0, {k}) to index the {k} bases, got [{y.min()}, {y.max()}]")


def float_or_array(a: np.ndarray) -> float | np.ndarray:
    return float(a) if np.ndim(a) == 0 else a
