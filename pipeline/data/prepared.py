"""The prepared format: what the ``prepare`` stage writes (:func:`prepare_dataset`, :func:`save_prepared`) and every
later stage reads (:func:`load_prepared`). Six ``.npy`` files, ``{train,val,test}_x.npy`` (the inputs, stored dtype, C
order) and ``{train,val,test}_y.npy`` (int64 labels), plus ``manifest.json`` with each file's sha256 (``val``: the
validation split held out of the training images, ``data.val_size``). numpy's own
format, so ``np.load(mmap_mode=...)`` maps a split of any size without reading it (``load_prepared(mmap=True)``);
written block by block (:func:`write_npy`), an image folder one decoded image at a time, so preparing never holds
the data set in memory. :func:`prepared_nbytes` sizes a split from its manifest, :func:`gather_rows` reads rows of
a (mapped) split in file order.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pipeline.config.data import DataConfig
from pipeline.data.sources import checked_root, folder_images, load_dataset, plan_image_folder
from pipeline.data.types import Dataset, DatasetError, Split, check_split
from pipeline.io import atomic_dir, sha256_file, write_json

MANIFEST = "manifest.json"
SPLIT_FILES = {"train": ("train_x.npy", "train_y.npy"), "val": ("val_x.npy", "val_y.npy"),
               "test": ("test_x.npy", "test_y.npy")}  # (inputs, labels)
PARTS = tuple(SPLIT_FILES)  # train, val, test
PREPARED_FILES = tuple(name for part in PARTS for name in SPLIT_FILES[part])
_PREPARE_HINT = "run `transfusion prepare` (or `dvc repro prepare`) first"
_REPREPARE_HINT = "run `transfusion prepare` (or `dvc repro prepare`) again"
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


def _manifest(name: str, classes: Sequence[str], input_shape: Sequence[int], counts: dict[str, int],
              dtype: torch.dtype, extra: dict | None) -> dict[str, Any]:
    """The manifest's fields, ``extra`` after them (``files`` is added once they are written); ``counts``: the
    samples of each split, by part."""
    manifest: dict[str, Any] = {
        "dataset": name,
        "classes": list(classes),
        "input_shape": list(input_shape),
        **{f"n_{part}": counts[part] for part in PARTS},
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
    """Write ``{train,val,test}_x.npy``, ``{train,val,test}_y.npy`` and ``manifest.json`` to ``out_dir``, atomically.

    The directory is built beside ``out_dir`` and swapped in whole, so a crash leaves the previous ``out_dir``
    (or none). The manifest holds ``dataset, classes, input_shape, n_train, n_val, n_test, dtype`` and
    ``files: {name: {sha256, shape}}`` (the shape of the array in that file), plus the keys of ``extra``.
    Returns the manifest.
    """
    splits = {"train": ds.train, "val": ds.val, "test": ds.test}
    if len({split.x.dtype for split in splits.values()}) > 1:
        raise DatasetError("the train, val and test inputs differ in dtype: "
                           + ", ".join(f"{part} {split.x.dtype}" for part, split in splits.items()))
    for part, split in splits.items():
        check_split(split, ds.input_shape, len(ds.classes), f"dataset '{ds.name}' ({part} split)")
    manifest = _manifest(ds.name, ds.classes, ds.input_shape, {part: len(s) for part, s in splits.items()},
                         ds.train.x.dtype, extra)
    with atomic_dir(out_dir) as tmp:
        for part, split in splits.items():
            manifest["files"].update(_write_split(tmp, part, split.x.shape, split.x.dtype, _row_blocks(split.x),
                                                  split.y))
        write_json(tmp / MANIFEST, manifest)
    return manifest


def _prepare_image_folder(data: DataConfig, root: Path, out_dir: Path | str, image_size: int,
                          extra: dict | None) -> dict:
    """:func:`save_prepared` of the image folder :func:`~pipeline.data.sources.load_dataset` would load, the same
    bytes, in bounded memory: each image is decoded and appended to its split's file before the next is read."""
    plan = plan_image_folder(data, root)
    shape = (3, image_size, image_size)
    n = {part: len(plan.index[part]) for part in PARTS}
    manifest = _manifest("image_folder", plan.classes, shape, n, torch.uint8, extra)
    with atomic_dir(out_dir) as tmp:
        for part in PARTS:
            images = (img.numpy()[None] for img in folder_images(plan, part, image_size))  # (1, 3, S, S) each
            manifest["files"].update(_write_split(tmp, part, (n[part], *shape), torch.uint8, images,
                                                  plan.y[plan.index[part]]))
        write_json(tmp / MANIFEST, manifest)
    return manifest


def prepare_dataset(data: DataConfig, out_dir: Path | str, extra: dict | None = None) -> dict:
    """``save_prepared(load_dataset(data), out_dir, extra)``, the ``prepare`` stage; returns the manifest.

    An ``image_folder`` is written without ever being in memory whole (one decoded image at a time), to the same
    bytes; the other data sets are loaded, then written.
    """
    if data.dataset != "image_folder":
        return save_prepared(load_dataset(data), out_dir, extra)
    root = checked_root(data)
    assert data.image_size is not None  # checked_root refuses an image folder without it
    return _prepare_image_folder(data, root, out_dir, data.image_size, extra)


def _require(manifest: dict, keys: Sequence[str], path: Path) -> None:
    missing = [k for k in keys if k not in manifest]
    if missing:
        raise DatasetError(f"{path} lacks the field(s) {', '.join(missing)}; {_REPREPARE_HINT}")


def read_manifest(out_dir: Path) -> dict[str, Any]:
    """``out_dir``'s manifest, with the fields every manifest has; :class:`DatasetError` naming the file and the
    fix when it is missing, not JSON, or lacks one."""
    mpath = out_dir / MANIFEST
    if not mpath.is_file():
        raise DatasetError(f"no prepared data: {mpath} does not exist; {_PREPARE_HINT}")
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, ValueError) as e:
        raise DatasetError(f"{mpath} is not readable JSON ({e}); {_REPREPARE_HINT}") from e
    if not isinstance(manifest, dict):
        raise DatasetError(f"{mpath} does not hold a JSON object; {_REPREPARE_HINT}")
    _require(manifest, ("dataset", "classes", "input_shape", *(f"n_{part}" for part in PARTS), "dtype", "files"),
             mpath)
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
    check_split(split, input_shape, n_classes, f"prepared file {x_path}", f"prepared file {out_dir / y_name}")
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
    manifest = read_manifest(out_dir)
    try:
        input_shape = tuple(int(s) for s in manifest["input_shape"])
        classes = tuple(str(c) for c in manifest["classes"])
        counts = {part: int(manifest[f"n_{part}"]) for part in PARTS}
    except (TypeError, ValueError) as e:
        raise DatasetError(
            f"{out_dir / MANIFEST}: malformed input_shape, classes, n_train, n_val or n_test ({e}); {_REPREPARE_HINT}"
        ) from e
    train, val, test = (_load_split(out_dir, manifest, part, counts[part], input_shape, len(classes), verify, mmap)
                        for part in PARTS)
    return Dataset(name=str(manifest["dataset"]), train=train, test=test, classes=classes, input_shape=input_shape,
                   val=val)


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
    "MANIFEST",
    "PARTS",
    "PREPARED_FILES",
    "SPLIT_FILES",
    "gather_rows",
    "load_prepared",
    "prepare_dataset",
    "prepared_nbytes",
    "read_manifest",
    "save_prepared",
    "write_npy",
]
