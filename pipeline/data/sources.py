"""Every dataset the pipeline supports, loaded into tensors, plus the ``prepare`` stage's on-disk format.

Storage dtypes (what :func:`load_dataset` returns and :func:`save_prepared` writes):

- ``cifar10`` / ``fashion_mnist`` / ``image_folder``: uint8 images ``(N, C, H, W)`` (CIFAR-10 train is
  150 MB as uint8, 600 MB as float32); convert batches with :func:`to_float` when they are used.
- ``digits``: float32 ``(N, 1, 8, 8)`` in [0, 1] (scikit-learn's 0..16 grey levels divided by 16).
- ``synthetic``: float32 ``(N, dim)`` unit rows drawn from a union of low-rank subspaces (paper, section 3).

Labels are always int64 ``(N,)`` in ``[0, len(classes))``.

The ``prepare`` stage's format (:func:`prepare_dataset`, :func:`save_prepared`, :func:`load_prepared`): four
``.npy`` files, ``{train,test}_x.npy`` (the inputs, stored dtype, C order) and ``{train,test}_y.npy`` (int64
labels), plus ``manifest.json`` with each file's sha256. numpy's own format, so ``np.load(mmap_mode=...)`` maps a
split of any size without reading it (``load_prepared(mmap=True)``); written block by block (:func:`write_npy`),
an image folder one decoded image at a time, so preparing never holds the data set in memory.

Every failure a user can cause (missing or corrupt files, bad values) raises :class:`DatasetError` whose
message says what is wrong, in which file, and what to do about it.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import math
import os
import pickle
import shutil
import struct
import tarfile
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pipeline.io import atomic_dir, sha256_file, write_json

DATASET_NAMES = ("digits", "synthetic", "cifar10", "fashion_mnist", "image_folder")

MANIFEST = "manifest.json"
SPLIT_FILES = {"train": ("train_x.npy", "train_y.npy"), "test": ("test_x.npy", "test_y.npy")}  # (inputs, labels)
PREPARED_FILES = (*SPLIT_FILES["train"], *SPLIT_FILES["test"])
_PREPARE_HINT = "run `transfusion prepare` (or `dvc repro prepare`) first"
_REPREPARE_HINT = "run `transfusion prepare` (or `dvc repro prepare`) again"
_DOWNLOAD_HINT = "set data.download: true to fetch it"

_CIFAR_FOLDER = "cifar-10-batches-py"
_CIFAR_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
_CIFAR_TEST = ("test_batch",)
_CIFAR_META = "batches.meta"
_CIFAR_ROW = 3 * 32 * 32

_FMNIST_FOLDER = "FashionMNIST"
_IDX_IMAGES_MAGIC = 2051  # 0x00000803: uint8, 3 dims
_IDX_LABELS_MAGIC = 2049  # 0x00000801: uint8, 1 dim


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
    """A loaded dataset: train/test splits, class names, and the shape of one input (without batch dim)."""

    name: str
    train: Split
    test: Split
    classes: tuple[str, ...]
    input_shape: tuple[int, ...]


@dataclass(frozen=True)
class SyntheticSpec:
    """Union-of-subspaces data (paper, section 3): ``n_clusters`` subspaces of rank <= ``rank`` in R^dim."""

    n_samples: int = 2000
    n_clusters: int = 10
    rank: int = 3
    dim: int = 64
    noise: float = 0.1


# --------------------------------------------------------------------------------------------------
# small pure helpers


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


def _take(split: Split, index: Tensor) -> Split:
    return Split(split.x[index].contiguous(), split.y[index].contiguous())


def _limit(split: Split, limit: int | None, seed: int) -> Split:
    if limit is None or limit >= len(split):
        return split
    return _take(split, torch.from_numpy(stratified_subset(split.y, limit, seed)))


def _limit_index(index: Tensor, y: Tensor, limit: int | None, seed: int) -> Tensor:
    """``index`` (n,) into ``y`` cut to the subset :func:`_limit` keeps of the split ``y[index]``: (min(n, limit),)."""
    if limit is None or limit >= len(index):
        return index
    return index[torch.from_numpy(stratified_subset(y[index], limit, seed))]


def _split_index(y: Tensor, test_fraction: float, seed: int, what: str) -> tuple[Tensor, Tensor]:
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


def _stratified_split(x: Tensor, y: Tensor, test_fraction: float, seed: int, what: str) -> tuple[Split, Split]:
    """Stratified train/test split of ``x`` (N, ...) / ``y`` (N,) (:func:`_split_index`)."""
    train_idx, test_idx = _split_index(y, test_fraction, seed, what)
    return Split(x[train_idx].contiguous(), y[train_idx].contiguous()), Split(
        x[test_idx].contiguous(), y[test_idx].contiguous()
    )


def _resize(x: Tensor, size: int, chunk: int = 4096) -> Tensor:
    """Resize images ``(N, C, H, W)`` to ``(N, C, size, size)`` (bilinear, antialiased); dtype is kept."""
    if tuple(x.shape[-2:]) == (size, size):
        return x
    from torchvision.transforms.v2 import functional as F

    parts = [F.resize(x[i : i + chunk], [size, size], antialias=True) for i in range(0, x.shape[0], chunk)]
    out = torch.cat(parts) if parts else x.new_empty((0, x.shape[1], size, size))
    return out.clamp_(0.0, 1.0) if out.is_floating_point() else out


def _count_nonfinite(x: Tensor, rows: int = 1 << 14) -> int:
    """NaN/inf values of floating ``x`` (N, ...), counted ``rows`` rows at a time (a memory-mapped x is read once,
    never copied whole)."""
    return sum(int((~torch.isfinite(x[i : i + rows])).sum()) for i in range(0, x.shape[0], rows))


def _check_split(split: Split, input_shape: tuple[int, ...], n_classes: int, where: str,
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


# --------------------------------------------------------------------------------------------------
# digits and synthetic (no files)


def _load_digits() -> tuple[Tensor, Tensor, tuple[str, ...]]:
    """sklearn's 8x8 digits: ``x`` float32 (1797, 1, 8, 8) = grey level / 16, ``y`` int64 (1797,)."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.from_numpy(np.asarray(bunch.images, dtype=np.float32) / 16.0).unsqueeze(1)  # (N, 1, 8, 8)
    y = torch.from_numpy(np.asarray(bunch.target, dtype=np.int64))  # (N,)
    return x, y, tuple(str(c) for c in range(10))


