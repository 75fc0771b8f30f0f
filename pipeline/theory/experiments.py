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
    small, and on a loaded 2-core machine two threads made a training step ~100x slower. The (seed, n, ε) cells
    run in parallel instead, one process per CPU (``run_empirical(workers=)``), with the same rows.
(c) ``pipeline.theory.report`` aggregates the runs, writes the verdict, the CSV tables and ``theory.md``;
    ``pipeline.evaluation.figures.theory_figure`` draws the formula panels beside the measurement panels.

Pure core: torch, numpy, scipy, scikit-learn and the standard library's process pool; no matplotlib, no file
output.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from pipeline.core.clustering import cosine_affinity, spectral_scores
from pipeline.core.losses import make_loss
from pipeline.core.model import TransFusionHead
from pipeline.data import synthetic
from pipeline.host import one_thread, spawned_map, usable_cpus
from pipeline.theory import bound, measures

if TYPE_CHECKING:
    from pipeline.config.theory import TheoryConfig

__all__ = [
    "EMPIRICAL_COLUMNS",
    "FORMULA_COLUMNS",
    "EmpiricalGrid",
    "TheoryGrid",
    "format_number",
    "formula_at",
    "formula_table",
    "measure",
    "run_cell",
    "run_empirical",
    "split_test",
    "squared_cosine",
    "train_head",
]

