"""The ``model`` section: backbone, the method (TransFusion or ABC) and its head's options, with their allowed names.

``method: transfusion`` (default) puts TransFusion's head (``depth`` blocks, ``activation``, ...) on the backbone;
``method: abc`` puts ABC's (Attention-Based Clustering, :mod:`pipeline.core.abc`) instead, configured by the ``abc``
subsection. Each method refuses the other's keys set away from their defaults, naming them. ``projector`` (ours, any
loss; ``none`` under ``abc``, which has its own pre-embedding) sits between the backbone and the head, so that a
comparison can give every loss the same head: :func:`pipeline.core.model.build_projector`.
"""

from __future__ import annotations

from functools import cache
from typing import Literal

from pydantic import Field, field_validator, model_validator

from pipeline.config.base import Section

# the backbones of pipeline.core.backbones, and the embedding width of those whose width is fixed
BACKBONE_NAMES = ("pixels", "mlp", "cnn_small", "resnet18_cifar", "resnet18")
FIXED_DIMS = {"resnet18_cifar": 512, "resnet18": 512}
BATCHNORM_BACKBONES = ("resnet18_cifar", "resnet18")  # gradient caching is refused with these
IMAGE_BACKBONES = ("cnn_small", "resnet18_cifar", "resnet18")  # need (C, H, W) inputs
# model.backbone: torchvision:<name> for any classification model of torchvision (pipeline.core.backbones builds it,
# without weights); image backbones, fixed width (their classifier's input), BatchNorm or not by model
TORCHVISION = "torchvision:"
TORCHVISION_LIST = "torchvision.models.list_models(module=torchvision.models)"  # where the names are
TORCHVISION_KWARGS = {  # builder arguments besides weights=None: no auxiliary classifiers (their training forward
    # returns a tuple), and the initialisation torchvision has always done without its FutureWarning
    "googlenet": {"aux_logits": False, "init_weights": True},
    "inception_v3": {"aux_logits": False, "init_weights": True},
}
NO_LINEAR_CLASSIFIER = ("squeezenet1_0", "squeezenet1_1")  # a 1x1 conv classifies: no Linear for the LayerNorm
# the blocks' options (pipeline.core.model checks its arguments against them)
ACTIVATIONS = ("relu", "softmax", "sigmoid", "identity")
BLOCK_NORMS = ("layernorm", "l2", "none")
FUSION_SCOPES = ("joint", "per_view")
QK_INITS = ("default", "tied", "identity")
HEADS = ("appendix_e", "truncated")
PROJECTORS = ("none", "linear", "mlp")  # model.projector: pipeline.core.model.build_projector builds each
METHODS = ("transfusion", "abc")  # pipeline.core.model.METHODS builds each
# ABC's options (pipeline.core.abc checks its arguments against its own COMPATIBILITIES, KERNELS)
ABC_COMPATIBILITIES = ("multiplicative", "additive")
ABC_KERNELS = ("logits", "paper")
# the TransFusion head's keys, which method abc refuses away from their defaults (ABC has no such blocks)
TRANSFUSION_ONLY = ("depth", "activation", "block_norm", "head", "fusion_scope", "qk_init")
AFFINITY_EPS = 1e-10  # Appendix E's additive constant in the row normalisation (the model, the losses, health)

Activation = Literal[ACTIVATIONS]  # type: ignore[valid-type]
BlockNorm = Literal[BLOCK_NORMS]  # type: ignore[valid-type]
FusionScope = Literal[FUSION_SCOPES]  # type: ignore[valid-type]
QkInit = Literal[QK_INITS]  # type: ignore[valid-type]
HeadName = Literal[HEADS]  # type: ignore[valid-type]
ProjectorName = Literal[PROJECTORS]  # type: ignore[valid-type]
MethodName = Literal[METHODS]  # type: ignore[valid-type]
AbcCompatibility = Literal[ABC_COMPATIBILITIES]  # type: ignore[valid-type]
AbcKernel = Literal[ABC_KERNELS]  # type: ignore[valid-type]


def torchvision_names() -> list[str]:
    """The names ``torchvision:<name>`` takes: torchvision's classification models (imports torchvision)."""
    import torchvision

    return torchvision.models.list_models(module=torchvision.models)


