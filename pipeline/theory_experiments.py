"""Theorem 2 of the TransFusion paper next to what a trained head actually does (the ``theory`` stage's engine).

Three parts, matching the paper's Figure 2 and its empirical counterpart:

(a) ``formula_table``: γ of Theorem 2 (``theory.theorem2``, exactly as printed) over a (ρ, ε) grid for several
    batch sizes n, with ``meaningful = (Δ > 0) & (Δ³ > n²(δ + δ²))`` (where Appendix D's bound is a bound at all)
    and the printed region {γ > 1}. ``theory.learnable_region`` proves that the two never overlap; the table and
    the figure show it cell by cell.
(b) ``run_empirical``: supervised training of a ``TransFusionHead(dim, depth)`` directly on union-of-subspaces
    vectors (``theory.union_of_subspaces``, no backbone) with the JSD loss (positives = same subspace), over a grid
    of batch size n × noise ε × depth × seed, then measurements on a fresh test batch of the same n:

    - the chain of affinities A⁰ = ReLU(cos(x_i, x_j)) (zero diagonal) and A^ℓ = block ℓ's ReLU(Q Kᵀ)
      (``HeadOutput.affinities``), their contrast (mean same / mean different, ``theory.affinity_contrast``),
      Definition 2's sharpness, and the per-layer gain c(A^ℓ) / c(A^{ℓ-1}); ``contrast_gain`` is their geometric
      mean (c(A^d) / c(A⁰))^{1/d}, the measured counterpart of a per-block factor γ;
    - the affinity the loss trains, g(A) = cos(q_i, k_j)² with zero diagonal (eq. 5 before ``Normalize``), for the
      head's output and, like for like, for the input: its spectral-clustering NMI (``clustering.spectral_scores``)
      and contrast; ``learned = NMI(output) >= learned_nmi``;
    - the data's cluster integrity ρ (``theory.cluster_integrity`` on the CLEAN test samples: in section 3 ρ is a
      property of the subspaces' samples, and Δ already accounts for the noise ε), and Theorem 2 evaluated at the
      data's (ρ, ε, n), ε being the bound of eq. (8) the generator enforces.

    Every training batch is fresh (``steps × n`` training samples in all, drawn from the same subspaces as the test
    batch), so a larger n also means more data seen in the same number of steps. Training and measuring run on
    one thread (``torch.set_num_threads(1)`` and a threadpool limit, restored afterwards): these matrices are
    small, and on a loaded 2-core machine two threads made a training step ~100x slower.
(c) ``write_outputs``: one figure with the formula panels (per n: the printed {γ > 1}, ``meaningful``, the Δ = 0
    singularity and the data's (ε, ρ) points) beside the measurement panels (NMI over (n, ε) per depth, hatched
    where the printed γ > 1 at the data's ρ), the ``figures.phase_diagram`` heat maps, CSV tables and
    ``theory.md`` with a verdict written from the numbers.

Pure core: torch, numpy, scipy, scikit-learn (and matplotlib through ``pipeline.figures``).
"""

from __future__ import annotations

import contextlib
import csv
import io
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from scipy.stats import spearmanr
from threadpoolctl import threadpool_limits  # a dependency of scikit-learn
from torch import Tensor

from pipeline import theory
from pipeline.clustering import cosine_affinity, spectral_scores
from pipeline.io import atomic_path, write_text
from pipeline.losses import make_loss
from pipeline.model import TransFusionHead

__all__ = [
    "EMPIRICAL_COLUMNS",
    "FORMULA_COLUMNS",
    "TABLE_COLUMNS",
    "EmpiricalGrid",
    "TheoryGrid",
    "aggregate",
    "formula_at",
    "formula_table",
    "run_all",
    "measure",
    "run_empirical",
    "split_test",
    "squared_cosine",
    "summarize",
    "train_head",
    "verdict",
    "write_outputs",
]

FORMULA_COLUMNS = ("n", "rho", "eps", "delta", "Delta", "gamma", "meaningful", "gamma_gt1", "learnable")
EMPIRICAL_COLUMNS = (
    "n", "eps", "depth", "seed", "rho", "delta", "Delta", "gamma", "meaningful", "gamma_gt1", "learnable",
    "train_loss", "test_loss", "contrast_layers", "sharpness_layers", "gain_layers", "contrast_gain",
    "sharpness", "contrast_in", "contrast_out", "nmi_in", "nmi", "learned",
)
TABLE_COLUMNS = (
    "n", "eps", "depth", "runs", "rho", "delta", "Delta", "gamma", "meaningful", "gamma_gt1", "contrast_gain",
    "sharpness", "contrast_in", "contrast_out", "nmi_in", "nmi", "learned",
)


# ------------------------------------------------------------------------------------------------------ grids
def _tuple(values: Sequence[Any], kind: type, name: str) -> tuple:
    out = tuple(kind(v) for v in values)
    if not out:
        raise ValueError(f"{name} must not be empty")
    if len(set(out)) != len(out):
        raise ValueError(f"{name} has duplicates: {list(out)}")
    return out


