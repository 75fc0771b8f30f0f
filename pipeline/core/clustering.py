"""Cluster quality of a learned affinity: spectral clustering of the batch affinity, scored against the labels.

TransFusion's last block produces an affinity ``A`` (n, n) that is trained towards the target of eq. (1),
``Y[i, j] = 1`` iff samples i and j share a label (i != j), a block-diagonal matrix after sorting by label. How close
``A`` is to that block structure is measured by clustering it and comparing the clusters with the labels::

    S    = (max(A, 0) + max(A, 0)^T) / 2,   S_ii = 0              (symmetric, non-negative, no self-loops)
    pred = SpectralClustering(S, n_clusters = #labels)
    NMI  = I(pred; y) / mean(H(pred), H(y)),   ARI = adjusted Rand index(pred, y)

For a model of depth 0 (no TransFusion block) the affinity is ``ReLU(cos(z_i, z_j))`` of the embeddings, the same
ReLU-of-cosine the blocks use.

Clustering unseen classes with an unknown number of clusters (ABC's inference, Coward et al., ICLR 2021 submission,
section 4.4): ``cluster_kernel`` clusters a kernel spectrally with k given or estimated by ``eigengap_k``, the
eigengap of ``D^-1/2 A D^-1/2`` (von Luxburg, 2007).
"""

from __future__ import annotations

import numpy as np
from scipy.sparse.csgraph import connected_components
from sklearn.cluster import SpectralClustering
from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score

__all__ = [
    "DISCONNECTED_EPS",
    "cluster",
    "cluster_kernel",
    "cosine_affinity",
    "eigengap_k",
    "kernel_spectrum",
    "set_kernel",
    "spectral_scores",
    "symmetric_affinity",
]

DISCONNECTED_EPS = 1e-8  # relative weight of the edges added between all pairs of a disconnected affinity
SYMMETRY_RTOL = 1e-6  # |A - A^T| allowed by eigengap_k, relative to max |A|: a few float32 ulps (eps = 1.2e-7)


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
    s = _nonnegative_symmetric(a, "affinity")  # (n, n)
    np.fill_diagonal(s, 0.0)
    return s


def _square(x, name: str) -> np.ndarray:
    """A float64 numpy copy of a finite square (n, n) matrix; ValueError otherwise."""
    a = _to_numpy(x, name)
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(f"{name} must be square (n, n), got shape {a.shape}")
    return a


def _nonnegative_symmetric(x, name: str) -> np.ndarray:
    """``(max(A, 0) + max(A, 0)^T) / 2``, diagonal included (``max(A_ii, 0)``): (n, n) float64."""
    pos = np.maximum(_square(x, name), 0.0)  # (n, n)
    return 0.5 * (pos + pos.T)


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

    pred = _spectral_labels(s, n_clusters, seed, assign_labels)  # (n,)
    return {
        "nmi": float(normalized_mutual_info_score(y, pred)),
        "ari": float(adjusted_rand_score(y, pred)),
    }


def _spectral_labels(s: np.ndarray, n_clusters: int, seed: int, assign_labels: str) -> np.ndarray:
    """Spectral clustering of a symmetric, non-negative, zero-diagonal ``s`` (n, n), connected first if it is not
    (``spectral_scores``' docstring): (n,) int64 labels in [0, n_clusters)."""
    n = s.shape[0]
    if n_clusters == 1:
        return np.zeros(n, dtype=np.int64)
    n_components, _ = connected_components(s > 0, directed=False)
    if n_components > 1:
        scale = float(s.max()) if s.max() > 0 else 1.0
        s = s + DISCONNECTED_EPS * scale * (1.0 - np.eye(n))  # (n, n), connected
    model = SpectralClustering(
        n_clusters=n_clusters, affinity="precomputed", assign_labels=assign_labels, random_state=seed
    )
    return model.fit_predict(s).astype(np.int64)  # (n,)


