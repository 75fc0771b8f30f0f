"""Seeded, class-stratified choices of samples: :func:`stratified_subset` (the one subset function the pipeline
uses, for ``limit_train`` / ``limit_test``, the probes' label fractions and the figures' points), the train/test split
of the data sets without their own (:func:`split_index`, :func:`stratified_split`), the validation split held out of
the training images (:func:`holdout_index`, :func:`holdout_split`), the limits applied to a split
(:func:`limit_split`, :func:`limit_index`), and :func:`to_float`, which turns stored inputs into float32 batches.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pipeline.data.types import DatasetError, Split


def to_float(x: Tensor) -> Tensor:
    """Convert stored inputs to float32: ``uint8 -> x / 255``; floating tensors pass through as float32.

    Shapes are unchanged, e.g. ``(B, C, H, W)`` uint8 -> ``(B, C, H, W)`` float32 in [0, 1].
    """
    if x.dtype == torch.uint8:
        return x.to(torch.float32).div_(255.0)
    if x.is_floating_point():
        return x.to(torch.float32)
    raise TypeError(f"to_float expects uint8 or floating inputs, got {x.dtype}")


def stratified_subset(
    y: Any, size: int | None = None, seed: int = 0, *, fraction: float | None = None, min_per_class: int = 0,
) -> np.ndarray:
    """Sorted indices of a seeded, class-stratified subset of the labels ``y`` (N,), numpy array or torch tensor.

    How many members ``k_c`` of class c (``N_c`` of them) it keeps, given exactly one of:

    - ``size``: ``min(size, N)`` indices in all. ``k_c = max(floor(size * N_c / N), min(min_per_class, N_c))``;
      the slots left over go, one each, to the classes with the largest fractional parts of ``size * N_c / N``
      (ties: the smaller label), slots beyond ``size`` (taken by the minimum) come off the largest ``k_c``.
      ValueError if ``size`` cannot hold the minimum of every class;
    - ``fraction`` (0 < f <= 1): every class on its own, ``k_c = max(floor(f * N_c + 1/2), min(min_per_class,
      N_c))`` (round half up).

    The ``k_c`` members are the first of a permutation of the class drawn from ``np.random.default_rng(seed)``,
    classes visited in increasing label order, so a seed fixes the subset. ``size >= N`` or ``fraction == 1``
    returns ``arange(N)``.

    Returns (m,) int64 numpy indices into ``y``, ascending.
    """
    labels = np.asarray(y).reshape(-1)
    total = labels.shape[0]
    if (size is None) == (fraction is None):
        raise ValueError("stratified_subset needs exactly one of size and fraction")
    if size is not None and size < 0:
        raise ValueError(f"subset size must be >= 0, got {size}")
    if fraction is not None and not 0.0 < float(fraction) <= 1.0:  # also rejects NaN
        raise ValueError(f"label fraction must be in (0, 1], got {fraction!r}")
    if (size is not None and size >= total) or fraction == 1.0:
        return np.arange(total, dtype=np.int64)
    classes, counts = np.unique(labels, return_counts=True)  # sorted
    floor_k = np.minimum(counts, min_per_class)  # (K,) the per-class minimum
    if fraction is not None:
        quota = np.maximum(np.floor(counts * float(fraction) + 0.5).astype(np.int64), floor_k)
    else:
        if size < floor_k.sum():
            raise ValueError(f"a subset of {size} cannot hold {min_per_class} of each of the {len(classes)} classes")
        exact = counts.astype(np.float64) * (size / total)  # (K,)
        quota = np.maximum(np.floor(exact).astype(np.int64), floor_k)
        for k in sorted(range(len(classes)), key=lambda k: (-float(exact[k] - np.floor(exact[k])), k)):
            if quota.sum() >= size:
                break
            if quota[k] < counts[k]:
                quota[k] += 1
        while quota.sum() > size:  # the minimum took slots: give them back from the largest classes
            quota[np.argmax(quota)] -= 1
    rng = np.random.default_rng(seed)
    picked = [members[rng.permutation(members.shape[0])[:k]]
              for members, k in zip((np.flatnonzero(labels == c) for c in classes), quota, strict=True)]
    return np.sort(np.concatenate(picked)).astype(np.int64) if picked else np.empty(0, dtype=np.int64)


def limit_split(split: Split, limit: int | None, seed: int) -> Split:
    """The seeded stratified subset of ``limit`` samples of ``split`` (:func:`stratified_subset`), rows in their
    order; the split itself when ``limit`` is None or not below its size."""
    if limit is None or limit >= len(split):
        return split
    index = torch.from_numpy(stratified_subset(split.y, limit, seed))
    return Split(split.x[index].contiguous(), split.y[index].contiguous())


def limit_index(index: Tensor, y: Tensor, limit: int | None, seed: int) -> Tensor:
    """``index`` (n,) into ``y`` cut to the subset :func:`limit_split` keeps of the split ``y[index]``:
    (min(n, limit),)."""
    if limit is None or limit >= len(index):
        return index
    return index[torch.from_numpy(stratified_subset(y[index], limit, seed))]


def split_index(y: Tensor, test_fraction: float, seed: int, what: str) -> tuple[Tensor, Tensor]:
    """Sorted train and test indices (int64) of a stratified split of the labels ``y`` (N,), by sklearn's
    ``train_test_split`` with ``test_fraction`` and ``seed``."""
    from sklearn.model_selection import train_test_split

    index = np.arange(int(y.shape[0]))
    try:
        train_idx, test_idx = train_test_split(
            index, test_size=test_fraction, stratify=y.numpy(), random_state=seed, shuffle=True
        )
    except ValueError as e:
        counts = torch.unique(y, return_counts=True)[1]
        raise DatasetError(
            f"cannot split {what} ({len(index)} samples, {len(counts)} classes, smallest class "
            f"{int(counts.min()) if len(counts) else 0}) into train/test with "
            f"test_fraction={test_fraction}: {e}. "
            "Every class needs at least 2 samples and the test split at least one sample per class; "
            "add data or change data.test_fraction."
        ) from e
    return torch.from_numpy(np.sort(train_idx)), torch.from_numpy(np.sort(test_idx))


def stratified_split(x: Tensor, y: Tensor, test_fraction: float, seed: int, what: str) -> tuple[Split, Split]:
    """Stratified train/test split of ``x`` (N, ...) / ``y`` (N,) (:func:`split_index`)."""
    train_idx, test_idx = split_index(y, test_fraction, seed, what)
    return Split(x[train_idx].contiguous(), y[train_idx].contiguous()), Split(
        x[test_idx].contiguous(), y[test_idx].contiguous()
    )


def val_count(val_size: int | float, n: int, classes: int = 1) -> int:
    """How many of ``n`` training samples of ``classes`` classes ``data.val_size`` holds out: a share (0 < f < 1,
    rounded half up, at least one sample a class) or a count, as given."""
    return max(classes, math.floor(val_size * n + 0.5)) if isinstance(val_size, float) else int(val_size)


def holdout_index(y: Tensor, val_size: int | float, seed: int, what: str) -> tuple[Tensor, Tensor]:
    """Ascending int64 indices ``(kept, val)`` into the training labels ``y`` (N,): the validation split is the
    seeded stratified subset (:func:`stratified_subset`, at least one sample of each class) of
    :func:`val_count` ``(val_size, N)`` samples, ``kept`` the rest. Every class keeps at least one training sample;
    :class:`DatasetError` naming ``data.val_size`` otherwise."""
    n, classes = int(y.shape[0]), int(torch.unique(y).numel())
    size = val_count(val_size, n, classes)
    if not classes <= size <= n - classes:
        raise DatasetError(f"data.val_size: {val_size!r} holds out {size} of the {n} training samples of {what}; "
                           f"with {classes} classes it must hold out between {classes} and {n - classes} (one sample "
                           "of each class in each part)")
    val = torch.from_numpy(stratified_subset(y, size, seed, min_per_class=1))  # (size,)
    keep = torch.ones(n, dtype=torch.bool)
    keep[val] = False
    if torch.unique(y[keep]).numel() < classes:
        raise DatasetError(f"data.val_size: {val_size!r} leaves a class of {what} with no training sample; lower it")
    return torch.nonzero(keep).reshape(-1), val


def holdout_split(split: Split, val_size: int | float, seed: int, what: str) -> tuple[Split, Split]:
    """``split`` cut into its training rest and its validation split (:func:`holdout_index`), rows in order."""
    keep, val = holdout_index(split.y, val_size, seed, what)
    return (Split(split.x[keep].contiguous(), split.y[keep].contiguous()),
            Split(split.x[val].contiguous(), split.y[val].contiguous()))


__all__ = ["holdout_index", "holdout_split", "limit_index", "limit_split", "split_index", "stratified_split",
           "stratified_subset", "to_float", "val_count"]
