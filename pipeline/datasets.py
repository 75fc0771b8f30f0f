"""Every dataset the pipeline supports, loaded into tensors, plus the ``prepare`` stage's on-disk format.

Storage dtypes (what :func:`load_dataset` returns and :func:`save_prepared` writes):

- ``cifar10`` / ``fashion_mnist`` / ``image_folder``: uint8 images ``(N, C, H, W)`` (CIFAR-10 train is
  150 MB as uint8, 600 MB as float32); convert batches with :func:`to_float` when they are used.
- ``digits``: float32 ``(N, 1, 8, 8)`` in [0, 1] (scikit-learn's 0..16 grey levels divided by 16).
- ``synthetic``: float32 ``(N, dim)`` unit rows drawn from a union of low-rank subspaces (paper, section 3).

Labels are always int64 ``(N,)`` in ``[0, len(classes))``.

Every failure a user can cause (missing or corrupt files, bad values) raises :class:`DatasetError` whose
message says what is wrong, in which file, and what to do about it.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import pickle
import shutil
import struct
import tarfile
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pipeline.io import TensorFileError, atomic_dir, load_torch, save_torch, sha256_file, write_json

DATASET_NAMES = ("digits", "synthetic", "cifar10", "fashion_mnist", "image_folder")

MANIFEST = "manifest.json"
PREPARED_FILES = ("train.pt", "test.pt")
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


def _stratified_split(x: Tensor, y: Tensor, test_fraction: float, seed: int, what: str) -> tuple[Split, Split]:
    """Stratified train/test split of ``x`` (N, ...) / ``y`` (N,) by sklearn's ``train_test_split``."""
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
    train_idx = torch.from_numpy(np.sort(train_idx))
    test_idx = torch.from_numpy(np.sort(test_idx))
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