FORMULA_COLUMNS = ("n", "rho", "eps", "delta", "Delta", "gamma", "meaningful", "gamma_gt1", "learnable")
EMPIRICAL_COLUMNS = (
    "n", "eps", "depth", "seed", "rho", "delta", "Delta", "gamma", "meaningful", "gamma_gt1", "learnable",
    "train_loss", "test_loss", "contrast_layers", "sharpness_layers", "gain_layers", "contrast_gain",
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
    Those rules are checked once, by :class:`pipeline.config.theory.TheoryConfig`: build the grid from a validated
    section with :meth:`from_config`. The constructor only turns the sequences into tuples.
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
            object.__setattr__(self, name, tuple(kind(v) for v in getattr(self, name)))

    @classmethod
    def from_config(cls, cfg: TheoryConfig, loss: str = "jsd") -> EmpiricalGrid:
        """The grid of a validated ``theory`` params section."""
        return cls(n=cfg.n, eps=cfg.eps, depth=cfg.depth, steps=cfg.steps, n_clusters=cfg.n_clusters, rank=cfg.rank,
                   dim=cfg.dim, lr=cfg.lr, seeds=cfg.seeds, learned_nmi=cfg.learned_nmi, loss=loss)


# ------------------------------------------------------------------------------------------------ part (a)
def formula_at(rho: float, eps: float, n: float) -> dict[str, Any]:
    """Theorem 2 at one point: δ, Δ, the printed γ, ``meaningful``, ``gamma_gt1`` (γ > 1) and ``learnable``.

        δ = sqrt(1 - (1 - ε)²),  Δ = (1 - ε) ρ - sqrt((1 - (1 - ε)²)(1 - ρ²))
        γ = (Δ³ - n²(δ + δ²))² (2 + δ) / (Δ² n³ (Δ² + (1 + δ)) (1 + δ(Δ² + (1 + δ))))
        meaningful = (Δ > 0) & (Δ³ > n²(δ + δ²)),  learnable = meaningful & (γ > 1)   (always False)

    ρ is clipped into [0, 1] (an integrity estimate can exceed 1 by rounding). Returns Python scalars.
    """
    t = bound.theorem2(min(max(float(rho), 0.0), 1.0), float(eps), float(n))
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
        t = bound.theorem2(rho, eps, n)  # fields (R, E)
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
    # foreach: one fused update over all parameters; on CPU torch defaults to a loop over them, which dominates a
    # step on these small matrices (the same numbers, bit for bit, in about 60 % of the time)
    opt = torch.optim.Adam(head.parameters(), lr=lr, foreach=True)
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
    contrasts = [measures.affinity_contrast(a, labels) for a in chain]
    sharp = [measures.sharpness(a, labels) for a in chain]
    gains = [_ratio(c1, c0) for c0, c1 in zip(contrasts[:-1], contrasts[1:], strict=True)]
    g_in, g_out = squared_cosine(x, x), squared_cosine(out.q, out.k)  # (n, n) each
    nmi = spectral_scores(g_out, labels, seed=seed)["nmi"]
    return {
        "test_loss": test_loss,
        "contrast_layers": ";".join(format_number(c) for c in contrasts),
        "sharpness_layers": ";".join(format_number(s) for s in sharp),
        "gain_layers": ";".join(format_number(g) for g in gains),
        "contrast_gain": _geometric_gain(contrasts[0], contrasts[-1], len(gains)),
        "sharpness": sharp[-1],
        "contrast_in": measures.affinity_contrast(g_in, labels),
        "contrast_out": measures.affinity_contrast(g_out, labels),
        "nmi_in": spectral_scores(g_in, labels, seed=seed)["nmi"],
        "nmi": nmi,
        "learned": bool(nmi >= learned_nmi),
    }


def run_cell(grid: EmpiricalGrid, seed: int, n: int, eps: float) -> list[tuple[dict[str, Any], str]]:
    """One (seed, n, ε) of part (b), every depth, on one thread: ``(row, progress line)`` per depth.

    One draw of ``union_of_subspaces(steps·n + n, K, r, m, ε, seed)`` (the subspaces depend on the seed only: they are
    the generator's first draw), split by ``split_test`` into a stratified test batch of n and a training stream of
    steps·n samples; ρ = ``cluster_integrity`` of the clean test samples; Theorem 2 at (ρ, ε, n) (``formula_at``).
    Per depth: ``train_head`` then ``measure``. Deterministic given its arguments.
    """
    out = []
    with one_thread():
        data = synthetic.union_of_subspaces(grid.steps * n + n, grid.n_clusters, grid.rank, grid.dim, eps, seed=seed)
        test, train = split_test(data.labels, n, grid.n_clusters)
        rho = measures.cluster_integrity(data.clean[test], data.labels[test], data.bases, seed=seed)
        formula = formula_at(rho, eps, n)
        for depth in grid.depth:
            head, losses = train_head(data.x[train], data.labels[train], n=n, depth=depth, steps=grid.steps,
                                      lr=grid.lr, seed=seed, loss=grid.loss)
            tail = losses[-min(10, len(losses)):]
            m = measure(head, data.x[test], data.labels[test], learned_nmi=grid.learned_nmi, loss=grid.loss,
                        seed=seed)
            row = {"n": n, "eps": eps, "depth": depth, "seed": seed, "rho": rho, **formula,
                   "train_loss": float(np.mean(tail)), **m}
            line = (f"theory: n={n} eps={eps:g} depth={depth} seed={seed}: rho {rho:.3f}, gamma "
                    f"{formula['gamma']:.3g}{'' if formula['meaningful'] else ' (not meaningful)'}; "
                    f"NMI {m['nmi_in']:.2f} -> {m['nmi']:.2f}, contrast gain/block {m['contrast_gain']:.3g}")
            out.append(({c: row[c] for c in EMPIRICAL_COLUMNS}, line))
    return out


# A spawned worker imports torch before its first step: 3-4 s on a 2-core machine (the 2-process run of the tests'
# 2-cell grid takes 4.6 s, 0.3 s in this process), the time of 1,200-2,800 steps of the grid's heads (measured 410
# steps/s at n = 128 and 670 at n = 8, depth 1, dim 32). Below this many steps in all, the pool costs more than
# it saves.
POOL_MIN_STEPS = 2000


def run_empirical(grid: EmpiricalGrid, progress: Callable[[str], Any] | None = print,
                  workers: int | None = None) -> list[dict[str, Any]]:
    """Part (b) over the whole grid: one row per (seed, n, ε, depth), columns ``EMPIRICAL_COLUMNS``, in that order.

    Each (seed, n, ε) is a :func:`run_cell`, on ``workers`` processes (default: one per usable CPU, each running one
    thread, once the grid holds at least :data:`POOL_MIN_STEPS` training steps; a smaller grid runs in this process,
    where it takes less than spawning the pool), the largest n first. The rows do not depend on ``workers``.
    ``progress`` gets one line per run as it ends (None: silent).
    """
    cells = [(seed, n, eps) for seed in grid.seeds for n in grid.n for eps in grid.eps]
    if workers is None and len(cells) * len(grid.depth) * grid.steps < POOL_MIN_STEPS:
        workers = 1
    workers = max(1, min(workers or usable_cpus(), len(cells)))
    done: dict[int, list[tuple[dict[str, Any], str]]] = {}

    def collect(i: int, result: list[tuple[dict[str, Any], str]]) -> None:
        done[i] = result
        for _, line in result:
            if progress is not None:
                progress(line)

    order = sorted(range(len(cells)), key=lambda i: -cells[i][1])  # the slowest cells (largest n) first
    spawned_map(run_cell, [(grid, *cell) for cell in cells], workers, collect, order)
    return [row for i in range(len(cells)) for row, _ in done[i]]


# ------------------------------------------------------------------------------------------------ formatting
def format_number(v: Any) -> str:
    """Compact text for a number: 4 significant digits, 'inf' / '-inf' / 'nan' spelled out; bools as 0/1."""
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    if isinstance(v, (float, np.floating)):
        return f"{float(v):.4g}"  # also 'inf', '-inf', 'nan'
    return str(v)
