"""The evaluate stage's work: frozen embeddings of every layer, probes, cluster quality, figures.

Representations probed (paper section 5, and Fig. 4 for the layers):
``input`` (raw pixels, the baseline that shows what pretraining bought), ``backbone`` (the encoder's
output, what the paper's tables probe; before the projector of ``model.projector``, as SimCLR probes), ``block_1`` …
``block_D`` (each TransFusion block's fused output); for an ABC model (``model.method: abc``) ``embedding`` (its
head's T(X), the last SAB's output) instead of the blocks, its kernel κ as the final affinity, and its kernel's
statistics as its health (``pipeline.evaluation.health``).

TransFusion mixes the samples of a batch, so a block's output for a sample depends on its batch mates.
Embeddings are therefore computed on batches of the trained size (``train.batch_size``), drawn by a
fixed seeded permutation and split into nearly equal chunks (no runt last batch), then put back in order.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import numpy as np
import torch

from pipeline.config.model import ModelConfig
from pipeline.config.params import Params
from pipeline.config.probe import ProbeConfig
from pipeline.core.clustering import cosine_affinity, spectral_scores, symmetric_affinity
from pipeline.core.model import ABCModel, Rows, TransFusion, build_model, memory_format
from pipeline.core.plan import budget_bytes, plan_head
from pipeline.data.prepared import load_prepared
from pipeline.data.split import stratified_subset, to_float
from pipeline.data.types import Dataset
from pipeline.evaluation.health import QKAffinity, block_stats, head_health, kernel_health, read_health
from pipeline.evaluation.probes import run_probes
from pipeline.host import device_memory
from pipeline.io import load_torch
from pipeline.theory.measures import affinity_contrast, quantile_sharpness, sharpness


class PretrainedConfig(TypedDict):
    """``models/pretrain/config.json``: what the pretrain stage writes beside ``model.pt``."""

    params: dict[str, Any]  # the resolved params (Params.model_dump())
    input_shape: list[int]
    n_classes: int
    run_name: str
    mlflow_run_id: str | None


def load_pretrained(models_dir: Path) -> tuple[TransFusion | ABCModel, PretrainedConfig]:
    """The model written by the pretrain stage, rebuilt from its resolved params; weights_only loading."""
    config = json.loads((models_dir / "config.json").read_text())
    abc = config["params"]["model"].get("abc")
    if isinstance(abc, dict):  # a model saved before model.abc.set_norm existed was trained without it
        abc.setdefault("set_norm", False)
    model = build_model(ModelConfig.model_validate(config["params"]["model"], strict=False),
                        tuple(config["input_shape"]))
    model.load_state_dict(load_torch(models_dir / "model.pt"))
    return model.eval(), config


def resolve_device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def eval_tile(model: TransFusion | ABCModel, n: int, device: torch.device) -> int | None:
    """The column tile for fusing ``n`` rows at once on ``device``, or None (dense): the training plan's choice
    (``pipeline.core.plan``, its default budget) for a global batch of n rows on one worker. None for ABC (its
    additive similarity tiles itself)."""
    if model.method == "abc":
        return None
    head = model.head
    budget = budget_bytes(None, device_memory(device))
    return plan_head(n, 1, head.depth - int(head.truncate_last), model.head_dim, budget).tile


@torch.no_grad()
def layer_embeddings(model: TransFusion | ABCModel, x: torch.Tensor, batch_size: int, device: torch.device,
                     seed: int = 0) -> list[np.ndarray]:
    """[backbone, block_1, ..., block_D] embeddings of x, each (N, m), on batches of ~batch_size (fused over
    column tiles where a dense batch of that size would not fit: :func:`eval_tile`)."""
    n = x.shape[0]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    chunks = torch.tensor_split(perm, max(1, round(n / batch_size)))
    parts: list[list[torch.Tensor]] = []
    tile = eval_tile(model, max(len(c) for c in chunks), device)
    for idx in chunks:
        reps = model.embed(to_float(x[idx]).to(device), tile=tile)
        parts.append([r.float().cpu() for r in reps])
    out = []
    inverse = torch.argsort(torch.cat(chunks))
    for layer in range(len(parts[0])):
        out.append(torch.cat([p[layer] for p in parts])[inverse].numpy())
    return out


@torch.no_grad()
def layer_affinities(model: TransFusion | ABCModel, x: torch.Tensor,
                     device: torch.device) -> list[tuple[str, np.ndarray]]:
    """The affinities of one test batch: backbone cosine, each block's act(QKᵀ), and the trained one (ABC: its
    kernel κ, the batch as one set)."""
    if model.method == "abc":
        z = model.encode(to_float(x).to(device))  # (n, m): the backbone's output (ABC has no projector)
        return [("backbone", cosine_affinity(z.float().cpu().numpy())),
                ("kernel", model.head(z).kernel.float().cpu().numpy())]
    out = model(to_float(x).to(device), collect=True)
    named = [("backbone", cosine_affinity(out.hidden[0].float().cpu().numpy()))]
    named += [(f"block_{i + 1}", a.float().cpu().numpy()) for i, a in enumerate(out.affinities)]
    if not model.head.truncate_last and model.head.depth > 0:
        named.append(("output", cosine_affinity(out.embedding.float().cpu().numpy())))
    return named


@torch.no_grad()
def test_health(model: TransFusion | ABCModel, x: torch.Tensor, y: torch.Tensor, batch_size: int, device: torch.device,
                seed: int = 0) -> dict[str, dict[str, float | None]]:
    """Per-block health (``pipeline.evaluation.health``) on one stratified test batch of the trained size, one view per
    image (as at test time: ``other_view`` is n/a). x (N, ...) uint8, y (N,) -> {"block_1": {...}, ...}. ABC: its
    kernel's statistics on that batch, ``{"kernel": {"same_class": ..., "other": ..., "above_half": ...}}``."""
    abc = model.method == "abc"
    if not abc and model.head.depth == 0:
        return {}
    k = min(batch_size, len(y))
    sub = stratified_subset(y, k, seed=seed) if k < len(y) else torch.arange(len(y))
    if abc:
        kappa = model(to_float(x[sub]).to(device)).kernel  # (k, k)
        return read_health(kernel_health(kappa, y[sub].to(device)))
    tile = eval_tile(model, k, device)
    if tile is None:
        out = model(to_float(x[sub]).to(device), collect=True)
        return head_health([a.float().cpu() for a in out.affinities], y[sub])
    # the (k, k) affinities would not fit: the blocks over tiles, each affinity a row slice at a time
    stats = {}
    labels = y[sub].to(device)

    def take(i: int, q: torch.Tensor, keys: torch.Tensor) -> None:
        a = QKAffinity(q[None], keys[None], model.head.blocks[i].activation)
        stats[f"block_{i + 1}"] = block_stats(a, labels)

    z = model.encode(to_float(x[sub]).to(device))  # the head's input: the projector's output
    model.head.forward_rows(z, Rows.whole(len(z), z.device), tile=tile, on_block=take)
    return read_health(stats)