@dataclass(frozen=True)
class TheoryGrid:
    """The (ρ, ε) grid of part (a) and the batch sizes n, one panel each. ρ, ε in [0, 1], n >= 1."""

    rho: tuple[float, ...]
    eps: tuple[float, ...]
    n: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "rho", _tuple(self.rho, float, "rho"))
        object.__setattr__(self, "eps", _tuple(self.eps, float, "eps"))
        object.__setattr__(self, "n", _tuple(self.n, int, "n"))
        for name in ("rho", "eps"):
            if any(not 0.0 <= v <= 1.0 for v in getattr(self, name)):
                raise ValueError(f"{name} values must lie in [0, 1]")
        if min(self.n) < 1:
            raise ValueError("batch sizes n must be >= 1")

    @classmethod
    def uniform(cls, points: int, n: Sequence[int], log_points: int = 0, eps_min: float = 1e-8) -> TheoryGrid:
        """``points`` evenly spaced ρ and ε in [0, 1] (ends included), plus ``log_points`` geometrically spaced ε in
        [eps_min, 1 / (points - 1)) -- the bound is only valid for tiny ε (its region shrinks like n^-4), which a
        linear grid cannot show."""
        if points < 2:
            raise ValueError(f"points must be >= 2, got {points}")
        if log_points < 0 or not 0.0 < eps_min < 1.0 / (points - 1):
            raise ValueError(f"need log_points >= 0 and 0 < eps_min < 1 / (points - 1), got {log_points}, {eps_min}")
        axis = [round(float(v), 12) for v in np.linspace(0.0, 1.0, points)]
        small = np.geomspace(eps_min, 1.0 / (points - 1), log_points, endpoint=False) if log_points else []
        eps = sorted(set(axis) | {float(f"{v:.6g}") for v in small})
        return cls(rho=axis, eps=eps, n=n)


@dataclass(frozen=True)
class EmpiricalGrid:
    """Part (b): batch sizes × noise bounds × depths × seeds, and the data / training settings shared by all runs.

    Data: ``n_clusters`` subspaces of rank ``rank`` in R^``dim`` ((K - 1) r < dim, section 3). Every run trains
    ``steps`` Adam steps (learning rate ``lr``) on fresh batches of n samples. ``learned_nmi``: the NMI threshold
    of ``learned``. Each n must be >= 2 K so that the stratified test batch has a same-cluster pair per cluster.
    """

    n: tuple[int, ...]
    eps: tuple[float, ...]
    depth: tuple[int, ...]
    steps: int = 100
    n_clusters: int = 4
    rank: int = 2
    dim: int = 32
    lr: float = 1e-2
    seeds: tuple[int, ...] = (0,)
    learned_nmi: float = 0.9
    loss: str = "jsd"

    def __post_init__(self) -> None:
        for name, kind in (("n", int), ("eps", float), ("depth", int), ("seeds", int)):
            object.__setattr__(self, name, _tuple(getattr(self, name), kind, name))
        if any(not 0.0 <= e <= 1.0 for e in self.eps):
            raise ValueError("eps values must lie in [0, 1] (eq. 8)")
        if min(self.depth) < 1:
            raise ValueError("depths must be >= 1 (a head with blocks)")
        if self.steps < 1 or self.lr <= 0:
            raise ValueError(f"need steps >= 1 and lr > 0, got {self.steps}, {self.lr}")
        if self.n_clusters < 2 or self.rank < 1 or (self.n_clusters - 1) * self.rank >= self.dim:
            raise ValueError(
                f"need n_clusters >= 2, rank >= 1 and (n_clusters - 1) * rank < dim, got K={self.n_clusters}, "
                f"r={self.rank}, m={self.dim}"
            )
        if min(self.n) < 2 * self.n_clusters:
            raise ValueError(
                f"every batch size must be >= 2 * n_clusters = {2 * self.n_clusters} (a same-cluster pair in "
                f"every cluster of the test batch), got {min(self.n)}"
            )
        if not 0.0 < self.learned_nmi <= 1.0:
            raise ValueError(f"learned_nmi must lie in (0, 1], got {self.learned_nmi}")


# ------------------------------------------------------------------------------------------------ part (a)
def formula_at(rho: float, eps: float, n: float) -> dict[str, Any]:
    """Theorem 2 at one point: δ, Δ, the printed γ, ``meaningful``, ``gamma_gt1`` (γ > 1) and ``learnable``.

        δ = sqrt(1 - (1 - ε)²),  Δ = (1 - ε) ρ - sqrt((1 - (1 - ε)²)(1 - ρ²))
        γ = (Δ³ - n²(δ + δ²))² (2 + δ) / (Δ² n³ (Δ² + (1 + δ)) (1 + δ(Δ² + (1 + δ))))
        meaningful = (Δ > 0) & (Δ³ > n²(δ + δ²)),  learnable = meaningful & (γ > 1)   (always False)

    ρ is clipped into [0, 1] (an integrity estimate can exceed 1 by rounding). Returns Python scalars.
    """
    t = theory.theorem2(min(max(float(rho), 0.0), 1.0), float(eps), float(n))
    gamma = float(t.gamma)
    meaningful = bool(t.meaningful)
    return {
        "delta": float(t.delta), "Delta": float(t.Delta), "gamma": gamma, "meaningful": meaningful,
        "gamma_gt1": bool(gamma > 1), "learnable": bool(meaningful and gamma > 1),
    }


def formula_table(grid: TheoryGrid) -> list[dict[str, Any]]:
    """γ of Theorem 2 on every (n, ρ, ε) of the grid, one row each (columns ``FORMULA_COLUMNS``).

    Rows come n-major, then ρ, then ε. Vectorised through ``theory.theorem2``; γ = +inf where Δ == 0 < δ and
    NaN at ρ = ε = 0 (0/0), as that function documents.
    """
    rho = np.asarray(grid.rho)[:, None]  # (R, 1)
    eps = np.asarray(grid.eps)[None, :]  # (1, E)
    rows: list[dict[str, Any]] = []
    for n in grid.n:
        t = theory.theorem2(rho, eps, n)  # fields (R, E)
        for i, r in enumerate(grid.rho):
            for j, e in enumerate(grid.eps):
                g = float(t.gamma[i, j])
                m = bool(t.meaningful[i, j])
                rows.append({
                    "n": int(n), "rho": r, "eps": e, "delta": float(t.delta[i, j]), "Delta": float(t.Delta[i, j]),
                    "gamma": g, "meaningful": m, "gamma_gt1": bool(g > 1), "learnable": bool(m and g > 1),
                })
    return rows