def _load_synthetic(spec: SyntheticSpec, seed: int) -> tuple[Tensor, Tensor, tuple[str, ...]]:
    """Union of ``n_clusters`` rank-``rank`` subspaces of R^dim: ``x`` float32 (n, dim) unit rows, ``y``."""
    from pipeline.data.synthetic import union_of_subspaces

    data = union_of_subspaces(
        n=spec.n_samples,
        n_clusters=spec.n_clusters,
        rank=spec.rank,
        dim=spec.dim,
        noise=spec.noise,
        seed=seed,
    )
    x = torch.as_tensor(data.x).to(torch.float32).contiguous()  # (n, dim)
    y = torch.as_tensor(data.labels).to(torch.int64).contiguous()  # (n,)
    return x, y, tuple(str(c) for c in range(spec.n_clusters))


# --------------------------------------------------------------------------------------------------
# CIFAR-10


def _read_cifar_pickle(path: Path) -> dict:
    """Load one CIFAR-10 python pickle the way torchvision does (``pickle.load(f, encoding="latin1")``).

    SAFETY: unpickling can run code. CIFAR-10 is distributed in this format, so this is only done on files the
    user placed under their data root themselves, or that torchvision extracted from the md5-verified official
    archive.
    """
    try:
        with open(path, "rb") as f:
            entry = pickle.load(f, encoding="latin1")
    except Exception as e:  # UnpicklingError, EOFError, ValueError, ... from a truncated or foreign file
        raise DatasetError(
            f"CIFAR-10 file {path} is not a readable pickle ({type(e).__name__}: {e}); "
            "it is truncated or corrupt. "
            f"Delete it and {_DOWNLOAD_HINT}, or re-extract the official archive."
        ) from e
    if not isinstance(entry, dict):
        raise DatasetError(f"CIFAR-10 file {path} holds a {type(entry).__name__}, expected a dict; re-extract it")
    return entry


def _check_cifar_batch(path: Path, n_classes: int) -> None:
    """Structural check of a batch file: ``data`` uint8 (n, 3072), ``labels`` n ints in [0, n_classes)."""
    entry = _read_cifar_pickle(path)
    for key in ("data", "labels"):
        if key not in entry:
            raise DatasetError(
                f"CIFAR-10 file {path} has no key '{key}' (keys: {sorted(map(str, entry))}); "
                "it is not a CIFAR-10 batch, re-extract the official archive"
            )
    data, labels = np.asarray(entry["data"]), np.asarray(entry["labels"])
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != _CIFAR_ROW:
        raise DatasetError(
            f"CIFAR-10 file {path}: 'data' is {data.dtype} {data.shape}, expected uint8 (n, {_CIFAR_ROW})"
        )
    if labels.ndim != 1 or labels.shape[0] != data.shape[0] or not np.issubdtype(labels.dtype, np.integer):
        raise DatasetError(
            f"CIFAR-10 file {path}: 'labels' is {labels.dtype} {labels.shape}, expected {data.shape[0]} integers"
        )
    if labels.size and (labels.min() < 0 or labels.max() >= n_classes):
        raise DatasetError(f"CIFAR-10 file {path}: labels outside [0, {n_classes})")


def _read_cifar_meta(path: Path) -> list[str]:
    entry = _read_cifar_pickle(path)
    names = entry.get("label_names")
    if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) for n in names):
        raise DatasetError(f"CIFAR-10 file {path} has no list of strings under 'label_names'; re-extract it")
    return list(names)


