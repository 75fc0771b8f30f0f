"""The source readers: every dataset the pipeline supports (digits, the synthetic union of subspaces, CIFAR-10,
Fashion-MNIST, Omniglot, an image folder), read from its own format into tensors by :func:`load_dataset`, split,
subset and resized as its :class:`~pipeline.config.data.DataConfig` asks.

Storage dtypes (what :func:`load_dataset` returns and :func:`pipeline.data.prepared.save_prepared` writes):

- ``cifar10`` / ``fashion_mnist`` / ``omniglot`` / ``image_folder``: uint8 images ``(N, C, H, W)`` (CIFAR-10 train is
  150 MB as uint8, 600 MB as float32); convert batches with :func:`pipeline.data.split.to_float` when they are used.
- ``digits``: float32 ``(N, 1, 8, 8)`` in [0, 1] (scikit-learn's 0..16 grey levels divided by 16).
- ``synthetic``: float32 ``(N, dim)`` unit rows drawn from a union of low-rank subspaces (paper, section 3).

Labels are always int64 ``(N,)`` in ``[0, len(classes))``. Every failure a user can cause (missing or corrupt
files, bad values) raises :class:`~pipeline.data.types.DatasetError` whose message says what is wrong, in which
file, and what to do about it.
"""

from __future__ import annotations

import gzip
import math
import os
import pickle
import shutil
import struct
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pipeline.config.data import DataConfig
from pipeline.data.omniglot import OMNIGLOT_FOLDER, OMNIGLOT_PARTS, omniglot_place, read_omniglot
from pipeline.data.split import holdout_index, holdout_split, limit_index, limit_split, split_index, stratified_split
from pipeline.data.types import Dataset, DatasetError, Split, check_split

_DOWNLOAD_HINT = "set data.download: true to fetch it"

_CIFAR_FOLDER = "cifar-10-batches-py"
_CIFAR_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
_CIFAR_TEST = ("test_batch",)
_CIFAR_META = "batches.meta"
_CIFAR_ROW = 3 * 32 * 32

_FMNIST_FOLDER = "FashionMNIST"
_FMNIST_APT = "apt-get install dataset-fashion-mnist"  # Debian's (Ubuntu's) package of the idx files, flat in:
FMNIST_DEBIAN_ROOT = Path("/usr/share/datasets/fashion-mnist")
_FMNIST_SIZES = {True: 60_000, False: 10_000}  # train / test images, a tenth of each of the 10 classes
_IDX_IMAGES_MAGIC = 2051  # 0x00000803: uint8, 3 dims
_IDX_LABELS_MAGIC = 2049  # 0x00000801: uint8, 1 dim

Splits = tuple[Split, Split, tuple[str, ...]]  # what a reader returns: train, test, class names


# --------------------------------------------------------------------------------------------------
# digits and synthetic (no files)


def _load_digits(data: DataConfig, root: Path) -> Splits:
    """sklearn's 8x8 digits: ``x`` float32 (1797, 1, 8, 8) = grey level / 16, ``y`` int64 (1797,), split by
    :func:`~pipeline.data.split.stratified_split`."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.from_numpy(np.asarray(bunch.images, dtype=np.float32) / 16.0).unsqueeze(1)  # (N, 1, 8, 8)
    y = torch.from_numpy(np.asarray(bunch.target, dtype=np.int64))  # (N,)
    return (*stratified_split(x, y, data.test_fraction, data.seed, "digits"), tuple(str(c) for c in range(10)))


def _load_synthetic(data: DataConfig, root: Path) -> Splits:
    """Union of ``n_clusters`` rank-``rank`` subspaces of R^dim (``data.synthetic``, drawn with ``data.seed``):
    ``x`` float32 (n, dim) unit rows, ``y`` int64 (n,), split by :func:`~pipeline.data.split.stratified_split`."""
    from pipeline.data.synthetic import union_of_subspaces

    spec = data.synthetic
    drawn = union_of_subspaces(
        n=spec.n_samples,
        n_clusters=spec.n_clusters,
        rank=spec.rank,
        dim=spec.dim,
        noise=spec.noise,
        seed=data.seed,
    )
    x = torch.as_tensor(drawn.x).to(torch.float32).contiguous()  # (n, dim)
    y = torch.as_tensor(drawn.labels).to(torch.int64).contiguous()  # (n,)
    train, test = stratified_split(x, y, data.test_fraction, data.seed, "synthetic data")
    return train, test, tuple(str(c) for c in range(spec.n_clusters))


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


def _load_cifar10(data: DataConfig, root: Path) -> Splits:
    """CIFAR-10 from ``root/cifar-10-batches-py`` (its own split; fetched first with ``data.download``): uint8
    (N, 3, 32, 32), rows are R, G, B planes of 32x32."""
    cls = _make_cifar10_class()
    splits = []
    for train in (True, False):
        try:  # torchvision unpickles the batch files: only files the user put there (see _read_cifar_pickle)
            ds = cls(str(root), train=train, download=data.download)
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


def _make_fashion_mnist_class(raw: Path):
    from torchvision.datasets import FashionMNIST

    class _FashionMNIST(FashionMNIST):
        """torchvision's FashionMNIST on the idx files in ``raw`` (either layout), ``*.gz`` too, headers checked."""

        @property
        def raw_folder(self) -> str:  # torchvision derives it from the class name
            return str(raw)

        @property
        def processed_folder(self) -> str:
            return os.path.join(self.root, _FMNIST_FOLDER, "processed")

        def _check_exists(self) -> bool:
            return not _fmnist_missing(raw)

        def _load_data(self):
            return _read_idx_pair(raw, self.train)

    return _FashionMNIST