# ------------------------------------------------------------------ unknown number of clusters (ABC, section 4.4)
def kernel_spectrum(kernel) -> np.ndarray:
    """Eigenvalues of the normalized kernel ``D^-1/2 A D^-1/2``, in descending order: ``mu_1 >= ... >= mu_n``.

    ``A`` is the kernel (n, n) as given, WITH its diagonal: the diagonal is neither zeroed nor changed, and it
    counts in the degrees ``D = diag(d)``, ``d_i = sum_j A_ij`` (j = i included), as in ABC's code
    (``lib/spectral.py`` of github.com/DramaCow/ABC, where ``A_ii = kappa(z_i, z_i)``). ``A`` must be symmetric
    (``|A - A^T| <= 1e-6 max|A|``; it is then symmetrised exactly) and finite, with degrees ``d_i >= 0``. A
    zero degree (an all-zero row) gets ``d_i^-1/2 = 0``, as scipy's normalized Laplacian treats isolated nodes:
    its row and column of the normalized kernel are zero. For a non-negative kernel the eigenvalues lie in
    [-1, 1] and ``mu_1 = 1``; each connected block of a block-diagonal kernel contributes one eigenvalue 1.

    Args:
        kernel: (n, n) symmetric kernel, numpy array or torch tensor.

    Returns:
        (n,) float64, descending.
    """
    a = _square(kernel, "kernel")  # (n, n)
    scale = float(np.abs(a).max()) if a.size else 0.0
    asym = float(np.abs(a - a.T).max()) if a.size else 0.0
    if asym > SYMMETRY_RTOL * scale:
        raise ValueError(
            f"kernel must be symmetric: max |A - A^T| = {asym:.3g} > {SYMMETRY_RTOL:g} * max |A| = "
            f"{SYMMETRY_RTOL * scale:.3g}; symmetrise it first, e.g. (A + A^T) / 2, or use cluster_kernel"
        )
    a = 0.5 * (a + a.T)  # (n, n), exactly symmetric
    d = a.sum(axis=1)  # (n,) degrees, diagonal included
    if (d < 0).any():
        raise ValueError(
            f"kernel has negative degrees (row sums) at rows {np.flatnonzero(d < 0)[:5].tolist()}: D^-1/2 is not "
            "real; clip the negative entries first (cluster_kernel does)"
        )
    inv_sqrt = np.divide(1.0, np.sqrt(d), out=np.zeros_like(d), where=d > 0)  # (n,)
    m = inv_sqrt[:, None] * a * inv_sqrt[None, :]  # (n, n) D^-1/2 A D^-1/2
    return np.linalg.eigvalsh(m)[::-1].copy()  # (n,) descending


def eigengap_k(kernel, k_max: int | None = None) -> int:
    """The number of clusters of a kernel by its largest eigengap: ``k = argmax_i (mu_i - mu_{i+1})``.

    ``mu_1 >= ... >= mu_n`` are the eigenvalues of ``D^-1/2 A D^-1/2`` (``kernel_spectrum``: the kernel's diagonal
    kept as given, in ``A`` and in the degrees ``D``), and ``i`` runs over ``1 .. k_max`` (1-based): ``k`` is the
    number of eigenvalues before the largest gap. A kernel with k well-separated blocks has k eigenvalues near 1
    and the rest well below, so the largest gap follows ``mu_k``. Ties go to the smallest ``i``.

    Deviation from the paper (section 4.4), whose printed formula is ``argmax_i (lambda_i - lambda_{i+1})`` over
    the eigenvalues ``lambda_1 >= ... >= lambda_n`` of the normalized Laplacian ``L = I - D^-1/2 A D^-1/2``:
    ``lambda_i = 1 - mu_{n+1-i}``, so that formula, read literally, finds the gap after ``lambda_{n-k}`` and
    returns ``n - k`` (``tests/core/test_clustering.py`` checks it does). ABC's code (``lib/spectral.py``) takes
    the gaps of the descending eigenvalues of ``D^-1/2 A D^-1/2`` itself, as done here.

    Bounds: ``1 <= k <= k_max``. ``k_max`` defaults to ``n - 1``, the last ``i`` for which ``mu_{i+1}`` exists;
    no tighter bound holds in general (Algorithm 1 allows up to ``min(C, L)`` clusters in a set of L elements).
    ``k = n`` (all singletons) is not detectable: ``A = I`` has all ``mu_i = 1``, no gap, and gives 1. A caller
    who knows an upper bound on k (the ``k_range`` of ``pipeline.data.sets.sample_sets``) should pass it: it keeps
    a gap inside the noise eigenvalues from being chosen. ``k_max > n - 1`` is clipped to ``n - 1``; ``n = 1``
    gives 1.

    Args:
        kernel: (n, n) symmetric, finite kernel, numpy array or torch tensor; its degrees must be >= 0.
        k_max: the largest k returned (>= 1), default ``n - 1``.

    Returns:
        k, an int in ``[1, min(k_max, max(n - 1, 1))]``.
    """
    mu = kernel_spectrum(kernel)  # (n,) descending
    n = mu.shape[0]
    if n == 0:
        raise ValueError("eigengap_k: empty kernel")
    if k_max is not None and (isinstance(k_max, bool) or int(k_max) != k_max or k_max < 1):
        raise ValueError(f"k_max must be an integer >= 1, got {k_max!r}")
    if n == 1:
        return 1
    top = n - 1 if k_max is None else min(int(k_max), n - 1)
    gaps = mu[:top] - mu[1 : top + 1]  # (top,) gaps[i - 1] = mu_i - mu_{i+1}, i = 1 .. top
    return int(np.argmax(gaps)) + 1


