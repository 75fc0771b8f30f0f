"""Backbones: the encoder that turns one input into one embedding row for the TransFusion head.

Every backbone maps (n, *input_shape) -> (n, embed_dim). Names:
- ``pixels``: flatten only (paper Fig. 4 runs the blocks directly on 784-d pixels); embed_dim = prod(shape).
- ``mlp``: Flatten → Linear → ReLU → Linear → LayerNorm.
- ``cnn_small``: three 3×3 conv layers with GroupNorm, global average pool, Linear, LayerNorm; for 8×8
  digits and 32×32 images. GroupNorm: a sample's embedding never depends on the rest of its batch, which also
  makes gradient caching exact.
- ``resnet18_cifar``: torchvision ResNet-18 with the CIFAR stem (3×3 conv, stride 1, no max-pool), fc
  replaced by Flatten + LayerNorm(512) as in Appendix E; the paper's Tables 1-2 backbone.
- ``resnet18``: torchvision ResNet-18 (ImageNet stem), fc → Flatten + LayerNorm(512); optional weights
  from a local file (``model.weights``), loaded with ``weights_only=True``; never downloaded.

Distributed training equals single-process training on the global batch for every backbone: the BatchNorm
ones (resnet18_cifar, resnet18) get global BatchNorm when the world size is > 1 (``pipeline.core.batchnorm``,
applied by ``PretrainLoop``: statistics over all 2B rows of all workers, running statistics identical on
every rank; the modules built here stay plain ``nn.BatchNorm2d``, so checkpoints load into them). Gradient
caching is refused with BatchNorm (``train.grad_cache_chunk``), where it cannot be exact.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

BACKBONE_NAMES = ("pixels", "mlp", "cnn_small", "resnet18_cifar", "resnet18")
FIXED_DIMS = {"resnet18_cifar": 512, "resnet18": 512}


def natural_embed_dim(name: str, input_shape: tuple[int, ...], embed_dim: int | None) -> int:
    """The embedding width a backbone produces (``embed_dim`` only applies to mlp and cnn_small)."""
    if name == "pixels":
        return math.prod(input_shape)
    if name in FIXED_DIMS:
        return FIXED_DIMS[name]
    return embed_dim or 128


def _resnet18(stem: str, in_channels: int, weights: str | Path | None) -> nn.Module:
    from torchvision.models import resnet18

    net = resnet18(weights=None)
    if weights is not None:
        state = torch.load(weights, map_location="cpu", weights_only=True)
        net.load_state_dict(state)
    if stem == "cifar":
        net.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        net.maxpool = nn.Identity()
    elif in_channels != 3:
        net.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    net.fc = nn.Sequential(nn.Flatten(), nn.LayerNorm(512))
    return net


def build_backbone(
    name: str,
    input_shape: tuple[int, ...],
    embed_dim: int | None = None,
    hidden_dim: int = 256,
    weights: str | Path | None = None,
) -> tuple[nn.Module, int]:
    """Build backbone ``name`` for inputs of ``input_shape`` (without the batch dim).

    Returns ``(module, out_dim)``; the module maps (n, *input_shape) -> (n, out_dim).
    """
    out_dim = natural_embed_dim(name, input_shape, embed_dim)
    n_in = math.prod(input_shape)
    if name == "pixels":
        return nn.Flatten(), out_dim
    if name == "mlp":
        net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(n_in, hidden_dim),
            nn.ReLU(),
            nn.Linear(hidden_dim, out_dim),
            nn.LayerNorm(out_dim),
        )
        return net, out_dim
    if name in ("cnn_small", "resnet18_cifar", "resnet18") and len(input_shape) != 3:
        raise ValueError(f"backbone {name!r} needs image inputs (C, H, W), got shape {tuple(input_shape)}")
    if name == "cnn_small":
        c = input_shape[0]
        net = nn.Sequential(
            nn.Conv2d(c, 32, 3, padding=1),
            nn.GroupNorm(8, 32),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.GroupNorm(8, 64),
            nn.ReLU(),
            nn.MaxPool2d(2) if min(input_shape[1:]) >= 8 else nn.Identity(),
            nn.Conv2d(64, 128, 3, padding=1),
            nn.GroupNorm(8, 128),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(128, out_dim),
            nn.LayerNorm(out_dim),
        )
        return net, out_dim
    if name == "resnet18_cifar":
        return _resnet18("cifar", input_shape[0], weights), out_dim
    if name == "resnet18":
        return _resnet18("imagenet", input_shape[0], weights), out_dim
    raise ValueError(f"unknown backbone {name!r}; allowed: {', '.join(BACKBONE_NAMES)}")