# ------------------------------------------------------------------------------------------------ part (b)
def split_test(labels: Tensor, n: int, n_clusters: int) -> tuple[Tensor, Tensor]:
    """A stratified test batch and the training stream from one sample of labels.

    Test: the LAST n_c samples of every cluster c, n_c = n // K (+1 for the first n % K clusters), so every cluster
    appears and counts differ by at most one. Train: every other index, in order. labels: (N,) int ->
    (test (n,), train (N - n,)) int64 indices. Raises ValueError if a cluster has fewer than n_c samples.
    """
    parts = []
    for c in range(n_clusters):
        members = torch.nonzero(labels == c).flatten()  # (N_c,)
        need = n // n_clusters + (1 if c < n % n_clusters else 0)
        if members.numel() < need:
            raise ValueError(f"cluster {c} has {members.numel()} samples, the test batch needs {need}")
        parts.append(members[members.numel() - need:])
    test = torch.cat(parts).sort().values  # (n,)
    keep = torch.ones(labels.shape[0], dtype=torch.bool)
    keep[test] = False
    return test, torch.nonzero(keep).flatten()


def squared_cosine(q: Tensor, k: Tensor) -> np.ndarray:
    """The affinity the JSD loss trains, before its row normalisation (eq. 5): A_ij = cos(q_i, k_j)², A_ii = 0.

    q, k: (n, h) -> (n, n) float64 numpy, entries in [0, 1].
    """
    a = F.normalize(q.detach().double(), dim=1) @ F.normalize(k.detach().double(), dim=1).T  # (n, n)
    a = a.square().cpu().numpy()
    np.fill_diagonal(a, 0.0)
    return a


def train_head(
    x: Tensor, labels: Tensor, *, n: int, depth: int, steps: int, lr: float, seed: int, loss: str = "jsd",
) -> tuple[TransFusionHead, list[float]]:
    """Supervised training of ``TransFusionHead(m, depth)`` on consecutive batches of n rows of x.

    Batch s is ``x[s n : (s + 1) n]`` (so x needs >= steps · n rows), its ids the subspace labels (positives =
    same label, eq. 1), the loss ``make_loss(loss)`` on the head's (q, k), Adam with learning rate ``lr``.
    The weights are initialised from ``torch.manual_seed(seed)`` inside ``torch.random.fork_rng`` (the global RNG
    state is restored). x: (N, m) float32, labels: (N,) int64. Returns the head (in eval mode) and the losses.
    """
    if x.shape[0] < steps * n:
        raise ValueError(f"need {steps} * {n} = {steps * n} training rows, got {x.shape[0]}")
    loss_fn = make_loss(loss)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = TransFusionHead(x.shape[1], depth)
    opt = torch.optim.Adam(head.parameters(), lr=lr)
    losses = []
    head.train()
    for s in range(steps):
        xb, yb = x[s * n:(s + 1) * n], labels[s * n:(s + 1) * n]  # (n, m), (n,)
        out = head(xb)
        value = loss_fn(out.q, out.k, yb)
        opt.zero_grad(set_to_none=True)
        value.backward()
        opt.step()
        losses.append(float(value.detach()))
    head.eval()
    return head, losses


def _ratio(num: float, den: float) -> float:
    """num / den with den <= 0 read as 0+ (``theory``'s convention): +inf if num > 0, 0 if num == 0; NaN in -> NaN."""
    if math.isnan(num) or math.isnan(den):
        return math.nan
    if den > 0:
        return num / den if math.isfinite(den) else (math.nan if math.isinf(num) else 0.0)
    return math.inf if num > 0 else (0.0 if num == 0 else -math.inf)


def _geometric_gain(first: float, last: float, layers: int) -> float:
    """(last / first)^(1 / layers): the per-layer factor whose product over ``layers`` layers is last / first."""
    r = _ratio(last, first)
    return r ** (1.0 / layers) if math.isfinite(r) and r >= 0 else r


