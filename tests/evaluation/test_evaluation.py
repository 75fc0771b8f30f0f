"""Embeddings of every layer: batches of the trained size, original order restored."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pipeline.config.model import ModelConfig
from pipeline.config.params import load_params
from pipeline.core.backbones import build_backbone
from pipeline.core.clustering import cosine_affinity, spectral_scores
from pipeline.core.model import TransFusion, TransFusionHead, build_model
from pipeline.data.sources import load_dataset
from pipeline.data.split import stratified_subset, to_float
from pipeline.evaluation.evaluate import layer_affinities, layer_clusters, layer_embeddings, probe_frozen
from pipeline.evaluation.probes import run_probes
from pipeline.io import save_torch
from tests.conftest import ROOT
from tests.evaluation.test_health import assert_same_numbers


def model(depth: int, truncated: bool = False) -> TransFusion:
    torch.manual_seed(0)
    bb, dim = build_backbone("mlp", (12,), embed_dim=8, hidden_dim=16)
    return TransFusion(bb, dim, TransFusionHead(dim, depth, truncate_last=truncated)).eval()


@pytest.mark.parametrize("n,batch", [(10, 4), (25, 8), (7, 100)])
def test_embeddings_are_in_input_order_and_fused_within_chunks(n, batch):
    m = model(2)
    x = torch.rand(n, 12)
    reps = layer_embeddings(m, x, batch, torch.device("cpu"), seed=3)
    assert [r.shape for r in reps] == [(n, 8)] * 3
    np.testing.assert_allclose(reps[0], m.backbone(x).detach().numpy(), rtol=1e-5, atol=1e-6)
    # the fused output of a sample equals the head run on the chunk it was drawn in
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(3))
    chunk = torch.tensor_split(perm, max(1, round(n / batch)))[0]
    ref = m.embed(x[chunk])
    np.testing.assert_allclose(reps[2][chunk.numpy()], ref[2].numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("depth,truncated,names", [(0, False, ["backbone"]),
                                                    (2, False, ["backbone", "block_1", "block_2", "output"]),
                                                    (2, True, ["backbone", "block_1", "block_2"])])
def test_affinity_layers(depth, truncated, names):
    x = torch.rand(9, 12)
    named = layer_affinities(model(depth, truncated), x, torch.device("cpu"))
    assert [n for n, _ in named] == names
    for _, a in named:
        assert a.shape == (9, 9) and np.all(np.diag(a) == 0) and np.all(a >= 0)


@pytest.mark.parametrize("truncated", [False, True])
def test_a_batch_too_large_for_the_dense_head_is_fused_over_tiles_with_the_same_numbers(monkeypatch, truncated):
    """Where the dense head of the trained batch would not fit (``eval_tile``), embeddings and health run over column
    tiles: the same numbers as dense."""
    import pipeline.evaluation.evaluate as ev

    m = model(2, truncated)
    x, y = torch.rand(30, 12), torch.arange(30) % 3
    dense = ev.layer_embeddings(m, x, 10, torch.device("cpu")), ev.test_health(m, x, y, 12, torch.device("cpu"))
    assert ev.eval_tile(m, 12, torch.device("cpu")) is None  # 12 rows: dense
    monkeypatch.setattr(ev, "eval_tile", lambda model, n, device: 4)
    tiled = ev.layer_embeddings(m, x, 10, torch.device("cpu")), ev.test_health(m, x, y, 12, torch.device("cpu"))
    for a, b in zip(dense[0], tiled[0], strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    assert dense[1].keys() == tiled[1].keys() and len(dense[1]) == 2
    for block, h in dense[1].items():
        assert_same_numbers(tiled[1][block], h, rel=1e-5, abs=1e-7)


def test_an_abc_model_saved_before_set_norm_loads_without_it(tmp_path):
    """config.json written before ``model.abc.set_norm`` existed: the model is rebuilt as it was trained (no set
    normalisation), not with today's default; one that says set_norm keeps it."""
    from pipeline.evaluation.evaluate import load_pretrained

    m = ModelConfig.model_validate({"method": "abc", "backbone": "mlp", "qk_init": "default",
                                    "abc": {"width": 8, "heads": 2}})
    model = build_model(m, (64,))
    params = m.model_dump()
    for saved, expected in ((None, False), (True, True)):
        params["abc"].pop("set_norm", None)
        if saved is not None:
            params["abc"]["set_norm"] = saved
        (tmp_path / "config.json").write_text(json.dumps({"params": {"model": params}, "input_shape": [64]}))
        save_torch(tmp_path / "model.pt", model.state_dict())
        loaded, _ = load_pretrained(tmp_path)
        assert loaded.head.set_norm is expected


