"""Section 3 of the TransFusion paper (and its appendices C, D) as numerical tools.

What is here, by the paper's numbering:

- the data model of section 3: K subspaces U_k of rank r in R^m with (K-1) r < m, samples on the unit
  sphere of their subspace, and noisy copies with x_i^T x~_i >= 1 - ε (eq. 8):  ``union_of_subspaces``;
- cluster integrity ρ (Definition 1, eq. 6):  ``cluster_integrity`` and friends;
- sharpness S(A) (Definition 2):  ``sharpness``, ``sharpness_per_layer``;
- δ and Δ of section 3.2:  ``noise_bounds``;
- the factor γ of Theorem 2, exactly as printed:  ``theorem2``, ``learnable_region``;
- the weight construction of Theorem 1 / Appendix C:  ``theorem1_weights``, ``affinity_from_weights``.

Where the paper is loose, this module implements what is printed and states the reading it had to choose.
The deviations and findings, each also noted at the function concerned:

1. Definition 1 says "x_i ∉ U_k". With noise no sample lies exactly in any subspace, so membership is
   taken from the labels: the min in eq. (6) runs over the samples whose label is not k.
2. ρ_k in eq. (6) is a max-min over the unit sphere of U_k's orthogonal complement; the problem is
   non-convex (the |.|). ``cluster_integrity`` returns the value of the best unit vector it finds. Every
   vector it evaluates is feasible, so the estimate is a LOWER bound of the true ρ.
   ``cluster_integrity_upper_bound`` gives a cheap rigorous upper bound (min_i of ||proj_{U_k^⊥} x_i||).
3. Theorem 1 claims [A]_ij > ν_i ρ² inside a cluster. With the construction of Appendix C (columns
   w_j of unit norm, orthogonal to every other subspace) this holds for two rank-1 subspaces with
   sign-aligned samples (the paper's example, with equality, so ">" should read ">="), but not in general:
   - with samples x and -x in one cluster the same-cluster entry is negative (the paper's ReLU then zeros it);
   - for rank r > 1 same-cluster entries can have either sign (only the diagonal is guaranteed > 0);
   - for K >= 3 the same-cluster entries scale with the distance of U_k to the SPAN of all the other
     subspaces, which can be far smaller than ρ (e.g. three lines in R^3, one nearly in the plane of the
     other two). Any W giving exact zeros across clusters has this problem, unless W is scaled up, and a
     scale-free bound then says nothing. Printed example (7) also does not follow from the printed W*.
4. Theorem 2's γ, evaluated as printed (``theorem2``), has these properties:
   - Appendix D's step from the second to the third line of (16) replaces n(n²(...))² = n⁵(...)² by
     n³(...)²; the printed γ keeps that slip (it makes γ larger than the derivation gives).
   - The denominator carries Δ², so γ → ∞ as Δ → 0, i.e. where noise and cluster overlap are worst.
   - The same-cluster lower bound Δ³ - n²(δ + δ²) of Appendix D is negative unless Δ³ > n²(δ + δ²);
     squaring a negative lower bound does not give a lower bound, so γ only means something where
     ``meaningful = (Δ > 0) & (Δ³ > n²(δ + δ²))``.
   - In that meaningful region γ <= 1 always (proof at ``learnable_region``), so the region
     "meaningful and γ > 1" is EMPTY for every n >= 1. The set {γ > 1} that a direct plot of the printed
     formula shades (``printed_gamma_region``) lies entirely in the non-meaningful part: it grows with ε
     and shrinks with ρ, the opposite of the paper's reading (low noise and separated clusters help).
   - The text says sharpness grows like O(Δ² n); the printed γ decays like Δ⁴ / n³ at δ = 0.
   - (16) divides by D(S) = α/β "<= Δ² / (2δ + δ²)", but α/β is a LOWER bound of the layer's sharpness,
     so the ratio D(S')/D(S) is not bounded below by the chain as written.

Shapes: n samples, m (``dim``) ambient dimension, K clusters, r rank. Arrays may be torch tensors or numpy
arrays; scalars and grids come back as Python floats / numpy arrays.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.optimize import nnls

from pipeline.theory.arrays import ArrayLike, basis_array, check_label_range, label_array, np64, orth_complement


# ------------------------------------------------------------------------------- cluster integrity
def _min_norm_point(a: np.ndarray) -> np.ndarray:
    """Approximate minimum-norm point of the convex hull of the rows of a (p, d) -> (d,).

    min_{λ >= 0} ||a^T λ||² + (1^T λ - 1)² as an NNLS problem; for any fixed 1^T λ the optimum is a
    multiple of the min-norm point, so the penalty weight does not bias the direction.
    """
    p, d = a.shape
    mat = np.vstack([a.T, np.ones((1, p))])  # (d + 1, p)
    rhs = np.zeros(d + 1)
    rhs[-1] = 1.0
    lam, _ = nnls(mat, rhs, maxiter=50 * (p + d + 1))
    s = lam.sum()
    return a.T @ lam / s if s > 0 else np.zeros(d)


def _maxmin_abs(
    z: np.ndarray, groups: np.ndarray, rng: np.random.Generator, n_random: int, max_sample_candidates: int,
    steps: int,
) -> tuple[np.ndarray, float]:
    """Estimate max_{||v|| = 1} min_i |z_i^T v| for z: (p, d) -> (v (d,), value).

    Candidates (normalised projected samples, principal directions per group and overall, their
    sign-aligned means, random directions) are improved by projected gradient ascent on a soft-min of
    |z_i^T v| with an annealed temperature, then the best few are polished by sign-fixed exact steps:
    for signs s_i = sign(z_i^T v), max_{||v|| <= 1} min_i s_i z_i^T v is concave and equals the distance
    from 0 to conv{s_i z_i}, attained at v = p*/||p*|| (p* the min-norm point), and this never decreases
    the value. ``value`` is always the exact min_i |z_i^T v| of the returned unit v.
    """
    p, d = z.shape
    if d == 1:  # the complement is one direction: nothing to optimise
        v = np.ones(1)
        return v, float(np.abs(z[:, 0]).min())

    def unit_rows(v: np.ndarray) -> np.ndarray:
        nrm = np.linalg.norm(v, axis=1, keepdims=True)
        return v[nrm[:, 0] > 1e-12] / nrm[nrm[:, 0] > 1e-12]

    cands = []
    idx = np.arange(p)
    if p > max_sample_candidates:
        idx = rng.choice(p, size=max_sample_candidates, replace=False)
    cands.append(z[idx])
    for sub in [z] + [z[groups == g] for g in np.unique(groups)]:
        _, evec = np.linalg.eigh(sub.T @ sub)  # principal directions, ascending eigenvalues
        top = evec[:, ::-1][:, : min(3, d)].T  # (<=3, d)
        cands.append(top)
        signs = np.sign(sub @ top[0])
        signs[signs == 0] = 1.0
        cands.append((signs[:, None] * sub).mean(0, keepdims=True))
    cands.append(rng.standard_normal((n_random, d)))
    v = unit_rows(np.vstack(cands))  # (c, d)

    best_v = v.copy()
    best_val = np.full(len(v), -np.inf)
    taus = np.geomspace(0.1, 1e-3, max(steps, 1))
    lrs = np.geomspace(0.2, 5e-3, max(steps, 1))
    prune_at, n_keep = steps // 5, 16  # after a warm-up, only the most promising candidates keep climbing
    for t in range(steps + 1):
        s = v @ z.T  # (c, p)
        a = np.abs(s)
        val = a.min(1)  # exact value of the current directions
        better = val > best_val
        best_v[better], best_val[better] = v[better], val[better]
        if t == steps:
            break
        if t == prune_at and len(v) > n_keep:
            keep = np.argsort(-best_val)[:n_keep]
            v, s, a, val = v[keep], s[keep], a[keep], val[keep]
            best_v, best_val = best_v[keep], best_val[keep]
        w = np.exp(-(a - val[:, None]) / taus[t])
        w /= w.sum(1, keepdims=True)  # soft-min weights
        grad = (w * np.sign(s)) @ z  # (c, d)
        grad -= (grad * v).sum(1, keepdims=True) * v  # tangent to the sphere
        v = v + lrs[t] * grad
        v /= np.linalg.norm(v, axis=1, keepdims=True)

    order = np.argsort(-best_val)[:n_keep]
    top_v, top_val = best_v[order[0]], float(best_val[order[0]])
    for c in order:  # polish: sign-fixed exact ascent
        cur_v, cur_val = best_v[c], float(best_val[c])
        for _ in range(20):
            signs = np.sign(z @ cur_v)
            signs[signs == 0] = 1.0
            try:
                pt = _min_norm_point(signs[:, None] * z)
            except RuntimeError:  # NNLS iteration limit: keep what we have
                break
            nrm = np.linalg.norm(pt)
            if nrm < 1e-12:
                break
            new_v = pt / nrm
            new_val = float(np.abs(z @ new_v).min())
            if new_val <= cur_val + 1e-15:
                break
            cur_v, cur_val = new_v, new_val
        if cur_val > top_val:
            top_v, top_val = cur_v, cur_val
    return top_v, top_val


def cluster_integrity_directions(
    x: ArrayLike, labels: ArrayLike, bases: ArrayLike, *, n_random: int = 32, max_sample_candidates: int = 64,
    steps: int = 300, seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Per-cluster estimates of eq. (6) with their witnesses.

        ρ_k := max_{unit u ⊥ U_k} min_{x_i ∉ U_k} |x_i^T u|            (6)

    "x_i ∉ U_k" is read as "label_i != k" (noisy samples lie in no subspace). u is searched in the
    orthogonal complement of span(bases[k]) (bases need not be orthonormal).
    Returns ``(rho (K,), u (K, dim))``: u[k] is a unit vector orthogonal to U_k and
    rho[k] = min_{label_i != k} |x_i^T u[k]| exactly. Every u evaluated is feasible, so rho[k] is a LOWER
    bound of the true ρ_k (exact when the complement is one-dimensional).
    Clusters with no sample outside them get ρ_k = +inf (min over an empty set).

    x: (n, dim); labels: (n,) in [0, K); bases: (K, dim, r).
    """
    xs = np64(x)
    if xs.ndim != 2:
        raise ValueError(f"x must be (n, dim), got shape {xs.shape}")
    n, dim = xs.shape
    y = label_array(labels, n)
    b = basis_array(bases, dim)
    n_clusters = b.shape[0]
    check_label_range(y, n_clusters)
    rng = np.random.default_rng(seed)
    rho = np.full(n_clusters, np.inf)
    u = np.zeros((n_clusters, dim))
    for k in range(n_clusters):
        comp = orth_complement(b[k])  # (dim, dim - r_k)
        if comp.shape[1] == 0:
            raise ValueError(f"subspace {k} spans R^{dim}: no unit vector is orthogonal to it (eq. 6)")
        u[k] = comp[:, 0]
        outside = y != k
        if not outside.any():
            continue
        z = xs[outside] @ comp  # (p, dim - r_k): coordinates in U_k^⊥
        v, _ = _maxmin_abs(z, y[outside], rng, n_random, max_sample_candidates, steps)
        u[k] = comp @ v
        u[k] /= np.linalg.norm(u[k])
        rho[k] = float(np.abs(xs[outside] @ u[k]).min())
    return rho, u


