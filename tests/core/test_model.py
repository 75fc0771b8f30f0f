"""TransFusion block / head against slow references and Appendix E.1's code semantics."""

from __future__ import annotations

import argparse
import math
import pickle

import pytest
import torch
import torch.nn.functional as F

from pipeline.config.model import AbcConfig, ModelConfig
from pipeline.core.abc import ABCHead, ABCOutput
from pipeline.core.backbones import build_backbone
from pipeline.core.model import (
    ACTIVATIONS,
    ABCModel,
    TransFusion,
    TransFusionBlock,
    TransFusionHead,
    build_model,
    fuse_weights,
)


def naive_block(x, wq, bq, wk, bk, wv, bv, activation="relu"):
    """Eq. 2-3 with Appendix E's normalisation, one scalar at a time, in float64 (no input norm)."""
    n, m = x.shape
    x = x.double().tolist()

    def lin(w, b, row):
        return [sum(w[o][i] * row[i] for i in range(m)) + b[o] for o in range(len(b))]

    def unit(v):
        s = math.sqrt(sum(t * t for t in v))
        return [t / max(s, 1e-12) for t in v]

    W = [w.double().tolist() for w in (wq, wk, wv)]
    B = [b.double().tolist() for b in (bq, bk, bv)]
    q = [unit(lin(W[0], B[0], r)) for r in x]
    k = [unit(lin(W[1], B[1], r)) for r in x]
    v = [lin(W[2], B[2], r) for r in x]
    s = [[sum(q[i][t] * k[j][t] for t in range(m)) for j in range(n)] for i in range(n)]
    if activation == "relu":
        a = [[max(s[i][j], 0.0) for j in range(n)] for i in range(n)]
    elif activation == "softmax":
        a = [[math.exp(s[i][j]) / sum(math.exp(s[i][t]) for t in range(n)) for j in range(n)] for i in range(n)]
    elif activation == "sigmoid":
        a = [[1 / (1 + math.exp(-s[i][j])) for j in range(n)] for i in range(n)]
    else:
        a = s
    raw = [[0.0 if i == j else a[i][j] for j in range(n)] for i in range(n)]
    w = [[(raw[i][j] + 1e-10) / sum(raw[i][t] + 1e-10 for t in range(n)) for j in range(n)] for i in range(n)]
    out = [[sum(w[i][j] * v[j][c] for j in range(n)) + x[i][c] for c in range(m)] for i in range(n)]
    return torch.tensor(out, dtype=torch.float64), torch.tensor(raw, dtype=torch.float64)


def appendix_e_block(block: TransFusionBlock, x):
    """Appendix E.1 TransFusionBlock.forward, restated: no input norm, ReLU, diagonal removed, +1e-10."""
    q = F.normalize(block.query(x))
    k = F.normalize(block.key(x))
    v = block.value(x)
    attn = torch.relu(q @ k.T)
    attn = attn - torch.diag(torch.diagonal(attn))
    attn = (attn + 1e-10) / torch.sum(attn + 1e-10, dim=1, keepdim=True)
    return attn @ v + x