def layer_clusters(reps: list[np.ndarray], names: list[str], labels: np.ndarray,
                   seed: int = 0) -> dict[str, dict[str, float | None]]:
    """How well each representation's test embeddings cluster by class (the paper's Figure 4, in numbers).

    For each representation z (n, d) of the same n test samples:
    - ``nmi`` / ``ari``: spectral clustering of its cosine affinity ``max(cos(z_i, z_j), 0)``
      (``clustering.spectral_scores`` with the number of classes), scored against the labels;
    - ``silhouette``: the mean cosine silhouette ``(b_i - a_i) / max(a_i, b_i)``, a_i the mean cosine distance to
      the sample's own class, b_i to the nearest other class (sklearn's ``silhouette_score``): 1 = condensed classes,
      0 = overlapping, < 0 = mixed; None (n/a) with one class. Only the ranking of ``cos`` enters nmi; silhouette
      also sees the spread.
    labels (n,) -> {name: {"nmi", "ari", "silhouette"}}.
    """
    from sklearn.metrics import silhouette_score

    out = {}
    for name, z in zip(names, reps, strict=True):
        z = np.asarray(z, dtype=np.float64).reshape(len(z), -1)  # (n, d)
        scores = spectral_scores(cosine_affinity(z), labels, seed=seed)
        sil = float(silhouette_score(z, labels, metric="cosine")) if len(set(labels.tolist())) > 1 else None
        out[name] = {"nmi": scores["nmi"], "ari": scores["ari"], "silhouette": sil}
    return out