def naive_cosine_silhouette(z: np.ndarray, y: np.ndarray) -> float:
    """Rousseeuw's silhouette with the cosine distance 1 - cos, by loops over i and j."""
    n = len(z)
    unit = z / np.linalg.norm(z, axis=1, keepdims=True)
    scores = []
    for i in range(n):
        by_class: dict[int, list[float]] = {}
        for j in range(n):
            if j != i:
                by_class.setdefault(int(y[j]), []).append(1.0 - float(unit[i] @ unit[j]))
        own = by_class.get(int(y[i]), [])
        if not own:  # a class of one sample: silhouette 0 (sklearn's convention)
            scores.append(0.0)
            continue
        a = sum(own) / len(own)
        b = min(sum(d) / len(d) for c, d in by_class.items() if c != int(y[i]))
        scores.append((b - a) / max(a, b))
    return sum(scores) / n


@pytest.mark.parametrize("n,d,k", [(12, 3, 2), (30, 5, 3), (40, 8, 4)])
def test_layer_clusters_match_a_loop_reference_and_rank_condensed_classes_first(n, d, k):
    rng = np.random.default_rng(n)
    y = np.arange(n) % k
    centres = rng.normal(size=(k, d)) * 3
    tight = centres[y] + 0.1 * rng.normal(size=(n, d))  # (n, d) condensed classes
    loose = centres[y] + 3.0 * rng.normal(size=(n, d))  # (n, d) overlapping classes
    got = layer_clusters([loose, tight], ["input", "block_1"], y, seed=0)
    assert list(got) == ["input", "block_1"]
    for name, z in (("input", loose), ("block_1", tight)):
        assert got[name]["silhouette"] == pytest.approx(naive_cosine_silhouette(z, y), abs=1e-9)
        assert got[name]["nmi"] == pytest.approx(spectral_scores(cosine_affinity(z), y, seed=0)["nmi"])
    assert got["block_1"]["silhouette"] > got["input"]["silhouette"] + 0.3
    assert got["block_1"]["nmi"] == pytest.approx(1.0)


@pytest.mark.parametrize("max_train", [None, 120])
def test_probe_frozen_is_run_probes_on_the_capped_split(max_train):
    """A tables row's probes (and a control's): the stratified ``probe.max_train`` cap, then every probe at 100 % of
    those labels, on the pixels (no model) or on the backbone's embeddings; checked against the steps written out."""
    params = load_params(ROOT / "params.yaml", ["data.limit_train=300", "probe.probes=[knn50, logreg]",
                                                f"probe.max_train={'null' if max_train is None else max_train}"])
    data = load_dataset(params.data)
    idx = np.arange(300) if max_train is None else np.asarray(stratified_subset(data.train.y, max_train, seed=0))
    y_tr, y_te = data.train.y[idx].numpy(), data.test.y.numpy()
    pixels = run_probes(to_float(data.train.x[idx]).reshape(len(idx), -1).numpy(), y_tr,
                        to_float(data.test.x).reshape(len(y_te), -1).numpy(), y_te, probes=("knn50", "logreg"),
                        fractions=(1.0,), seed=0)
    assert probe_frozen(params, data) == ({r.probe: r.accuracy for r in pixels}, len(idx))
    torch.manual_seed(0)
    net = build_model(params.model, data.input_shape).eval()
    z_tr = layer_embeddings(net, data.train.x[idx], 128, torch.device("cpu"))[0]
    z_te = layer_embeddings(net, data.test.x, 128, torch.device("cpu"))[0]
    backbone = run_probes(z_tr, y_tr, z_te, y_te, probes=("knn50", "logreg"), fractions=(1.0,), seed=0)
    assert probe_frozen(params, data, net) == ({r.probe: r.accuracy for r in backbone}, len(idx))


def test_probes_embed_in_the_trainings_memory_format():
    """``train.memory_format: channels_last`` (the Fashion-MNIST presets'): a model rebuilt from its state (a tables
    trial's, the evaluate stage's) is probed in that layout too, as the loop trained it, with the same numbers."""
    params = load_params(ROOT / "params.yaml", ["data.limit_train=300", "probe.probes=[knn50]"])
    data = load_dataset(params.data)
    assert len(data.input_shape) == 3  # images: (C, H, W)
    torch.manual_seed(0)
    net = build_model(params.model, data.input_shape).eval()
    convs = [m.weight for m in net.modules() if isinstance(m, torch.nn.Conv2d)]
    assert convs
    contiguous = probe_frozen(params, data, net)
    assert all(w.is_contiguous() for w in convs)
    fmt = params.model_copy(update={"train": params.train.model_copy(update={"memory_format": "channels_last"})})
    assert probe_frozen(fmt, data, net) == contiguous
    convs = [m.weight for m in net.modules() if isinstance(m, torch.nn.Conv2d)]
    assert all(w.is_contiguous(memory_format=torch.channels_last) for w in convs)
    assert not all(w.is_contiguous() for w in convs)  # (one input channel: both layouts are the same strides)