def cluster_kernel(kernel, k: int | None = None, seed: int = 0) -> tuple[np.ndarray, int]:
    """Cluster a kernel spectrally into ``k`` clusters, ``k`` given or estimated by the eigengap (ABC's inference).

    ``S = (max(A, 0) + max(A, 0)^T) / 2`` (any affinity is accepted: a TransFusion affinity, ABC's kernel), then

        k    = k if given, else eigengap_k(S)                  (S with its diagonal max(A_ii, 0))
        pred = SpectralClustering(S with S_ii = 0, n_clusters = k, affinity = "precomputed")

    i.e. the clustering is ``spectral_scores``' (``symmetric_affinity``, a disconnected graph connected by
    ``DISCONNECTED_EPS`` edges, ``assign_labels="cluster_qr"``, deterministic given ``seed``).

    Args:
        kernel: (n, n) finite affinity or kernel, numpy array or torch tensor.
        k: the number of clusters, in [1, n]; default estimated by ``eigengap_k`` (in [1, max(n - 1, 1)]).
        seed: random_state of the eigensolver.

    Returns:
        ``(labels, k)``: labels (n,) int64 in [0, k), and the k used (the given one or the estimate).
    """
    s = _nonnegative_symmetric(kernel, "kernel")  # (n, n), diagonal kept
    n = s.shape[0]
    if n == 0:
        raise ValueError("cluster_kernel: empty kernel")
    if k is None:
        k = eigengap_k(s)
    elif isinstance(k, bool) or int(k) != k or not 1 <= k <= n:
        raise ValueError(f"k must be an integer in [1, {n}], got {k!r}")
    k = int(k)
    off = s.copy()
    np.fill_diagonal(off, 0.0)  # (n, n) = symmetric_affinity(kernel)
    return _spectral_labels(off, k, seed, "cluster_qr"), k


def set_kernel(head, x) -> np.ndarray:
    """The kernel a trained set head gives the set x (n, d), as float64 numpy (n, n), for :func:`cluster`.

    An ABC head (:class:`pipeline.core.abc.ABCHead`, or anything whose output has a ``kernel``): κ, diagonal kept.
    A TransFusion head (output with ``q`` and ``k``): its trained affinity cos(q_i, k_j)² (eq. 5 before the row
    normalisation) with a zero diagonal, the kernel ``pipeline.evaluation.set_study`` clusters.
    """
    import torch

    with torch.no_grad():
        out = head(x)
        if hasattr(out, "kernel"):
            return out.kernel.double().cpu().numpy()
        q = torch.nn.functional.normalize(out.q.double(), dim=-1)
        k = torch.nn.functional.normalize(out.k.double(), dim=-1)
        a = (q @ k.mT).square()  # (n, n)
        a.diagonal(dim1=-2, dim2=-1).zero_()
        return a.cpu().numpy()


def cluster(x, head=None, *, k: int | None = None, k_max: int | None = None, seed: int = 0) -> tuple[np.ndarray, int]:
    """Cluster one set: ``labels, k̂ = cluster(x, head)``; the inference of ABC (section 4.4) for any kernel.

    x: a set (n, d) (torch tensor) and ``head`` a trained set head (ABC or TransFusion, :func:`set_kernel`), or,
    with ``head=None``, a kernel (n, n) itself. S = ½(K + Kᵀ) clipped at 0; k̂ = ``k`` if given, else
    ``eigengap_k(S, k_max)``; then ``cluster_kernel(S, k̂)``. Returns (labels (n,) int64, k̂).
    """
    kern = set_kernel(head, x) if head is not None else _to_numpy(x, "kernel")
    s = np.clip(0.5 * (kern + kern.T), 0.0, None)  # (n, n)
    if k is None:
        k = eigengap_k(s, k_max=None if k_max is None else min(k_max, max(1, s.shape[0] - 1)))
    return cluster_kernel(s, k, seed=seed)
