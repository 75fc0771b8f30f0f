"""The set-clustering study: five methods that turn a set into a kernel, each clustered spectrally with the number of
clusters known or estimated by the eigengap (ABC, Coward et al., sections 4.4 and 6).

==================== ==================================================================================================
method               the kernel of a set X (n, d), what trains it
==================== ==================================================================================================
abc_multiplicative   ABC (:class:`pipeline.core.abc.ABCHead`): pre-embedding, ``blocks`` SABs, κ = σ(½(E + Eᵀ)),
                     E_ij = q_i·k_j; BCE against Y_ij = 1[y_i = y_j], diagonal included; the SABs softmax(q·k/√width)
abc_additive         the same with E_ij = wᵀ tanh(q_i + k_j); with ``abc_attention: matched`` (the code's) its SABs
                     attend additively too, softmax(uᵀ tanh(q_i + k_j)) unscaled
                     (both: ``circles_heads`` heads on the circles, ``heads`` elsewhere; W_O with ``abc_projection``)
pairwise             ABC without SABs, additive (section 6.1's ablation): each pair judged out of context
transfusion          the same pre-embedding, then ``blocks`` TransFusion blocks of the same width
                     (:class:`pipeline.core.model.TransFusionHead`); its trained affinity cos(q_i, k_j)² (eq. 5 before
                     the row normalisation, zero diagonal), trained by the supervised JSD (``jsd``)
rbf                  exp(−c ||x_i − x_j||² / median_ij ||x_i − x_j||²) on the inputs, c chosen from ``rbf_gammas`` by
                     the mean NMI with the true k on ``rbf_select_sets`` training sets; nothing trained
==================== ==================================================================================================

Inference on a set, for every method: S = ½(K + Kᵀ) clipped at 0 (each kernel's diagonal as it is: ABC's κ_ii,
TransFusion's 0, the RBF's 1); with known k, ``cluster_kernel(S, k)``; with unknown k, k̂ = ``eigengap_k(S,
k_max)`` (``k_max`` = min(``sets.k_max``, n − 1)) and ``cluster_kernel(S, k̂)``. Scores per set: NMI, ARI, |k̂ − k|;
per (data set, method, seed) their means over ``test_sets`` sets; reported as mean ± sd over the seeds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score
from torch import Tensor, nn

from pipeline.config.sets import SET_METHODS, TRAINED_METHODS
from pipeline.core.abc import ABCHead, bce
from pipeline.core.clustering import cluster, eigengap_k
from pipeline.core.losses import make_loss
from pipeline.core.model import TransFusionHead
from pipeline.data.set_tasks import TEST, TRAIN, SetBatch, SetTask, make_task
from pipeline.host import one_thread, spawned_map, usable_cpus

METRICS = ("nmi_known", "ari_known", "nmi_unknown", "ari_unknown", "k_error")

__all__ = ["METRICS", "SetModel", "build_set_model", "rbf_kernels", "run_study", "score_kernels", "summarize",
           "train_set_model"]


class SetModel(nn.Module):
    """A trained set method: x (S, n, d), labels (S, n) -> ``loss``; x -> ``kernels`` (S, n, n), for clustering."""

    def __init__(self, method: str, dim: int, cfg: Any, heads: int | None = None) -> None:
        super().__init__()
        self.method = method
        if method == "transfusion":
            self.pre = nn.Sequential(nn.Linear(dim, cfg.width), nn.Tanh(), nn.Linear(cfg.width, cfg.width))
            self.head = TransFusionHead(cfg.width, cfg.blocks, fusion_scope="per_view")
            self.jsd = make_loss("jsd")
        elif method == "pairwise":
            self.head = ABCHead.pairwise(dim, width=cfg.width, kernel=cfg.kernel)
        else:
            compat = method.removeprefix("abc_")
            attention = compat if cfg.abc_attention == "matched" else "multiplicative"
            self.head = ABCHead(dim, depth=cfg.blocks, heads=heads or cfg.heads, width=cfg.width,
                                compatibility=compat, kernel=cfg.kernel, attention=attention,
                                scale="none" if attention == "additive" else "width", project=cfg.abc_projection)
        self.pos_weight = cfg.pos_weight

    def _qk(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """TransFusion's last block's (q, k), (S, n, h) each: the S sets fused apart (``per_view`` with S views)."""
        s, n, _ = x.shape
        out = self.head(self.pre(x).flatten(0, 1), views=s)  # (S n, width) in, S groups of n fused apart
        return out.q.unflatten(0, (s, n)), out.k.unflatten(0, (s, n))

    def loss(self, x: Tensor, labels: Tensor) -> Tensor:
        """The method's loss, the mean over the S sets."""
        if self.method == "transfusion":
            q, k = self._qk(x)
            return torch.stack([self.jsd(q[i], k[i], labels[i]) for i in range(x.shape[0])]).mean()
        out = self.head(x)  # matrices (S, n, n)
        logits = out.kind == "logits"  # BCE with logits on S = ½(E + Eᵀ), or on κ itself (pipeline.core.abc)
        x = out.logits if logits else out.kernel  # (S, n, n)
        if self.pos_weight == "balanced":  # a weight per set: one call per set
            return torch.stack([bce(x[i], labels[i], pos_weight="balanced", logits=logits)
                                for i in range(x.shape[0])]).mean()
        # a batch of sets in one call (bce's batched form: the mean of the sets' losses)
        return bce(x, labels, pos_weight=self.pos_weight, logits=logits)

    @torch.no_grad()
    def kernels(self, x: Tensor) -> np.ndarray:
        """(S, n, n) float64: ABC's κ, or TransFusion's cos(q_i, k_j)² with a zero diagonal."""
        if self.method == "transfusion":
            q, k = (torch.nn.functional.normalize(t.double(), dim=-1) for t in self._qk(x))
            a = (q @ k.mT).square()  # (S, n, n)
            a.diagonal(dim1=-2, dim2=-1).zero_()
            return a.numpy()
        return self.head(x).kernel.double().numpy()