def _check_split(split: Split, input_shape: tuple[int, ...], n_classes: int, where: str) -> None:
    """Raise :class:`DatasetError` unless ``split`` is ``(N, *input_shape)``, finite, with valid labels."""
    if tuple(split.x.shape[1:]) != tuple(input_shape):
        raise DatasetError(
            f"{where}: inputs have shape {tuple(split.x.shape)}, expected (N, {', '.join(map(str, input_shape))}); "
            "fix or regenerate the data"
        )
    if split.x.is_floating_point() and split.x.numel() and not bool(torch.isfinite(split.x).all()):
        bad = int((~torch.isfinite(split.x)).sum())
        raise DatasetError(f"{where}: {bad} input values are NaN or infinite; fix or regenerate the data")
    if len(split) and (int(split.y.min()) < 0 or int(split.y.max()) >= n_classes):
        raise DatasetError(
            f"{where}: labels span [{int(split.y.min())}, {int(split.y.max())}] but there are {n_classes} classes; "
            "fix or regenerate the data"
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
    try:
        from pipeline.theory import union_of_subspaces
    except ImportError as e:
        raise DatasetError(f"the synthetic dataset needs pipeline.theory.union_of_subspaces: {e}") from e
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


def _load_image_folder(root: Path, image_size: int) -> tuple[Tensor, Tensor, tuple[str, ...]]:
    """``root/<class>/<image>`` via torchvision's ImageFolder: RGB uint8 (N, 3, image_size, image_size)."""
    from torchvision.datasets import ImageFolder
    from torchvision.transforms import v2

    transform = v2.Compose([v2.ToImage(), v2.Resize((image_size, image_size), antialias=True)])
    try:
        folder = ImageFolder(str(root))
    except (FileNotFoundError, OSError) as e:
        raise DatasetError(
            f"image_folder {root}: {str(e).rstrip('.')}. Expected one sub-folder per class holding images "
            "(e.g. <root>/cat/1.png, <root>/dog/2.jpg)"
        ) from e
    images = []
    for path, _ in folder.samples:
        try:
            img = folder.loader(path)  # PIL image converted to RGB
        except Exception as e:  # UnidentifiedImageError, truncated file, ...
            raise DatasetError(f"image file {path} cannot be decoded ({e}); delete or replace it") from e
        images.append(transform(img).as_subclass(Tensor))  # (3, S, S) uint8
    x = torch.stack(images) if images else torch.empty((0, 3, image_size, image_size), dtype=torch.uint8)
    y = torch.tensor([t for _, t in folder.samples], dtype=torch.int64)
    return x, y, tuple(folder.classes)


# --------------------------------------------------------------------------------------------------
# public loader


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
    if name not in DATASET_NAMES:
        raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASET_NAMES)}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    for key, value in (("image_size", image_size), ("limit_train", limit_train), ("limit_test", limit_test)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{key} must be a positive integer or None, got {value!r}")
    root = Path(root).expanduser()

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
        if image_size is None:
            raise ValueError(
                "image_folder needs image_size (set data.image_size, e.g. 32) so that all images share one shape"
            )
        x, y, classes = _load_image_folder(root, image_size)
        if x.shape[0] == 0:
            raise DatasetError(f"image_folder {root} holds no images; add <root>/<class>/<image> files")
        train, test = _stratified_split(x, y, test_fraction, seed, f"image_folder {root}")

    train, test = _limit(train, limit_train, seed), _limit(test, limit_test, seed)
    if image_size is not None:
        train, test = Split(_resize(train.x, image_size), train.y), Split(_resize(test.x, image_size), test.y)
    input_shape = tuple(int(s) for s in train.x.shape[1:])
    for split, part in ((train, "train"), (test, "test")):
        _check_split(split, input_shape, len(classes), f"dataset '{name}' ({part} split)")
    return Dataset(name=name, train=train, test=test, classes=tuple(classes), input_shape=input_shape)


# --------------------------------------------------------------------------------------------------
# prepared data on disk


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _compact(t: Tensor) -> Tensor:
    """A contiguous tensor owning exactly its storage (``torch.save`` of a view would save the whole base)."""
    t = t.contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset() != 0:
        t = t.clone()
    return t


def save_prepared(ds: Dataset, out_dir: Path | str, extra: dict | None = None) -> dict:
    """Write ``train.pt``, ``test.pt`` ({"x", "y"} tensors) and ``manifest.json`` to ``out_dir``, atomically.

    The directory is built beside ``out_dir`` and swapped in whole, so a crash leaves the previous ``out_dir``
    (or none). The manifest holds ``dataset, classes, input_shape, n_train, n_test, dtype`` and
    ``files: {name: {sha256, shape}}`` (shape of ``x``), plus the keys of ``extra``. Returns the manifest.
    """
    extra = dict(extra or {})
    if ds.train.x.dtype != ds.test.x.dtype:
        raise DatasetError(f"train ({ds.train.x.dtype}) and test ({ds.test.x.dtype}) inputs differ in dtype")
    for split, part in ((ds.train, "train"), (ds.test, "test")):
        _check_split(split, ds.input_shape, len(ds.classes), f"dataset '{ds.name}' ({part} split)")
    manifest: dict[str, Any] = {
        "dataset": ds.name,
        "classes": list(ds.classes),
        "input_shape": list(ds.input_shape),
        "n_train": len(ds.train),
        "n_test": len(ds.test),
        "dtype": _dtype_name(ds.train.x.dtype),
    }
    clash = sorted(set(extra) & (set(manifest) | {"files"}))
    if clash:
        raise ValueError(f"extra manifest keys {clash} would overwrite reserved manifest fields")
    json.dumps(extra)  # fail before writing anything if extra is not JSON-serialisable
    files: dict[str, dict] = {}
    with atomic_dir(out_dir) as tmp:
        for fname, split in zip(PREPARED_FILES, (ds.train, ds.test), strict=True):
            save_torch(tmp / fname, {"x": _compact(split.x), "y": _compact(split.y)})
            files[fname] = {"sha256": sha256_file(tmp / fname), "shape": list(split.x.shape)}
        manifest["files"] = files
        manifest.update(extra)
        write_json(tmp / MANIFEST, manifest)
    return manifest


def _require(manifest: dict, keys: Sequence[str], path: Path) -> None:
    missing = [k for k in keys if k not in manifest]
    if missing:
        raise DatasetError(f"{path} lacks the field(s) {', '.join(missing)}; {_REPREPARE_HINT}")


def load_prepared(out_dir: Path | str, verify: bool = True) -> Dataset:
    """Load what :func:`save_prepared` wrote; with ``verify`` check each file's sha256 against the manifest.

    Tensors are loaded with ``weights_only=True`` (no arbitrary unpickling). Raises :class:`DatasetError`
    naming the file when the manifest is missing/unreadable, a file is missing, its hash or shape disagrees,
    or values are NaN/inf.
    """
    out_dir = Path(out_dir)
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
    try:
        input_shape = tuple(int(s) for s in manifest["input_shape"])
        classes = tuple(str(c) for c in manifest["classes"])
        counts = {k: int(manifest[k]) for k in ("n_train", "n_test")}
    except (TypeError, ValueError) as e:
        raise DatasetError(
            f"{mpath}: malformed input_shape, classes, n_train or n_test ({e}); {_REPREPARE_HINT}"
        ) from e
    splits = []
    for fname, n_key in zip(PREPARED_FILES, ("n_train", "n_test"), strict=True):
        path = out_dir / fname
        entry = manifest["files"].get(fname) if isinstance(manifest["files"], dict) else None
        if not isinstance(entry, dict) or "sha256" not in entry:
            raise DatasetError(f"{mpath} has no sha256 entry for {fname}; {_REPREPARE_HINT}")
        if not path.is_file():
            raise DatasetError(f"prepared file {path} is missing; {_REPREPARE_HINT}")
        if verify and sha256_file(path) != entry["sha256"]:
            raise DatasetError(
                f"prepared file {path} does not match the sha256 in {mpath}: it was modified or corrupted; "
                f"{_REPREPARE_HINT}"
            )
        try:
            obj = load_torch(path)
        except TensorFileError as e:  # truncated zip, foreign pickle refused by weights_only, ...
            raise DatasetError(f"prepared file {e}; it cannot be loaded, {_REPREPARE_HINT}") from e
        if not isinstance(obj, dict) or not isinstance(obj.get("x"), Tensor) or not isinstance(obj.get("y"), Tensor):
            raise DatasetError(f"prepared file {path} does not hold {{'x': tensor, 'y': tensor}}; {_REPREPARE_HINT}")
        try:
            split = Split(obj["x"], obj["y"])
        except ValueError as e:
            raise DatasetError(f"prepared file {path}: {e}; {_REPREPARE_HINT}") from e
        if len(split) != counts[n_key] or _dtype_name(split.x.dtype) != manifest["dtype"]:
            raise DatasetError(
                f"prepared file {path} holds {len(split)} {_dtype_name(split.x.dtype)} samples, "
                "manifest says "
                f"{manifest[n_key]} {manifest['dtype']}; {_REPREPARE_HINT}"
            )
        _check_split(split, input_shape, len(classes), f"prepared file {path}")
        splits.append(split)
    return Dataset(
        name=str(manifest["dataset"]),
        train=splits[0],
        test=splits[1],
        classes=classes,
        input_shape=input_shape,
    )


__all__ = [
    "DATASET_NAMES",
    "Dataset",
    "DatasetError",
    "Split",
    "SyntheticSpec",
    "load_dataset",
    "load_prepared",
    "save_prepared",
    "stratified_subset",
    "to_float",
]