def cluster_integrity_per_cluster(
    x: ArrayLike, labels: ArrayLike, bases: ArrayLike, *, n_random: int = 32, max_sample_candidates: int = 64,
    steps: int = 300, seed: int = 0,
) -> np.ndarray:
    """Lower-bound estimates of ρ_k (Definition 1, eq. 6), one per subspace: (K,) numpy array.

    See ``cluster_integrity_directions`` for the method and conventions.
    """
    rho, _ = cluster_integrity_directions(
        x, labels, bases, n_random=n_random, max_sample_candidates=max_sample_candidates, steps=steps,
        seed=seed,
    )
    return rho


def cluster_integrity(
    x: ArrayLike, labels: ArrayLike, bases: ArrayLike, *, n_random: int = 32, max_sample_candidates: int = 64,
    steps: int = 300, seed: int = 0,
) -> float:
    """Cluster integrity ρ = min_k ρ_k (Definition 1, eq. 6), estimated from below.

        ρ_k := max_{unit u ⊥ U_k} min_{x_i ∉ U_k} |x_i^T u|

    The max-min is non-convex; the returned value is attained by an explicit feasible u per cluster, so it
    is a LOWER bound of the true ρ (``cluster_integrity_upper_bound`` brackets it from above).
    x: (n, dim); labels: (n,) in [0, K); bases: (K, dim, r). Returns a float in [0, 1] for unit rows.
    """
    return float(
        cluster_integrity_per_cluster(
            x, labels, bases, n_random=n_random, max_sample_candidates=max_sample_candidates, steps=steps,
            seed=seed,
        ).min()
    )