@cache
def torchvision_facts(name: str) -> tuple[int, bool]:
    """(width, BatchNorm) of torchvision's classification model ``name``: the in_features of its last Linear (the
    classifier that ``pipeline.core.backbones`` replaces by Flatten + LayerNorm(width)) and whether it has BatchNorm.

    Built without weights on the meta device (shapes only: no memory, no initialisation; 0.01-0.6 s a model measured
    here), except the models whose builder computes with tensor values (RegNet), built on the CPU (regnet_x_400mf
    0.07 s, regnet_y_32gf 3 s, regnet_y_128gf 4 s and 3.2 GB measured here). Called only by the checks that need the
    facts (model.embed_dim set, model.abc.pre_embed: false, train.grad_cache_chunk set, `transfusion check`), once
    per process.
    """
    import torch
    from torch import nn
    from torchvision.models import get_model

    kwargs = {"weights": None, **TORCHVISION_KWARGS.get(name, {})}
    try:
        with torch.device("meta"):
            net = get_model(name, **kwargs)
    except NotImplementedError:  # "Cannot copy out of meta tensor": the builder reads a tensor's values
        net = get_model(name, **kwargs)
    width = [m for m in net.modules() if isinstance(m, nn.Linear)][-1].in_features
    return width, any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in net.modules())


def is_torchvision(backbone: str) -> bool:
    return backbone.startswith(TORCHVISION)


def image_backbone(backbone: str) -> bool:
    """True if ``backbone`` needs (C, H, W) inputs."""
    return backbone in IMAGE_BACKBONES or is_torchvision(backbone)


def batchnorm_backbone(backbone: str) -> bool:
    """True if ``backbone`` has BatchNorm (builds a torchvision model's skeleton: :func:`torchvision_facts`)."""
    if is_torchvision(backbone):
        return torchvision_facts(backbone.removeprefix(TORCHVISION))[1]
    return backbone in BATCHNORM_BACKBONES


def fixed_width(backbone: str) -> int | None:
    """The width of a backbone whose width is fixed (resnet18*, torchvision:*), else None."""
    if is_torchvision(backbone):
        return torchvision_facts(backbone.removeprefix(TORCHVISION))[0]
    return FIXED_DIMS.get(backbone)


class AbcConfig(Section):
    """``model.abc``: ABC's head (:class:`pipeline.core.abc.ABCHead`), read only with ``model.method: abc``."""

    blocks: int = Field(2, ge=0, le=64)  # SAB blocks (the paper's Omniglot: 2); 0 with additive = the pairwise ablation
    heads: int = Field(4, ge=1, le=1024)  # attention heads of each SAB
    width: int = Field(128, ge=2, le=65_536)  # the SABs' and the similarity's width
    compatibility: AbcCompatibility = "multiplicative"  # Table 1: multiplicative q·k | additive wᵀtanh(q + k)
    kernel: AbcKernel = "logits"  # logits (the code's σ(½(E + Eᵀ))) | paper (½(σ(E) + σ(Eᵀ)))
    pre_embed: bool = True  # the code's Linear–tanh–Linear after the backbone; false needs the backbone width = width
    set_norm: bool = True  # standardise each backbone feature over the set (the global batch) before the head: ours,
    # the kernel learns on a fresh backbone's features (docs/design.md#abc-as-a-method); false = the paper's maths

    @model_validator(mode="after")
    def _heads(self) -> AbcConfig:
        if self.width % self.heads:
            raise ValueError(f"model.abc.width ({self.width}) must be a multiple of model.abc.heads ({self.heads})")
        return self