def _make_cifar10_class():
    from torchvision.datasets import CIFAR10

    class _StructuralCIFAR10(CIFAR10):
        """torchvision's CIFAR10 with the per-file md5 check replaced by a structural check.

        The download path is torchvision's own (it verifies the md5 of the downloaded archive), extracted with
        tarfile's "data" filter.
        """

        _downloading = False

        def _split_files(self) -> tuple[str, ...]:
            return _CIFAR_TRAIN if self.train else _CIFAR_TEST

        def _check_integrity(self) -> bool:
            folder = Path(self.root) / self.base_folder
            missing = [n for n in (*self._split_files(), _CIFAR_META) if not (folder / n).is_file()]
            try:
                if missing:
                    raise DatasetError(
                        f"CIFAR-10 file(s) {', '.join(missing)} missing in {folder}; {_DOWNLOAD_HINT}, "
                        f"or place the extracted '{_CIFAR_FOLDER}' folder under {self.root}"
                    )
                n_classes = len(_read_cifar_meta(folder / _CIFAR_META))
                for name in self._split_files():
                    _check_cifar_batch(folder / name, n_classes)
            except DatasetError:
                if self._downloading:  # let torchvision fetch (or re-extract) the archive
                    return False
                raise
            return True

        def download(self) -> None:
            # torchvision extracts the archive with a bare ``tar.extractall``: make tarfile's default filter the
            # safe "data" filter while it does (no absolute paths, no "..", no links out of data.root)
            if not hasattr(tarfile, "data_filter"):
                raise DatasetError(
                    "downloading CIFAR-10 needs a Python with safe tar extraction (3.10.12+, 3.11.4+); upgrade "
                    f"Python, or place the extracted '{_CIFAR_FOLDER}' folder under {self.root}"
                )
            previous = tarfile.TarFile.extraction_filter
            tarfile.TarFile.extraction_filter = staticmethod(tarfile.data_filter)
            self._downloading = True
            try:
                super().download()
            finally:
                self._downloading = False
                tarfile.TarFile.extraction_filter = previous

        def _load_meta(self) -> None:
            self.classes = _read_cifar_meta(Path(self.root) / self.base_folder / _CIFAR_META)
            self.class_to_idx = {c: i for i, c in enumerate(self.classes)}

    return _StructuralCIFAR10


def _load_cifar10(root: Path, download: bool) -> tuple[Split, Split, tuple[str, ...]]:
    """CIFAR-10 from ``root/cifar-10-batches-py``: uint8 (N, 3, 32, 32), rows are R, G, B planes of 32x32."""
    cls = _make_cifar10_class()
    splits = []
    for train in (True, False):
        try:  # torchvision unpickles the batch files: only files the user put there (see _read_cifar_pickle)
            ds = cls(str(root), train=train, download=download)
        except DatasetError:
            raise
        except Exception as e:  # download failure (URLError, md5 mismatch) or a file changed under our feet
            raise DatasetError(
                f"could not load CIFAR-10 from {root / _CIFAR_FOLDER} ({type(e).__name__}: {e}); "
                "check the network if data.download is true, "
                f"or place the extracted '{_CIFAR_FOLDER}' folder under {root}"
            ) from e
        x = torch.from_numpy(np.ascontiguousarray(ds.data)).permute(0, 3, 1, 2).contiguous()  # (N, 3, 32, 32)
        y = torch.as_tensor(np.asarray(ds.targets, dtype=np.int64))  # (N,)
        splits.append(Split(x, y))
    return splits[0], splits[1], tuple(ds.classes)


# --------------------------------------------------------------------------------------------------
# Fashion-MNIST


def _idx_stems(train: bool) -> tuple[str, str]:
    prefix = "train" if train else "t10k"
    return f"{prefix}-images-idx3-ubyte", f"{prefix}-labels-idx1-ubyte"


def _check_idx(path: Path, magic: int, ndim: int, shown: Path) -> tuple[int, ...]:
    """Check an idx file's header (big-endian magic, ``ndim`` uint32 dims) and its size; return the dims."""
    header = 4 * (1 + ndim)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(header)
    if len(head) < 4 or struct.unpack(">I", head[:4])[0] != magic:
        found = struct.unpack(">I", head[:4])[0] if len(head) >= 4 else None
        raise DatasetError(
            f"Fashion-MNIST file {shown} is not an idx file (magic {found}, expected {magic}); "
            "it is corrupt. "
            f"Delete it and {_DOWNLOAD_HINT}, or replace it with the original file."
        )
    if len(head) < header:
        raise DatasetError(f"Fashion-MNIST file {shown} is truncated inside its header; replace it")
    dims = struct.unpack(f">{ndim}I", head[4:])
    expected = header + math.prod(dims)
    if size != expected:
        raise DatasetError(
            f"Fashion-MNIST file {shown} has {size} bytes but its header {dims} implies {expected}; "
            "it is truncated or corrupt, replace it with the original file"
        )
    return dims


def _plain_idx(raw: Path, stem: str, tmp: Path) -> tuple[Path, Path]:
    """The uncompressed idx file for ``stem`` (decompressing ``stem.gz`` into ``tmp`` if only that exists)."""
    plain, gz = raw / stem, raw / f"{stem}.gz"
    if plain.is_file():
        return plain, plain
    if not gz.is_file():
        raise DatasetError(f"Fashion-MNIST file {plain} (or {gz.name}) is missing")
    out = tmp / stem
    try:
        with gzip.open(gz, "rb") as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst)
    except (OSError, EOFError) as e:
        raise DatasetError(f"Fashion-MNIST file {gz} is not a valid gzip file ({e}); replace it") from e
    return out, gz