@dataclass
class Evaluation:
    metrics: dict[str, Any] = field(default_factory=dict)
    probe_rows: list[dict[str, Any]] = field(default_factory=list)
    sharpness_rows: list[dict[str, Any]] = field(default_factory=list)
    tsne: tuple[list[np.ndarray], np.ndarray, list[str]] | None = None

    def flat_metrics(self) -> dict[str, float]:
        """The finite numbers of :attr:`metrics` under flat names, as MLflow logs them: ``<rep>.<probe>.<pct>pct``,
        ``spectral.*``, ``layers.<rep>.*``, ``sharpness.*``, ``sharpness_q10.*``, ``health.<block>.*``."""
        m, out = self.metrics, {}
        for rep, by_probe in m["probes"].items():
            for probe, by_frac in by_probe.items():
                out |= {f"{rep}.{probe}.{round(float(f) * 100)}pct": a for f, a in by_frac.items() if a is not None}
        out |= {f"spectral.{k}": v for k, v in m["spectral"].items() if isinstance(v, float)}
        out |= {f"layers.{rep}.{k}": v for rep, s in m["layers"].items() for k, v in s.items()
                if v is not None and math.isfinite(v)}
        out |= {f"{key}.{k}": v for key in ("sharpness", "sharpness_q10") for k, v in m[key].items()
                if math.isfinite(v)}
        return out | {f"health.{b}.{k}": v for b, h in m["health"].items() for k, v in h.items() if v is not None}


def probe_train_index(p: ProbeConfig, y: torch.Tensor) -> np.ndarray:
    """The training samples the probes fit on: all of them, or a stratified ``probe.max_train`` of them (seeded by
    ``probe.seed``)."""
    if p.max_train is not None and len(y) > p.max_train:
        return np.asarray(stratified_subset(y, p.max_train, seed=p.seed))
    return np.arange(len(y))


def probe_frozen(params: Params, data: Dataset, model: TransFusion | ABCModel | None = None
                 ) -> tuple[dict[str, float], int]:
    """``probe.probes`` on the frozen backbone's embeddings (``model`` None: on the flattened input pixels), fitted on
    100 % of the :func:`probe_train_index` labels, scored on the test split: a tables row's, or a control's, numbers.
    Returns ({probe: test accuracy}, number of probe training samples)."""
    p = params.probe
    idx = probe_train_index(p, data.train.y)
    if model is None:
        z_tr, z_te = (to_float(x).flatten(1).numpy() for x in (data.train.x[idx], data.test.x))
    else:
        device = resolve_device(p.device)
        model = model.to(device, memory_format=memory_format(params.train.memory_format, data.input_shape)).eval()
        batch = params.train.batch_size
        z_tr = layer_embeddings(model, data.train.x[idx], batch, device, p.seed)[0]  # [0]: the backbone
        z_te = layer_embeddings(model, data.test.x, batch, device, p.seed)[0]
    results = run_probes(z_tr, data.train.y[idx].numpy(), z_te, data.test.y.numpy(), probes=tuple(p.probes),
                         fractions=(1.0,), seed=p.seed)
    return {r.probe: r.accuracy for r in results}, len(idx)


