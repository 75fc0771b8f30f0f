"""Cluster quality of a learned affinity: spectral clustering of the batch affinity, scored against the labels.

TransFusion's last block produces an affinity ``A`` (n, n) that is trained towards the target of eq. (1),
``Y[i, j] = 1`` iff samples i and j share a label (i != j), a block-diagonal matrix after sorting by label. How close
``A`` is to that block structure is measured by clustering it and comparing the clusters with the labels::

    S    = (max(A, 0) + max(A, 0)^T) / 2,   S_ii = 0              (symmetric, non-negative, no self-loops)
    pred = SpectralClustering(S, n_clusters = #labels)
    NMI  = I(pred; y) / mean(H(pred), H(y)),   ARI = adjusted Rand index(pred, y)

For a model of depth 0 (no TransFusion block) the affinity is ``ReLU(cos(z_i, z_j))`` of the embeddings, the same
ReLU-of-cosine the blocks use.
"""

from __future__ import annotations

import numpy as np
from scipy.sparse.csgraph import connected_components
from sklearn.cluster import SpectralClustering
from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score

__all__ = ["DISCONNECTED_EPS", "cosine_affinity", "spectral_scores", "symmetric_affinity"]

DISCONNECTED_EPS = 1e-8  # relative weight of the edges added between all pairs of a disconnected affinity


def _to_numpy(x, name: str) -> np.ndarray:
    """A float64 numpy copy of a numpy array / torch tensor (detached, on CPU) / array-like."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch.Tensor, without importing torch
        x = x.detach().cpu().numpy()
    arr = np.array(x, dtype=np.float64)
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} contains NaN or inf")
    return arr


def symmetric_affinity(a) -> np.ndarray:
    """Symmetric, non-negative, zero-diagonal version of an affinity, as spectral clustering needs it.

    ``S_ij = (max(A_ij, 0) + max(A_ji, 0)) / 2`` for i != j, ``S_ii = 0``.

    Args:
        a: (n, n) affinity, numpy array or torch tensor (any float dtype).

    Returns:
        (n, n) float64 numpy array.
    """
    a = _to_numpy(a, "affinity")
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(f"affinity must be square (n, n), got shape {a.shape}")
    pos = np.maximum(a, 0.0)  # (n, n)
    s = 0.5 * (pos + pos.T)  # (n, n)
    np.fill_diagonal(s, 0.0)
    return s


def cosine_affinity(z) -> np.ndarray:
    """ReLU of the cosine similarity of the embeddings, zero diagonal: the affinity of a depth-0 model.

    ``A_ij = max(<z_i, z_j> / (||z_i|| ||z_j||), 0)`` for i != j, ``A_ii = 0``. A zero embedding has cosine 0
    with everything (its norm is clamped to 1e-12 before dividing).

    Args:
        z: (n, d) embeddings, numpy array or torch tensor.

    Returns:
        (n, n) float64 numpy array, symmetric, entries in [0, 1].
    """
    z = _to_numpy(z, "z")
    if z.ndim != 2:
        raise ValueError(f"z must be 2-d (n, d), got shape {z.shape}")
    norm = np.maximum(np.linalg.norm(z, axis=1, keepdims=True), 1e-12)  # (n, 1)
    zn = z / norm  # (n, d)
    cos = np.clip(zn @ zn.T, -1.0, 1.0)  # (n, n)
    a = np.maximum(cos, 0.0)
    a = 0.5 * (a + a.T)  # exact symmetry despite rounding in the matmul
    np.fill_diagonal(a, 0.0)
    return a


def spectral_scores(
    affinity,
    labels,
    n_clusters: int | None = None,
    seed: int = 0,
    assign_labels: str = "cluster_qr",
) -> dict[str, float]:
    """Spectral clustering of an affinity, scored against the labels with NMI and ARI.

    ``S = symmetric_affinity(affinity)`` (module docstring), then
    ``SpectralClustering(n_clusters, affinity="precomputed", assign_labels=assign_labels, random_state=seed)``.

    Disconnected graphs: if ``S`` (as a graph with an edge where ``S_ij > 0``) has more than one connected
    component, e.g. a sample whose affinities are all <= 0 or an exactly block-diagonal affinity, then
    ``eps = 1e-8 * max(S)`` (``1e-8`` if S is all zero) is added to every off-diagonal entry. This connects the
    graph, so sklearn's spectral embedding is well posed (it otherwise warns that the graph is not fully
    connected and an isolated sample claims a cluster of its own); it changes the clustering of the connected
    parts only by O(eps). Connected affinities are clustered unchanged.

    Args:
        affinity: (n, n) affinity, numpy array or torch tensor; negative entries are clipped to 0.
        labels: (n,) integer (or any hashable-valued) labels.
        n_clusters: number of clusters; default the number of distinct labels.
        seed: random_state of the eigensolver (and of k-means with ``assign_labels="kmeans"``).
        assign_labels: ``"cluster_qr"`` (deterministic) or ``"kmeans"``; see sklearn.cluster.SpectralClustering.

    Returns:
        ``{"nmi": float, "ari": float}``: normalized mutual information (arithmetic mean normalisation) in [0, 1]
        and adjusted Rand index (1 = perfect, ~0 = chance).
    """
    s = symmetric_affinity(affinity)  # (n, n)
    y = np.asarray(labels.detach().cpu().numpy() if hasattr(labels, "detach") else labels)
    n = s.shape[0]
    if y.shape != (n,):
        raise ValueError(f"labels must have shape ({n},), got {y.shape}")
    if n == 0:
        raise ValueError("spectral_scores: empty affinity")
    if n_clusters is None:
        n_clusters = int(np.unique(y).shape[0])
    if not 1 <= n_clusters <= n:
        raise ValueError(f"n_clusters must be in [1, {n}], got {n_clusters}")
    if assign_labels not in ("cluster_qr", "kmeans"):
        raise ValueError(f"assign_labels must be 'cluster_qr' or 'kmeans', got {assign_labels!r}")

    if n_clusters == 1:
        pred = np.zeros(n, dtype=np.int64)
    else:
        n_components, _ = connected_components(s > 0, directed=False)
        if n_components > 1:
            scale = float(s.max()) if s.max() > 0 else 1.0
            s = s + DISCONNECTED_EPS * scale * (1.0 - np.eye(n))  # (n, n), connected
        model = SpectralClustering(
            n_clusters=n_clusters, affinity="precomputed", assign_labels=assign_labels, random_state=seed
        )
        pred = model.fit_predict(s)  # (n,)
    return {
        "nmi": float(normalized_mutual_info_score(y, pred)),
        "ari": float(adjusted_rand_score(y, pred)),
    }
