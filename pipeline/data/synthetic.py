"""The data model of the paper's section 3: K subspaces U_k of rank r in R^m with (K-1) r < m, samples on the
unit sphere of their subspace, and noisy copies with x_i^T x~_i >= 1 - ε (eq. 8). The ``synthetic`` dataset and
the theory stage both draw from it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


# ------------------------------------------------------------------------------------ data generator
@dataclass(frozen=True)
class SubspaceData:
    """A union-of-subspaces batch (section 3).

    x: (n, dim) float32 unit rows, the noisy samples x~_i; clean: (n, dim) float32 unit rows x_i in their
    subspace; labels: (n,) int64 in [0, K); bases: (K, dim, rank) float32, orthonormal columns spanning U_k.
    """

    x: torch.Tensor
    labels: torch.Tensor
    bases: torch.Tensor
    clean: torch.Tensor


def union_of_subspaces(
    n: int, n_clusters: int, rank: int, dim: int, noise: float, seed: int = 0
) -> SubspaceData:
    """Sample n unit points from K random rank-r subspaces of R^dim, then perturb them within eq. (8).

    Subspaces: U_k = span(Q_k), Q_k the orthonormal factor of a (dim, r) Gaussian matrix. The paper
    assumes no subspace lies in the span of the others, (K - 1) r < m; that is required here.
    Labels: balanced (counts differ by at most one), in random order.
    Clean samples: x_i = Q_{c_i} g_i / ||g_i||, g_i ~ N(0, I_r).
    Noisy samples: x~_i = (1 - e_i) x_i + sqrt(1 - (1 - e_i)²) d_i with d_i a random unit vector orthogonal
    to x_i and e_i ~ U[0, noise], so ||x~_i|| = 1 and x_i^T x~_i = 1 - e_i >= 1 - ε (eq. 8 with ε = noise).

    Deterministic given ``seed`` (a private torch.Generator; global RNG state is untouched).
    """
    if n_clusters < 1 or rank < 1:
        raise ValueError(f"need n_clusters >= 1 and rank >= 1, got {n_clusters}, {rank}")
    if dim < 2:
        raise ValueError(f"need dim >= 2 (a noise direction orthogonal to each sample), got {dim}")
    if rank > dim:
        raise ValueError(f"rank {rank} exceeds the ambient dimension {dim}")
    if (n_clusters - 1) * rank >= dim:
        raise ValueError(
            f"(K - 1) r = ({n_clusters} - 1) * {rank} = {(n_clusters - 1) * rank} must be < m = {dim}: "
            "the paper "
            "assumes no subspace is linearly dependent on the others (section 3)"
        )
    if n < n_clusters:
        raise ValueError(f"need n >= n_clusters (every cluster gets a sample), got n={n} < K={n_clusters}")
    if not 0.0 <= noise <= 1.0:
        raise ValueError(f"noise ε must lie in [0, 1] (eq. 8), got {noise}")

    g = torch.Generator().manual_seed(int(seed))
    f64 = torch.float64
    bases = torch.linalg.qr(torch.randn(n_clusters, dim, rank, generator=g, dtype=f64)).Q  # (K, m, r)
    labels = (torch.arange(n) % n_clusters)[torch.randperm(n, generator=g)]  # (n,)
    coef = torch.randn(n, rank, generator=g, dtype=f64)  # (n, r)
    clean = torch.einsum("nmr,nr->nm", bases[labels], coef)  # (n, m)
    clean = clean / clean.norm(dim=1, keepdim=True)
    d = torch.randn(n, dim, generator=g, dtype=f64)  # (n, m)
    d = d - (d * clean).sum(1, keepdim=True) * clean  # orthogonal to the clean sample
    d = d / d.norm(dim=1, keepdim=True)
    e = noise * torch.rand(n, generator=g, dtype=f64)  # (n,) e_i ~ U[0, ε]
    cos = (1.0 - e)[:, None]
    sin = torch.sqrt(torch.clamp(1.0 - cos**2, min=0.0))
    x = cos * clean + sin * d  # (n, m), unit rows
    return SubspaceData(
        x=x.float(), labels=labels.to(torch.int64), bases=bases.float(), clean=clean.float()
    )
