"""Tests for pipeline/data (sources, split, prepared, types): every loader on data fabricated in its real on-disk
format, no network; the stratified subsets and splits; the prepared format."""

from __future__ import annotations

import collections
import gzip
import importlib
import itertools
import json
import math
import pickle
import shutil
import struct
from pathlib import Path
from urllib.error import URLError

import numpy as np
import pytest
import torch

from pipeline.config.data import DataConfig, SyntheticConfig
from pipeline.data import prepared as D
from pipeline.data.prepared import (
    PREPARED_FILES,
    gather_rows,
    load_prepared,
    prepare_dataset,
    prepared_nbytes,
    save_prepared,
    write_npy,
)
from pipeline.data.sources import DATASET_NAMES, READERS, checked_root, load_dataset
from pipeline.data.split import holdout_index, stratified_subset, to_float
from pipeline.data.types import Dataset, DatasetError, Split
from pipeline.io import sha256_file

FILES = sorted(["manifest.json", *PREPARED_FILES])  # what a prepared directory holds

CIFAR_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


# ---------------------------------------------------------------------------------- fabricated data in the real formats
def write_cifar(root: Path, per_batch: int = 20, seed: int = 0) -> dict[str, tuple[np.ndarray, list[int]]]:
    """Write ``root/cifar-10-batches-py`` like the official archive: python pickles of dicts."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    written = {}
    for k, name in enumerate([f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]):
        data = rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
        labels = [int((i + k) % 10) for i in range(per_batch)]
        pickle_to(folder / name, {"batch_label": f"fabricated batch {k}", "labels": labels, "data": data,
                                  "filenames": [f"img_{k}_{i}.png" for i in range(per_batch)]})
        written[name] = (data, labels)
    pickle_to(folder / "batches.meta", {"label_names": CIFAR_NAMES, "num_cases_per_batch": per_batch, "num_vis": 3072})
    return written


def pickle_to(path: Path, obj) -> None:
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)


def idx_bytes(arr: np.ndarray, magic: int) -> bytes:
    """The idx format: big-endian uint32 magic, one big-endian uint32 per dim, then the uint8 payload."""
    return struct.pack(f">I{arr.ndim}I", magic, *arr.shape) + np.ascontiguousarray(arr, dtype=np.uint8).tobytes()


FMNIST_FULL = {"train": 60_000, "t10k": 10_000}  # Fashion-MNIST's split sizes, which the reader checks
FMNIST_STEMS = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",  # in the order the reader names them
                "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def write_fmnist(root: Path, n_train: int = 30, n_test: int = 12, gz: bool = False, seed: int = 0,
                 flat: bool = False) -> dict:
    """Fabricated idx files (random images, labels 0..9 in turn) in torchvision's ``root/FashionMNIST/raw``, or in
    ``root`` itself with ``flat`` (Debian's and Zalando's layout); ``gz``: gzip'd (stored, fast). Returns
    ``{"train" | "t10k": (images uint8 (n, 28, 28), labels uint8 (n,))}``."""
    rng = np.random.default_rng(seed)
    raw = root if flat else root / "FashionMNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=flat)
    out = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = (np.arange(n) % 10).astype(np.uint8)
        for kind, arr, magic in (("images-idx3", images, 2051), ("labels-idx1", labels, 2049)):
            stem, blob = f"{prefix}-{kind}-ubyte", idx_bytes(arr, magic)
            if gz:
                stem, blob = f"{stem}.gz", gzip.compress(blob, compresslevel=0)
            (raw / stem).write_bytes(blob)
        out[prefix] = (images, labels)
    return out


@pytest.fixture(scope="module")
def fmnist_full(tmp_path_factory) -> dict:
    """Fabricated Fashion-MNIST of the real sizes (60,000 / 10,000, a tenth of each class), written once: flat folders
    ``plain`` and ``gz`` (tests point data.root at them or link them, never write there), and the arrays."""
    base = tmp_path_factory.mktemp("fmnist-full")
    written = write_fmnist(base / "plain", *FMNIST_FULL.values(), flat=True)
    write_fmnist(base / "gz", *FMNIST_FULL.values(), gz=True, flat=True)
    return {"plain": base / "plain", "gz": base / "gz", "arrays": written}


def fmnist_root(tmp_path: Path, folder: Path, layout: str) -> Path:
    """A data root for the idx files in ``folder``: ``folder`` itself (``flat``), or ``tmp_path`` with
    ``FashionMNIST/raw`` a link to it (``torchvision``), as a user links Debian's folder into torchvision's layout."""
    if layout == "flat":
        return folder
    (tmp_path / "FashionMNIST").mkdir()
    (tmp_path / "FashionMNIST" / "raw").symlink_to(folder, target_is_directory=True)
    return tmp_path


def write_png_folder(root: Path) -> dict[str, tuple[int, int, int]]:
    """Three classes of solid-colour PNGs of varying size and mode; returns the colour of each class."""
    from PIL import Image

    colours = {"blue": (5, 20, 240), "green": (10, 200, 40), "red": (220, 15, 30)}
    for name, rgb in colours.items():
        (root / name).mkdir(parents=True)
        for i in range(5):
            size = (10 + 3 * i, 7 + 2 * i)
            Image.new("RGB", size, rgb).save(root / name / f"{i}.png")
    # a grey-scale image in its own class: the loader converts it to RGB
    (root / "zgrey").mkdir()
    for i in range(5):
        Image.new("L", (9, 9), 128).save(root / "zgrey" / f"{i}.png")
    colours["zgrey"] = (128, 128, 128)
    return colours


@pytest.fixture(scope="module")
def digits() -> Dataset:
    return load_dataset(DataConfig(dataset="digits", root="unused"))


# -------------------------------------------------------------------------------------------------------------- helpers
def test_to_float_matches_loop():
    x = torch.randint(0, 256, (2, 3, 4, 5), dtype=torch.uint8)
    got = to_float(x)
    assert got.dtype == torch.float32 and got.shape == x.shape
    flat, ref = got.flatten().tolist(), x.flatten().tolist()
    for i in range(len(ref)):
        assert abs(flat[i] - ref[i] / 255.0) < 1e-7
    f64 = torch.rand(3, 4, dtype=torch.float64)
    assert to_float(f64).dtype == torch.float32
    assert torch.allclose(to_float(f64).double(), f64, atol=1e-7)
    with pytest.raises(TypeError, match="uint8 or floating"):
        to_float(torch.zeros(3, dtype=torch.int32))


def _reference_quota(labels: list[int], n: int) -> dict[int, int]:
    """Largest-remainder allocation with explicit loops in float64."""
    counts = collections.Counter(labels)
    total = len(labels)
    quota, frac = {}, {}
    for k in sorted(counts):
        exact = counts[k] * n / total
        quota[k] = math.floor(exact)
        frac[k] = exact - quota[k]
    left = n - sum(quota.values())
    for k in sorted(counts, key=lambda k: (-frac[k], k))[:left]:
        quota[k] += 1
    return quota


@pytest.mark.parametrize("total,n,n_classes", [(10, 3, 2), (50, 7, 4), (101, 40, 5), (30, 30, 3), (12, 1, 4)])
def test_stratified_subset_against_reference(total, n, n_classes):
    gen = torch.Generator().manual_seed(total)
    y = torch.randint(0, n_classes, (total,), generator=gen)
    idx = stratified_subset(y, n, seed=3)
    assert idx.dtype == np.int64 and idx.shape == (min(n, total),)
    assert idx.tolist() == sorted(set(idx.tolist())), "indices must be unique and sorted"
    assert 0 <= int(idx.min()) and int(idx.max()) < total
    got = collections.Counter(int(y[i]) for i in idx.tolist())
    ref = _reference_quota(y.tolist(), n)
    assert {k: v for k, v in ref.items() if v} == got
    assert np.array_equal(idx, stratified_subset(y, n, seed=3))


def test_stratified_subset_depends_on_seed():
    y = torch.arange(200) % 4
    a, b = stratified_subset(y, 40, seed=0), stratified_subset(y, 40, seed=1)
    assert not np.array_equal(a, b)
    assert torch.equal(torch.bincount(y[a]), torch.bincount(y[b]))


def test_stratified_subset_minimum_per_class_and_arguments():
    y = torch.tensor([0] * 50 + [1] * 2 + [2])
    assert np.bincount(y[stratified_subset(y, 6)].numpy()).tolist() == [6]  # largest remainders: class 0 only
    assert np.bincount(y[stratified_subset(y, 6, min_per_class=1)].numpy()).tolist() == [4, 1, 1]
    assert np.bincount(y[stratified_subset(y, 6, min_per_class=2)].numpy()).tolist() == [3, 2, 1]
    assert np.bincount(y[stratified_subset(y, fraction=0.1, min_per_class=2)].numpy()).tolist() == [5, 2, 1]
    with pytest.raises(ValueError, match="cannot hold"):
        stratified_subset(y, 2, min_per_class=1)
    assert np.array_equal(stratified_subset(y, 100, min_per_class=1), np.arange(len(y)))  # more than there are
    with pytest.raises(ValueError, match="exactly one"):
        stratified_subset(y, 5, fraction=0.5)


def test_split_rejects_bad_labels():
    with pytest.raises(ValueError, match="differ in length"):
        Split(torch.zeros(3, 2), torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="int64"):
        Split(torch.zeros(3, 2), torch.zeros(3, dtype=torch.int32))


# --------------------------------------------------------------------------------------------------------------- digits
def test_digits_shapes_range_classes(digits):
    from sklearn.datasets import load_digits

    assert digits.name == "digits" and digits.classes == tuple(str(i) for i in range(10))
    assert digits.input_shape == (1, 8, 8)
    for split in (digits.train, digits.test):
        assert split.x.dtype == torch.float32 and split.x.shape[1:] == (1, 8, 8)
        assert split.y.dtype == torch.int64
        assert float(split.x.min()) >= 0.0 and float(split.x.max()) <= 1.0
    ref = load_digits()
    n = len(ref.target)
    assert len(digits.test) == math.ceil(0.2 * n) and len(digits.train) + len(digits.val) + len(digits.test) == n
    assert len(digits.val) == round(0.1 * (n - len(digits.test)))  # data.val_size: a tenth of the training images
    # every (image, label) of sklearn appears exactly once across the three splits, scaled by 1/16
    want = collections.Counter(
        (tuple((ref.images[i] / 16.0).astype(np.float32).ravel().tolist()), int(ref.target[i])) for i in range(n)
    )
    have = collections.Counter(
        (tuple(x.ravel().tolist()), int(y)) for s in (digits.train, digits.val, digits.test)
        for x, y in zip(s.x, s.y, strict=True)
    )
    assert have == want
    # stratified: each class's test share is within one sample of test_fraction
    n_k, t_k = np.bincount(ref.target, minlength=10), torch.bincount(digits.test.y, minlength=10).numpy()
    assert (np.abs(t_k - 0.2 * n_k) <= 1.0).all(), (t_k, n_k)


def test_digits_deterministic_per_seed(digits):
    again = load_dataset(DataConfig(dataset="digits", root="unused", seed=0))
    assert torch.equal(again.train.x, digits.train.x) and torch.equal(again.test.y, digits.test.y)
    other = load_dataset(DataConfig(dataset="digits", root="unused", seed=1))
    assert not torch.equal(other.test.y, digits.test.y) or not torch.equal(other.test.x, digits.test.x)


def test_digits_limits_are_stratified_subsets(digits):
    small = load_dataset(DataConfig(dataset="digits", root="unused", limit_train=50, limit_test=20))
    assert len(small.train) == 50 and len(small.test) == 20
    assert torch.bincount(small.train.y, minlength=10).tolist() == [5] * 10
    full_rows = {tuple(r.tolist()) for r in digits.train.x.flatten(1)}
    assert all(tuple(r.tolist()) in full_rows for r in small.train.x.flatten(1))


def test_digits_image_size_resizes():
    ds = load_dataset(DataConfig(dataset="digits", root="unused", image_size=16, limit_train=30, limit_test=10))
    assert ds.input_shape == (1, 16, 16) and ds.train.x.shape == (30, 1, 16, 16)
    assert float(ds.train.x.min()) >= 0.0 and float(ds.train.x.max()) <= 1.0


@pytest.mark.parametrize("request_of", [DataConfig, DataConfig.model_construct], ids=["validated", "unvalidated"])
def test_bad_arguments(request_of):
    """Refused as a DataConfig, and by load_dataset itself when a request was built without validation."""
    with pytest.raises(ValueError) as e:
        load_dataset(request_of(dataset="imagenet", root="."))
    for name in DATASET_NAMES:
        assert name in str(e.value)
    with pytest.raises(ValueError, match="test_fraction"):
        load_dataset(request_of(dataset="digits", root=".", test_fraction=1.0))
    with pytest.raises(ValueError, match="limit_train"):
        load_dataset(request_of(dataset="digits", root=".", limit_train=0))


def reader_dataset(data: DataConfig) -> Dataset:
    """The data set as its reader gives it (``READERS``: the file's own train and test rows, in order), before
    ``load_dataset`` holds the validation split out of the training rows (``test_holdout_*`` test that)."""
    train, test, classes = READERS[data.dataset](data, checked_root(data))
    return Dataset(data.dataset, train, test, tuple(classes), tuple(train.x.shape[1:]), val=test)


# ------------------------------------------------------------------------------------------------------------- CIFAR-10
def test_cifar10_round_trips_pixels(tmp_path, no_download):
    written = write_cifar(tmp_path)
    data = DataConfig(dataset="cifar10", root=str(tmp_path), download=True)  # present: never fetched
    ds = reader_dataset(data)
    assert ds.classes == tuple(CIFAR_NAMES) and ds.input_shape == (3, 32, 32)
    assert ds.train.x.dtype == torch.uint8 and ds.train.x.shape == (100, 3, 32, 32)
    assert ds.test.x.shape == (20, 3, 32, 32)
    train_data = np.concatenate([written[f"data_batch_{i}"][0] for i in range(1, 6)])
    train_labels = sum((written[f"data_batch_{i}"][1] for i in range(1, 6)), [])
    assert ds.train.y.tolist() == train_labels and ds.test.y.tolist() == written["test_batch"][1]
    # explicit loops: row = R plane, G plane, B plane, each 32x32 in row-major order
    x = ds.train.x.numpy()
    for k, c, h, w in itertools.product((0, 19, 20, 57, 99), range(3), range(32), range(32)):
        assert x[k, c, h, w] == train_data[k, c * 1024 + h * 32 + w]
    xt, test_data = ds.test.x.numpy(), written["test_batch"][0]
    for c in range(3):
        assert np.array_equal(xt[:, c], test_data[:, c * 1024 : (c + 1) * 1024].reshape(-1, 32, 32))


@pytest.mark.parametrize("dataset", ["cifar10", "fashion_mnist", "omniglot"])
def test_download_failure_is_explained(tmp_path, monkeypatch, dataset):
    """Offline: a CIFAR-10 batch corrupt (so re-downloaded), or no Fashion-MNIST or Omniglot file at all."""
    calls = []

    def offline(*a, **k):
        calls.append(a)
        raise URLError("offline")

    name = {"cifar10": "cifar", "fashion_mnist": "mnist", "omniglot": "omniglot"}[dataset]
    module = importlib.import_module(f"torchvision.datasets.{name}")  # the module whose downloads fail
    monkeypatch.setattr(module, "download_and_extract_archive", offline)
    if dataset == "cifar10":
        write_cifar(tmp_path)
        (tmp_path / "cifar-10-batches-py" / "data_batch_4").write_bytes(b"\x80\x02}q")  # corrupt: re-download
    with pytest.raises(DatasetError, match="network") as e:
        load_dataset(DataConfig(dataset=dataset, root=str(tmp_path), download=True))
    assert calls and "<urlopen error offline>" in str(e.value.__cause__)  # the network's error, kept as the cause
    if dataset == "omniglot":  # the background part alone
        assert [a[0] for a in calls] == [f"{module.Omniglot.download_url_prefix}/images_background.zip"]


@pytest.mark.parametrize("damage,needles", [
    (lambda f: (f / "data_batch_3").unlink(), ["data_batch_3", "data.download: true", "!data_batch_2"]),
    *[(lambda f, e=entry: pickle_to(f / "test_batch", e), ["test_batch", needle]) for entry, needle in [
        ({"images": np.zeros((4, 3072), np.uint8), "labels": [0] * 4}, "no key 'data'"),
        ({"data": np.zeros((4, 3072), np.uint8)}, "no key 'labels'"),
        ({"data": np.zeros((4, 3000), np.uint8), "labels": [0] * 4}, "expected uint8"),
        ({"data": np.zeros((4, 3072), np.uint8), "labels": [0] * 3}, "'labels'"),
        ({"data": np.zeros((4, 3072), np.uint8), "labels": [0, 1, 2, 10]}, "labels outside"),
    ]],
])
def test_cifar10_damaged_files_are_named(tmp_path, damage, needles):
    """A missing batch, a malformed batch: refused, the file named (and what is fine not). The missing root, a
    truncated pickle and the meta file: tests/test_hostile_input.py's cifar cases."""
    root = tmp_path / "root"
    write_cifar(root)
    damage(root / "cifar-10-batches-py")
    with pytest.raises(DatasetError) as e:
        load_dataset(DataConfig(dataset="cifar10", root=str(root)))
    assert_names(str(e.value), needles, root=root)


def assert_names(msg: str, needles: list[str], **fields) -> None:
    """Each needle (formatted with ``fields``) is in ``msg``; one starting with "!" is not."""
    for needle in needles:
        if needle.startswith("!"):
            assert needle[1:].format(**fields) not in msg
        else:
            assert needle.format(**fields) in msg, (needle, msg)


# -------------------------------------------------------------------------------------------------------- Fashion-MNIST
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["torchvision", "flat"])
@pytest.mark.parametrize("gz", [False, True])
def test_fashion_mnist_values(tmp_path, fmnist_full, gz, layout, no_download):
    from torchvision.datasets import FashionMNIST

    folder = fmnist_full["gz" if gz else "plain"]
    before = sorted(p.name for p in folder.iterdir())
    root = fmnist_root(tmp_path, folder, layout)
    ds = reader_dataset(DataConfig(dataset="fashion_mnist", root=str(root), download=True))  # present: never fetched
    assert ds.classes == tuple(FashionMNIST.classes) and ds.input_shape == (1, 28, 28)
    assert ds.train.x.dtype == torch.uint8 and ds.train.x.shape == (60_000, 1, 28, 28)
    assert ds.test.x.shape == (10_000, 1, 28, 28)
    arrays = fmnist_full["arrays"]
    for split, (images, labels) in ((ds.train, arrays["train"]), (ds.test, arrays["t10k"])):
        x, y = split.x.numpy(), split.y.numpy()
        for k in (0, 1, len(labels) - 1):  # rows, then columns, of the first and last images, pixel by pixel
            assert y[k] == int(labels[k])
            for h in range(0, 28, 3):
                for w in range(28):
                    assert x[k, 0, h, w] == images[k, h, w]
        assert np.array_equal(x[:, 0], images) and np.array_equal(y, labels.astype(np.int64))
        assert np.bincount(y).tolist() == [len(y) // 10] * 10
    # read without writing anything into the user's data folder
    assert sorted(p.name for p in folder.iterdir()) == before == sorted(f"{s}.gz" if gz else s for s in FMNIST_STEMS)


def test_fashion_mnist_the_layout_read(tmp_path):
    """torchvision's layout when it is complete, else a complete flat folder, else the one with the most files."""
    from pipeline.data.sources import fmnist_raw_folder

    tv = tmp_path / "FashionMNIST" / "raw"
    assert fmnist_raw_folder(tmp_path) == (tv, list(FMNIST_STEMS))  # nothing anywhere: torchvision's is named
    write_fmnist(tmp_path, flat=True)
    assert fmnist_raw_folder(tmp_path) == (tmp_path, [])
    write_fmnist(tmp_path, gz=True)
    assert fmnist_raw_folder(tmp_path) == (tv, [])
    (tv / "t10k-images-idx3-ubyte.gz").unlink()
    assert fmnist_raw_folder(tmp_path) == (tmp_path, [])
    (tmp_path / "t10k-images-idx3-ubyte").unlink()
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    assert fmnist_raw_folder(tmp_path) == (tv, ["t10k-images-idx3-ubyte"])


@pytest.mark.parametrize("labels, found", [
    (lambda y: np.where(np.arange(len(y)) == 0, 1, y), "999, 1,001, 1,000"),  # one image of class 0 said to be 1
    (lambda y: np.where(np.arange(len(y)) == 5, 10, y), "labels 0..10"),  # a class Fashion-MNIST has not
], ids=["unbalanced", "out-of-range"])
def test_fashion_mnist_classes_must_be_a_tenth_each(tmp_path, fmnist_full, labels, found):
    """The real sizes with the test split's classes off: refused, the counts named."""
    for stem in FMNIST_STEMS[:3]:
        (tmp_path / stem).symlink_to(fmnist_full["plain"] / stem)
    y = labels(fmnist_full["arrays"]["t10k"][1].astype(np.int64)).astype(np.uint8)
    (tmp_path / FMNIST_STEMS[3]).write_bytes(idx_bytes(y, 2049))
    with pytest.raises(DatasetError, match="test split") as e:
        load_dataset(DataConfig(dataset="fashion_mnist", root=str(tmp_path)))
    assert f"holds 10,000 images ({found}" in str(e.value) and "1,000 of each of 10 classes" in str(e.value)


RAW = Path("FashionMNIST", "raw")
APT = ["`apt-get install dataset-fashion-mnist`", "/usr/share/datasets/fashion-mnist", "data.download: true"]


def mutate(rel: str, change):
    def damage(root: Path) -> None:
        (root / rel).write_bytes(change((root / rel).read_bytes()))

    return damage


@pytest.mark.parametrize("written,damage,needles", [
    (None, lambda r: shutil.rmtree(r), ["does not exist", *APT]),
    (None, lambda r: (r / RAW).mkdir(parents=True),  # no file in either layout: every way to get them
     ["no Fashion-MNIST idx file in {root} or in {raw}", "data.root", *APT]),
    ({"gz": True, "flat": True}, lambda r: (r / "train-labels-idx1-ubyte.gz").unlink(),
     ["train-labels-idx1-ubyte (or .gz) missing in {root};", *APT, "!t10k-labels"]),
    ({"flat": True}, lambda r: None,  # 30 / 12 images: well-formed idx files, not Fashion-MNIST's
     ["train split in {root} (train-labels-idx1-ubyte[.gz]) holds 30 images (3, 3, 3,",
      "60,000, 6,000 of each of 10 classes", "apt-get install --reinstall dataset-fashion-mnist"]),
    *[({}, mutate(RAW / "train-images-idx3-ubyte", change), ["train-images-idx3-ubyte", needle]) for change, needle in [
        (lambda b: struct.pack(">I", 2049) + b[4:], "not an idx file"),  # label magic on an image file
        (lambda b: b + b"\x00", "truncated or corrupt"),  # trailing bytes
        (lambda b: b[:10], "truncated inside its header"),
    ]],
])
def test_fashion_mnist_damaged_files_are_named(tmp_path, written, damage, needles):
    """A missing root, folder or file, other sizes, a bad idx file: refused, the file named, with the ways to get
    the data (a missing file in torchvision's layout, garbage, a bad gzip, counts that differ, a cut file:
    tests/test_hostile_input.py's fmnist cases)."""
    root = tmp_path / "root"
    root.mkdir()
    if written is not None:
        write_fmnist(root, **written)
    damage(root)
    with pytest.raises(DatasetError) as e:
        load_dataset(DataConfig(dataset="fashion_mnist", root=str(root)))
    assert_names(str(e.value), needles, root=root, raw=root / RAW)


# --------------------------------------------------------------------------------------------------------- image folder
def test_image_folder_shapes_labels_colours(tmp_path):
    colours = write_png_folder(tmp_path)
    ds = load_dataset(DataConfig(dataset="image_folder", root=str(tmp_path), image_size=8, test_fraction=0.4,
                                 seed=1))
    assert ds.classes == ("blue", "green", "red", "zgrey") and ds.input_shape == (3, 8, 8)
    assert len(ds.train) == 8 and len(ds.val) == 4 and len(ds.test) == 8  # val: at least one image a class
    assert torch.bincount(ds.test.y, minlength=4).tolist() == [2] * 4 and torch.bincount(ds.val.y).tolist() == [1] * 4
    for split in (ds.train, ds.val, ds.test):
        assert split.x.dtype == torch.uint8 and split.x.shape[1:] == (3, 8, 8)
        for k in range(len(split)):
            rgb = colours[ds.classes[int(split.y[k])]]
            for c in range(3):  # a solid image stays solid under resizing, in RGB channel order
                assert split.x[k, c].min() == rgb[c] and split.x[k, c].max() == rgb[c]


# ------------------------------------------------------------------------------------------------------------ synthetic
def test_synthetic_shapes_and_determinism():
    spec = SyntheticConfig(n_samples=300, n_clusters=3, rank=2, dim=16, noise=0.05)
    ds = load_dataset(DataConfig(dataset="synthetic", root="unused", synthetic=spec, seed=4))
    assert ds.input_shape == (16,) and ds.classes == ("0", "1", "2")
    assert len(ds.train) + len(ds.val) + len(ds.test) == 300 and len(ds.test) == 60 and len(ds.val) == 24
    assert ds.train.x.dtype == torch.float32 and ds.train.y.dtype == torch.int64
    assert torch.allclose(ds.train.x.norm(dim=1), torch.ones(len(ds.train)), atol=1e-4)
    assert torch.bincount(ds.test.y, minlength=3).tolist() == [20, 20, 20]
    again = load_dataset(DataConfig(dataset="synthetic", root="unused", synthetic=spec, seed=4))
    assert torch.equal(again.train.x, ds.train.x) and torch.equal(again.test.y, ds.test.y)
    other = load_dataset(DataConfig(dataset="synthetic", root="unused", synthetic=spec, seed=5))
    assert not torch.equal(other.train.x, ds.train.x)


# -------------------------------------------------------------------------------------------------------- prepared data
def _uint8_dataset(n_train: int = 12, n_test: int = 6, n_val: int = 3) -> Dataset:
    gen = torch.Generator().manual_seed(0)
    n = n_train + n_val + n_test
    x = torch.randint(0, 256, (n, 3, 4, 4), dtype=torch.uint8, generator=gen)
    y = torch.arange(n) % 3
    return Dataset(
        name="image_folder",
        train=Split(x[:n_train], y[:n_train]),  # views into a bigger storage on purpose
        test=Split(x[n_train:n_train + n_test], y[n_train:n_train + n_test]),
        classes=("a", "b", "c"),
        input_shape=(3, 4, 4),
        val=Split(x[n_train + n_test:], y[n_train + n_test:]),
    )


@pytest.mark.parametrize("which", ["digits", "uint8"])
def test_prepared_round_trip(tmp_path, digits, which):
    ds = digits if which == "digits" else _uint8_dataset()
    out = tmp_path / "prepared"
    manifest = save_prepared(ds, out, extra={"seed": 0, "source": which})
    assert sorted(p.name for p in out.iterdir()) == FILES
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk == manifest
    assert manifest["dataset"] == ds.name and manifest["classes"] == list(ds.classes)
    assert manifest["input_shape"] == list(ds.input_shape)
    assert manifest["n_train"] == len(ds.train) and manifest["n_test"] == len(ds.test)
    assert manifest["dtype"] == str(ds.train.x.dtype).removeprefix("torch.")
    assert manifest["seed"] == 0 and manifest["source"] == which
    assert manifest["files"]["train_x.npy"]["shape"] == list(ds.train.x.shape)
    assert manifest["files"]["test_y.npy"]["shape"] == [len(ds.test)]
    assert all(len(manifest["files"][name]["sha256"]) == 64 for name in PREPARED_FILES)
    for verify, mmap in itertools.product((True, False), (False, True)):
        back = load_prepared(out, verify=verify, mmap=mmap)
        assert back.name == ds.name and back.classes == ds.classes and back.input_shape == ds.input_shape
        for a, b in ((back.train, ds.train), (back.test, ds.test)):
            assert a.x.dtype == b.x.dtype and torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    # plain numpy files: the views were written, not their base storage (12 images of the 18)
    saved = np.load(out / "train_x.npy", allow_pickle=False)
    assert saved.shape == tuple(ds.train.x.shape) and np.array_equal(saved, ds.train.x.numpy())
    assert prepared_nbytes(manifest) == ds.train.x.numel() * ds.train.x.element_size()


@pytest.mark.parametrize("name", PREPARED_FILES)
def test_load_prepared_refuses_damage(tmp_path, name):
    """A flipped byte in any file, read or mapped (no manifest, a missing file, a shape off the manifest, pickled
    objects: tests/test_hostile_input.py's prepared cases)."""
    out = tmp_path / "prepared"
    save_prepared(_uint8_dataset(), out)
    blob = bytearray((out / name).read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (out / name).write_bytes(bytes(blob))
    for mmap in (False, True):
        with pytest.raises(DatasetError, match=rf"{name}.*sha256"):
            load_prepared(out, verify=True, mmap=mmap)


def test_save_prepared_crash_leaves_nothing_half_written(tmp_path, monkeypatch):
    out = tmp_path / "prepared"
    calls = []
    real_save = D.write_npy

    def crash_on_second(path, *args):
        calls.append(Path(path).name)
        if len(calls) == 2:
            raise OSError("disk full")
        return real_save(path, *args)

    monkeypatch.setattr(D, "write_npy", crash_on_second)
    with pytest.raises(OSError, match="disk full"):
        save_prepared(_uint8_dataset(), out)
    assert not out.exists() and list(tmp_path.iterdir()) == []

    # with a previous good directory: it survives a crashed rewrite untouched
    monkeypatch.setattr(D, "write_npy", real_save)
    old = _uint8_dataset(n_train=9, n_test=3)
    save_prepared(old, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    calls.clear()
    monkeypatch.setattr(D, "write_npy", crash_on_second)
    with pytest.raises(OSError, match="disk full"):
        save_prepared(_uint8_dataset(), out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["prepared"]
    assert len(load_prepared(out).train) == 9


def _nan_dataset() -> Dataset:
    x = torch.rand(6, 4)
    x[2, 1] = float("nan")
    y = torch.arange(6) % 2
    return Dataset("synthetic", Split(x[:4], y[:4]), Split(x[4:], y[4:]), ("0", "1"), (4,), Split(x[4:], y[4:]))


@pytest.mark.parametrize("dataset,extra,error,match", [
    pytest.param(_uint8_dataset, {"n_train": 5}, ValueError, "n_train", id="extra-overrides-a-field"),
    pytest.param(_nan_dataset, None, DatasetError, "NaN", id="nan"),
])
def test_save_prepared_refuses_and_writes_nothing(tmp_path, dataset, extra, error, match):
    with pytest.raises(error, match=match):
        save_prepared(dataset(), tmp_path / "p", extra=extra)
    assert not (tmp_path / "p").exists()


# --------------------------------------------- the prepared format at scale: block-wise writing, memory maps, row reads
def mapped_file(t: torch.Tensor) -> str | None:
    """The file whose memory map holds ``t``'s data (from /proc/self/maps), or None if it is ordinary memory."""
    ptr = t.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        lo, hi = (int(v, 16) for v in fields[0].split("-"))
        if lo <= ptr < hi:
            return fields[5] if len(fields) == 6 and fields[5].startswith("/") else None
    return None


def test_write_npy_is_numpys_format_hashed_as_written(tmp_path):
    x = np.random.default_rng(0).integers(0, 256, size=(10, 3, 2, 2), dtype=np.uint8)
    digest = write_npy(tmp_path / "x.npy", x.shape, np.uint8, [x[:3], x[3:4], x[4:]])
    np.save(tmp_path / "ref.npy", x)
    assert (tmp_path / "x.npy").read_bytes() == (tmp_path / "ref.npy").read_bytes()
    assert digest == sha256_file(tmp_path / "x.npy")
    with pytest.raises(ValueError, match="does not continue"):  # a block of another row shape
        write_npy(tmp_path / "bad.npy", x.shape, np.uint8, [x[:3, :2]])
    with pytest.raises(ValueError, match="does not continue"):  # another dtype: never converted silently
        write_npy(tmp_path / "bad.npy", x.shape, np.uint8, [x.astype(np.int64)])
    with pytest.raises(ValueError, match="9 rows written"):
        write_npy(tmp_path / "bad.npy", x.shape, np.uint8, [x[:9]])


@pytest.mark.parametrize("which", ["digits", "uint8"])
def test_load_prepared_mmap_maps_the_files(tmp_path, digits, which):
    ds = digits if which == "digits" else _uint8_dataset()
    out = tmp_path / "prepared"
    save_prepared(ds, out)
    mapped, loaded = load_prepared(out, mmap=True), load_prepared(out)
    for part in ("train", "test"):
        x = getattr(mapped, part).x
        assert mapped_file(x) == str((out / f"{part}_x.npy").resolve())  # zero copy: the file's pages
        assert mapped_file(getattr(loaded, part).x) is None  # the default reads into memory
        assert torch.equal(x, getattr(ds, part).x)
    x = mapped.train.x
    x[0] += 1  # copy-on-write: a change stays in this process, the file and its digest are untouched
    assert load_prepared(out, verify=True).train.x[0].equal(ds.train.x[0])


def test_gather_rows_equals_indexing(tmp_path):
    x = torch.arange(7 * 2 * 3, dtype=torch.float32).reshape(7, 2, 3)
    for index in (torch.tensor([5, 0, 3]), torch.tensor([6, 6, 1, 0, 2]), torch.tensor([], dtype=torch.int64)):
        got = gather_rows(x, index)
        assert torch.equal(got, x[index]) and got.dtype == x.dtype


def test_image_folder_is_prepared_in_bounded_memory_to_the_same_bytes(tmp_path):
    """``prepare_dataset`` writes an image folder one image at a time: the same files as loading it, then saving."""
    write_png_folder(tmp_path / "raw")
    kwargs = dict(dataset="image_folder", root=str(tmp_path / "raw"), image_size=8, test_fraction=0.4, seed=1)
    for limits in ({}, {"limit_train": 8, "limit_test": 4}):
        data = DataConfig(**kwargs, **limits)
        streamed = prepare_dataset(data, tmp_path / "streamed", extra={"k": 1})
        loaded = save_prepared(load_dataset(data), tmp_path / "loaded", extra={"k": 1})
        assert streamed == loaded
        assert (streamed["n_train"], streamed["n_val"], streamed["n_test"]) == (limits.get("limit_train", 8), 4,
                                                                               limits.get("limit_test", 8))
        for name in PREPARED_FILES:
            assert (tmp_path / "streamed" / name).read_bytes() == (tmp_path / "loaded" / name).read_bytes()
    with pytest.raises(ValueError, match="image_size"):
        prepare_dataset(DataConfig(dataset="image_folder", root=str(tmp_path / "raw")), tmp_path / "x")
    with pytest.raises(ValueError, match="image_size"):  # a request built without validation: refused all the same
        prepare_dataset(DataConfig.model_construct(dataset="image_folder", root=str(tmp_path / "raw")), tmp_path / "x")
    assert not (tmp_path / "x").exists()


# ------------------------------------------------------------------------------------------- the validation split
@pytest.mark.parametrize("val_size,expect", [(0.1, 144), (0.25, 359), (50, 50), (10, 10)])
def test_holdout_takes_a_stratified_seeded_validation_split_out_of_the_training_rows(val_size, expect):
    """load_dataset's train and val are the reader's training rows, split by ``holdout_index`` (in row order, each
    row once), before limit_train; every class in both; the same seed the same split, another seed another."""
    data = DataConfig(dataset="digits", root="unused", val_size=val_size)
    whole = reader_dataset(data).train  # (1437, 1, 8, 8)
    ds = load_dataset(data)
    keep, val = holdout_index(whole.y, val_size, 0, "digits")
    assert len(ds.val) == len(val) == expect and len(ds.train) == len(whole) - expect
    assert torch.equal(ds.val.x, whole.x[val]) and torch.equal(ds.train.x, whole.x[keep])
    assert sorted(keep.tolist() + val.tolist()) == list(range(len(whole)))
    shares = torch.bincount(ds.val.y, minlength=10) / torch.bincount(whole.y, minlength=10).float()  # (10,)
    assert float(shares.min()) > 0 and float(shares.max() - shares.min()) <= 2 / 130  # within a sample or two a class
    assert torch.equal(holdout_index(whole.y, val_size, 0, "digits")[1], val)
    assert not torch.equal(holdout_index(whole.y, val_size, 1, "digits")[1], val)
    limited = load_dataset(data.model_copy(update={"limit_train": 200}))
    assert torch.equal(limited.val.x, ds.val.x) and len(limited.train) == 200  # the limit never moves the split


@pytest.mark.parametrize("val_size", [9, 1430, 0.999])
def test_a_holdout_that_would_empty_a_class_names_the_key(val_size):
    with pytest.raises(DatasetError, match=r"data\.val_size"):
        load_dataset(DataConfig(dataset="digits", root="unused", val_size=val_size))