def cluster_integrity_upper_bound(x: ArrayLike, labels: ArrayLike, bases: ArrayLike) -> float:
    """A rigorous upper bound of ρ (eq. 6): min_k min_{label_i != k} ||P_{U_k^⊥} x_i||.

    For unit u ⊥ U_k, |x_i^T u| = |(P_{U_k^⊥} x_i)^T u| <= ||P_{U_k^⊥} x_i||, so every ρ_k is below it.
    x: (n, dim); labels: (n,); bases: (K, dim, r).
    """
    xs = np64(x)
    n, dim = xs.shape
    y = label_array(labels, n)
    b = basis_array(bases, dim)
    check_label_range(y, b.shape[0])
    out = np.inf
    for k in range(b.shape[0]):
        outside = y != k
        if outside.any():
            out = min(out, float(np.linalg.norm(xs[outside] @ orth_complement(b[k]), axis=1).min()))
    return out


# --------------------------------------------------------------------------------------- sharpness
def _ratio_with_conventions(lo: float, hi: float) -> float:
    """lo / hi, with a non-positive hi treated as 0+: +inf if lo > 0, 0 if lo == 0, -inf if lo < 0."""
    if np.isnan(lo) or np.isnan(hi):
        return float("nan")
    if hi > 0:
        return float(lo / hi)
    if lo > 0:
        return float("inf")
    return 0.0 if lo == 0 else float("-inf")