def measure(
    head: TransFusionHead, x: Tensor, labels: Tensor, *, learned_nmi: float = 0.9, loss: str = "jsd", seed: int = 0,
) -> dict[str, Any]:
    """Measurements of a trained head on one test batch (module docstring, part (b)).

    Chain: A⁰ = ReLU(cos x) (zero diagonal, ``clustering.cosine_affinity``), A^ℓ = block ℓ's ReLU(Q Kᵀ), ℓ = 1..d.
      contrast_layers / sharpness_layers: c(A^ℓ), S(A^ℓ) for ℓ = 0..d (";"-joined text);
      gain_layers: c(A^ℓ) / c(A^{ℓ-1}), ℓ = 1..d;  contrast_gain = (c(A^d) / c(A⁰))^{1/d};  sharpness = S(A^d).
    Trained affinity g = cos(q_i, k_j)² (zero diagonal): contrast_in / nmi_in of g on x itself, contrast_out / nmi
      on the head's output; learned = nmi >= learned_nmi. test_loss: the training loss on this batch.
    x: (n, m), labels: (n,) with a same-cluster pair in every cluster. ``seed``: the eigensolver's random_state.
    """
    with torch.no_grad():
        out = head(x, collect=True)
        test_loss = float(make_loss(loss)(out.q, out.k, labels))
    chain = [cosine_affinity(x), *[a.double().cpu().numpy() for a in out.affinities]]  # d + 1 of (n, n)
    contrasts = [theory.affinity_contrast(a, labels) for a in chain]
    sharp = [theory.sharpness(a, labels) for a in chain]
    gains = [_ratio(c1, c0) for c0, c1 in zip(contrasts[:-1], contrasts[1:], strict=True)]
    g_in, g_out = squared_cosine(x, x), squared_cosine(out.q, out.k)  # (n, n) each
    nmi = spectral_scores(g_out, labels, seed=seed)["nmi"]
    return {
        "test_loss": test_loss,
        "contrast_layers": ";".join(_num(c) for c in contrasts),
        "sharpness_layers": ";".join(_num(s) for s in sharp),
        "gain_layers": ";".join(_num(g) for g in gains),
        "contrast_gain": _geometric_gain(contrasts[0], contrasts[-1], len(gains)),
        "sharpness": sharp[-1],
        "contrast_in": theory.affinity_contrast(g_in, labels),
        "contrast_out": theory.affinity_contrast(g_out, labels),
        "nmi_in": spectral_scores(g_in, labels, seed=seed)["nmi"],
        "nmi": nmi,
        "learned": bool(nmi >= learned_nmi),
    }


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """torch and the BLAS / OpenMP pools on one thread for the block; the previous torch setting is restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with threadpool_limits(limits=1):
            yield
    finally:
        torch.set_num_threads(before)


def run_empirical(grid: EmpiricalGrid, progress: Callable[[str], Any] | None = print) -> list[dict[str, Any]]:
    """Part (b) over the whole grid: one row per (seed, n, ε, depth), columns ``EMPIRICAL_COLUMNS``.

    Per (seed, n, ε): one draw of ``union_of_subspaces(steps·n + n, K, r, m, ε, seed)`` (the subspaces depend on the
    seed only: they are the generator's first draw), split by ``split_test`` into a stratified test batch of n
    and a training stream of steps·n samples; ρ = ``cluster_integrity`` of the clean test samples; Theorem 2 at
    (ρ, ε, n) (``formula_at``). Per depth: ``train_head`` then ``measure``. Deterministic given the grid (one
    thread, seeded weights and data). ``progress`` gets one line per run (None: silent).
    """
    rows = []
    with _one_thread():
        for seed in grid.seeds:
            for n in grid.n:
                for eps in grid.eps:
                    data = theory.union_of_subspaces(
                        grid.steps * n + n, grid.n_clusters, grid.rank, grid.dim, eps, seed=seed)
                    test, train = split_test(data.labels, n, grid.n_clusters)
                    rho = theory.cluster_integrity(data.clean[test], data.labels[test], data.bases, seed=seed)
                    formula = formula_at(rho, eps, n)
                    for depth in grid.depth:
                        head, losses = train_head(
                            data.x[train], data.labels[train], n=n, depth=depth, steps=grid.steps, lr=grid.lr,
                            seed=seed, loss=grid.loss)
                        tail = losses[-min(10, len(losses)):]
                        m = measure(head, data.x[test], data.labels[test], learned_nmi=grid.learned_nmi,
                                    loss=grid.loss, seed=seed)
                        row = {"n": n, "eps": eps, "depth": depth, "seed": seed, "rho": rho, **formula,
                               "train_loss": float(np.mean(tail)), **m}
                        rows.append({c: row[c] for c in EMPIRICAL_COLUMNS})
                        if progress is not None:
                            progress(
                                f"theory: n={n} eps={eps:g} depth={depth} seed={seed}: rho {rho:.3f}, gamma "
                                f"{formula['gamma']:.3g}{'' if formula['meaningful'] else ' (not meaningful)'}; "
                                f"NMI {m['nmi_in']:.2f} -> {m['nmi']:.2f}, contrast gain/block "
                                f"{m['contrast_gain']:.3g}")
    return rows


# ---------------------------------------------------------------------------------------------- aggregation
def _mean(values: Sequence[float]) -> float:
    """Mean of the values; +inf / -inf if any is infinite (and none of the other sign); NaN if empty or any NaN."""
    v = [float(x) for x in values]
    if not v or any(math.isnan(x) for x in v):
        return math.nan
    return float(np.mean(v))


def aggregate(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per grid point (n, ε, depth): means over seeds (``TABLE_COLUMNS``); booleans become the fraction of runs."""
    groups: dict[tuple, list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["n"], r["eps"], r["depth"]), []).append(r)
    out = []
    for (n, eps, depth), rs in sorted(groups.items()):
        row: dict[str, Any] = {"n": n, "eps": eps, "depth": depth, "runs": len(rs)}
        for c in TABLE_COLUMNS[4:]:
            vals = [r[c] for r in rs]
            row[c] = sum(bool(v) for v in vals) / len(vals) if isinstance(vals[0], bool) else _mean(vals)
        out.append(row)
    return out


def _rankable(v: float) -> float:
    """±inf -> ±1e300 so that a rank correlation can order it; NaN stays NaN (and is dropped)."""
    return math.copysign(1e300, v) if math.isinf(v) else float(v)


