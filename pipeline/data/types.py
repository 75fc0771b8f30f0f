"""The types the source readers and the prepared format share: :class:`DatasetError` (a missing, corrupt or malformed
data set, with a message that names the file and the fix), :class:`Split` and :class:`Dataset` (a loaded data set's
tensors), and :func:`check_split`, the check every split passes when it is loaded, written or read back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


class DatasetError(RuntimeError):
    """A dataset is missing, corrupt or malformed; the message names the file and the fix."""


@dataclass(frozen=True, eq=False)
class Split:
    """One split of a dataset: inputs ``x`` of shape ``(N, *input_shape)`` and labels ``y`` int64 ``(N,)``."""

    x: Tensor
    y: Tensor

    def __post_init__(self) -> None:
        if self.y.dtype != torch.int64 or self.y.dim() != 1:
            raise ValueError(f"Split.y must be int64 of shape (N,), got {self.y.dtype} {tuple(self.y.shape)}")
        if self.x.dim() < 1 or self.x.shape[0] != self.y.shape[0]:
            raise ValueError(f"Split.x {tuple(self.x.shape)} and Split.y {tuple(self.y.shape)} differ in length")

    def __len__(self) -> int:
        return int(self.y.shape[0])


@dataclass(frozen=True, eq=False)
class Dataset:
    """A loaded dataset: train/test splits, class names, the shape of one input (without batch dim), and the
    validation split held out of the training images (``data.val_size``): what every choice reads (the online kNN,
    Tune's metric), so that only the final probes read ``test``."""

    name: str
    train: Split
    test: Split
    classes: tuple[str, ...]
    input_shape: tuple[int, ...]
    val: Split


def _count_nonfinite(x: Tensor, rows: int = 1 << 14) -> int:
    """NaN/inf values of floating ``x`` (N, ...), counted ``rows`` rows at a time (a memory-mapped x is read once,
    never copied whole)."""
    return sum(int((~torch.isfinite(x[i : i + rows])).sum()) for i in range(0, x.shape[0], rows))


def check_split(split: Split, input_shape: tuple[int, ...], n_classes: int, where: str,
                labels_where: str | None = None) -> None:
    """Raise :class:`DatasetError` unless ``split`` is ``(N, *input_shape)``, finite, with valid labels.

    ``where`` names the inputs in messages, ``labels_where`` the labels (default: ``where``)."""
    if tuple(split.x.shape[1:]) != tuple(input_shape):
        raise DatasetError(
            f"{where}: inputs have shape {tuple(split.x.shape)}, expected (N, {', '.join(map(str, input_shape))}); "
            "fix or regenerate the data"
        )
    bad = _count_nonfinite(split.x) if split.x.is_floating_point() and split.x.numel() else 0
    if bad:
        raise DatasetError(f"{where}: {bad} input values are NaN or infinite; fix or regenerate the data")
    if len(split) and (int(split.y.min()) < 0 or int(split.y.max()) >= n_classes):
        raise DatasetError(
            f"{labels_where or where}: labels span [{int(split.y.min())}, {int(split.y.max())}] but there are "
            f"{n_classes} classes; fix or regenerate the data"
        )


__all__ = ["Dataset", "DatasetError", "Split", "check_split"]