def _read_idx_pair(raw: Path, train: bool) -> tuple[Tensor, Tensor]:
    """Images uint8 (N, H, W) and labels int64 (N,) of one split, validated, then read by torchvision."""
    from torchvision.datasets.mnist import read_image_file, read_label_file

    img_stem, lbl_stem = _idx_stems(train)
    with tempfile.TemporaryDirectory(prefix="fmnist-") as tmp:
        img_path, img_shown = _plain_idx(raw, img_stem, Path(tmp))
        lbl_path, lbl_shown = _plain_idx(raw, lbl_stem, Path(tmp))
        n_img = _check_idx(img_path, _IDX_IMAGES_MAGIC, 3, img_shown)[0]
        n_lbl = _check_idx(lbl_path, _IDX_LABELS_MAGIC, 1, lbl_shown)[0]
        if n_img != n_lbl:
            raise DatasetError(f"Fashion-MNIST: {img_shown} has {n_img} images but {lbl_shown} {n_lbl} labels")
        try:
            images, labels = read_image_file(str(img_path)), read_label_file(str(lbl_path))
        except Exception as e:  # headers were validated; keep the file in the message regardless
            raise DatasetError(f"Fashion-MNIST files {img_shown} / {lbl_shown} could not be read: {e}") from e
    return images.clone(), labels.to(torch.int64)


def _make_fashion_mnist_class():
    from torchvision.datasets import FashionMNIST

    class _FashionMNIST(FashionMNIST):
        """torchvision's FashionMNIST, also accepting ``*.gz`` idx files and validating headers first."""

        @property
        def raw_folder(self) -> str:  # torchvision derives it from the class name
            return os.path.join(self.root, _FMNIST_FOLDER, "raw")

        @property
        def processed_folder(self) -> str:
            return os.path.join(self.root, _FMNIST_FOLDER, "processed")

        def _check_exists(self) -> bool:
            raw = Path(self.raw_folder)
            stems = [*_idx_stems(True), *_idx_stems(False)]
            return all((raw / s).is_file() or (raw / f"{s}.gz").is_file() for s in stems)

        def _load_data(self):
            return _read_idx_pair(Path(self.raw_folder), self.train)

    return _FashionMNIST


def _load_fashion_mnist(root: Path, download: bool) -> tuple[Split, Split, tuple[str, ...]]:
    """Fashion-MNIST from ``root/FashionMNIST/raw/*-ubyte[.gz]``: uint8 (N, 1, 28, 28)."""
    cls = _make_fashion_mnist_class()
    raw = root / _FMNIST_FOLDER / "raw"
    if not download:
        missing = [
            s
            for s in (*_idx_stems(True), *_idx_stems(False))
            if not ((raw / s).is_file() or (raw / f"{s}.gz").is_file())
        ]
        if missing:
            raise DatasetError(
                f"Fashion-MNIST file(s) {', '.join(missing)} (or .gz) missing in {raw}; {_DOWNLOAD_HINT}, "
                f"or place the idx files under {raw}"
            )
    splits = []
    for train in (True, False):
        try:
            ds = cls(str(root), train=train, download=download)
        except DatasetError:
            raise
        except Exception as e:  # download failure or a file changed under our feet
            raise DatasetError(
                f"could not load Fashion-MNIST from {raw} ({type(e).__name__}: {e}); check the network if "
                f"data.download is true, or place the idx files under {raw}"
            ) from e
        x = ds.data.unsqueeze(1).contiguous()  # (N, 1, 28, 28) uint8
        splits.append(Split(x, torch.as_tensor(ds.targets, dtype=torch.int64)))
    return splits[0], splits[1], tuple(cls.classes)


# --------------------------------------------------------------------------------------------------
# image folder


@dataclass(frozen=True, eq=False)
class _FolderPlan:
    """What an image folder's splits are made of, before any image is decoded."""

    paths: tuple[str, ...]  # (N,) every image, in ImageFolder's order (classes sorted, then file names)
    y: Tensor  # (N,) int64 labels
    classes: tuple[str, ...]
    index: dict[str, Tensor]  # "train" / "test": ascending int64 indices into paths, the limits applied
    loader: Callable[[str], Any]  # path -> PIL image in RGB


def _plan_image_folder(root: Path, test_fraction: float, seed: int, limit_train: int | None,
                       limit_test: int | None) -> _FolderPlan:
    """Scan ``root/<class>/<image>`` (file names only) and choose each split's images: the stratified split of
    :func:`_split_index`, then the stratified subsets of ``limit_train`` / ``limit_test``."""
    from torchvision.datasets import ImageFolder

    try:
        folder = ImageFolder(str(root))
    except (FileNotFoundError, OSError) as e:
        raise DatasetError(
            f"image_folder {root}: {str(e).rstrip('.')}. Expected one sub-folder per class holding images "
            "(e.g. <root>/cat/1.png, <root>/dog/2.jpg)"
        ) from e
    if not folder.samples:
        raise DatasetError(f"image_folder {root} holds no images; add <root>/<class>/<image> files")
    y = torch.tensor(folder.targets, dtype=torch.int64)
    train, test = _split_index(y, test_fraction, seed, f"image_folder {root}")
    index = {"train": _limit_index(train, y, limit_train, seed), "test": _limit_index(test, y, limit_test, seed)}
    return _FolderPlan(tuple(p for p, _ in folder.samples), y, tuple(folder.classes), index, folder.loader)


