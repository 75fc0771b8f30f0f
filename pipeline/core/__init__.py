"""The pure core: TransFusion's blocks and head (``model``), one block's fusion for some of its rows, dense or over
column tiles (``attention``), the losses (``losses``; the pairwise ones' one implementation, over column tiles, dense
being one tile: ``tiled_losses``) and their target affinities, the head's path by memory (``plan``: dense or tiled,
per worker), the backbones, exact global BatchNorm, the optimizers and spectral clustering; ABC, Attention-Based
Clustering's head and its BCE (``abc``).

Plain torch, NumPy and scikit-learn: nothing here imports Ray, MLflow, DVC or matplotlib, nor any other package of
``pipeline`` but the ground floor (``pipeline.config``, ``pipeline.io``, ``pipeline.host``).
"""