def _fmnist_missing(raw: Path) -> list[str]:
    return [s for s in (*_idx_stems(True), *_idx_stems(False)) if not any((raw / n).is_file() for n in (s, f"{s}.gz"))]


def fmnist_raw_folder(root: Path) -> tuple[Path, list[str]]:
    """The folder to read Fashion-MNIST's idx files from, and the stems it lacks (none: all there): torchvision's
    layout ``root/FashionMNIST/raw/`` (what ``data.download`` fills) if complete, else ``root`` itself if complete (a
    flat folder, as Zalando's repository and Debian's ``dataset-fashion-mnist`` have them), else the one holding
    more of the files (torchvision's on a tie)."""
    layouts = [root / _FMNIST_FOLDER / "raw", root]
    return min(((raw, _fmnist_missing(raw)) for raw in layouts), key=lambda found: len(found[1]))


def _fmnist_fix(root: Path, fetch: bool = True) -> str:
    """The ways to get the idx files for data root ``root`` (``fetch``: data.download's first), for a message."""
    raw = root / _FMNIST_FOLDER / "raw"
    return (f"{f'{_DOWNLOAD_HINT} (into {raw}), or ' if fetch else ''}`{_FMNIST_APT}` (Debian, Ubuntu), which puts "
            f"them in {FMNIST_DEBIAN_ROOT}, and set data.root to that folder, or place the four idx files (plain or "
            f".gz) in {root} itself or in {raw}")