def _folder_images(plan: _FolderPlan, part: str, image_size: int) -> Iterator[Tensor]:
    """The images of split ``part`` in row order, decoded one at a time: RGB uint8 (3, image_size, image_size)
    each (bilinear, antialiased). A file that does not decode raises :class:`DatasetError` naming it."""
    from torchvision.transforms import v2

    transform = v2.Compose([v2.ToImage(), v2.Resize((image_size, image_size), antialias=True)])
    for i in plan.index[part].tolist():
        path = plan.paths[i]
        try:
            img = plan.loader(path)  # PIL image converted to RGB
        except Exception as e:  # UnidentifiedImageError, truncated file, ...
            raise DatasetError(f"image file {path} cannot be decoded ({e}); delete or replace it") from e
        yield transform(img).as_subclass(Tensor)  # (3, S, S) uint8


def _load_image_folder(root: Path, image_size: int, test_fraction: float, seed: int, limit_train: int | None,
                       limit_test: int | None) -> tuple[Split, Split, tuple[str, ...]]:
    """An image folder's splits in memory, RGB uint8 (n, 3, S, S): each image decoded into a preallocated tensor
    (never a list of images stacked, which would hold the split twice)."""
    plan = _plan_image_folder(root, test_fraction, seed, limit_train, limit_test)
    splits = []
    for part in ("train", "test"):
        idx = plan.index[part]
        x = torch.empty((len(idx), 3, image_size, image_size), dtype=torch.uint8)  # (n, 3, S, S)
        for row, img in enumerate(_folder_images(plan, part, image_size)):
            x[row] = img
        splits.append(Split(x, plan.y[idx]))
    return splits[0], splits[1], plan.classes


# --------------------------------------------------------------------------------------------------
# public loader


def _check_request(name: str, root: Path, download: bool, test_fraction: float, image_size: int | None,
                   limit_train: int | None, limit_test: int | None) -> Path:
    """ValueError for bad arguments, :class:`DatasetError` for a data root that cannot hold the data set; returns
    the root with ``~`` expanded."""
    if name not in DATASET_NAMES:
        raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASET_NAMES)}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    for key, value in (("image_size", image_size), ("limit_train", limit_train), ("limit_test", limit_test)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{key} must be a positive integer or None, got {value!r}")
    root = root.expanduser()

    needs_root = name == "image_folder" or (name in ("cifar10", "fashion_mnist") and not download)
    if root.exists() and not root.is_dir() and name in ("image_folder", "cifar10", "fashion_mnist"):
        raise DatasetError(f"data root {root} for dataset '{name}' is not a directory; point data.root at the "
                           "folder that holds the data"
                           + (f" (the one with '{_CIFAR_FOLDER}' in it)" if name == "cifar10" else ""))
    if needs_root and not root.is_dir():
        if name == "image_folder":
            fix = "point data.root at a folder with one sub-folder of images per class"
        elif name == "cifar10":
            fix = f"{_DOWNLOAD_HINT}, or place the extracted '{_CIFAR_FOLDER}' folder under {root}"
        else:
            fix = f"{_DOWNLOAD_HINT}, or place the idx files under {root / _FMNIST_FOLDER / 'raw'}"
        raise DatasetError(f"data root {root} for dataset '{name}' does not exist; {fix}")
    if name == "image_folder" and image_size is None:
        raise ValueError(
            "image_folder needs image_size (set data.image_size, e.g. 32) so that all images share one shape"
        )
    return root


def load_dataset(
    name: str,
    *,
    root: Path | str,
    download: bool = False,
    test_fraction: float = 0.2,
    seed: int = 0,
    image_size: int | None = None,
    limit_train: int | None = None,
    limit_test: int | None = None,
    synthetic: SyntheticSpec | None = None,
) -> Dataset:
    """Load dataset ``name``: ``train``/``test`` splits of ``x`` (N, *input_shape) and ``y`` int64 (N,).

    - ``digits`` / ``synthetic`` / ``image_folder`` are split with a stratified ``train_test_split`` of
      ``test_fraction`` and ``seed``; ``cifar10`` / ``fashion_mnist`` keep their own train/test splits.
    - ``image_size`` resizes images to ``(image_size, image_size)``; required for ``image_folder``; ignored by
      ``synthetic``.
    - ``limit_train`` / ``limit_test`` keep a seeded stratified subset of that many samples (see
      :func:`stratified_subset`).
    - ``synthetic`` gives the union-of-subspaces parameters (default :class:`SyntheticSpec`).
    """
    root = _check_request(name, Path(root), download, test_fraction, image_size, limit_train, limit_test)
    if name == "digits":
        x, y, classes = _load_digits()
        train, test = _stratified_split(x, y, test_fraction, seed, "digits")
    elif name == "synthetic":
        x, y, classes = _load_synthetic(synthetic or SyntheticSpec(), seed)
        train, test = _stratified_split(x, y, test_fraction, seed, "synthetic data")
        image_size = None
    elif name == "cifar10":
        train, test, classes = _load_cifar10(root, download)
    elif name == "fashion_mnist":
        train, test, classes = _load_fashion_mnist(root, download)
    else:
        train, test, classes = _load_image_folder(root, image_size, test_fraction, seed, limit_train, limit_test)

    train, test = _limit(train, limit_train, seed), _limit(test, limit_test, seed)
    if image_size is not None:
        train, test = Split(_resize(train.x, image_size), train.y), Split(_resize(test.x, image_size), test.y)
    input_shape = tuple(int(s) for s in train.x.shape[1:])
    for split, part in ((train, "train"), (test, "test")):
        _check_split(split, input_shape, len(classes), f"dataset '{name}' ({part} split)")
    return Dataset(name=name, train=train, test=test, classes=tuple(classes), input_shape=input_shape)


# --------------------------------------------------------------------------------------------------
# prepared data on disk


_BLOCK_BYTES = 16 << 20  # rows per block of write_npy / gather_rows: about this many bytes


def _dtype_name(dtype: torch.dtype | np.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dtype).numpy().dtype


def write_npy(path: Path | str, shape: Sequence[int], dtype: np.dtype | type, blocks: Iterable[np.ndarray]) -> str:
    """Write the ``.npy`` file of an array of ``shape`` (N, ...) and ``dtype`` from its row blocks, in order, one
    block in memory at a time (``(n_i, *shape[1:])`` each, n_i summing to N); returns the file's sha256, hashed as
    it is written.

    numpy's own header (format 1.0, C order): ``np.load(path, mmap_mode=...)`` maps the file. The bytes go out by
    plain writes (page cache, not the process's memory). ValueError if a block has another dtype or row shape, or
    the blocks do not add up to N rows.
    """
    shape, dtype = tuple(int(s) for s in shape), np.dtype(dtype)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape})
    digest, rows = hashlib.sha256(header.getvalue()), 0
    with open(path, "wb") as f:
        f.write(header.getvalue())
        for block in blocks:
            block = np.asarray(block)
            if block.dtype != dtype or block.shape[1:] != shape[1:] or rows + block.shape[0] > shape[0]:
                raise ValueError(f"{path}: a block of {block.dtype} {block.shape} does not continue an array of "
                                 f"{dtype} {shape} at row {rows}")
            data = np.ascontiguousarray(block).reshape(-1).view(np.uint8)  # (n_i * row bytes,)
            f.write(data)
            digest.update(data)
            rows += block.shape[0]
    if rows != shape[0]:
        raise ValueError(f"{path}: {rows} rows written, the header says {shape[0]}")
    return digest.hexdigest()


