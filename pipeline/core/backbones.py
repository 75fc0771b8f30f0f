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
- ``torchvision:<name>``: any classification model of torchvision (``torchvision.models.list_models(
  module=torchvision.models)``), built with ``weights=None`` (never downloaded) and adapted as ``resnet18`` is: a
  first convolution of the input's channels where they are not 3 (the same settings, PyTorch's default
  initialisation), the classifier (the last Linear, width d = its in_features) → Flatten + LayerNorm(d). Dropout and
  stochastic depth become ``nn.Identity``: every backbone here is a function of its input and parameters (what
  distributed training's equality with one process and gradient caching's recomputation need; SimCLR-style
  pretraining uses none). ViT gets the input's side as its ``image_size``; GoogLeNet and Inception-v3 no auxiliary
  classifiers. The model must run on the input's size: a forward on the meta device (shapes only) checks it at build
  time and says what failed (ConvNeXt needs >= 32 px, Inception-v3 >= 75 px, ViT a square side divisible by its
  patch). SqueezeNet (a convolution classifies) is refused.

Distributed training equals single-process training on the global batch for every backbone: the BatchNorm
ones (resnet18_cifar, resnet18, torchvision models with BatchNorm) get global BatchNorm when the world size is > 1
(``pipeline.core.batchnorm``, applied by ``PretrainLoop``: statistics over all 2B rows of all workers, running
statistics identical on every rank; the modules built here stay plain ``nn.BatchNorm2d``, so checkpoints load into
them). Gradient caching is refused with BatchNorm (``train.grad_cache_chunk``), where it cannot be exact.
"""

from __future__ import annotations

import math
from itertools import chain
from pathlib import Path

import torch
from torch import nn

from pipeline.config.model import TORCHVISION_KWARGS

BACKBONE_NAMES = ("pixels", "mlp", "cnn_small", "resnet18_cifar", "resnet18")
FIXED_DIMS = {"resnet18_cifar": 512, "resnet18": 512}
TORCHVISION = "torchvision:"  # the prefix of a torchvision model's name


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


def _swap(net: nn.Module, old: nn.Module, new: nn.Module) -> None:
    """Register ``new`` wherever ``old`` is a child in ``net``."""
    for parent in list(net.modules()):
        for key, child in list(parent.named_children()):
            if child is old:
                setattr(parent, key, new)


def _torchvision(model: str, input_shape: tuple[int, ...]) -> tuple[nn.Module, int]:
    """torchvision's classification model ``model`` as a backbone for (n, C, H, W) inputs (see the module docstring).

    Returns ``(module, d)``: (n, C, H, W) -> (n, d), d the in_features of the model's last Linear."""
    import torchvision
    from torchvision.ops import StochasticDepth

    what = f"backbone {TORCHVISION}{model}"
    if model not in torchvision.models.list_models(module=torchvision.models):
        raise ValueError(f"unknown {what}; the names after {TORCHVISION!r} are those of "
                         "torchvision.models.list_models(module=torchvision.models)")
    what += f" on inputs of shape {tuple(input_shape)}"
    kwargs = dict(TORCHVISION_KWARGS.get(model, {}))
    if model.startswith("vit_"):
        kwargs["image_size"] = input_shape[1]  # its position embeddings are sized for one square image
    try:
        net = torchvision.models.get_model(model, weights=None, **kwargs)
    except (AssertionError, ValueError) as err:  # ViT: "Input shape indivisible by patch size!"
        raise ValueError(f"{what}: {err}") from None
    stem = next(m for m in net.modules() if isinstance(m, nn.Conv2d))  # the first convolution reads the image
    if stem.in_channels != input_shape[0]:
        _swap(net, stem, nn.Conv2d(input_shape[0], stem.out_channels, stem.kernel_size, stem.stride, stem.padding,
                                   stem.dilation, stem.groups, stem.bias is not None, stem.padding_mode))
    linears = [m for m in net.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError(f"{what}: no Linear classifier to replace (its classes come from a convolution)")
    width = linears[-1].in_features
    _swap(net, linears[-1], nn.Sequential(nn.Flatten(), nn.LayerNorm(width)))
    for m in list(net.modules()):
        if isinstance(m, (nn.modules.dropout._DropoutNd, StochasticDepth)):
            _swap(net, m, nn.Identity())
    _check_runs(net, input_shape, width, what)
    return net, width


def _check_runs(net: nn.Module, input_shape: tuple[int, ...], width: int, what: str) -> None:
    """One training-mode forward of two images on the meta device (shapes only; ``net`` itself untouched): the
    model must run on ``input_shape`` and give (2, width)."""
    meta = {k: torch.empty_like(v, device="meta") for k, v in chain(net.named_parameters(), net.named_buffers())}
    try:
        out = torch.func.functional_call(net, meta, (torch.zeros(2, *input_shape, device="meta"),))
    except NotImplementedError:  # an op without a meta kernel: the first real forward will tell
        return
    except (RuntimeError, ValueError, AssertionError, IndexError) as err:  # sizes that do not fit the model
        raise ValueError(f"{what}: the model does not run on this size ({' '.join(str(err).split())}); choose a "
                         "model for images this small or larger images") from None
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, width):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"{what}: the model's output is {got}, not (2, {width}) after its last Linear")


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
    image = name in ("cnn_small", "resnet18_cifar", "resnet18") or name.startswith(TORCHVISION)
    if image and len(input_shape) != 3:
        raise ValueError(f"backbone {name!r} needs image inputs (C, H, W), got shape {tuple(input_shape)}")
    if name.startswith(TORCHVISION):
        return _torchvision(name.removeprefix(TORCHVISION), tuple(input_shape))
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
    raise ValueError(f"unknown backbone {name!r}; allowed: {', '.join(BACKBONE_NAMES)}, {TORCHVISION}<name>")