@pytest.mark.parametrize("n,m", [(3, 2), (5, 4), (8, 6)])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_block_matches_naive_reference(n, m, activation):
    torch.manual_seed(n * 10 + m)
    block = TransFusionBlock(m, activation=activation, norm="none").double()
    x = torch.randn(n, m, dtype=torch.float64)
    out, raw = block(x)
    ref_out, ref_raw = naive_block(x, block.query.weight, block.query.bias, block.key.weight, block.key.bias,
                                   block.value.weight, block.value.bias, activation)
    torch.testing.assert_close(out, ref_out.double(), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(raw, ref_raw.double(), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("n,m", [(4, 3), (16, 8)])
def test_block_equals_appendix_e_code(n, m):
    torch.manual_seed(0)
    block = TransFusionBlock(m, norm="none")
    x = torch.randn(n, m)
    torch.testing.assert_close(block(x)[0], appendix_e_block(block, x))


def test_layernorm_and_l2_are_applied_before_the_block():
    torch.manual_seed(1)
    x = torch.randn(6, 5) * 7 + 3
    ln = TransFusionBlock(5, norm="layernorm")
    plain = TransFusionBlock(5, norm="none")
    plain.load_state_dict({k: v for k, v in ln.state_dict().items() if not k.startswith("norm.")})
    torch.testing.assert_close(ln(x)[0], plain(F.layer_norm(x, (5,)))[0])
    l2 = TransFusionBlock(5, norm="l2")
    l2.load_state_dict(plain.state_dict())
    torch.testing.assert_close(l2(x)[0], plain(F.normalize(x, dim=-1))[0])


def test_attention_rows_sum_to_one_and_ignore_self():
    q = F.normalize(torch.rand(7, 4) + 0.1, dim=-1)  # all cosines > 0
    raw, w = fuse_weights(q, q)
    torch.testing.assert_close(w.sum(1), torch.ones(7))
    assert torch.all(torch.diagonal(raw) == 0)
    assert torch.all(torch.diagonal(w) < 1e-8)


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_head_collects_every_block(depth):
    torch.manual_seed(3)
    head = TransFusionHead(6, depth=depth)
    x = torch.randn(9, 6)
    out = head(x, collect=True)
    assert len(out.hidden) == depth + 1 and len(out.affinities) == depth
    assert out.q is out.embedding and out.k is out.embedding
    torch.testing.assert_close(out.hidden[0], x)
    h = x
    for i, block in enumerate(head.blocks):
        h, raw = block(h)
        torch.testing.assert_close(out.hidden[i + 1], h)
        torch.testing.assert_close(out.affinities[i], raw)
    if depth == 0:
        torch.testing.assert_close(out.embedding, x)


def test_truncated_head_uses_last_block_queries_and_keys():
    torch.manual_seed(4)
    head = TransFusionHead(5, depth=2, truncate_last=True)
    x = torch.randn(8, 5)
    out = head(x, collect=True)
    h, _ = head.blocks[0](x)
    last = head.blocks[1]
    q_ref = F.normalize(last.query(last.norm(h)), dim=-1)
    k_ref = F.normalize(last.key(last.norm(h)), dim=-1)
    torch.testing.assert_close(out.q, q_ref)
    torch.testing.assert_close(out.k, k_ref)
    torch.testing.assert_close(out.embedding, h)
    assert len(out.affinities) == 2 and len(out.hidden) == 2
    with pytest.raises(ValueError, match="depth >= 1"):
        TransFusionHead(5, depth=0, truncate_last=True)


@pytest.mark.parametrize("name,shape,dim", [
    ("pixels", (1, 8, 8), 64), ("mlp", (64,), 32), ("mlp", (1, 8, 8), 16), ("cnn_small", (1, 8, 8), 32),
    ("cnn_small", (3, 32, 32), 64), ("resnet18_cifar", (3, 32, 32), 512), ("resnet18", (3, 32, 32), 512),
    ("resnet18_cifar", (1, 28, 28), 512)])
def test_backbones_shapes_and_full_model(name, shape, dim):
    torch.manual_seed(5)
    bb, out_dim = build_backbone(name, shape, embed_dim=None if name.startswith(("res", "pix")) else dim)
    assert out_dim == dim
    model = TransFusion(bb, out_dim, TransFusionHead(out_dim, depth=2)).eval()
    x = torch.rand(4, *shape)
    out = model(x, collect=True)
    assert out.embedding.shape == (4, dim) and len(out.hidden) == 3
    reps = model.embed(x)
    assert [r.shape for r in reps] == [(4, dim)] * 3 and not reps[0].requires_grad


def test_resnet_fc_is_flatten_layernorm_and_cifar_stem():
    bb, _ = build_backbone("resnet18_cifar", (3, 32, 32))
    assert bb.conv1.kernel_size == (3, 3) and bb.conv1.stride == (1, 1)
    assert isinstance(bb.maxpool, torch.nn.Identity)
    assert isinstance(bb.fc[1], torch.nn.LayerNorm) and bb.fc[1].normalized_shape == (512,)


def test_resnet18_loads_local_weights_only(tmp_path):
    from torchvision.models import resnet18

    ref = resnet18(weights=None)
    torch.save(ref.state_dict(), tmp_path / "w.pt")
    bb, _ = build_backbone("resnet18", (3, 32, 32), weights=tmp_path / "w.pt")
    torch.testing.assert_close(bb.conv1.weight, ref.conv1.weight)
    # a pickle that would build an arbitrary object is refused (weights_only=True)
    torch.save({"conv1.weight": argparse.Namespace(payload="x")}, tmp_path / "evil.pt")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        build_backbone("resnet18", (3, 32, 32), weights=tmp_path / "evil.pt")


def test_cnn_small_embedding_does_not_depend_on_batch_split():
    """GroupNorm, not BatchNorm: per-sample outputs equal whatever the batch (needed for exact DDP)."""
    torch.manual_seed(6)
    bb, _ = build_backbone("cnn_small", (1, 8, 8), embed_dim=16)
    x = torch.rand(6, 1, 8, 8)
    torch.testing.assert_close(bb(x)[:3], bb(x[:3]))


# ------------------------------------------------------------------ fusion scope and Q/K initialisation
@pytest.mark.parametrize("depth", [1, 3])
@pytest.mark.parametrize("truncated", [False, True])
def test_per_view_fusion_equals_each_view_fused_alone(depth, truncated):
    torch.manual_seed(0)
    head = TransFusionHead(8, depth, truncate_last=truncated, fusion_scope="per_view").double()
    x = torch.randn(12, 8, dtype=torch.float64)  # rows [view 1 (6); view 2 (6)]
    out = head(x, collect=True, views=2)
    full = head.blocks[:-1] if truncated else head.blocks
    for half in (slice(0, 6), slice(6, 12)):  # naive: run the full blocks on one view's rows at a time
        h = x[half]
        for block in full:
            h, _ = block(h)
        torch.testing.assert_close(out.embedding[half], h)
    if truncated:  # the last block's affinity still spans both views: the loss compares all 12 rows
        assert out.affinities[-1].shape == (12, 12)
    if depth - truncated:
        assert out.affinities[0].shape == (2, 6, 6)
    joint = TransFusionHead(8, depth, truncate_last=truncated, fusion_scope="joint").double()
    joint.load_state_dict(head.state_dict())
    torch.testing.assert_close(head(x, views=1).embedding, joint(x, views=2).embedding)  # one view: same as joint
    with pytest.raises(ValueError, match="do not split"):
        head(x[:11], views=2)


def test_identity_and_tied_init_and_refused_options():
    torch.manual_seed(1)
    x = torch.randn(10, 6, dtype=torch.float64)
    block = TransFusionBlock(6, norm="none", qk_init="identity").double()
    _, raw = block(x)
    xn = F.normalize(x, dim=-1)
    want = (xn @ xn.T).clamp_min(0)
    want.fill_diagonal_(0)
    torch.testing.assert_close(raw, want)
    tied = TransFusionBlock(6, qk_init="tied").double()
    torch.testing.assert_close(tied.key.weight, tied.query.weight)
    torch.testing.assert_close(tied.key.bias, tied.query.bias)
    _, raw = tied(x)
    torch.testing.assert_close(raw, raw.T)  # Q = K: a symmetric affinity at the start
    default = TransFusionBlock(6)
    assert not torch.equal(default.key.weight, default.query.weight)
    for bad, match in [(lambda: TransFusionBlock(6, qk_init="zeros"), "qk_init"),
                       (lambda: TransFusionHead(6, 1, fusion_scope="pairs"), "fusion_scope"),
                       (lambda: TransFusionBlock(4, activation="gelu"), "allowed"),
                       (lambda: build_backbone("vit", (3, 32, 32)), "allowed"),
                       (lambda: build_backbone("cnn_small", (64,)), "image inputs")]:
        with pytest.raises(ValueError, match=match):
            bad()


# ------------------------------------------------------------------ model.method: abc
@pytest.mark.parametrize("backbone,shape,embed_dim,dim,compatibility,kernel", [
    ("mlp", (1, 6, 6), 12, 12, "multiplicative", "logits"), ("cnn_small", (1, 8, 8), None, 128, "additive", "paper"),
    ("pixels", (1, 5, 5), None, 25, "additive", "logits"), ("mlp", (1, 6, 6), 12, 12, "multiplicative", "paper")])
def test_build_model_abc_is_the_backbone_with_abcs_head(backbone, shape, embed_dim, dim, compatibility, kernel):
    cfg = ModelConfig(method="abc", backbone=backbone, embed_dim=embed_dim,
                      abc=AbcConfig(blocks=3, heads=2, width=8, compatibility=compatibility, kernel=kernel))
    torch.manual_seed(0)
    model = build_model(cfg, shape)
    assert isinstance(model, ABCModel) and isinstance(model.head, ABCHead) and model.method == "abc"
    assert model.embed_dim == dim and len(model.head.blocks) == 3 and model.head.blocks[0].heads == 2
    assert (model.head.compatibility, model.head.kernel) == (compatibility, kernel)
    assert model.head.pre[0].in_features == dim and model.head.query.in_features == 8
    x = torch.rand(7, *shape)
    out = model(x)
    assert isinstance(out, ABCOutput) and out.kernel.shape == (7, 7) and out.embedding.shape == (7, 8)
    torch.testing.assert_close(out.kernel, out.kernel.T)
    # the same numbers as the backbone and the head composed by hand
    torch.testing.assert_close(out.kernel, model.head(model.backbone(x)).kernel)
    reps = model.embed(x)  # probes: [backbone output, T(X)]
    assert [tuple(r.shape) for r in reps] == [(7, dim), (7, 8)] and not any(r.requires_grad for r in reps)
    torch.testing.assert_close(reps[1], out.embedding.detach())
    # the transfusion default builds TransFusion's head, untouched by model.abc's defaults
    assert isinstance(build_model(ModelConfig(backbone=backbone, embed_dim=embed_dim), shape).head, TransFusionHead)


@pytest.mark.parametrize("set_norm", [True, False])
def test_build_model_abc_passes_set_norm_and_pre_embed_to_the_head(set_norm):
    cfg = ModelConfig(method="abc", backbone="mlp", embed_dim=8, abc=AbcConfig(width=8, heads=2, set_norm=set_norm))
    assert AbcConfig().set_norm and build_model(cfg, (1, 4, 4)).head.set_norm is set_norm
    # without the pre-embedding the backbone's output goes to the SABs
    cfg = ModelConfig(method="abc", backbone="mlp", embed_dim=8, abc=AbcConfig(width=8, heads=2, pre_embed=False))
    model = build_model(cfg, (1, 4, 4))
    assert model.head.pre is None and model.head(torch.randn(5, 8)).kernel.shape == (5, 5)


# ------------------------------------------------------------------ model.projector
@pytest.mark.parametrize("projector,projector_dim,params", [("none", None, 0), ("linear", None, 16 * 16 + 16),
                                                            ("linear", 6, 16 * 6 + 6),
                                                            ("mlp", 6, 16 * 16 + 16 + 16 * 6 + 6)])
@pytest.mark.parametrize("truncated", [False, True])
def test_the_projector_sits_between_the_backbone_and_the_head_and_the_probes_read_the_backbone(
        projector, projector_dim, params, truncated):
    cfg = ModelConfig(backbone="mlp", embed_dim=16, hidden_dim=8, depth=2, projector=projector,
                      projector_dim=projector_dim, head="truncated" if truncated else "appendix_e")
    torch.manual_seed(0)
    model = build_model(cfg, (1, 4, 4))
    width = projector_dim or 16
    assert (model.embed_dim, model.head_dim, cfg.head_width()) == (16, width, width)
    assert sum(p.numel() for p in model.projector.parameters()) == params
    x = torch.rand(9, 1, 4, 4)
    z = model.backbone(x)  # (9, 16)
    p = z if projector == "none" else (
        model.projector(z) if projector == "linear" else
        F.linear(F.relu(F.linear(z, model.projector[0].weight, model.projector[0].bias)),
                 model.projector[2].weight, model.projector[2].bias))  # Linear, ReLU, Linear by hand
    torch.testing.assert_close(model.encode(x), p)
    out = model(x, collect=True)
    torch.testing.assert_close(out.q, model.head(p).q)  # the head reads the projector's output
    assert out.hidden[0] is not None and torch.equal(out.hidden[0], z)  # the probes read the backbone's
    dense, tiled = model.embed(x), model.embed(x, tile=4)
    assert [tuple(r.shape) for r in dense] == [(9, 16)] + [(9, width)] * (2 - int(truncated))
    for a, b in zip(dense, tiled, strict=True):
        torch.testing.assert_close(a, b)


def test_no_projector_keeps_the_state_dict_and_abc_refuses_one():
    plain = build_model(ModelConfig(backbone="mlp", embed_dim=8), (1, 4, 4))
    assert not any(k.startswith("projector.") for k in plain.state_dict())  # models saved before it load as they did
    with pytest.raises(ValueError, match="model.projector_dim: 6 is the width of a projector, but model.projector is "
                                         "none"):
        ModelConfig(projector_dim=6)
    with pytest.raises(ValueError, match="model.projector: mlp: method abc has its own projection"):
        ModelConfig(method="abc", projector="mlp", qk_init="default")