def _spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman rank correlation over the pairs where both are not NaN (NaN if < 3 pairs or a constant side)."""
    pairs = [(float(a), float(b)) for a, b in zip(x, y, strict=True) if not (math.isnan(a) or math.isnan(b))]
    if len(pairs) < 3:
        return math.nan
    a, b = zip(*pairs, strict=True)
    if len(set(a)) < 2 or len(set(b)) < 2:
        return math.nan
    return float(spearmanr(a, b).statistic)


def summarize(formula_rows: Sequence[Mapping[str, Any]], empirical_rows: Sequence[Mapping[str, Any]]) -> dict:
    """The numbers behind the verdict (also the stage's metrics). Keys:

    formula: per n, the fraction of (ρ, ε) cells with printed γ > 1, the fraction ``meaningful``, the number of
      cells that are both (``overlap``, 0 by ``theory.learnable_region``) and the largest γ on a meaningful cell.
    empirical: over all runs, counts of ``learned``, ``meaningful``, ``gamma_gt1``, ``learnable`` at the data's
      (ρ, ε, n); the confusion of printed γ > 1 with learned (``both``, ``formula_only``, ``measured_only``,
      ``neither``); runs with contrast gain > 1 and their overlap with γ > 1; runs where NMI / the trained
      affinity's contrast beat the input's (``nmi_improved``, ``contrast_improved``); on meaningful runs, how often the
      measured gain reaches γ; Spearman correlations of NMI, contrast gain and γ with ε and with n (pooled);
      the mean NMI in and out per ε.
    """
    formula: dict[str, Any] = {}
    for n in sorted({int(r["n"]) for r in formula_rows}):
        rs = [r for r in formula_rows if r["n"] == n]
        mg = [r["gamma"] for r in rs if r["meaningful"]]
        formula[str(n)] = {
            "cells": len(rs),
            "gamma_gt1_fraction": sum(r["gamma_gt1"] for r in rs) / len(rs),
            "meaningful_fraction": sum(r["meaningful"] for r in rs) / len(rs),
            "overlap": sum(bool(r["gamma_gt1"] and r["meaningful"]) for r in rs),
            "max_gamma_meaningful": max(mg) if mg else math.nan,
        }
    e = list(empirical_rows)
    learned = [bool(r["learned"]) for r in e]
    printed = [bool(r["gamma_gt1"]) for r in e]
    gain_up = [bool(r["contrast_gain"] > 1) for r in e]
    meaningful = [r for r in e if r["meaningful"]]
    by_eps = {}
    for eps in sorted({r["eps"] for r in e}):
        rs = [r for r in e if r["eps"] == eps]
        by_eps[repr(float(eps))] = {"nmi_in": _mean([r["nmi_in"] for r in rs]), "nmi": _mean([r["nmi"] for r in rs]),
                                    "learned": sum(r["learned"] for r in rs), "runs": len(rs)}
    gamma = [_rankable(r["gamma"]) for r in e]
    empirical = {
        "runs": len(e),
        "learned": sum(learned),
        "meaningful": len(meaningful),
        "gamma_gt1": sum(printed),
        "learnable": sum(bool(r["learnable"]) for r in e),
        "both": sum(p and q for p, q in zip(printed, learned, strict=True)),
        "formula_only": sum(p and not q for p, q in zip(printed, learned, strict=True)),
        "measured_only": sum(q and not p for p, q in zip(printed, learned, strict=True)),
        "neither": sum(not p and not q for p, q in zip(printed, learned, strict=True)),
        "gain_gt1": sum(gain_up),
        "gain_gt1_and_gamma_gt1": sum(p and g for p, g in zip(printed, gain_up, strict=True)),
        "meaningful_gain_ge_gamma": sum(bool(r["contrast_gain"] >= r["gamma"]) for r in meaningful),
        "nmi_mean": _mean([r["nmi"] for r in e]),
        "nmi_in_mean": _mean([r["nmi_in"] for r in e]),
        "nmi_improved": sum(bool(r["nmi"] > r["nmi_in"]) for r in e),
        "contrast_improved": sum(bool(r["contrast_out"] > r["contrast_in"]) for r in e),
        "sharpness_positive": sum(bool(r["sharpness"] > 0) for r in e),
        "spearman_eps_nmi": _spearman([r["eps"] for r in e], [r["nmi"] for r in e]),
        "spearman_eps_gain": _spearman([r["eps"] for r in e], [r["contrast_gain"] for r in e]),
        "spearman_eps_gamma": _spearman([r["eps"] for r in e], gamma),
        "spearman_n_nmi": _spearman([r["n"] for r in e], [r["nmi"] for r in e]),
        "spearman_n_gain": _spearman([r["n"] for r in e], [r["contrast_gain"] for r in e]),
        "spearman_n_gamma": _spearman([r["n"] for r in e], gamma),
        "rho_min": min((r["rho"] for r in e), default=math.nan),
        "rho_max": max((r["rho"] for r in e), default=math.nan),
        "by_eps": by_eps,
    }
    return {"formula": formula, "empirical": empirical}


def _trend(s: float) -> str:
    if math.isnan(s):
        return "undefined (constant or too few points)"
    return f"Spearman {s:+.2f}"


def verdict(summary: Mapping[str, Any], learned_nmi: float = 0.9) -> str:
    """A short Markdown paragraph (bullets) from ``summarize``'s numbers: where formula and measurement agree and
    disagree, stated as counts and correlations, with the caveat that Theorem 2 is a sufficient condition about
    the existence of weights, so learning outside its region does not contradict it."""
    f, e = summary["formula"], summary["empirical"]
    per_n = "; ".join(
        f"n={n}: γ>1 on {100 * v['gamma_gt1_fraction']:.1f}% of the cells, meaningful on "
        f"{100 * v['meaningful_fraction']:.1f}%, "
        f"both on {v['overlap']} cells, max γ where meaningful {_num(v['max_gamma_meaningful'])}"
        for n, v in f.items())
    runs = e["runs"]
    overlap = sum(int(v["overlap"]) for v in f.values())
    if overlap == 0:
        overlap_text = (
            "The printed region {γ > 1} and the region where the bound is valid share no cell, so read as printed "
            "the theorem certifies sharpening on none of them; its {γ > 1} cells lie where Δ ≤ 0 or "
            "Δ³ ≤ n²(δ + δ²), i.e. where the bound says nothing.")
    else:
        overlap_text = (f"The printed region {{γ > 1}} and the valid region share {overlap} cells, contradicting "
                        "theory.learnable_region's proof: check the grid and the formula.")
    by_eps = ", ".join(f"ε={float(k):g}: {v['learned']}/{v['runs']}" for k, v in e["by_eps"].items())
    lines = [
        f"- **Formula alone** (cells of the (ρ, ε) grid; with a mixed log / linear ε grid these are cell counts, "
        f"not areas): {per_n}. {overlap_text}",
        f"- **At the data's (ρ, ε, n)** ({runs} runs, ρ of the clean test batch in "
        f"[{_num(e['rho_min'])}, {_num(e['rho_max'])}]): meaningful in {e['meaningful']}, printed γ > 1 in "
        f"{e['gamma_gt1']}, meaningful and γ > 1 in {e['learnable']}.",
        f"- **Measurement**: learned (spectral NMI of the trained affinity ≥ {learned_nmi:g}) in {e['learned']} of "
        f"{runs} runs; mean NMI {_num(e['nmi_in_mean'])} on the input → {_num(e['nmi_mean'])} after the head, higher "
        f"than the input's in {e['nmi_improved']} runs; learned per ε: {by_eps}; per-block contrast gain > 1 in "
        f"{e['gain_gt1']} runs (the blocks' own ReLU(QKᵀ) affinities), while the trained affinity's contrast exceeds "
        f"the input's in {e['contrast_improved']} runs; "
        f"Definition 2 sharpness of the last block > 0 in {e['sharpness_positive']} runs.",
        f"- **Agreement of printed γ > 1 with learned**: both {e['both']}, γ > 1 but not learned {e['formula_only']}, "
        f"learned but γ ≤ 1 {e['measured_only']}, neither {e['neither']} "
        f"(agree on {e['both'] + e['neither']} of {runs}). Contrast gain > 1 and γ > 1 together in "
        f"{e['gain_gt1_and_gamma_gt1']} runs.",
        f"- **Trends, pooled over the grid**: with ε, NMI {_trend(e['spearman_eps_nmi'])}, contrast gain "
        f"{_trend(e['spearman_eps_gain'])}, printed γ {_trend(e['spearman_eps_gamma'])}; with n, NMI "
        f"{_trend(e['spearman_n_nmi'])}, contrast gain {_trend(e['spearman_n_gain'])}, printed γ "
        f"{_trend(e['spearman_n_gamma'])}. Opposite signs mean the formula and the measurement move in opposite "
        "directions along that axis.",
        f"- **Caveat**: Theorem 2 asserts that SOME weights sharpen every block by γ; trained weights are one "
        "instance, so learning where the theorem is silent does not refute it, and a measured gain below γ only "
        f"says training did not find such weights. Where meaningful, the measured gain reached γ in "
        f"{e['meaningful_gain_ge_gamma']} of {e['meaningful']} runs.",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- writing
def _num(v: Any) -> str:
    """Compact text for a number: 4 significant digits, 'inf' / '-inf' / 'nan' spelled out; bools as 0/1."""
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    if isinstance(v, (float, np.floating)):
        v = float(v)
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return f"{v:.4g}"
    return str(v)


def _csv_text(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], fmt: Callable[[Any], str]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(columns)
    for r in rows:
        w.writerow([fmt(r.get(c)) for c in columns])
    return buf.getvalue()


def _csv_value(v: Any) -> str:
    """CSV cell: full-precision floats ('%.6g' keeps the formula table small), bools as true/false."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (float, np.floating)):
        return "nan" if math.isnan(v) else ("inf" if v == math.inf else "-inf" if v == -math.inf else f"{v:.6g}")
    return "" if v is None else str(v)


def _json_safe(obj: Any) -> Any:
    """JSON for DVC: non-finite floats become the strings 'inf' / '-inf' / 'nan'; numpy scalars become Python."""
    if isinstance(obj, Mapping):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        v = float(obj)
        return v if math.isfinite(v) else _num(v)
    return obj


def _formula_maps(rows: Sequence[Mapping[str, Any]], n: int) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """ρ values (R,), ε values (E,) and (R, E) arrays of gamma_gt1 / meaningful / Delta for one n."""
    rs = [r for r in rows if r["n"] == n]
    rho = np.array(sorted({float(r["rho"]) for r in rs}))
    eps = np.array(sorted({float(r["eps"]) for r in rs}))
    ri = {v: i for i, v in enumerate(rho)}
    ei = {v: j for j, v in enumerate(eps)}
    maps = {k: np.full((len(rho), len(eps)), np.nan) for k in ("gamma_gt1", "meaningful", "Delta")}
    for r in rs:
        for k in maps:
            maps[k][ri[float(r["rho"])], ei[float(r["eps"])]] = float(r[k])
    return rho, eps, maps


NICE_TICKS = (0.0, 1e-8, 1e-6, 1e-4, 1e-2, 0.25, 0.5, 0.75, 1.0)


def _ticks(values: np.ndarray) -> tuple[list[float], list[str]]:
    """Tick positions (in index space: one unit per grid value) and labels for the values of NICE_TICKS inside the
    grid's range, dropping a tick that would sit less than max(1.5, len / 15) columns from the previous one."""
    pos: list[float] = []
    text: list[str] = []
    gap = max(1.5, len(values) / 15)
    for v in NICE_TICKS:
        if not values[0] <= v <= values[-1]:
            continue
        p = float(np.interp(v, values, np.arange(len(values))))
        if pos and p - pos[-1] < gap:
            continue
        pos.append(p)
        text.append("0" if v == 0 else (f"1e{round(math.log10(v))}" if v < 0.01 else f"{v:g}"))
    return pos, text


def _figure(formula_rows: Sequence[Mapping[str, Any]], table: Sequence[Mapping[str, Any]],
            empirical_rows: Sequence[Mapping[str, Any]], png: Path) -> None:
    """Left: per formula n, categorical (ρ, ε) map {γ > 1 only, meaningful only, both}, the Δ = 0 line and the
    data's points (filled = learned in at least half of the runs there). Right: measured NMI over (n, ε), one panel
    per depth, hatched where the printed γ > 1 at the data's ρ in at least half of the runs, '*' where meaningful."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import ListedColormap, Normalize
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch, Rectangle

    from pipeline.figures import DPI

    ns = sorted({int(r["n"]) for r in formula_rows})
    depths = sorted({int(r["depth"]) for r in table})
    n_emp = sorted({int(r["n"]) for r in table})
    eps_emp = sorted({float(r["eps"]) for r in table})
    fcols = min(len(ns), 2)
    frows = math.ceil(len(ns) / fcols)
    left_w = 3.3 * fcols + 0.5
    right_w = (0.55 * len(eps_emp) + 1.3) * len(depths) + 1.2
    height = max(3.0 * frows, 0.45 * len(n_emp) + 2.5) + 1.0
    fig = Figure(figsize=(left_w + right_w, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subfigures(1, 2, width_ratios=[left_w, right_w])
    colors = ["white", "#f4a582", "#92c5de", "#762a83"]  # neither, printed γ>1 only, meaningful only, both
    cmap = ListedColormap(colors)
    axes = left.subplots(frows, fcols, squeeze=False).reshape(-1)
    emp_points: dict[tuple[int, float], list[Mapping[str, Any]]] = {}
    for r in empirical_rows:
        emp_points.setdefault((int(r["n"]), float(r["eps"])), []).append(r)
    for ax, n in zip(axes, ns, strict=False):
        rho, eps, maps = _formula_maps(formula_rows, n)
        cat = np.nan_to_num(maps["gamma_gt1"]) + 2 * np.nan_to_num(maps["meaningful"])  # (R, E) in {0..3}
        # drawn in index space (one column per grid value): a mixed log / linear ε grid stays readable
        ax.imshow(cat, cmap=cmap, vmin=-0.5, vmax=3.5, origin="lower", aspect="auto", interpolation="nearest")
        if len(rho) > 1 and len(eps) > 1 and np.nanmin(maps["Delta"]) < 0 < np.nanmax(maps["Delta"]):
            ax.contour(np.arange(len(eps)), np.arange(len(rho)), maps["Delta"], levels=[0.0], colors="black",
                       linestyles="--", linewidths=1.0)
        for (pn, pe), rs in emp_points.items():
            if pn != n:
                continue
            ok = sum(bool(r["learned"]) for r in rs) >= len(rs) / 2
            py = float(np.interp(np.mean([r["rho"] for r in rs]), rho, np.arange(len(rho))))
            ax.plot([float(np.interp(pe, eps, np.arange(len(eps))))], [py], marker="o", markersize=6,
                    color="black", markerfacecolor="black" if ok else "white", linestyle="")
        for axis, values in ((ax.xaxis, eps), (ax.yaxis, rho)):
            pos, text = _ticks(values)
            axis.set_ticks(pos, text, fontsize="x-small")
        ax.set_xlabel("noise bound ε (one column per grid value)", fontsize="small")
        ax.set_ylabel("cluster integrity ρ", fontsize="small")
        overlap = int(np.nansum(cat == 3))
        ax.set_title(f"n = {n}: γ>1 {100 * np.nanmean(maps['gamma_gt1']):.0f}%, valid "
                     f"{100 * np.nanmean(maps['meaningful']):.1f}%, both {overlap}", fontsize="small")
    for ax in axes[len(ns):]:
        ax.set_visible(False)
    left.legend(handles=[
        Patch(facecolor=colors[1], edgecolor="grey", label="printed γ > 1 (bound not valid)"),
        Patch(facecolor=colors[2], edgecolor="grey", label="bound valid (meaningful), γ ≤ 1"),
        Patch(facecolor=colors[3], edgecolor="grey", label="valid and γ > 1 (empty)"),
        Line2D([], [], color="black", linestyle="--", label="Δ = 0 (γ → ∞)"),
        Line2D([], [], color="black", marker="o", linestyle="", label="data, learned"),
        Line2D([], [], color="black", marker="o", markerfacecolor="white", linestyle="", label="data, not learned"),
    ], loc="outside lower center", ncols=2, fontsize="x-small", frameon=False)
    left.suptitle("Theorem 2 as printed, per batch size n", fontsize="medium")

    raxes = right.subplots(1, len(depths), squeeze=False)[0]
    cm = colormaps["viridis"].with_extremes(bad="white")
    norm = Normalize(vmin=0.0, vmax=1.0)
    image = None
    for ax, depth in zip(raxes, depths, strict=True):
        grid = np.full((len(n_emp), len(eps_emp)), np.nan)
        for r in table:
            if int(r["depth"]) == depth:
                i, j = n_emp.index(int(r["n"])), eps_emp.index(float(r["eps"]))
                grid[i, j] = r["nmi"]
                if r["gamma_gt1"] >= 0.5:
                    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="tab:red", hatch="//",
                                           linewidth=1.2))
        image = ax.imshow(np.ma.masked_invalid(grid), cmap=cm, norm=norm, origin="lower", aspect="auto",
                          interpolation="nearest")
        for r in table:
            if int(r["depth"]) == depth and math.isfinite(r["nmi"]):
                i, j = n_emp.index(int(r["n"])), eps_emp.index(float(r["eps"]))
                mark = "*" if r["meaningful"] >= 0.5 else ""
                ax.text(j, i, f"{r['nmi']:.2f}{mark}", ha="center", va="center", fontsize="x-small",
                        color="black" if r["nmi"] > 0.5 else "white")
        ax.set_xticks(range(len(eps_emp)), [f"{v:g}" for v in eps_emp])
        ax.set_yticks(range(len(n_emp)), [str(v) for v in n_emp])
        ax.set_xlabel("noise bound ε")
        ax.set_ylabel("batch size n")
        ax.set_title(f"measured NMI, depth {depth}", fontsize="small")
    right.colorbar(image, ax=list(raxes), label="spectral NMI of the trained affinity", shrink=0.9)
    right.legend(handles=[Patch(fill=False, edgecolor="tab:red", hatch="//",
                                label="printed γ > 1 at the data's (ρ, ε, n)"),
                          Line2D([], [], linestyle="", marker="$*$", color="black", label="bound valid there")],
                 loc="outside lower center", fontsize="x-small", frameon=False)
    right.suptitle("Measured (trained TransFusion head, test batch)", fontsize="medium")
    with atomic_path(png) as tmp:
        fig.savefig(tmp, format="png", dpi=DPI)


def _markdown_table(table: Sequence[Mapping[str, Any]]) -> str:
    head = ("n", "ε", "depth", "ρ", "δ", "Δ", "γ (printed)", "meaningful", "gain/block", "S(A^d)", "NMI in → out",
            "learned")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table:
        runs = r["runs"]
        lines.append("| " + " | ".join([
            _num(r["n"]), _num(r["eps"]), _num(r["depth"]), _num(r["rho"]), _num(r["delta"]), _num(r["Delta"]),
            _num(r["gamma"]), f"{round(r['meaningful'] * runs)}/{runs}", _num(r["contrast_gain"]),
            _num(r["sharpness"]), f"{_num(r['nmi_in'])} → {_num(r['nmi'])}", f"{round(r['learned'] * runs)}/{runs}",
        ]) + " |")
    return "\n".join(lines)


def write_outputs(
    formula_rows: Sequence[Mapping[str, Any]],
    empirical_rows: Sequence[Mapping[str, Any]],
    out_dir: Path,
    *,
    setup: Mapping[str, Any] | None = None,
    learned_nmi: float = 0.9,
) -> dict[str, Any]:
    """Write part (c) into ``out_dir`` and return the metrics (``summarize``, JSON-safe, plus the file list).

    Files: ``theory.png`` (formula panels beside measurement panels), ``measured_nmi.{png,csv}`` and
    ``measured_gain.{png,csv}`` (``figures.phase_diagram``: x = ε, y = n, one panel per depth, hatched where the
    printed γ > 1 at the data's ρ), ``formula.csv`` (``FORMULA_COLUMNS``), ``empirical.csv`` (one row per run,
    ``EMPIRICAL_COLUMNS``), ``table.csv`` (per grid point, means over seeds, booleans as fractions,
    ``TABLE_COLUMNS``) and ``theory.md`` (setup, verdict, per-n formula summary, the table). Each file is written
    atomically; ``setup`` (e.g. the grid's fields) is listed in the Markdown.
    """
    from pipeline import figures

    if not formula_rows or not empirical_rows:
        raise ValueError("write_outputs needs formula rows and empirical rows")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = aggregate(empirical_rows)
    summary = summarize(formula_rows, empirical_rows)

    write_text(out_dir / "formula.csv", _csv_text(formula_rows, FORMULA_COLUMNS, _csv_value))
    write_text(out_dir / "empirical.csv", _csv_text(empirical_rows, EMPIRICAL_COLUMNS, _csv_value))
    write_text(out_dir / "table.csv", _csv_text(table, TABLE_COLUMNS, _csv_value))
    printed = {(int(r["n"]), float(r["eps"]), int(r["depth"])): r["gamma_gt1"] >= 0.5 for r in table}

    def region(x: Any, y: Any, panel: Any) -> bool:
        return bool(printed.get((int(y), float(x), int(panel)), False))

    for value, name in (("nmi", "measured_nmi"), ("contrast_gain", "measured_gain")):
        figures.phase_diagram(empirical_rows, x="eps", y="n", value=value, panel="depth", png=out_dir / f"{name}.png",
                              csv=out_dir / f"{name}.csv", region=region)
    _figure(formula_rows, table, empirical_rows, out_dir / "theory.png")

    setup_lines = "\n".join(f"- {k}: {v}" for k, v in (setup or {}).items())
    per_n = "\n".join(
        f"| {n} | {v['cells']} | {100 * v['gamma_gt1_fraction']:.1f}% | {100 * v['meaningful_fraction']:.1f}% | "
        f"{v['overlap']} | {_num(v['max_gamma_meaningful'])} |" for n, v in summary["formula"].items())
    md = "\n".join([
        "# Theorem 2 against a trained TransFusion head",
        "",
        "γ is Theorem 2's factor exactly as printed; *meaningful* = (Δ > 0) and (Δ³ > n²(δ + δ²)), where Appendix D's "
        "lower bound is positive and γ is a bound at all. ρ: cluster integrity (Definition 1) of the clean test "
        "samples, a lower-bound estimate. Measured: a head trained with the JSD loss on fresh union-of-subspaces "
        "batches of n, evaluated on a fresh stratified test batch of n. *gain/block* = (c(A^d) / c(A⁰))^(1/d), c = "
        "mean same-cluster / mean different-cluster affinity, A⁰ = ReLU(cos x), A^ℓ = block ℓ's ReLU(QKᵀ). *NMI*: "
        f"spectral clustering of cos² (the affinity the loss trains) on the input → on the head's output; "
        f"*learned* = NMI ≥ {learned_nmi:g}. Fractions are over seeds.",
        "",
        "## Setup",
        "",
        setup_lines or "- (not given)",
        "",
        "## Verdict",
        "",
        verdict(summary, learned_nmi),
        "",
        "## The formula on the (ρ, ε) grid",
        "",
        "| n | cells | printed γ > 1 | meaningful | both | max γ where meaningful |",
        "|---|---|---|---|---|---|",
        per_n,
        "",
        "## Per grid point",
        "",
        _markdown_table(table),
        "",
        "Files: theory.png (formula | measurement), measured_nmi.png, measured_gain.png, formula.csv, empirical.csv, "
        "table.csv.",
        "",
    ])
    write_text(out_dir / "theory.md", md)
    metrics = _json_safe(summary)
    metrics["files"] = sorted(p.name for p in out_dir.iterdir() if not p.name.startswith("."))
    return metrics


def run_all(theory_grid: TheoryGrid, empirical_grid: EmpiricalGrid, out_dir: Path,
            progress: Callable[[str], Any] | None = print) -> dict[str, Any]:
    """Parts (a), (b), (c) in one call: returns ``write_outputs``' metrics plus ``seconds`` (wall time)."""
    t0 = time.perf_counter()
    formula = formula_table(theory_grid)
    rows = run_empirical(empirical_grid, progress)
    setup = asdict(empirical_grid)
    setup["formula grid"] = f"{len(theory_grid.rho)} x {len(theory_grid.eps)} (ρ, ε) points, n = {list(theory_grid.n)}"
    metrics = write_outputs(formula, rows, out_dir, setup=setup, learned_nmi=empirical_grid.learned_nmi)
    metrics["seconds"] = round(time.perf_counter() - t0, 2)
    return metrics
