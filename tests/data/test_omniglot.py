"""Omniglot (pipeline/data/omniglot.py, its reader in sources.py) on tiny 105x105 PNGs in torchvision's layout
(``omniglot-py/images_{background,evaluation}/<Alphabet>/<characterNN>/<id>_<nn>.png``); no network."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from pipeline.config.data import DataConfig
from pipeline.data.omniglot import OMNIGLOT_SIZE, omniglot_counts, read_omniglot
from pipeline.data.prepared import load_prepared
from pipeline.data.sources import load_dataset, omniglot_sets_split
from pipeline.data.types import DatasetError
from stages.cli import main

# alphabet -> number of characters; names chosen so that sorted order is not creation order
BACKGROUND = {"Latin": 3, "Greek": 2}  # 5 characters
EVALUATION = {"Tengwar": 2, "Angelic": 2}  # 4 characters
DRAWINGS = 3  # per character (the real data set has 20)
SIZE = OMNIGLOT_SIZE  # 105


def write_omniglot(root: Path, parts: tuple[str, ...] = ("background", "evaluation"),
                   drawings: int = DRAWINGS) -> dict[str, list[np.ndarray]]:
    """Write the parts under ``root/omniglot-py`` as the official zips extract: mode "1" PNGs, white paper (255),
    black strokes (0). Returns each character's drawings as uint8 grey levels, by ``<Alphabet>/<characterNN>``."""
    from PIL import Image

    written: dict[str, list[np.ndarray]] = {}
    for part in parts:
        alphabets = BACKGROUND if part == "background" else EVALUATION
        for a_i, (alphabet, n_chars) in enumerate(alphabets.items()):
            for c in range(n_chars, 0, -1):  # created last to first
                name = f"{alphabet}/character{c:02d}"
                folder = root / "omniglot-py" / f"images_{part}" / name
                folder.mkdir(parents=True)
                written[name] = []
                for d in range(1, drawings + 1):
                    rng = np.random.default_rng([int(part == "evaluation"), a_i, c, d])
                    grey = np.where(rng.random((SIZE, SIZE)) < 0.1, 0, 255).astype(np.uint8)  # (105, 105)
                    Image.fromarray(grey).convert("1").save(folder / f"{1000 * a_i + c:04d}_{d:02d}.png")
                    written[name].append(grey)
    return written


@pytest.fixture(scope="module")
def omniglot(tmp_path_factory) -> tuple[Path, dict[str, list[np.ndarray]]]:
    root = tmp_path_factory.mktemp("omniglot")
    return root, write_omniglot(root)


def sorted_names(alphabets: dict[str, int]) -> tuple[str, ...]:
    return tuple(sorted(f"{a}/character{c:02d}" for a, n in alphabets.items() for c in range(1, n + 1)))


def assert_drawings_of_their_class(x: torch.Tensor, y: torch.Tensor, classes, written) -> list[tuple[int, int]]:
    """Every row is one of the drawings written for its label's character; returns (class, drawing) per row."""
    seen = []
    for k in range(len(y)):
        drawings = written[classes[int(y[k])]]
        hits = [d for d in range(len(drawings)) if np.array_equal(x[k, 0].numpy(), drawings[d])]
        assert len(hits) == 1, f"row {k} is not a drawing of {classes[int(y[k])]}"
        seen.append((int(y[k]), hits[0]))
    return seen


# ---------------------------------------------------------------------------------------------------- one part, as read
@pytest.mark.parametrize("background", [True, False])
def test_read_omniglot_one_part(omniglot, background):
    root, written = omniglot
    x, y, classes = read_omniglot(root, background=background)
    alphabets = BACKGROUND if background else EVALUATION
    assert classes == sorted_names(alphabets)
    assert x.dtype == torch.uint8 and x.shape == (len(classes) * DRAWINGS, 1, SIZE, SIZE) and y.dtype == torch.int64
    assert y.tolist() == [c for c in range(len(classes)) for _ in range(DRAWINGS)]  # label order, then file order
    for k in range(len(y)):
        assert np.array_equal(x[k, 0].numpy(), written[classes[int(y[k])]][k % DRAWINGS])


