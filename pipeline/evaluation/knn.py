"""k-nearest-neighbour classification on embeddings, the usual monitor of self-supervised pretraining.

Cosine similarity between L2-normalised embeddings, top-k neighbours among the training embeddings, then either a
plain majority vote or the temperature-weighted vote of the InstDisc / SimCLR kNN monitor (Wu et al. 2018)::

    s_ij   = <z_i / ||z_i||, x_j / ||x_j||>                        (test i, train j)
    N_k(i) = the k training points with the largest s_ij
    vote_i(c) = sum_{j in N_k(i), y_j = c} w_ij,   w_ij = 1  or  exp(s_ij / T)
    pred_i = argmax_c vote_i(c)                                    (ties -> smallest label)

Test points are processed in chunks so memory stays O(chunk * n_train). Which of several neighbours with exactly
equal similarity is kept at the k-th place is up to ``torch.topk``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["knn_accuracy", "knn_predict"]


@torch.no_grad()
def knn_predict(
    train_z: Tensor,
    train_y: Tensor,
    test_z: Tensor,
    k: int = 20,
    n_classes: int | None = None,
    temperature: float | None = None,
    chunk: int = 1024,
) -> Tensor:
    """Predict test labels by a k-NN vote over cosine similarities (equations in the module docstring).

    Majority vote (``temperature=None``): every neighbour votes 1 for its label; ties go to the smallest label
    (scatter-add of ones, then ``argmax``, which returns the first maximum). Weighted vote: neighbour ``j`` votes
    ``exp(s_ij / T)``; it is computed as ``exp((s_ij - max_j' s_ij') / T)`` over the chosen neighbours, the same
    vote up to a positive per-row factor, so a small ``T`` cannot overflow.

    Args:
        train_z: (n_train, d) training embeddings (need not be normalised).
        train_y: (n_train,) integer labels in [0, n_classes).
        test_z: (n_test, d) test embeddings, same device as ``train_z``.
        k: number of neighbours (>= 1); ``k > n_train`` uses all ``n_train`` points.
        n_classes: number of classes; default ``max(train_y) + 1``.
        temperature: ``T`` > 0 for the weighted vote, None for the majority vote.
        chunk: number of test points per similarity block (>= 1).

    Returns:
        (n_test,) int64 predicted labels on ``test_z.device``.
    """
    if train_z.ndim != 2 or test_z.ndim != 2:
        raise ValueError(f"train_z and test_z must be 2-d, got {tuple(train_z.shape)} and {tuple(test_z.shape)}")
    if train_z.shape[1] != test_z.shape[1]:
        raise ValueError(f"embedding dims differ: train {train_z.shape[1]} vs test {test_z.shape[1]}")
    if train_y.shape != (train_z.shape[0],):
        raise ValueError(f"train_y must have shape ({train_z.shape[0]},), got {tuple(train_y.shape)}")
    if train_z.shape[0] == 0:
        raise ValueError("knn_predict: empty training set")
    if train_y.dtype.is_floating_point or train_y.dtype.is_complex or train_y.dtype == torch.bool:
        raise ValueError(f"train_y must hold integer labels, got dtype {train_y.dtype}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if temperature is not None and temperature <= 0:
        raise ValueError(f"temperature must be > 0 or None, got {temperature}")

    device = train_z.device
    labels = train_y.to(device=device, dtype=torch.int64)  # (n_train,)
    if int(labels.min()) < 0:
        raise ValueError("train_y must be non-negative")
    max_label = int(labels.max())
    if n_classes is None:
        n_classes = max_label + 1
    elif max_label >= n_classes:
        raise ValueError(f"train_y has label {max_label} >= n_classes={n_classes}")

    dtype = torch.promote_types(train_z.dtype, test_z.dtype)
    if not dtype.is_floating_point:
        dtype = torch.get_default_dtype()
    train_n = F.normalize(train_z.to(dtype), dim=1)  # (n_train, d)
    test_n = F.normalize(test_z.to(device=device, dtype=dtype), dim=1)  # (n_test, d)
    k_eff = min(k, train_n.shape[0])

    preds = []
    for start in range(0, test_n.shape[0], chunk):
        sim = test_n[start : start + chunk] @ train_n.T  # (c, n_train)
        top_sim, top_idx = sim.topk(k_eff, dim=1)  # (c, k), sorted descending
        top_lab = labels[top_idx]  # (c, k)
        if temperature is None:
            weight = torch.ones_like(top_sim)  # (c, k)
        else:
            weight = ((top_sim - top_sim[:, :1]) / temperature).exp()  # (c, k), in (0, 1]
        votes = torch.zeros(top_sim.shape[0], n_classes, dtype=dtype, device=device)  # (c, C)
        votes.scatter_add_(1, top_lab, weight)
        preds.append(votes.argmax(dim=1))  # (c,)
    if not preds:
        return torch.empty(0, dtype=torch.int64, device=test_z.device)
    return torch.cat(preds).to(test_z.device)


@torch.no_grad()
def knn_accuracy(
    train_z: Tensor,
    train_y: Tensor,
    test_z: Tensor,
    test_y: Tensor,
    k: int = 20,
    **kw,
) -> float:
    """Fraction of test points whose :func:`knn_predict` label equals ``test_y``.

    ``acc = (1 / n_test) * sum_i [pred_i == test_y_i]``.

    Args:
        train_z: (n_train, d) training embeddings.
        train_y: (n_train,) integer labels.
        test_z: (n_test, d) test embeddings, n_test >= 1.
        test_y: (n_test,) integer labels.
        k: number of neighbours.
        **kw: ``n_classes``, ``temperature``, ``chunk`` of :func:`knn_predict`.

    Returns:
        Accuracy in [0, 1] as a python float.
    """
    if test_y.shape != (test_z.shape[0],):
        raise ValueError(f"test_y must have shape ({test_z.shape[0]},), got {tuple(test_y.shape)}")
    if test_z.shape[0] == 0:
        raise ValueError("knn_accuracy: empty test set")
    pred = knn_predict(train_z, train_y, test_z, k=k, **kw)  # (n_test,)
    return (pred == test_y.to(device=pred.device, dtype=torch.int64)).double().mean().item()