class ModelConfig(Section):
    method: MethodName = "transfusion"
    backbone: str = "cnn_small"  # BACKBONE_NAMES, or torchvision:<name> (TORCHVISION)
    embed_dim: int | None = Field(None, ge=2, le=65_536)
    hidden_dim: int = Field(256, ge=2, le=65_536)
    # ours: between the backbone and the head, for any method and loss (none | linear | mlp, SimCLR's without its
    # BatchNorm: pipeline.core.model.build_projector); the probes keep reading the backbone
    projector: ProjectorName = "none"
    projector_dim: int | None = Field(None, ge=2, le=65_536)  # the projector's output width; null: the backbone's
    depth: int = Field(1, ge=0, le=64)
    activation: Activation = "relu"
    block_norm: BlockNorm = "layernorm"
    head: HeadName = "appendix_e"
    fusion_scope: FusionScope = "joint"  # joint (Appendix E) | per_view (the authors' later code)
    qk_init: QkInit = "default"  # ours: default (nn.Linear's) | tied (W_K = W_Q) | identity (W_Q = W_K = I)
    weights: str | None = None
    abc: AbcConfig = Field(default_factory=AbcConfig)

    @field_validator("backbone", mode="before")
    @classmethod
    def _known_backbone(cls, name: object) -> str:
        if not isinstance(name, str):  # e.g. `torchvision:` alone, which YAML reads as a mapping
            name = f"{name!r} ({type(name).__name__}, not a name)"
        model = name.removeprefix(TORCHVISION)
        if name in BACKBONE_NAMES or (is_torchvision(name) and model in torchvision_names()
                                      and model not in NO_LINEAR_CLASSIFIER):
            return name
        why = "unknown backbone"
        if model in NO_LINEAR_CLASSIFIER and is_torchvision(name):
            why = "its classifier is a 1x1 convolution, not the Linear a backbone's Flatten + LayerNorm replaces"
        raise ValueError(f"model.backbone: {name}: {why}; allowed: {', '.join(BACKBONE_NAMES)}, or "
                         f"{TORCHVISION}<name> for any <name> in {TORCHVISION_LIST} except "
                         f"{', '.join(NO_LINEAR_CLASSIFIER)} (built without weights; e.g. {TORCHVISION}resnet50, "
                         f"{TORCHVISION}convnext_tiny)")

    @model_validator(mode="after")
    def _consistent(self) -> ModelConfig:
        if self.method == "abc":
            self._abc_only()
        elif self.abc != AbcConfig():
            raise ValueError("model.abc: read only with model.method: abc; set model.method: abc or remove model.abc")
        if self.projector == "none" and self.projector_dim is not None:
            raise ValueError(f"model.projector_dim: {self.projector_dim} is the width of a projector, but "
                             "model.projector is none; set model.projector: linear or mlp, or model.projector_dim: "
                             "null")
        if self.head == "truncated" and self.depth == 0:
            raise ValueError("model.head: truncated needs model.depth >= 1 (its last block gives the affinity)")
        if self.backbone == "pixels" and self.depth == 0:
            raise ValueError("model.backbone: pixels with model.depth: 0 has nothing to train; use depth >= 1")
        width = None if self.embed_dim is None else fixed_width(self.backbone)
        if width is not None and self.embed_dim != width:
            raise ValueError(f"model.embed_dim: {self.backbone} produces {width}-d embeddings; "
                             f"set embed_dim to null or {width}")
        if self.backbone == "pixels" and self.embed_dim is not None:
            raise ValueError("model.embed_dim: the pixels backbone's width is the input size; set it to null")
        if self.weights is not None and self.backbone != "resnet18":
            raise ValueError("model.weights: only the resnet18 backbone loads weights from a file")
        return self

    def width(self) -> int | None:
        """The backbone's output width: fixed, or embed_dim (null: 128); None for pixels (the input's size)."""
        if self.backbone == "pixels":
            return None
        return fixed_width(self.backbone) or self.embed_dim or 128

    def head_width(self) -> int | None:
        """The width the head works at: the projector's (``projector_dim``; null: the backbone's), else the backbone's
        (:meth:`width`; None for pixels: the input's size)."""
        if self.projector != "none" and self.projector_dim is not None:
            return self.projector_dim
        return self.width()

    def _abc_only(self) -> None:
        """Method abc: the TransFusion head's keys at their defaults, no projector (ABC has its own pre-embedding);
        without the pre-embedding, widths that match."""
        if self.projector != "none":
            raise ValueError(f"model.projector: {self.projector}: method abc has its own projection before its SABs "
                             "(model.abc.pre_embed, the code's Linear-tanh-Linear); set model.projector: none with "
                             "model.method: abc")
        fields = type(self).model_fields
        bad = [f"model.{k}: {getattr(self, k)}" for k in TRANSFUSION_ONLY if getattr(self, k) != fields[k].default]
        if bad:
            defaults = ", ".join(f"model.{k}: {fields[k].default}" for k in TRANSFUSION_ONLY)
            raise ValueError(f"{'; '.join(bad)}: TransFusion's head only, but model.method is abc (ABC's head is "
                             f"model.abc.*); set them to their defaults ({defaults}) or remove them")
        if not self.abc.pre_embed:
            dim = self.width()
            if dim is None or dim != self.abc.width:
                raise ValueError(f"model.abc.pre_embed: false feeds the backbone's output to the SABs directly, so "
                                 f"its width must be model.abc.width ({self.abc.width}); {self.backbone} gives "
                                 f"{'the input size' if self.backbone == 'pixels' else dim}: set model.embed_dim "
                                 "to the width or model.abc.pre_embed: true")


__all__ = [
    "ABC_COMPATIBILITIES",
    "ABC_KERNELS",
    "ACTIVATIONS",
    "AbcConfig",
    "AFFINITY_EPS",
    "BACKBONE_NAMES",
    "BATCHNORM_BACKBONES",
    "BLOCK_NORMS",
    "FIXED_DIMS",
    "FUSION_SCOPES",
    "HEADS",
    "IMAGE_BACKBONES",
    "METHODS",
    "ModelConfig",
    "QK_INITS",
    "NO_LINEAR_CLASSIFIER",
    "PROJECTORS",
    "TORCHVISION",
    "TORCHVISION_KWARGS",
    "TORCHVISION_LIST",
    "TRANSFUSION_ONLY",
    "batchnorm_backbone",
    "fixed_width",
    "image_backbone",
    "is_torchvision",
    "torchvision_facts",
    "torchvision_names",
]
