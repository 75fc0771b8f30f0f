"""δ and Δ of section 3.2, the factor γ of Theorem 2 exactly as printed, and Theorem 1's weight construction
(Appendix C). What the printed formulas imply, and where they slip, is in :mod:`pipeline.theory.measures`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.theory.arrays import (
    ArrayLike,
    basis_array,
    check_label_range,
    float_or_array,
    label_array,
    np64,
    orth_basis,
)


# ------------------------------------------------------------------------------ noise bounds, Thm 2
def _validate_unit_interval(name: str, v: np.ndarray) -> None:
    if np.any(~np.isfinite(v)) or np.any(v < 0) or np.any(v > 1):
        raise ValueError(f"{name} must lie in [0, 1]")


def _noise_bounds_np(rho: np.ndarray, eps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    keep = 1.0 - eps
    s = 1.0 - keep**2  # 1 - (1 - ε)², in [0, 1]
    delta = np.sqrt(s)
    big_delta = keep * rho - np.sqrt(s * (1.0 - rho**2))
    return delta, big_delta


def noise_bounds(
    rho: float | ArrayLike, eps: float | ArrayLike
) -> tuple[float | np.ndarray, float | np.ndarray]:
    """δ and Δ of section 3.2 (and Appendix D), broadcast over rho and eps.

        δ := sqrt(1 - (1 - ε)²)                                   (projection of a noisy in-cluster sample
                                                                   onto a direction ⊥ its subspace, upper)
        Δ := (1 - ε) ρ - sqrt((1 - (1 - ε)²)(1 - ρ²))              (same for other clusters, lower)

    Δ = cos(arccos(1 - ε) + arccos ρ), so Δ < 0 once the two angles add up to more than 90°, and Δ = 0
    exactly when ρ = δ. ρ, ε in [0, 1]. Returns floats for scalar inputs, numpy arrays otherwise.
    """
    r, e = np.broadcast_arrays(np64(rho), np64(eps))
    _validate_unit_interval("rho", r)
    _validate_unit_interval("eps", e)
    delta, big_delta = _noise_bounds_np(r, e)
    return float_or_array(delta), float_or_array(big_delta)


@dataclass(frozen=True)
class Theorem2:
    """Theorem 2 evaluated on a grid; every field has the broadcast shape of (rho, eps, n).

    delta, Delta: section 3.2's bounds; gamma: the printed factor; meaningful: where Appendix D's
    same-cluster lower bound is positive, (Δ > 0) & (Δ³ > n²(δ + δ²)).
    """

    delta: np.ndarray
    Delta: np.ndarray
    gamma: np.ndarray
    meaningful: np.ndarray


def theorem2(rho: float | ArrayLike, eps: float | ArrayLike, n: float | ArrayLike) -> Theorem2:
    """Theorem 2's sharpness factor, exactly as printed, with where it means anything.

        γ := (Δ³ - n²(δ + δ²))² (2 + δ) / ( Δ² n³ (Δ² + (1 + δ)) (1 + δ(Δ² + (1 + δ))) )

    Evaluated honestly:
    - the denominator vanishes with Δ, so γ → ∞ as Δ → 0 (where noise and overlap are worst). At Δ == 0
      exactly, γ = +inf when δ > 0; at the single point ρ = ε = 0 (Δ = δ = 0) the formula is 0/0 and
      γ = NaN (along ε = 0, γ = 2Δ⁴ / (n³(1 + Δ²)) → 0, so +inf would be wrong there);
    - when Δ³ < n²(δ + δ²), Appendix D's lower bound Δ³ - n²(δ + δ²) on the next layer's same-cluster
      affinity is negative, and squaring it gives no bound: ``meaningful`` marks where γ can be read,
      (Δ > 0) & (Δ³ > n²(δ + δ²));
    - the printed γ carries Appendix D's slip n⁵ -> n³ in (16) (module docstring, item 4).
    No floating-point warnings are emitted. rho, eps in [0, 1], n >= 1 (the batch size), all broadcast.
    """
    r, e, nn = np.broadcast_arrays(np64(rho), np64(eps), np64(n))
    _validate_unit_interval("rho", r)
    _validate_unit_interval("eps", e)
    if np.any(~np.isfinite(nn)) or np.any(nn < 1):
        raise ValueError("n (batch size) must be finite and >= 1")
    delta, big_delta = _noise_bounds_np(r, e)
    dd = delta + delta**2  # δ + δ²
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        num = (big_delta**3 - nn**2 * dd) ** 2 * (2.0 + delta)
        inner = big_delta**2 + (1.0 + delta)  # Δ² + (1 + δ)
        den = big_delta**2 * nn**3 * inner * (1.0 + delta * inner)
        gamma = num / den
    gamma = np.where(big_delta == 0, np.where(delta > 0, np.inf, np.nan), gamma)
    meaningful = (big_delta > 0) & (big_delta**3 > nn**2 * dd)
    return Theorem2(
        delta=np.asarray(delta), Delta=np.asarray(big_delta), gamma=np.asarray(gamma),
        meaningful=np.asarray(meaningful),
    )


def learnable_region(
    rho_grid: float | ArrayLike, eps_grid: float | ArrayLike, n: float | ArrayLike
) -> np.ndarray:
    """Where Theorem 2 promises growing sharpness: ``meaningful & (γ > 1)`` (bool array, broadcast shape).

    This is the set Figure 2 is said to shade. It is EMPTY for every n >= 1. Proof: where meaningful,
    0 < Δ³ - n²(δ + δ²) <= Δ³, so the numerator is <= Δ⁶(2 + δ), and the denominator is
    >= Δ² n³ (1 + δ) (drop Δ² in the first bracket, δ(...) in the second), hence
    γ <= Δ⁴ (2 + δ) / (n³ (1 + δ)) <= 2Δ⁴ / n³ <= 2 / n³ (Δ <= ρ <= 1). For n >= 2 that is <= 1/4; for n = 1,
    the δ = 0 case gives γ = 2Δ⁴ / (1 + Δ²) <= 1 with equality only at ρ = 1, ε = 0, and δ > 0 is smaller
    still. Pass ``rho_grid[:, None], eps_grid[None, :]`` for a 2-D grid.
    """
    t = theorem2(rho_grid, eps_grid, n)
    return t.meaningful & (t.gamma > 1)


def printed_gamma_region(
    rho_grid: float | ArrayLike, eps_grid: float | ArrayLike, n: float | ArrayLike
) -> np.ndarray:
    """{γ > 1} for the printed γ, ignoring whether the bound behind it holds (bool array).

    This is what a direct plot of Theorem 2's formula shades. It lies entirely outside ``meaningful``
    (see ``learnable_region``) and, at fixed ρ and n, is an interval ε >= ε*(ρ, n): more noise enters it,
    less noise leaves it; it grows with n. Provided to put the paper's figure and the honest reading side
    by side.
    """
    return np.asarray(theorem2(rho_grid, eps_grid, n).gamma > 1)


# ------------------------------------------------------------------------------------------ Theorem 1
def theorem1_weights(bases: ArrayLike, labels: ArrayLike, x: ArrayLike) -> ArrayLike:
    """The weight matrix W ∈ R^{m×n} of Theorem 1's proof (Appendix C).

    Column w_j is orthogonal to every subspace except U_{c_j}:
        w_j = P_{c_j} x_j / ||P_{c_j} x_j||,   P_c = projector onto (span of all U_k, k != c)^⊥,
    so [XW]_ij = x_i^T w_j = 0 whenever c_i != c_j and x_i ∈ U_{c_i} (Appendix C), and with
    W_Q = W_K = W the affinity A = (XW)(XW)^T (eq. 2) is block diagonal (eq. 13). On the paper's lower bound
    (12) see the module docstring, item 3: it holds for two rank-1 subspaces with sign-aligned samples.

    bases: (K, m, r); labels: (n,) in [0, K); x: (n, m). Returns (m, n), a torch tensor of x's dtype and
    device if x is a tensor, else a float64 numpy array. Raises ValueError if some x_j lies in the span of
    the other subspaces (no such w_j exists).
    """
    xs = np64(x)
    n, dim = xs.shape
    y = label_array(labels, n)
    b = basis_array(bases, dim)
    n_clusters = b.shape[0]
    check_label_range(y, n_clusters)
    w = np.zeros((dim, n))
    for c in range(n_clusters):
        cols = np.flatnonzero(y == c)
        if cols.size == 0:
            continue
        others = b[[k for k in range(n_clusters) if k != c]]  # (K-1, m, r)
        others = others.transpose(1, 0, 2).reshape(dim, -1)  # (m, (K-1) r)
        o = orth_basis(others)  # (m, rank of the others' span)
        v = xs[cols].T - o @ (o.T @ xs[cols].T)  # (m, |c|) = P_c x_j
        nrm = np.linalg.norm(v, axis=0)
        bad = nrm <= 1e-10 * np.maximum(np.linalg.norm(xs[cols], axis=1), 1e-300)
        if bad.any():
            raise ValueError(
                f"sample {cols[bad][0]} lies in the span of the subspaces of the other clusters: "
                "no column orthogonal to them can see it "
                "(Theorem 1 needs (K-1) r < m and U_c outside that span)"
            )
        w[:, cols] = v / nrm
    if isinstance(x, torch.Tensor):
        dtype = x.dtype if x.is_floating_point() else torch.float64
        return torch.from_numpy(w).to(device=x.device, dtype=dtype)
    return w


def affinity_from_weights(x: ArrayLike, w: ArrayLike) -> ArrayLike:
    """A = (X W)(X W)^T, eq. (2) with W_Q = W_K = W (no activation, no normalisation).

    x: (n, m); w: (m, h) -> (n, n). Torch in, torch out (if either is a tensor); numpy otherwise.
    """
    if isinstance(x, torch.Tensor) or isinstance(w, torch.Tensor):
        xt = x if isinstance(x, torch.Tensor) else torch.as_tensor(x)
        wt = w if isinstance(w, torch.Tensor) else torch.as_tensor(w)
        dtype = torch.promote_types(xt.dtype, wt.dtype)
        q = xt.to(dtype) @ wt.to(device=xt.device, dtype=dtype)  # (n, h)
        return q @ q.T
    q = np.asarray(x, dtype=np.float64) @ np.asarray(w, dtype=np.float64)  # (n, h)
    return q @ q.T