def build_set_model(method: str, dim: int, cfg: Any, seed: int, heads: int | None = None) -> SetModel:
    """A :class:`SetModel` for a trained ``method``, initialised from ``seed`` (the global RNG state is kept); ABC's
    SABs get ``heads`` heads (default ``cfg.heads``)."""
    if method not in TRAINED_METHODS:
        raise ValueError(f"unknown trained set method {method!r}; allowed: {', '.join(TRAINED_METHODS)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return SetModel(method, dim, cfg, heads)


def train_set_model(method: str, task: SetTask, cfg: Any, seed: int) -> tuple[SetModel, list[float]]:
    """``cfg.steps`` Adam steps (``cfg.lr``) on ``cfg.batch_sets`` fresh training sets each; the model (eval mode) and
    the losses. All training sets are drawn up front (one draw: they are small)."""
    heads = cfg.circles_heads if task.name == "circles" else cfg.heads
    model = build_set_model(method, task.dim, cfg, seed, heads)
    data = task.draw(cfg.steps * cfg.batch_sets, TRAIN, seed)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, foreach=True)
    losses = []
    model.train()
    for step in range(cfg.steps):
        part = slice(step * cfg.batch_sets, (step + 1) * cfg.batch_sets)
        value = model.loss(data.x[part], data.labels[part])
        opt.zero_grad(set_to_none=True)
        value.backward()
        opt.step()
        losses.append(float(value.detach()))
    model.eval()
    return model, losses


def rbf_kernels(x: Tensor, c: float) -> np.ndarray:
    """exp(−c d_ij² / median_{i≠j} d_ij²) per set: x (S, n, d) -> (S, n, n) float64, diagonal 1."""
    x = x.double()
    d2 = torch.cdist(x, x).square()  # (S, n, n)
    n = x.shape[1]
    off = ~torch.eye(n, dtype=torch.bool)
    med = torch.quantile(d2[:, off], 0.5, dim=1).clamp_min(1e-12)  # (S,) the median (mean of the middle two)
    return torch.exp(-c * d2 / med[:, None, None]).numpy()


def score_kernels(kernels: np.ndarray, labels: np.ndarray, k_max: int, seed: int = 0,
                  unknown: bool = True) -> dict[str, float]:
    """Cluster each (n, n) kernel (:func:`pipeline.core.clustering.cluster`) with the true k and (``unknown``) with
    the eigengap's k̂ (capped at ``k_max``); the mean scores.

    kernels: (S, n, n); labels: (S, n). Returns {nmi_known, ari_known[, nmi_unknown, ari_unknown, k_error]}.
    """
    rows = []
    for kern, y in zip(kernels, labels, strict=True):
        k = int(np.unique(y).size)
        known, _ = cluster(kern, k=k, seed=seed)
        row = [normalized_mutual_info_score(y, known), adjusted_rand_score(y, known)]
        if unknown:
            k_hat = eigengap_k(np.clip(0.5 * (kern + kern.T), 0.0, None), k_max=min(k_max, kern.shape[0] - 1))
            pred = known if k_hat == k else cluster(kern, k=k_hat, seed=seed)[0]  # deterministic given the seed
            row += [normalized_mutual_info_score(y, pred), adjusted_rand_score(y, pred), abs(k_hat - k)]
        rows.append(row)
    return dict(zip(METRICS, np.mean(rows, axis=0).tolist(), strict=False))


def choose_rbf(task: SetTask, cfg: Any, seed: int) -> float:
    """The RBF's c in ``cfg.rbf_gammas`` with the best mean NMI (true k) on ``rbf_select_sets`` training sets."""
    data = task.draw(cfg.rbf_select_sets, TRAIN, seed)
    scores = [score_kernels(rbf_kernels(data.x, c), data.labels.numpy(), cfg.k_max, seed, unknown=False)["nmi_known"]
              for c in cfg.rbf_gammas]
    return float(cfg.rbf_gammas[int(np.argmax(scores))])