def _row_blocks(x: Tensor) -> Iterator[np.ndarray]:
    """``x`` (N, ...) as numpy row blocks of about ``_BLOCK_BYTES`` each, contiguous, in order."""
    row = max(1, math.prod(x.shape[1:]) * x.element_size())
    step = max(1, _BLOCK_BYTES // row)
    for i in range(0, x.shape[0], step):
        yield x[i : i + step].contiguous().numpy()


def _manifest(name: str, classes: Sequence[str], input_shape: Sequence[int], n_train: int, n_test: int,
              dtype: torch.dtype, extra: dict | None) -> dict[str, Any]:
    """The manifest's fields, ``extra`` after them (``files`` is added once they are written)."""
    manifest: dict[str, Any] = {
        "dataset": name,
        "classes": list(classes),
        "input_shape": list(input_shape),
        "n_train": n_train,
        "n_test": n_test,
        "dtype": _dtype_name(dtype),
    }
    extra = dict(extra or {})
    clash = sorted(set(extra) & (set(manifest) | {"files"}))
    if clash:
        raise ValueError(f"extra manifest keys {clash} would overwrite reserved manifest fields")
    json.dumps(extra)  # fail before writing anything if extra is not JSON-serialisable
    return {**manifest, "files": {}, **extra}


def _write_split(out: Path, part: str, shape: Sequence[int], dtype: torch.dtype, x_blocks: Iterable[np.ndarray],
                 y: Tensor) -> dict[str, dict]:
    """Write split ``part``'s inputs (``shape`` (N, ...), from their row blocks) and labels ``y`` (N,) into ``out``;
    returns their manifest entries ``{name: {sha256, shape}}``."""
    x_name, y_name = SPLIT_FILES[part]
    y_np = y.contiguous().numpy()
    return {
        x_name: {"sha256": write_npy(out / x_name, shape, _numpy_dtype(dtype), x_blocks), "shape": list(shape)},
        y_name: {"sha256": write_npy(out / y_name, y_np.shape, np.int64, [y_np]), "shape": list(y_np.shape)},
    }


def save_prepared(ds: Dataset, out_dir: Path | str, extra: dict | None = None) -> dict:
    """Write ``{train,test}_x.npy``, ``{train,test}_y.npy`` and ``manifest.json`` to ``out_dir``, atomically.

    The directory is built beside ``out_dir`` and swapped in whole, so a crash leaves the previous ``out_dir``
    (or none). The manifest holds ``dataset, classes, input_shape, n_train, n_test, dtype`` and
    ``files: {name: {sha256, shape}}`` (the shape of the array in that file), plus the keys of ``extra``.
    Returns the manifest.
    """
    if ds.train.x.dtype != ds.test.x.dtype:
        raise DatasetError(f"train ({ds.train.x.dtype}) and test ({ds.test.x.dtype}) inputs differ in dtype")
    for split, part in ((ds.train, "train"), (ds.test, "test")):
        _check_split(split, ds.input_shape, len(ds.classes), f"dataset '{ds.name}' ({part} split)")
    manifest = _manifest(ds.name, ds.classes, ds.input_shape, len(ds.train), len(ds.test), ds.train.x.dtype, extra)
    with atomic_dir(out_dir) as tmp:
        for part, split in (("train", ds.train), ("test", ds.test)):
            manifest["files"].update(_write_split(tmp, part, split.x.shape, split.x.dtype, _row_blocks(split.x),
                                                  split.y))
        write_json(tmp / MANIFEST, manifest)
    return manifest


def _prepare_image_folder(root: Path, out_dir: Path | str, image_size: int, test_fraction: float, seed: int,
                          limit_train: int | None, limit_test: int | None, extra: dict | None) -> dict:
    """:func:`save_prepared` of the image folder :func:`load_dataset` would load, the same bytes, in bounded
    memory: each image is decoded and appended to its split's file before the next is read."""
    plan = _plan_image_folder(root, test_fraction, seed, limit_train, limit_test)
    shape = (3, image_size, image_size)
    n = {part: len(plan.index[part]) for part in ("train", "test")}
    manifest = _manifest("image_folder", plan.classes, shape, n["train"], n["test"], torch.uint8, extra)
    with atomic_dir(out_dir) as tmp:
        for part in ("train", "test"):
            images = (img.numpy()[None] for img in _folder_images(plan, part, image_size))  # (1, 3, S, S) each
            manifest["files"].update(_write_split(tmp, part, (n[part], *shape), torch.uint8, images,
                                                  plan.y[plan.index[part]]))
        write_json(tmp / MANIFEST, manifest)
    return manifest


def prepare_dataset(
    name: str,
    out_dir: Path | str,
    *,
    root: Path | str,
    download: bool = False,
    test_fraction: float = 0.2,
    seed: int = 0,
    image_size: int | None = None,
    limit_train: int | None = None,
    limit_test: int | None = None,
    synthetic: SyntheticSpec | None = None,
    extra: dict | None = None,
) -> dict:
    """``save_prepared(load_dataset(name, ...), out_dir, extra)``, the ``prepare`` stage; returns the manifest.

    An ``image_folder`` is written without ever being in memory whole (one decoded image at a time), to the same
    bytes; the other data sets are loaded, then written.
    """
    if name != "image_folder":
        return save_prepared(load_dataset(name, root=root, download=download, test_fraction=test_fraction, seed=seed,
                                          image_size=image_size, limit_train=limit_train, limit_test=limit_test,
                                          synthetic=synthetic), out_dir, extra)
    root = _check_request(name, Path(root), download, test_fraction, image_size, limit_train, limit_test)
    assert image_size is not None  # _check_request refuses an image folder without it
    return _prepare_image_folder(root, out_dir, image_size, test_fraction, seed, limit_train, limit_test, extra)


def _require(manifest: dict, keys: Sequence[str], path: Path) -> None:
    missing = [k for k in keys if k not in manifest]
    if missing:
        raise DatasetError(f"{path} lacks the field(s) {', '.join(missing)}; {_REPREPARE_HINT}")


def _read_manifest(out_dir: Path) -> dict[str, Any]:
    mpath = out_dir / MANIFEST
    if not mpath.is_file():
        raise DatasetError(f"no prepared data: {mpath} does not exist; {_PREPARE_HINT}")
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, ValueError) as e:
        raise DatasetError(f"{mpath} is not readable JSON ({e}); {_REPREPARE_HINT}") from e
    if not isinstance(manifest, dict):
        raise DatasetError(f"{mpath} does not hold a JSON object; {_REPREPARE_HINT}")
    _require(manifest, ("dataset", "classes", "input_shape", "n_train", "n_test", "dtype", "files"), mpath)
    return manifest