def _check_fmnist_counts(y: Tensor, train: bool, raw: Path) -> None:
    """Fashion-MNIST's sizes, on the decoded labels ``y`` (N,) of a split: 60,000 train / 10,000 test, a tenth of each
    class. Not the ``.gz`` files' MD5s: Debian recompressed them (the same images, other bytes), so the decoded data is
    what is checked, and what the manifest's sha256s are of."""
    expected, in_range = _FMNIST_SIZES[train], bool(len(y)) and 0 <= int(y.min()) and int(y.max()) < 10
    counts = torch.bincount(y, minlength=10).tolist() if in_range else None
    if len(y) == expected and counts == [expected // 10] * 10:
        return
    found = (f"{', '.join(f'{c:,}' for c in counts)} of classes 0-9" if counts is not None
             else f"labels {int(y.min())}..{int(y.max())}" if len(y) else "no labels")
    raise DatasetError(
        f"Fashion-MNIST's {'train' if train else 'test'} split in {raw} ({_idx_stems(train)[1]}[.gz]) holds "
        f"{len(y):,} images ({found}); Fashion-MNIST's has {expected:,}, {expected // 10:,} of each of 10 classes: "
        "these files are not Fashion-MNIST's, or are damaged. Replace them with the originals (`apt-get install "
        f"--reinstall dataset-fashion-mnist` for {FMNIST_DEBIAN_ROOT}, or delete them and {_DOWNLOAD_HINT})")


def _load_fashion_mnist(data: DataConfig, root: Path) -> Splits:
    """Fashion-MNIST from the idx files (plain or ``.gz``) of :func:`fmnist_raw_folder` (fetched into torchvision's
    layout first with ``data.download`` when neither layout has them); its own split, uint8 (N, 1, 28, 28), checked
    to be Fashion-MNIST's sizes once every file is read (:func:`_check_fmnist_counts`)."""
    raw, missing = fmnist_raw_folder(root)
    if missing and not data.download:
        what = (f"no Fashion-MNIST idx file in {root} or in {root / _FMNIST_FOLDER / 'raw'}" if len(missing) == 4
                else f"Fashion-MNIST file(s) {', '.join(missing)} (or .gz) missing in {raw}")
        raise DatasetError(f"{what}; {_fmnist_fix(root)}")
    raw = root / _FMNIST_FOLDER / "raw" if missing else raw  # data.download fetches into torchvision's layout
    cls = _make_fashion_mnist_class(raw)
    splits = []
    for train in (True, False):
        try:
            ds = cls(str(root), train=train, download=data.download)
        except DatasetError:
            raise
        except Exception as e:  # download failure or a file changed under our feet
            raise DatasetError(f"could not load Fashion-MNIST from {raw} ({type(e).__name__}: {e}); check the network "
                               f"if data.download is true, or {_fmnist_fix(root, fetch=False)}") from e
        x = ds.data.unsqueeze(1).contiguous()  # (N, 1, 28, 28) uint8
        splits.append(Split(x, torch.as_tensor(ds.targets, dtype=torch.int64)))
    for split, train in zip(splits, (True, False), strict=True):
        _check_fmnist_counts(split.y, train, raw)
    return splits[0], splits[1], tuple(cls.classes)


# --------------------------------------------------------------------------------------------------
# Omniglot


def _load_omniglot(data: DataConfig, root: Path) -> Splits:
    """Omniglot's background part (``root/omniglot-py/images_background``, fetched first with ``data.download``):
    uint8 (N, 1, 105, 105), one class per character (964), split by
    :func:`~pipeline.data.split.stratified_split` (``data.test_fraction``, ``data.seed``).

    Why not Omniglot's own background/evaluation split: the two parts share no character, and the evaluate stage
    fits its probes on the train split's labels and scores them on the test split's, so a test split of unseen
    characters would score every probe 0 and say nothing. The pipeline's train and test splits therefore hold
    different drawings of the same 964 characters (20 each: 16 / 4 at test_fraction 0.2). The evaluation part's
    659 unseen characters are the set-clustering study's test classes (ABC's protocol), read by
    :func:`omniglot_sets_split`.

    Cost: the part is decoded whole at 105 px (19280 x 105 x 105 B = 213 MB as uint8) and resized afterwards; on
    a fabricated tree of that size (19280 random binary PNGs) this took 4.4 s on 2 shared CPU cores, and
    :func:`omniglot_sets_split` at 28 px (both parts, 32460 PNGs) 7.3 s (``time.time()`` around the calls).
    """
    x, y, classes = read_omniglot(root, background=True, download=data.download)
    train, test = stratified_split(x, y, data.test_fraction, data.seed, f"Omniglot {OMNIGLOT_PARTS[True]}")
    return train, test, classes


def omniglot_sets_split(root: str | Path, image_size: int | None = 28,
                        download: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Omniglot as attention-based clustering's protocol uses it: train on the background part's 964 characters,
    test on the evaluation part's 659 characters, none of which training saw.

    Args:
        root: ``data.root``, the folder holding ``omniglot-py``.
        image_size: side S the drawings are resized to (bilinear, antialiased, as ``data.image_size``); 28, ABC's
            code's size, by default; None keeps 105.
        download: let torchvision fetch the parts that are missing (``data.download``).

    Returns:
        ``train_x`` uint8 (N_b, 1, S, S), ``train_y`` int64 (N_b,) in [0, 964), ``test_x`` uint8 (N_e, 1, S, S),
        ``test_y`` int64 (N_e,) in [964, 1623): the evaluation characters numbered after the background ones, so
        that no label names a class of both parts (the full data: N_b = 19280, N_e = 13180).
    """
    if image_size is not None and (not isinstance(image_size, int) or isinstance(image_size, bool) or image_size < 1):
        raise ValueError(f"image_size must be a positive integer or None, got {image_size!r}")
    base = Path(root).expanduser()
    if not download and not base.is_dir():
        raise DatasetError(f"data root {base} for Omniglot does not exist; {_DOWNLOAD_HINT}, or {omniglot_place(base)}")
    parts, offset = [], 0
    for background in (True, False):
        x, y, classes = read_omniglot(base, background=background, download=download)
        parts += [x if image_size is None else _resize(x, image_size), y + offset]
        offset += len(classes)
    train_x, train_y, test_x, test_y = parts
    return train_x, train_y, test_x, test_y


# --------------------------------------------------------------------------------------------------
# image folder


@dataclass(frozen=True, eq=False)
class FolderPlan:
    """What an image folder's splits are made of, before any image is decoded."""

    paths: tuple[str, ...]  # (N,) every image, in ImageFolder's order (classes sorted, then file names)
    y: Tensor  # (N,) int64 labels
    classes: tuple[str, ...]
    index: dict[str, Tensor]  # "train" / "val" / "test": ascending int64 indices into paths, the limits applied
    loader: Callable[[str], Any]  # path -> PIL image in RGB


def plan_image_folder(data: DataConfig, root: Path) -> FolderPlan:
    """Scan ``root/<class>/<image>`` (file names only) and choose each split's images: the stratified split of
    :func:`~pipeline.data.split.split_index` (``data.test_fraction``, ``data.seed``), the validation split held out
    of its training part (:func:`~pipeline.data.split.holdout_index`, ``data.val_size``), then the stratified
    subsets of ``data.limit_train`` / ``data.limit_test``: the rows :func:`load_dataset` gives the other data sets."""
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
    train, test = split_index(y, data.test_fraction, data.seed, f"image_folder {root}")
    keep, val = holdout_index(y[train], data.val_size, data.seed, f"image_folder {root}")
    index = {"train": limit_index(train[keep], y, data.limit_train, data.seed), "val": train[val],
             "test": limit_index(test, y, data.limit_test, data.seed)}
    return FolderPlan(tuple(p for p, _ in folder.samples), y, tuple(folder.classes), index, folder.loader)


def folder_images(plan: FolderPlan, part: str, image_size: int) -> Iterator[Tensor]:
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


def _folder_splits(data: DataConfig, root: Path) -> tuple[Split, Split, Split, tuple[str, ...]]:
    """An image folder's train, val and test splits in memory, RGB uint8 (n, 3, S, S) with S = ``data.image_size``,
    each image decoded into a preallocated tensor (never a list of images stacked), and its class names."""
    plan, size = plan_image_folder(data, root), data.image_size
    assert size is not None  # checked_root refuses an image folder without it
    splits = [Split(torch.empty((len(plan.index[part]), 3, size, size), dtype=torch.uint8), plan.y[plan.index[part]])
              for part in ("train", "val", "test")]  # (n, 3, S, S) each
    for split, part in zip(splits, ("train", "val", "test"), strict=True):
        for row, img in enumerate(folder_images(plan, part, size)):
            split.x[row] = img
    return *splits, plan.classes


# ---------------------------------------------------------------------------------------------------- public loader
# the reader of each data set but the image folder (read by its plan: _folder_splits), by name: (request, its root
# with ``~`` expanded) -> train, test, class names
READERS: dict[str, Callable[[DataConfig, Path], Splits]] = {
    "digits": _load_digits,
    "synthetic": _load_synthetic,
    "cifar10": _load_cifar10,
    "fashion_mnist": _load_fashion_mnist,
    "omniglot": _load_omniglot,
}
DATASET_NAMES = (*READERS, "image_folder")  # pipeline.config.data.DATASET_NAMES names the same (tests/config/)


def _resize(x: Tensor, size: int, chunk: int = 4096) -> Tensor:
    """Resize images ``(N, C, H, W)`` to ``(N, C, size, size)`` (bilinear, antialiased); dtype is kept."""
    if tuple(x.shape[-2:]) == (size, size):
        return x
    from torchvision.transforms.v2 import functional as F

    parts = [F.resize(x[i : i + chunk], [size, size], antialias=True) for i in range(0, x.shape[0], chunk)]
    out = torch.cat(parts) if parts else x.new_empty((0, x.shape[1], size, size))
    return out.clamp_(0.0, 1.0) if out.is_floating_point() else out


def checked_root(data: DataConfig) -> Path:
    """``data.root`` with ``~`` expanded, once the request is one :func:`load_dataset` can serve: ValueError for
    bad values (a :class:`DataConfig` refuses them already; this guards one built without validation),
    :class:`DatasetError` for a data root that cannot hold the data set."""
    name, image_size = data.dataset, data.image_size
    if name not in DATASET_NAMES:
        raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASET_NAMES)}")
    if not 0.0 < data.test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {data.test_fraction}")
    for key in ("image_size", "limit_train", "limit_test"):
        value = getattr(data, key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{key} must be a positive integer or None, got {value!r}")
    root = Path(data.root).expanduser()

    needs_root = name == "image_folder" or (name in ("cifar10", "fashion_mnist", "omniglot") and not data.download)
    if root.exists() and not root.is_dir() and name in ("image_folder", "cifar10", "fashion_mnist", "omniglot"):
        raise DatasetError(f"data root {root} for dataset '{name}' is not a directory; point data.root at the "
                           "folder that holds the data"
                           + (f" (the one with '{_CIFAR_FOLDER}' in it)" if name == "cifar10" else "")
                           + (f" (the one with '{OMNIGLOT_FOLDER}' in it)" if name == "omniglot" else ""))
    if needs_root and not root.is_dir():
        if name == "image_folder":
            fix = "point data.root at a folder with one sub-folder of images per class"
        elif name == "cifar10":
            fix = f"{_DOWNLOAD_HINT}, or place the extracted '{_CIFAR_FOLDER}' folder under {root}"
        elif name == "omniglot":
            fix = f"{_DOWNLOAD_HINT}, or {omniglot_place(root)}"
        else:
            fix = _fmnist_fix(root)
        raise DatasetError(f"data root {root} for dataset '{name}' does not exist; {fix}")
    if name == "image_folder" and image_size is None:
        raise ValueError(
            "image_folder needs image_size (set data.image_size, e.g. 32) so that all images share one shape"
        )
    return root


def load_dataset(data: DataConfig) -> Dataset:
    """Load the data set ``data.dataset`` asks for: train, val and test splits of ``x`` (N, *input_shape), ``y`` (N,).

    - ``digits`` / ``synthetic`` / ``omniglot`` / ``image_folder`` are split with a stratified ``train_test_split``
      of ``data.test_fraction`` and ``data.seed`` (``omniglot``: its background characters, see
      :func:`_load_omniglot`); ``cifar10`` / ``fashion_mnist`` keep their own train/test splits.
    - ``data.image_size`` resizes images (required for ``image_folder``; ignored by ``synthetic``).
    - ``data.val_size`` holds a stratified validation split out of the training split, before the limits.
    - ``data.limit_train`` / ``data.limit_test`` keep a seeded stratified subset of that many samples (see
      :func:`~pipeline.data.split.stratified_subset`).
    - ``data.synthetic`` gives the union-of-subspaces parameters.
    """
    root = checked_root(data)
    name, seed = data.dataset, data.seed
    if name == "image_folder":  # the plan holds the validation rows out before any image is decoded
        train, val, test, classes = _folder_splits(data, root)
    else:
        train, test, classes = READERS[name](data, root)
        train, val = holdout_split(train, data.val_size, seed, f"dataset '{name}'")
        train, test = limit_split(train, data.limit_train, seed), limit_split(test, data.limit_test, seed)
    image_size = None if name == "synthetic" else data.image_size
    if image_size is not None:
        train, val, test = (Split(_resize(s.x, image_size), s.y) for s in (train, val, test))
    input_shape = tuple(int(s) for s in train.x.shape[1:])
    for split, part in ((train, "train"), (val, "val"), (test, "test")):
        check_split(split, input_shape, len(classes), f"dataset '{name}' ({part} split)")
    return Dataset(name=name, train=train, test=test, classes=tuple(classes), input_shape=input_shape, val=val)


__all__ = ["DATASET_NAMES", "FMNIST_DEBIAN_ROOT", "READERS", "FolderPlan", "checked_root", "fmnist_raw_folder",
           "folder_images", "load_dataset", "omniglot_sets_split", "plan_image_folder"]
