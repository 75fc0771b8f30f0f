"""The pure core: TransFusion's blocks and head (``model``), the backbones, exact global BatchNorm, the losses and
their target affinities, the optimizers and spectral clustering.

Plain torch, NumPy and scikit-learn: nothing here imports Ray, MLflow, DVC or matplotlib, nor any other package of
``pipeline`` but the ground floor (``pipeline.config``, ``pipeline.io``, ``pipeline.host``).
"""