def _load_npy(out_dir: Path, manifest: dict[str, Any], name: str, verify: bool, mmap: bool) -> Tensor:
    """One prepared file as a tensor over numpy's array: read whole, or (``mmap``) mapped copy-on-write, read by
    the OS as rows are used. With ``verify`` its sha256 must be the manifest's. Never unpickles anything."""
    path, mpath = out_dir / name, out_dir / MANIFEST
    entry = manifest["files"].get(name) if isinstance(manifest["files"], dict) else None
    if not isinstance(entry, dict) or "sha256" not in entry:
        raise DatasetError(f"{mpath} has no sha256 entry for {name}; {_REPREPARE_HINT}")
    if not path.is_file():
        raise DatasetError(f"prepared file {path} is missing; {_REPREPARE_HINT}")
    if verify and sha256_file(path) != entry["sha256"]:
        raise DatasetError(
            f"prepared file {path} does not match the sha256 in {mpath}: it was modified or corrupted; "
            f"{_REPREPARE_HINT}"
        )
    try:
        if _npy_dtype(path).hasobject:  # np.load refuses it too (allow_pickle=False): say why, whatever the mode
            raise DatasetError(f"prepared file {path} holds pickled Python objects, which are never loaded (a "
                               f"prepared file holds plain numbers); {_REPREPARE_HINT}")
        array = np.load(path, mmap_mode="c" if mmap else None, allow_pickle=False)
        if not isinstance(array, np.ndarray) or not array.flags.c_contiguous or array.ndim < 1:
            raise ValueError("not a C-ordered array of at least one dimension")
        return torch.from_numpy(array)
    except (ValueError, OSError, TypeError) as e:  # truncated, a foreign header, a dtype torch has no tensor for
        raise DatasetError(f"prepared file {path} cannot be loaded ({e}); {_REPREPARE_HINT}") from e


