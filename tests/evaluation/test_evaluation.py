"""Embeddings of every layer: batches of the trained size, original order restored."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.core.backbones import build_backbone
from pipeline.core.model import TransFusion, TransFusionHead
from pipeline.evaluation.evaluate import layer_affinities, layer_embeddings


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


def test_chunks_have_nearly_equal_sizes():
    sizes = [len(c) for c in torch.tensor_split(torch.arange(103), round(103 / 25))]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("depth,truncated,names", [
    (0, False, ["backbone"]),
    (2, False, ["backbone", "block_1", "block_2", "output"]),
    (2, True, ["backbone", "block_1", "block_2"]),
])
def test_affinity_layers(depth, truncated, names):
    x = torch.rand(9, 12)
    named = layer_affinities(model(depth, truncated), x, torch.device("cpu"))
    assert [n for n, _ in named] == names
    for _, a in named:
        assert a.shape == (9, 9) and np.all(np.diag(a) == 0) and np.all(a >= 0)
