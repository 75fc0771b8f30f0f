"""Evaluation of a frozen model: probes (FFN, SVM, kNN, logistic regression), the online kNN, fusion health of
every block, layer embeddings and affinities (``evaluate``), figures and the Markdown report.

May import the ground floor, ``pipeline.core``, ``pipeline.data`` and ``pipeline.theory``; never Ray or MLflow.
"""
