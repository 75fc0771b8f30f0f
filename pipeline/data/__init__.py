"""Data: the source readers (digits, the synthetic union of subspaces, CIFAR-10, Fashion-MNIST, image folders),
the prepared ``.npy`` format the ``prepare`` stage writes and every later stage reads, the batch augmentation, and
attention-based clustering's instances: its circles problem (``synthetic``) and sets of k classes (``sets``).

May import the ground floor (``pipeline.config``, ``pipeline.io``, ``pipeline.host``) only: the ``prepare`` stage
depends on this package and the ground floor, so editing a loss, a probe or the training code never re-runs it.
"""
