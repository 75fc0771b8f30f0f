"""The ``model`` section: backbone, the method (TransFusion or ABC) and its head's options, with their allowed names.

``method: transfusion`` (default) puts TransFusion's head (``depth`` blocks, ``activation``, ...) on the backbone;
``method: abc`` puts ABC's (Attention-Based Clustering, :mod:`pipeline.core.abc`) instead, configured by the ``abc``
subsection. Each method refuses the other's keys set away from their defaults, naming them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pipeline.config.base import Section

# the backbones of pipeline.core.backbones, and the embedding width of those whose width is fixed
BACKBONE_NAMES = ("pixels", "mlp", "cnn_small", "resnet18_cifar", "resnet18")
FIXED_DIMS = {"resnet18_cifar": 512, "resnet18": 512}
BATCHNORM_BACKBONES = ("resnet18_cifar", "resnet18")  # gradient caching is refused with these
IMAGE_BACKBONES = ("cnn_small", "resnet18_cifar", "resnet18")  # need (C, H, W) inputs
# the blocks' options (pipeline.core.model checks its arguments against them)
ACTIVATIONS = ("relu", "softmax", "sigmoid", "identity")
BLOCK_NORMS = ("layernorm", "l2", "none")
FUSION_SCOPES = ("joint", "per_view")
QK_INITS = ("default", "tied", "identity")
HEADS = ("appendix_e", "truncated")
METHODS = ("transfusion", "abc")  # pipeline.core.model.METHODS builds each
# ABC's options (pipeline.core.abc checks its arguments against its own COMPATIBILITIES, KERNELS)
ABC_COMPATIBILITIES = ("multiplicative", "additive")
ABC_KERNELS = ("logits", "paper")
# the TransFusion head's keys, which method abc refuses away from their defaults (ABC has no such blocks)
TRANSFUSION_ONLY = ("depth", "activation", "block_norm", "head", "fusion_scope", "qk_init")
AFFINITY_EPS = 1e-10  # Appendix E's additive constant in the row normalisation (the model, the losses, health)

BackboneName = Literal[BACKBONE_NAMES]  # type: ignore[valid-type]
Activation = Literal[ACTIVATIONS]  # type: ignore[valid-type]
BlockNorm = Literal[BLOCK_NORMS]  # type: ignore[valid-type]
FusionScope = Literal[FUSION_SCOPES]  # type: ignore[valid-type]
QkInit = Literal[QK_INITS]  # type: ignore[valid-type]
HeadName = Literal[HEADS]  # type: ignore[valid-type]
MethodName = Literal[METHODS]  # type: ignore[valid-type]
AbcCompatibility = Literal[ABC_COMPATIBILITIES]  # type: ignore[valid-type]
AbcKernel = Literal[ABC_KERNELS]  # type: ignore[valid-type]


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
    backbone: BackboneName = "cnn_small"
    embed_dim: int | None = Field(None, ge=2, le=65_536)
    hidden_dim: int = Field(256, ge=2, le=65_536)
    depth: int = Field(1, ge=0, le=64)
    activation: Activation = "relu"
    block_norm: BlockNorm = "layernorm"
    head: HeadName = "appendix_e"
    fusion_scope: FusionScope = "joint"  # joint (Appendix E) | per_view (the authors' later code)
    qk_init: QkInit = "default"  # ours: default (nn.Linear's) | tied (W_K = W_Q) | identity (W_Q = W_K = I)
    weights: str | None = None
    abc: AbcConfig = Field(default_factory=AbcConfig)

    @model_validator(mode="after")
    def _consistent(self) -> ModelConfig:
        if self.method == "abc":
            self._abc_only()
        elif self.abc != AbcConfig():
            raise ValueError("model.abc: read only with model.method: abc; set model.method: abc or remove model.abc")
        if self.head == "truncated" and self.depth == 0:
            raise ValueError("model.head: truncated needs model.depth >= 1 (its last block gives the affinity)")
        if self.backbone == "pixels" and self.depth == 0:
            raise ValueError("model.backbone: pixels with model.depth: 0 has nothing to train; use depth >= 1")
        if self.backbone in FIXED_DIMS and self.embed_dim not in (None, FIXED_DIMS[self.backbone]):
            raise ValueError(
                f"model.embed_dim: {self.backbone} produces {FIXED_DIMS[self.backbone]}-d embeddings; "
                f"set embed_dim to null or {FIXED_DIMS[self.backbone]}"
            )
        if self.backbone == "pixels" and self.embed_dim is not None:
            raise ValueError("model.embed_dim: the pixels backbone's width is the input size; set it to null")
        if self.weights is not None and self.backbone != "resnet18":
            raise ValueError("model.weights: only the resnet18 backbone loads weights from a file")
        return self

    def _abc_only(self) -> None:
        """Method abc: the TransFusion head's keys at their defaults; without the pre-embedding, widths that match."""
        fields = type(self).model_fields
        bad = [f"model.{k}: {getattr(self, k)}" for k in TRANSFUSION_ONLY if getattr(self, k) != fields[k].default]
        if bad:
            defaults = ", ".join(f"model.{k}: {fields[k].default}" for k in TRANSFUSION_ONLY)
            raise ValueError(f"{'; '.join(bad)}: TransFusion's head only, but model.method is abc (ABC's head is "
                             f"model.abc.*); set them to their defaults ({defaults}) or remove them")
        if not self.abc.pre_embed:
            dim = FIXED_DIMS.get(self.backbone, self.embed_dim if self.embed_dim is not None else 128)
            if self.backbone == "pixels" or dim != self.abc.width:
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
    "TRANSFUSION_ONLY",
]
