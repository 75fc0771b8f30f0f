"""The allowed values of the TransFusion blocks' options, in one place for both their readers.

:mod:`pipeline.model` checks its constructor arguments against them and :mod:`pipeline.config` validates
``params.yaml`` against them (``model.activation``, ``model.block_norm``, ``model.fusion_scope``,
``model.qk_init``). Neither imports the other for them, so the two stay free of an import cycle. Plain data:
no imports.
"""

ACTIVATIONS = ("relu", "softmax", "sigmoid", "identity")
BLOCK_NORMS = ("layernorm", "l2", "none")
FUSION_SCOPES = ("joint", "per_view")
QK_INITS = ("default", "tied", "identity")

__all__ = ["ACTIVATIONS", "BLOCK_NORMS", "FUSION_SCOPES", "QK_INITS"]