def sharpness(a: ArrayLike, labels: ArrayLike) -> float:
    """Sharpness of an affinity matrix (Definition 2).

        S(A) := inf_{i,j,p,q} [A]_ij / [A]_pq,   c_i = c_j (i != j),  c_p != c_q
              = min_{same, i != j} A_ij / max_{different} A_pq      (for A >= 0)

    Conventions: the diagonal is excluded (the model removes it; A_ii says nothing about clusters). The
    value computed is always min_same / max_diff; for a non-negative A this is exactly the infimum above.
    A non-positive max_diff is treated as 0+: the result is +inf if min_same > 0, 0 if min_same == 0 and
    -inf if min_same < 0. Hence a matrix whose same-cluster minimum is <= 0 gets a sharpness <= 0.
    NaN entries give NaN. Raises ValueError when there is no same-cluster pair i != j or no
    different-cluster pair.

    a: (n, n) torch or numpy; labels: (n,).
    """
    am = np64(a)
    if am.ndim != 2 or am.shape[0] != am.shape[1]:
        raise ValueError(f"affinity must be a square (n, n) matrix, got shape {am.shape}")
    n = am.shape[0]
    y = label_array(labels, n)
    same = y[:, None] == y[None, :]  # (n, n)
    same_off = same & ~np.eye(n, dtype=bool)
    diff = ~same
    if not same_off.any():
        raise ValueError("sharpness needs a same-cluster pair i != j; every cluster is a singleton")
    if not diff.any():
        raise ValueError("sharpness needs two clusters; all samples share one label")
    return _ratio_with_conventions(float(am[same_off].min()), float(am[diff].max()))


def quantile_sharpness(a: ArrayLike, labels: ArrayLike, q: float = 0.1) -> float:
    """Definition 2 with quantiles instead of the worst pairs, a measure that still discriminates:

        S_q(A) = quantile_q(A_ij : c_i = c_j, i != j) / quantile_{1-q}(A_pq : c_p != c_q)

    so S_0.1 > 1 means 90 % of same-cluster pairs have more affinity than 90 % of cross-cluster pairs. q = 0 is
    :func:`sharpness`. Definition 2's infimum is 0 as soon as one same-cluster pair has a zero ReLU affinity, which
    in a batch of hundreds is almost always; S_q moves with the bulk. Same conventions as :func:`sharpness`
    (diagonal excluded, a non-positive denominator treated as 0+). a: (n, n), labels: (n,); q in [0, 0.5).
    """
    if not 0.0 <= q < 0.5:
        raise ValueError(f"quantile q must be in [0, 0.5), got {q}")
    same, diff = _same_and_different(a, labels, "quantile_sharpness")
    return _ratio_with_conventions(float(np.quantile(same, q)), float(np.quantile(diff, 1.0 - q)))


def _same_and_different(a: ArrayLike, labels: ArrayLike, what: str) -> tuple[np.ndarray, np.ndarray]:
    """The same-cluster (i != j) and the different-cluster entries of a (n, n) affinity, as flat float64 arrays."""
    am = np64(a)
    n = am.shape[0]
    y = label_array(labels, n)
    same = (y[:, None] == y[None, :]) & ~np.eye(n, dtype=bool)
    diff = y[:, None] != y[None, :]
    if not same.any() or not diff.any():
        raise ValueError(f"{what} needs a same-cluster pair i != j and two clusters")
    return am[same], am[diff]


def affinity_contrast(a: ArrayLike, labels: ArrayLike) -> float:
    """The average-case counterpart of Definition 2: mean same-cluster affinity / mean different-cluster one.

    Definition 2 takes the worst pair on each side, which with ReLU affinities is almost always 0; this ratio
    of means (diagonal excluded, like the Silhouette index the paper compares with) shows progress that the
    infimum hides. a: (n, n), labels: (n,). +inf when the different-cluster mean is <= 0 < same mean.
    """
    same, diff = _same_and_different(a, labels, "affinity_contrast")
    return _ratio_with_conventions(float(same.mean()), float(diff.mean()))


def sharpness_per_layer(affinities: Sequence[ArrayLike], labels: ArrayLike) -> list[float]:
    """Definition 2 for each layer's affinity A^ℓ: list of (n, n) matrices -> list of floats."""
    return [sharpness(a, labels) for a in affinities]


