def run_one(method: str, task: SetTask, cfg: Any, seed: int, test: SetBatch) -> dict[str, Any]:
    """Train (or tune) ``method`` on ``task`` with ``seed`` and score it on ``test``: one row of the study."""
    start = time.perf_counter()
    extra: dict[str, Any] = {}
    if method == "rbf":
        c = choose_rbf(task, cfg, seed)
        kernels, extra["rbf_c"], steps = rbf_kernels(test.x, c), c, 0
    else:
        model, losses = train_set_model(method, task, cfg, seed)
        kernels, steps = model.kernels(test.x), cfg.steps
        extra["final_loss"] = float(np.mean(losses[-max(1, len(losses) // 10):]))
    scores = score_kernels(kernels, test.labels.numpy(), cfg.k_max, seed)
    return {"dataset": task.name, "method": method, "seed": seed, "steps": steps, **scores, **extra,
            "seconds": round(time.perf_counter() - start, 3)}


# A spawned worker imports torch and scikit-learn before its first cell (3-4 s on a 2-core machine, as the theory
# grid's), the time of ~400 training steps of the study's models (the default's 7,200 steps: 65.5 s in one process,
# benchmarks/bench_sets.py). Below this many steps in all, the pool costs more than it saves.
POOL_MIN_STEPS = 2000


def run_cell(cfg: Any, name: str, seed: int, method: str) -> dict[str, Any]:
    """One data set, seed and method: its row, on one thread (small matrices). The test sets are drawn from the
    (data set, seed) alone, so every method of a seed is scored on the same sets."""
    with one_thread():
        task = make_task(name, cfg)
        return run_one(method, task, cfg, seed, task.draw(cfg.test_sets, TEST, seed))


def cell_cost(cfg: Any, name: str, method: str) -> float:
    """A cell's relative cost, to hand out the slowest first: steps × the pairs a step scores (RBF: a little)."""
    if method not in TRAINED_METHODS:
        return 1.0
    size = {"circles": cfg.circles_points, "subspaces": cfg.subspaces_size, "digits": cfg.digits_size,
            "omniglot": cfg.omniglot_size}[name]  # the elements per set
    return cfg.steps * cfg.batch_sets * size * size * (2.0 if method == "abc_additive" else 1.0)


def run_cells(cells: list[tuple[Any, str, int, str]], progress: Callable[[str], Any] | None = print,
              workers: int | None = None) -> list[dict[str, Any]]:
    """:func:`run_cell` of every (cfg, data set, seed, method) on ``workers`` spawned processes (default: one per
    usable CPU once the cells train at least :data:`POOL_MIN_STEPS` steps in all; fewer run in this process), the
    costliest first; the rows in the order of ``cells``. The rows do not depend on ``workers`` (every draw and every
    model is seeded by its cell; tests/evaluation/test_set_study.py compares)."""
    trained = sum(c[0].steps for c in cells if c[3] in TRAINED_METHODS)
    if workers is None and trained < POOL_MIN_STEPS:
        workers = 1
    workers = max(1, min(workers or usable_cpus(), len(cells)))
    done: dict[int, dict[str, Any]] = {}

    def collect(i: int, row: dict[str, Any]) -> None:
        done[i] = row
        if progress:
            progress(f"[sets] {row['dataset']:<9} {row['method']:<18} seed {row['seed']}: ARI {row['ari_known']:.3f} "
                     f"(k known), {row['ari_unknown']:.3f} (k̂, |k̂-k| {row['k_error']:.2f}) in {row['seconds']:.1f} s "
                     f"({len(done)}/{len(cells)})")

    order = sorted(range(len(cells)), key=lambda i: -cell_cost(cells[i][0], cells[i][1], cells[i][3]))
    spawned_map(run_cell, cells, workers, collect, order=order)
    return [done[i] for i in range(len(cells))]


def run_study(cfg: Any, progress: Callable[[str], Any] | None = print,
              workers: int | None = None) -> list[dict[str, Any]]:
    """Every data set × seed × method of ``cfg`` (a :class:`pipeline.config.sets.SetsConfig`): the rows, in that
    order, each a :func:`run_cell` (:func:`run_cells`: on a process per CPU once the study is large enough)."""
    cells = [(cfg, name, seed, method) for name in cfg.datasets for seed in cfg.seeds for method in cfg.methods]
    return run_cells(cells, progress, workers)


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """{dataset: {method: {metric: mean, metric_sd: sd over seeds (ddof 1; NaN with one seed), seeds, steps}}}."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for row in rows:
        out.setdefault(row["dataset"], {}).setdefault(row["method"], {})
    for name, methods in out.items():
        for method in methods:
            mine = [r for r in rows if r["dataset"] == name and r["method"] == method]
            entry: dict[str, float] = {"seeds": len(mine), "steps": mine[0]["steps"]}
            for m in METRICS:
                v = np.array([r[m] for r in mine], dtype=float)
                entry[m] = float(v.mean())
                entry[f"{m}_sd"] = float(v.std(ddof=1)) if v.size > 1 else math.nan
            methods[method] = entry
    return {name: {m: out[name][m] for m in SET_METHODS if m in out[name]} for name in out}