def _npy_dtype(path: Path) -> np.dtype:
    """The dtype an ``.npy`` file's header declares (format 1.0 or 2.0); ValueError for anything else."""
    with open(path, "rb") as f:
        major, _ = np.lib.format.read_magic(f)
        if major not in (1, 2):
            raise ValueError(f"npy format version {major} is not one prepare writes")
        read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
        return read(f)[2]


def _load_split(out_dir: Path, manifest: dict[str, Any], part: str, n: int, input_shape: tuple[int, ...],
                n_classes: int, verify: bool, mmap: bool) -> Split:
    x_name, y_name = SPLIT_FILES[part]
    x_path = out_dir / x_name
    x = _load_npy(out_dir, manifest, x_name, verify, mmap)  # (n, *input_shape)
    y = _load_npy(out_dir, manifest, y_name, verify, False)  # (n,) int64
    try:
        split = Split(x, y)
    except ValueError as e:
        raise DatasetError(f"prepared files {x_path} / {y_name}: {e}; {_REPREPARE_HINT}") from e
    if len(split) != n or _dtype_name(x.dtype) != manifest["dtype"]:
        raise DatasetError(
            f"prepared file {x_path} holds {len(split)} {_dtype_name(x.dtype)} samples, manifest says "
            f"{n} {manifest['dtype']}; {_REPREPARE_HINT}"
        )
    _check_split(split, input_shape, n_classes, f"prepared file {x_path}", f"prepared file {out_dir / y_name}")
    return split


def load_prepared(out_dir: Path | str, verify: bool = True, mmap: bool = False) -> Dataset:
    """Load what :func:`save_prepared` wrote; with ``verify`` check each file's sha256 against the manifest.

    ``mmap=False``: the inputs are read into memory. ``mmap=True``: ``x`` of each split is a tensor over a
    copy-on-write memory map of its file (zero copy; the OS reads the rows that are used, and processes mapping
    the same file share its pages); the labels are read. Same :class:`Dataset`, same values either way.

    Nothing is unpickled. Raises :class:`DatasetError` naming the file when the manifest is missing/unreadable, a
    file is missing, its hash, shape, dtype or count disagrees, or values are NaN/inf.
    """
    out_dir = Path(out_dir)
    manifest = _read_manifest(out_dir)
    try:
        input_shape = tuple(int(s) for s in manifest["input_shape"])
        classes = tuple(str(c) for c in manifest["classes"])
        counts = {k: int(manifest[k]) for k in ("n_train", "n_test")}
    except (TypeError, ValueError) as e:
        raise DatasetError(
            f"{out_dir / MANIFEST}: malformed input_shape, classes, n_train or n_test ({e}); {_REPREPARE_HINT}"
        ) from e
    train, test = (_load_split(out_dir, manifest, part, counts[f"n_{part}"], input_shape, len(classes), verify, mmap)
                   for part in ("train", "test"))
    return Dataset(name=str(manifest["dataset"]), train=train, test=test, classes=classes, input_shape=input_shape)


def prepared_nbytes(manifest: dict[str, Any], part: str = "train") -> int:
    """Bytes of split ``part``'s inputs, from the manifest alone (before anything is loaded)."""
    shape = manifest["files"][SPLIT_FILES[part][0]]["shape"]
    return math.prod(int(s) for s in shape) * np.dtype(manifest["dtype"]).itemsize


def gather_rows(x: Tensor, index: Tensor, pin: bool = False) -> Tensor:
    """``x[index]``: rows ``index`` (b,) of ``x`` (N, ...) -> (b, ...), on the host, in ``index``'s order.

    Read in ascending row order (a memory-mapped ``x`` is then read as forward as the rows allow) and put back in
    place; ``pin``: into page-locked memory, for an asynchronous copy to a GPU. Equal to ``x[index]``.
    """
    index = index.cpu()
    order = torch.argsort(index)  # (b,)
    out = torch.empty((index.shape[0], *x.shape[1:]), dtype=x.dtype, pin_memory=pin)
    out[order] = x[index[order]]
    return out


__all__ = [
    "DATASET_NAMES",
    "PREPARED_FILES",
    "SPLIT_FILES",
    "Dataset",
    "DatasetError",
    "Split",
    "SyntheticSpec",
    "gather_rows",
    "load_dataset",
    "load_prepared",
    "prepare_dataset",
    "prepared_nbytes",
    "save_prepared",
    "stratified_subset",
    "to_float",
    "write_npy",
]
