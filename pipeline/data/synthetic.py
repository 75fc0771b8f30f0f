"""The data model of the paper's section 3: K subspaces U_k of rank r in R^m with (K-1) r < m, samples on the
unit sphere of their subspace, and noisy copies with x_i^T x~_i >= 1 - ε (eq. 8). The ``synthetic`` dataset and
the theory stage both draw from it.

Also the circles toy problem of attention-based clustering (ABC, Coward et al., section 6.1): sets of points on a
few random, likely overlapping circles, to be clustered by circle (``four_circles``)."""

from __future__ import annotations

import math
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


# ------------------------------------------------------------------------------- the circles toy problem (ABC)
@dataclass(frozen=True)
class CircleSets:
    """Sets of points on circles (``four_circles``).

    points: (S, P, 2) float32; labels: (S, P) int64, the circle of each point, in [0, C); centres: (S, C, 2)
    float32; radii: (S, C) float32. Point p of set s lies on its circle:
    ``|points[s, p] - centres[s, labels[s, p]]| = radii[s, labels[s, p]]`` (to float32 rounding).
    """

    points: torch.Tensor
    labels: torch.Tensor
    centres: torch.Tensor
    radii: torch.Tensor


ANGLES = ("stratified", "iid")  # how a circle's points are placed: the code's m equal arcs, or section 6.1's i.i.d.


def four_circles(n_sets: int, points: int = 20, circles: int = 4, seed: int = 0,
                 angles: str = "stratified") -> CircleSets:
    """ABC's circles problem: each set has ``circles`` random circles and ``points`` points on them.

    Per set, independently (as ABC's code, ``lib/utils/data/circles.py`` of github.com/DramaCow/ABC, with 20
    points per set in its experiments):

        centre_c = 0.5 sqrt(u_c) (cos phi_c, sin phi_c),   u_c ~ U[0, 1), phi_c ~ U[0, 2 pi)
                   (uniform in the disk of radius 0.5: P(|centre| <= rho) = (rho / 0.5)^2)
        r_c      = clip(0.3 + 0.1 g_c, 0.2, 0.4),           g_c ~ N(0, 1)
        counts   = 1 + Multinomial(P - C, (1/C, ..., 1/C))  (every circle gets a point, then each further point
                   picks a circle uniformly), the points in random order within the set
        point_p  = centre_{c_p} + r_{c_p} (cos theta_p, sin theta_p)

    with the angles of a circle's m points, u_p ~ U[0, 1) i.i.d.:

        "stratified" (default, the code's ``np.linspace(0, 2 pi, m, endpoint=False) + U(0, 2 pi / m)``): the j-th
                     point of the circle (j = 0..m-1, in the set's order) at theta = 2 pi (j + u_p) / m, one uniform
                     angle in each of m equal arcs; two neighbouring points are never more than 2 arcs apart
        "iid"        (section 6.1's words): theta_p = 2 pi u_p

    Both use the same draws, so a seed gives the same circles and memberships either way. The paper also says every
    circle overlaps another; ABC's
    code does not enforce it and neither does this function: in 17.6 % of 20 000 sets (seed 1, 4 circles) some
    circle crosses no other (circles cross iff |r_a - r_b| <= |centre_a - centre_b| <= r_a + r_b). Not
    scikit-learn's ``make_circles`` (two concentric circles). Computed in float64, returned in float32;
    deterministic given ``seed`` (a private torch.Generator).

    Args:
        n_sets: S >= 1, the number of sets.
        points: P >= circles, points per set.
        circles: C >= 1, circles per set.
        seed: the seed.
        angles: "stratified" | "iid".

    Returns:
        ``CircleSets`` (points (S, P, 2), labels (S, P), centres (S, C, 2), radii (S, C)).
    """
    if angles not in ANGLES:
        raise ValueError(f"unknown angles {angles!r}; allowed: {', '.join(ANGLES)}")
    for name, value, low in (("n_sets", n_sets, 1), ("circles", circles, 1), ("points", points, circles)):
        if isinstance(value, bool) or int(value) != value or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    n_sets, points, circles = int(n_sets), int(points), int(circles)
    g = torch.Generator().manual_seed(int(seed))
    f64 = torch.float64
    rho = 0.5 * torch.sqrt(torch.rand(n_sets, circles, generator=g, dtype=f64))  # (S, C)
    phi = 2.0 * math.pi * torch.rand(n_sets, circles, generator=g, dtype=f64)  # (S, C)
    centres = rho[..., None] * torch.stack((phi.cos(), phi.sin()), dim=-1)  # (S, C, 2)
    radii = (0.3 + 0.1 * torch.randn(n_sets, circles, generator=g, dtype=f64)).clamp(0.2, 0.4)  # (S, C)
    first = torch.arange(circles).expand(n_sets, circles)  # (S, C) one point per circle
    rest = torch.randint(0, circles, (n_sets, points - circles), generator=g)  # (S, P - C)
    order = torch.rand(n_sets, points, generator=g).argsort(dim=1)  # (S, P) a random permutation per set
    labels = torch.cat((first, rest), dim=1).gather(1, order)  # (S, P)
    u = torch.rand(n_sets, points, generator=g, dtype=f64)  # (S, P)
    if angles == "iid":
        theta = 2.0 * math.pi * u
    else:
        onehot = torch.nn.functional.one_hot(labels, circles)  # (S, P, C)
        rank = (onehot.cumsum(1) - 1).gather(2, labels[..., None])[..., 0]  # (S, P) j: the point's rank on its circle
        count = onehot.sum(1).gather(1, labels)  # (S, P) m: the points on its circle
        theta = 2.0 * math.pi * (rank + u) / count
    on = centres.gather(1, labels[..., None].expand(-1, -1, 2))  # (S, P, 2) each point's centre
    xy = on + radii.gather(1, labels)[..., None] * torch.stack((theta.cos(), theta.sin()), dim=-1)  # (S, P, 2)
    return CircleSets(points=xy.float(), labels=labels.to(torch.int64), centres=centres.float(), radii=radii.float())