# ------------------------------------------- data.dataset: omniglot (the background characters, split by test_fraction)
def test_omniglot_background_characters_are_the_classes(omniglot):
    root, written = omniglot
    ds = load_dataset(DataConfig(dataset="omniglot", root=str(root), test_fraction=1 / 3, seed=2))
    assert ds.name == "omniglot" and ds.classes == sorted_names(BACKGROUND) and ds.input_shape == (1, SIZE, SIZE)
    n_chars = len(ds.classes)
    assert ds.train.x.dtype == torch.uint8 and ds.train.x.shape == ds.val.x.shape == (n_chars, 1, SIZE, SIZE)
    assert ds.test.x.shape == (n_chars, 1, SIZE, SIZE)
    # stratified: every character in the three splits (1 + 1 + 1 of its 3 drawings), no drawing twice
    for split in (ds.train, ds.val, ds.test):
        assert torch.bincount(split.y, minlength=n_chars).tolist() == [1] * n_chars
    seen = [drawing for split in (ds.train, ds.val, ds.test)
            for drawing in assert_drawings_of_their_class(split.x, split.y, ds.classes, written)]
    assert sorted(seen) == [(c, d) for c in range(n_chars) for d in range(DRAWINGS)]
    assert set(ds.train.x.unique().tolist()) == {0, 255}
    again = load_dataset(DataConfig(dataset="omniglot", root=str(root), test_fraction=1 / 3, seed=2))
    assert torch.equal(again.train.x, ds.train.x) and torch.equal(again.test.y, ds.test.y)


def test_omniglot_labels_do_not_depend_on_listing_order(omniglot, monkeypatch):
    """torchvision lists folders in os.listdir's order; the labels follow the sorted names whatever it is."""
    root, _ = omniglot
    data = DataConfig(dataset="omniglot", root=str(root), test_fraction=1 / 3)
    before = load_dataset(data)
    listdir = os.listdir
    monkeypatch.setattr(os, "listdir", lambda p=".": sorted(listdir(p), reverse=True))
    after = load_dataset(data)
    assert after.classes == before.classes
    assert torch.equal(after.train.y, before.train.y) and torch.equal(after.train.x, before.train.x)


@pytest.mark.parametrize("size", [28, 12])
def test_omniglot_image_size_resizes_each_drawing(omniglot, size):
    from torchvision.transforms.v2 import functional as F

    root, _ = omniglot
    native = load_dataset(DataConfig(dataset="omniglot", root=str(root), test_fraction=1 / 3))
    small = load_dataset(DataConfig(dataset="omniglot", root=str(root), test_fraction=1 / 3, image_size=size))
    assert small.input_shape == (1, size, size) and small.train.x.dtype == torch.uint8
    assert torch.equal(small.train.y, native.train.y)
    for k in range(len(native.train)):  # one drawing at a time: bilinear, antialiased
        ref = F.resize(native.train.x[k], [size, size], antialias=True)  # (1, S, S)
        assert torch.equal(small.train.x[k], ref)


# ------------------- omniglot_sets_split (background characters for training, unseen evaluation characters for testing)
def test_sets_split_has_disjoint_classes(omniglot):
    root, written = omniglot
    train_x, train_y, test_x, test_y = omniglot_sets_split(root)
    n_bg, n_ev = sum(BACKGROUND.values()), sum(EVALUATION.values())
    assert train_x.shape == (n_bg * DRAWINGS, 1, 28, 28) and test_x.shape == (n_ev * DRAWINGS, 1, 28, 28)
    assert train_x.dtype == test_x.dtype == torch.uint8 and train_y.dtype == test_y.dtype == torch.int64
    assert torch.bincount(train_y).tolist() == [DRAWINGS] * n_bg
    assert torch.bincount(test_y - n_bg).tolist() == [DRAWINGS] * n_ev
    assert not set(train_y.tolist()) & set(test_y.tolist())
    # at 105 px the rows are the drawings of the evaluation characters, numbered after the background ones
    _, _, full_x, full_y = omniglot_sets_split(str(root), image_size=None)
    classes = (*sorted_names(BACKGROUND), *sorted_names(EVALUATION))
    seen = assert_drawings_of_their_class(full_x, full_y, classes, written)
    assert sorted(seen) == [(c, d) for c in range(n_bg, n_bg + n_ev) for d in range(DRAWINGS)]


