"""The ``model`` section: backbone, head and the blocks' options, with their allowed names."""

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
AFFINITY_EPS = 1e-10  # Appendix E's additive constant in the row normalisation (the model, the losses, health)

BackboneName = Literal[BACKBONE_NAMES]  # type: ignore[valid-type]
Activation = Literal[ACTIVATIONS]  # type: ignore[valid-type]
BlockNorm = Literal[BLOCK_NORMS]  # type: ignore[valid-type]
FusionScope = Literal[FUSION_SCOPES]  # type: ignore[valid-type]
QkInit = Literal[QK_INITS]  # type: ignore[valid-type]
HeadName = Literal[HEADS]  # type: ignore[valid-type]


class ModelConfig(Section):
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

    @model_validator(mode="after")
    def _consistent(self) -> ModelConfig:
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


__all__ = [
    "ACTIVATIONS",
    "AFFINITY_EPS",
    "BACKBONE_NAMES",
    "BATCHNORM_BACKBONES",
    "BLOCK_NORMS",
    "FIXED_DIMS",
    "FUSION_SCOPES",
    "HEADS",
    "IMAGE_BACKBONES",
    "ModelConfig",
    "QK_INITS",
]
