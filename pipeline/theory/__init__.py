"""The paper's section 3: cluster integrity ρ, sharpness S(A), the noise bounds δ and Δ, Theorem 2's γ and
Theorem 1's weights (``measures``, ``bound``), and the ``theory`` stage that sets the formula beside heads trained
on union-of-subspaces data (``experiments``, ``report``, ``figure``).

May import the ground floor, ``pipeline.core`` and ``pipeline.data``; never Ray or MLflow.
"""