def test_sets_split_names_the_missing_part(tmp_path):
    write_omniglot(tmp_path, parts=("background",))
    with pytest.raises(DatasetError) as e:
        omniglot_sets_split(tmp_path)
    msg = str(e.value)
    assert "images_evaluation" in msg and "data.download: true" in msg and str(tmp_path) in msg
    with pytest.raises(ValueError, match="image_size"):
        omniglot_sets_split(tmp_path, image_size=0)


# -------------------------------------------------- missing and broken files, never a download when the files are there
def test_omniglot_missing_root_and_folder(tmp_path):
    root = tmp_path / "nowhere"
    for call in (lambda: load_dataset(DataConfig(dataset="omniglot", root=str(root))),
                 lambda: omniglot_sets_split(root)):
        with pytest.raises(DatasetError) as e:
            call()
        msg = str(e.value)
        assert str(root) in msg and "data.download: true" in msg
        assert "images_background" in msg and "images_evaluation" in msg and "omniglot-py" in msg
    root.mkdir()  # the root exists, its omniglot-py does not
    with pytest.raises(DatasetError) as e:
        load_dataset(DataConfig(dataset="omniglot", root=str(root)))
    msg = str(e.value)
    assert str(root / "omniglot-py" / "images_background") in msg and "missing" in msg and "data.download" in msg


def test_omniglot_counts_lists_without_decoding(tmp_path):
    """Drawings per character of each part in label order, from the listing (the layout problems it names:
    tests/test_hostile_input.py's sets-omniglot cases)."""
    write_omniglot(tmp_path, drawings=2)
    (tmp_path / "omniglot-py/images_background/Latin/character02/0002_02.png").write_bytes(b"not decoded here")
    (tmp_path / "omniglot-py/images_background/Greek/character01/1001_01.png").unlink()
    counts = omniglot_counts(tmp_path)
    assert counts[True].tolist() == [1, 2, 2, 2, 2] and counts[False].tolist() == [2, 2, 2, 2]  # Greek/... sorts first


def test_a_drawing_of_another_size_is_named(tmp_path):  # an undecodable one: hostile input's omniglot cases
    from PIL import Image

    write_omniglot(tmp_path, parts=("background",), drawings=2)
    Image.new("1", (50, 60), 1).save(tmp_path / "omniglot-py/images_background/Greek/character02/1002_01.png")
    with pytest.raises(DatasetError, match=r"1002_01\.png is 50x60, expected 105x105"):
        load_dataset(DataConfig(dataset="omniglot", root=str(tmp_path), test_fraction=0.5))


def test_omniglot_present_files_never_download(omniglot, no_download):
    root, _ = omniglot
    ds = load_dataset(DataConfig(dataset="omniglot", root=str(root), download=True, test_fraction=1 / 3))
    assert len(ds.train) + len(ds.val) + len(ds.test) == sum(BACKGROUND.values()) * DRAWINGS
    assert len(omniglot_sets_split(root, download=True)[3]) == sum(EVALUATION.values()) * DRAWINGS


# ---------------------------------------------------------------------------------------------------- the prepare stage
def test_prepare_stage_writes_omniglot(project):
    write_omniglot(project / "data" / "raw", parts=("background",), drawings=3)
    result = CliRunner().invoke(main, ["prepare", "-S", "data.dataset=omniglot", "-S", "data.test_fraction=0.3333",
                                       "-S", "data.image_size=16"])
    assert result.exit_code == 0, result.output
    out = project / "data" / "prepared"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["dataset"] == "omniglot" and manifest["classes"] == list(sorted_names(BACKGROUND))
    assert manifest["n_train"] == manifest["n_val"] == manifest["n_test"] == sum(BACKGROUND.values())
    ds = load_prepared(out)
    assert ds.train.x.dtype == torch.uint8 and ds.input_shape == (1, 16, 16)