def evaluate(params: Params, data: Dataset, model: TransFusion | ABCModel, train_batch: int,
             progress: Callable[[str], None] = print) -> Evaluation:
    """Probe every representation at every label fraction; cluster and sharpness on the test affinity."""
    p = params.probe
    device = resolve_device(p.device)
    model = model.to(device, memory_format=memory_format(params.train.memory_format, data.input_shape))
    train_idx = probe_train_index(p, data.train.y)
    x_tr, y_tr = data.train.x[train_idx], data.train.y[train_idx].numpy()
    x_te, y_te = data.test.x, data.test.y.numpy()

    t0 = time.perf_counter()
    reps_tr = layer_embeddings(model, x_tr, train_batch, device, p.seed)
    reps_te = layer_embeddings(model, x_te, train_batch, device, p.seed)
    embed_seconds = time.perf_counter() - t0
    names = ["input", "backbone"] + (["embedding"] if model.method == "abc" else
                                     [f"block_{i}" for i in range(1, len(reps_tr))])
    reps_tr = [to_float(x_tr).reshape(len(x_tr), -1).numpy()] + reps_tr
    reps_te = [to_float(x_te).reshape(len(x_te), -1).numpy()] + reps_te

    ev = Evaluation()
    probes: dict[str, dict[str, dict[str, float]]] = {}
    for name, ztr, zte in zip(names, reps_tr, reps_te, strict=True):
        progress(f"[evaluate] probing {name} ({ztr.shape[1]}-d)")
        results = run_probes(ztr, y_tr, zte, y_te, probes=p.probes, fractions=p.label_fractions, seed=p.seed,
                             progress=lambda line, n=name: progress(f"[evaluate]   {n}: {line}"))
        for r in results:
            probes.setdefault(name, {}).setdefault(r.probe, {})[f"{r.fraction:g}"] = r.accuracy
            ev.probe_rows.append({"representation": name, "probe": r.probe, "fraction": r.fraction,
                                  "accuracy": r.accuracy, "seconds": r.seconds, "n_train": r.n_train})

    # cluster quality and sharpness on one test batch
    k = min(p.affinity_points, len(y_te))
    sub = stratified_subset(data.test.y, k, seed=p.seed)  # (k,) numpy indices
    named = layer_affinities(model, x_te[sub], device)
    labels = y_te[sub]
    for layer, a in named:
        ev.sharpness_rows.append({"layer": layer, "sharpness": sharpness(a, labels),
                                  "sharpness_q10": quantile_sharpness(a, labels, 0.1),
                                  "contrast": affinity_contrast(a, labels)})
    health = test_health(model, x_te, data.test.y, train_batch, device, p.seed)
    final_name, final = named[-1]
    clusters = spectral_scores(symmetric_affinity(final), labels, seed=p.seed)
    progress(f"[evaluate] clustering each representation of {len(sub)} test samples")
    layers = layer_clusters([r[sub] for r in reps_te], names, labels, seed=p.seed)

    ev.metrics = {
        "probes": probes,
        "spectral": {"affinity": final_name, **clusters},
        "layers": layers,
        "sharpness": {r["layer"]: r["sharpness"] for r in ev.sharpness_rows},
        "sharpness_q10": {r["layer"]: r["sharpness_q10"] for r in ev.sharpness_rows},
        "contrast": {r["layer"]: r["contrast"] for r in ev.sharpness_rows},
        "health": health,
        "embed_seconds": embed_seconds,
        "n_probe_train": int(len(y_tr)),
        "n_test": int(len(y_te)),
    }
    if p.tsne_points:
        m = min(p.tsne_points, len(y_te))
        pick = stratified_subset(data.test.y, m, seed=p.seed)
        ev.tsne = ([r[pick] for r in reps_te], y_te[pick], names)
    return ev


def load_data(data_dir: Path) -> Dataset:
    return load_prepared(data_dir, verify=True)
