"""Hostile input, table-driven: every bad params file, override and data file through the real `transfusion` CLI.

Each case runs one command in a fresh project directory (the ``project`` fixture) and checks that

1. the exit code is 2 for bad params / usage and 1 for runtime or data problems;
2. the output is one paragraph starting with ``Error:`` that names the bad key or file and what to do, with no
   Python traceback;
3. nothing is left behind: the project tree is exactly what the case's own set-up made (no outputs, no
   ``*.tmp`` or dot-temp files from atomic writes), and no case starts Ray.
"""

from __future__ import annotations

import ast
import functools
import gzip
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner

from pipeline.config.params import load_params
from pipeline.data.prepared import save_prepared
from pipeline.io import save_torch, sha256_file, write_json
from stages.cli import main
from tests.conftest import ROOT
from tests.data.test_datasets import _uint8_dataset, idx_bytes, write_cifar, write_fmnist, write_png_folder
from tests.data.test_omniglot import write_omniglot

Setup = Callable[[Path], None]
PREPARED = Path("data/prepared")
MODELS = Path("models/pretrain")
RAW = Path("data/raw")  # data.root in params.yaml
MARKER = "PWNED"  # what an unpickled payload would create


@dataclass(frozen=True)
class Case:
    id: str
    args: tuple[str, ...]
    code: int  # 2: bad params / usage; 1: runtime or data problem
    needles: tuple[str, ...]  # the bad key or file, and what is allowed or what to do
    setup: tuple[Setup, ...] = ()


class Payload:
    """Unpickling this runs ``os.mkdir(marker)``: weights-only loading must refuse it."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


# ------------------------------------------------------------------------------------------------ set-up steps
def params_text(text: str | bytes) -> Setup:
    return write_file("params.yaml", text.encode() if isinstance(text, str) else text)


def params_edit(old: str, new: str) -> Setup:
    def run(p: Path) -> None:
        text = (p / "params.yaml").read_text()
        assert old in text, old
        (p / "params.yaml").write_text(text.replace(old, new, 1))

    return run


def params_set(section: str, value: object) -> Setup:
    def run(p: Path) -> None:
        raw = yaml.safe_load((p / "params.yaml").read_text())
        raw[section] = value
        (p / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))

    return run


def valid_prepared(p: Path) -> None:
    """Valid prepared data: 12 train / 6 test uint8 images (3, 4, 4) of 3 classes."""
    save_prepared(_uint8_dataset(), p / PREPARED)


def prepared_file(name: str, mutate: Callable[[Path, bytes], bytes | None], fix_hash: bool) -> Setup:
    """Rewrite ``data/prepared/<name>`` with ``mutate(project, old bytes)`` (None: delete it)."""

    def run(p: Path) -> None:
        path = p / PREPARED / name
        blob = mutate(p, path.read_bytes())
        if blob is None:
            path.unlink()
            return
        path.write_bytes(blob)
        if fix_hash:  # the manifest agrees with the replaced file: only the content check can catch it
            manifest_edit(lambda m: m["files"][name].update(sha256=sha256_file(path)))(p)

    return run


def torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def npy_bytes(array: np.ndarray, allow_pickle: bool = False) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=allow_pickle)
    return buf.getvalue()


def nan_pixels(p: Path, blob: bytes) -> bytes:
    x = np.random.default_rng(0).random((12, 3, 4, 4), dtype=np.float32)
    x[3, 1, 2, 2] = float("nan")
    manifest_edit(lambda m: m.update(dtype="float32"))(p)
    return npy_bytes(x)


def flip_byte(p: Path, blob: bytes) -> bytes:
    out = bytearray(blob)
    out[len(out) // 2] ^= 0xFF
    return bytes(out)


def manifest_edit(fn: Callable[[dict], object]) -> Setup:
    def run(p: Path) -> None:
        mpath = p / PREPARED / "manifest.json"
        manifest = json.loads(mpath.read_text())
        fn(manifest)
        mpath.write_text(json.dumps(manifest))

    return run


def remove(rel: str) -> Setup:
    return lambda p: (p / rel).unlink()


def write_file(rel: str, data: bytes | Callable[[Path], bytes]) -> Setup:
    def run(p: Path) -> None:
        path = p / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data(p) if callable(data) else data)

    return run


def emptied(rel: str) -> Setup:
    """The folder ``rel``, emptied (kept, with nothing in it)."""

    def run(p: Path) -> None:
        shutil.rmtree(p / rel)
        (p / rel).mkdir()

    return run


def truncate(rel: str, keep: int) -> Setup:
    return write_file(rel, lambda p: (p / rel).read_bytes()[:keep])


def pretrained(input_shape: tuple[int, ...] = (3, 4, 4)) -> Setup:
    """A model as the pretrain stage writes it (untrained weights; the cases never get to use them)."""

    def run(p: Path) -> None:
        from pipeline.core.model import build_model

        params = load_params(p / "params.yaml")
        save_torch(p / MODELS / "model.pt", build_model(params.model, input_shape).state_dict())
        write_json(p / MODELS / "config.json", {"params": params.model_dump(), "input_shape": list(input_shape),
                                                "n_classes": 3, "run_name": "pretrain-test", "mlflow_run_id": None})

    return run


def cifar(p: Path) -> None:
    write_cifar(p / RAW, per_batch=4)


def fmnist(gz: bool = False) -> Setup:
    return lambda p: write_fmnist(p / RAW, n_train=10, n_test=10, gz=gz)


def omniglot(p: Path) -> None:
    write_omniglot(p / RAW, parts=("background",), drawings=2)


def omniglot_parts(p: Path) -> None:
    """Both parts under data/raw (sets.omniglot_root's default): 5 training and 4 test characters of 3 drawings."""
    write_omniglot(p / RAW)


def png_folder(p: Path) -> None:
    write_png_folder(p / RAW)


def png_classes(counts: dict[str, int]) -> Setup:
    def run(p: Path) -> None:
        from PIL import Image

        for name, n in counts.items():
            (p / RAW / name).mkdir(parents=True)
            for i in range(n):
                Image.new("RGB", (6, 6), (i * 40, 0, 0)).save(p / RAW / name / f"{i}.png")

    return run


CIFAR = ("-S", "data.dataset=cifar10")
FMNIST = ("-S", "data.dataset=fashion_mnist")
FOLDER = ("-S", "data.dataset=image_folder", "-S", "data.image_size=8")
OMNIGLOT = ("-S", "data.dataset=omniglot", "-S", "data.test_fraction=0.5")
CIFAR_DIR = f"{RAW}/cifar-10-batches-py"
FMNIST_DIR = f"{RAW}/FashionMNIST/raw"
RESNET = ("-S", "model.backbone=resnet18", "-S", "model.embed_dim=null")
# the set study on Omniglot only, as small as it goes (every check fires before any training anyway); no --no-mlflow:
# the tree check sees that no MLflow store (let alone a RUNNING run) is made
SETS_OMNIGLOT = ("sets", "--quiet", "-S", "sets.datasets=[omniglot]", "-S", "sets.steps=1", "-S", "sets.methods=[rbf]",
                 "-S", "sets.seeds=[0]", "-S", "sets.test_sets=1", "-S", "sets.rbf_select_sets=1",
                 "-S", "sets.omniglot_size=4", "-S", "sets.omniglot_k=[2, 4]")
OMNIGLOT_EVAL = f"{RAW}/omniglot-py/images_evaluation"
LAYOUT = "omniglot-py/images_background/<Alphabet>/<characterNN>/*.png"
VALID_YAML_HEAD = "data:\n  dataset: digits\n"

CASES = [
    # ---------------------------------------------------------------- params.yaml: the file itself (exit 2)
    Case("file-yaml-syntax", ("check",), 2, ("params.yaml", "not valid YAML", "line 3"),
         (params_text(VALID_YAML_HEAD + "model: [1, 2\nloss: {}\n"),)),
    Case("file-yaml-bad-indent", ("prepare",), 2, ("params.yaml", "not valid YAML", "line"),
         (params_edit("  backbone: cnn_small", "    backbone: cnn_small\n  - oops"),)),
    Case("file-empty", ("check",), 2, ("params.yaml", "empty", "data, model, loss"), (params_text(""),)),
    Case("file-comments-only", ("prepare",), 2, ("params.yaml", "empty"), (params_text("# nothing\n"),)),
    Case("file-is-a-list", ("check",), 2, ("params.yaml", "mapping of sections", "list"),
         (params_text("- data\n- model\n"),)),
    Case("file-is-a-scalar", ("check",), 2, ("params.yaml", "mapping of sections", "str"), (params_text("hello\n"),)),
    Case("file-not-utf8", ("check",), 2, ("params.yaml", "UTF-8"), (params_text(b"data:\n  seed: \xff\xfe\n"),)),
    Case("file-python-tag", ("check",), 2, ("params.yaml", "not valid YAML", "python/object"),
         (params_text("data: !!python/object/apply:os.system ['echo pwned']\n"),)),
    Case("file-duplicate-key", ("check",), 2, ("params.yaml", "duplicate key", "depth"),
         (params_edit("  depth: 1 ", "  depth: 1\n  depth: 3 "),)),
    Case("file-missing", ("check", "--params", "nope.yaml"), 2, ("nope.yaml", "not found", "--params")),
    Case("file-missing-sections", ("check",), 2, ("model: required section is missing", "theory"),
         (params_text(VALID_YAML_HEAD),)),
    Case("file-section-empty", ("check",), 2, ("ray", "section is empty", "{}"), (params_set("ray", None),)),
    Case("file-unknown-section", ("check",), 2, ("trainer", "unknown key", "data, model, loss"),
         (params_edit("ray:\n", "trainer:\n  lr: 1\nray:\n"),)),
    # ---------------------------------------------------------------- params: values (exit 2)
    Case("type-int-from-word", ("check", "-S", "model.depth=three"), 2, ("model.depth", "valid integer")),
    Case("type-int-from-bool", ("prepare", "-S", "data.seed=true"), 2, ("data.seed", "valid integer")),
    Case("type-int-from-float", ("check", "-S", "train.epochs=1.5"), 2, ("train.epochs", "valid integer")),
    Case("type-bool-from-word", ("prepare", "-S", "data.download=maybe"), 2, ("data.download", "valid boolean")),
    Case("type-list-from-scalar", ("check", "-S", "probe.probes=svm"), 2, ("probe.probes", "valid list")),
    Case("range-lr-zero", ("check", "-S", "train.lr=0"), 2, ("train.lr", "greater than 0")),
    Case("range-batch-one", ("check", "-S", "train.batch_size=1"), 2,
         ("train.batch_size", "greater than or equal to 2")),
    Case("range-strength", ("check", "-S", "augment.strength=1.5"), 2, ("augment.strength", "less than or equal to 1")),
    Case("range-test-fraction", ("prepare", "-S", "data.test_fraction=0"), 2, ("data.test_fraction", "greater than 0")),
    Case("range-inf", ("check", "-S", "loss.barlow_lambda=.inf"), 2, ("loss.barlow_lambda", "finite number")),
    Case("range-nan", ("check", "-S", "loss.temperature=.nan"), 2, ("loss.temperature", "finite number")),
    Case("range-seed-beyond-32-bit", ("prepare", "-S", "data.seed=4294967296"), 2,
         ("data.seed", "less than or equal to 4294967295")),
    Case("name-dataset", ("prepare", "-S", "data.dataset=imagenet"), 2, ("data.dataset", "digits", "cifar10")),
    Case("name-loss", ("check", "-S", "loss.name=triplet"), 2, ("loss.name", "jsd", "barlow_twins")),
    Case("name-backbone", ("check", "-S", "model.backbone=vit"), 2, ("model.backbone", "cnn_small", "resnet18")),
    Case("name-backbone-torchvision", ("pretrain", "-S", "model.backbone=torchvision:resnet5", "-S",
                                       "model.embed_dim=null"), 2,
         ("model.backbone", "torchvision:resnet5", "unknown backbone",
          "torchvision.models.list_models(module=torchvision.models)")),
    Case("name-backbone-torchvision-squeezenet", ("check", "-S", "model.backbone=torchvision:squeezenet1_0", "-S",
                                                  "model.embed_dim=null"), 2,
         ("model.backbone", "squeezenet1_0", "1x1 convolution", "torchvision:<name>")),
    Case("name-preset", ("check", "-S", "augment.preset=strong"), 2, ("augment.preset", "paper", "simclr")),
    Case("name-probe", ("evaluate", "-S", "probe.probes=[svm, mlp]"), 2, ("probe.probes.1", "ffn", "logreg")),
    Case("unknown-key", ("check", "-S", "model.depht=3"), 2, ("model.depht", "unknown key", "depth")),
    Case("unknown-nested-key", ("check", "-S", "data.synthetic.ranks=2"), 2,
         ("data.synthetic.ranks", "unknown key", "rank")),
    # ---------------------------------------------------------------- params: conflicts (exit 2)
    Case("conflict-batch-workers", ("pretrain", "-S", "train.batch_size=7", "-S", "ray.num_workers=2"), 2,
         ("train.batch_size (7)", "multiple of ray.num_workers (2)")),
    Case("conflict-supervised-infonce", ("check", "-S", "train.mode=supervised", "-S", "loss.name=infonce"), 2,
         ("loss.name", "self_supervised", "supcon")),
    Case("conflict-synthetic-cnn", ("pretrain", "-S", "data.dataset=synthetic"), 2,
         ("model.backbone", "synthetic", "mlp")),
    Case("conflict-image-folder-size", ("prepare", "-S", "data.dataset=image_folder"), 2,
         ("data.image_size", "image_folder")),
    Case("conflict-warmup", ("pretrain", "-S", "train.warmup_epochs=40"), 2,
         ("train.warmup_epochs (40)", "train.epochs (40)")),
    Case("conflict-grad-cache-batchnorm", ("pretrain", "-S", "model.backbone=resnet18_cifar", "-S",
                                           "model.embed_dim=null", "-S", "train.grad_cache_chunk=8"), 2,
         ("train.grad_cache_chunk", "resnet18_cifar", "BatchNorm batches", "running statistics")),
    Case("conflict-grad-cache-batchnorm-torchvision", ("pretrain", "-S", "model.backbone=torchvision:resnet50", "-S",
                                                       "model.embed_dim=null", "-S", "train.grad_cache_chunk=8"), 2,
         ("train.grad_cache_chunk", "torchvision:resnet50", "BatchNorm batches", "torchvision:convnext_tiny")),
    Case("conflict-embed-dim-torchvision", ("check", "-S", "model.backbone=torchvision:convnext_tiny"), 2,
         ("model.embed_dim", "torchvision:convnext_tiny produces 768-d", "null or 768")),
    # ---------------------------------------------------------------- params: sweep / theory sections (exit 2)
    Case("sweep-search", ("sweep", "-S", "sweep.search=bayes"), 2, ("sweep.search", "grid", "random")),
    Case("sweep-batch-range", ("sweep", "-S", "sweep.batch_size=[16, 1]"), 2,
         ("sweep.batch_size.1", "greater than or equal to 2")),
    Case("sweep-empty-axis", ("sweep", "-S", "sweep.depth=[]"), 2, ("sweep.depth", "at least 1")),
    Case("sweep-strength-range", ("sweep", "-S", "sweep.strength=[0.5, 2]"), 2,
         ("sweep.strength.1", "less than or equal to 1")),
    Case("sweep-point-vs-workers", ("sweep", "-S", "ray.num_workers=2", "-S", "train.batch_size=4",
                                    "-S", "sweep.batch_size=[4, 5]"), 2,
         ("sweep.batch_size", "5", "multiple of ray.num_workers (2)"), (valid_prepared,)),
    Case("sweep-batch-beyond-data", ("sweep", "-S", "sweep.batch_size=[8, 64]"), 2,
         ("sweep.batch_size", "64", "12 samples"), (valid_prepared,)),
    Case("theory-eps-min", ("theory", "-S", "theory.formula_eps_min=0.5"), 2,
         ("theory.formula_eps_min", "1 / (formula_points - 1)")),
    Case("theory-n-small", ("theory", "-S", "theory.n=[4, 32]"), 2, ("theory.n", "2 * n_clusters = 8")),
    Case("theory-eps-range", ("theory", "-S", "theory.eps=[0.1, 1.5]"), 2, ("theory.eps.1", "less than or equal to 1")),
    Case("theory-duplicate-seeds", ("theory", "-S", "theory.seeds=[0, 0]"), 2, ("theory.seeds", "duplicate")),
    # ---------------------------------------------------------------- -S overrides (exit 2)
    Case("override-no-equals", ("check", "-S", "model.depth"), 2, ("model.depth", "key=value")),
    Case("override-bad-path", ("prepare", "-S", "model..depth=3"), 2, ("model..depth", "section.name")),
    Case("override-empty-key", ("check", "-S", "=3"), 2, ("'=3'", "section.name")),
    Case("override-bad-yaml", ("check", "-S", "model.depth=[1"), 2, ("model.depth=[1", "not valid YAML", "column")),
    Case("override-python-tag", ("check", "-S", "model.depth=!!python/name:os.system"), 2,
         ("model.depth", "not valid YAML", "python/name")),
    Case("override-into-value", ("check", "-S", "model.depth.x=1"), 2, ("'depth'", "a value, not a section")),
    Case("override-unknown-section", ("pretrain", "-S", "nosuch.key=1"), 2,
         ("nosuch", "unknown key", "data, model, loss")),
    Case("override-section-as-value", ("check", "-S", "model=3"), 2, ("model", "valid dictionary", "got 3")),
    # ---------------------------------------------------------------- raw data: cifar10 (exit 1)
    Case("cifar-root-missing", ("prepare", *CIFAR), 1, ("data/raw", "data.download: true", "cifar-10-batches-py")),
    Case("cifar-root-is-file", ("prepare", *CIFAR, "-S", "data.root=params.yaml"), 1,
         ("params.yaml", "not a directory", "cifar-10-batches-py")),
    Case("cifar-batch-missing", ("prepare", *CIFAR), 1, ("data_batch_3", "missing", "data.download: true"),
         (cifar, remove(f"{CIFAR_DIR}/data_batch_3"))),
    Case("cifar-batch-truncated", ("prepare", *CIFAR), 1, ("data_batch_2", "truncated or corrupt", "re-extract"),
         (cifar, truncate(f"{CIFAR_DIR}/data_batch_2", 3000))),
    Case("cifar-batch-garbage", ("prepare", *CIFAR), 1, ("test_batch", "not a readable pickle", "re-extract"),
         (cifar, write_file(f"{CIFAR_DIR}/test_batch", bytes(range(256)) * 8))),
    Case("cifar-meta-wrong", ("prepare", *CIFAR), 1, ("batches.meta", "label_names", "re-extract"),
         (cifar, write_file(f"{CIFAR_DIR}/batches.meta", pickle.dumps({"names": []}, protocol=2)))),
    # ---------------------------------------------------------------- raw data: fashion_mnist (exit 1)
    Case("fmnist-file-missing", ("prepare", *FMNIST), 1, ("t10k-labels-idx1-ubyte", "data.download: true"),
         (fmnist(), remove(f"{FMNIST_DIR}/t10k-labels-idx1-ubyte"))),
    Case("fmnist-truncated", ("prepare", *FMNIST), 1, ("train-images-idx3-ubyte", "truncated", "replace it"),
         (fmnist(), truncate(f"{FMNIST_DIR}/train-images-idx3-ubyte", 1000))),
    Case("fmnist-garbage", ("prepare", *FMNIST), 1, ("t10k-images-idx3-ubyte", "not an idx file", "data.download"),
         (fmnist(), write_file(f"{FMNIST_DIR}/t10k-images-idx3-ubyte", bytes(range(256)) * 4))),
    Case("fmnist-bad-gzip", ("prepare", *FMNIST), 1, ("train-labels-idx1-ubyte.gz", "gzip", "replace it"),
         (fmnist(gz=True), write_file(f"{FMNIST_DIR}/train-labels-idx1-ubyte.gz", b"not gzip"))),
    Case("fmnist-count-mismatch", ("prepare", *FMNIST), 1, ("t10k-images-idx3-ubyte", "4 images", "10 labels"),
         (fmnist(gz=True), write_file(f"{FMNIST_DIR}/t10k-images-idx3-ubyte.gz",
                                      gzip.compress(idx_bytes(np.zeros((4, 28, 28), np.uint8), 2051))))),
    # ---------------------------------------------------------------- raw data: omniglot (exit 1)
    Case("omniglot-root-missing", ("prepare", *OMNIGLOT), 1,
         ("data/raw", "data.download: true", "omniglot-py", "images_background")),
    Case("omniglot-truncated-png", ("prepare", *OMNIGLOT), 1,
         ("Greek/character01/1001_02.png", "cannot be decoded", "re-extract"),
         (omniglot, truncate(f"{RAW}/omniglot-py/images_background/Greek/character01/1001_02.png", 60))),
    # ---------------------------------------------------------------- the set study's inputs (exit 1 / 2)
    Case("sets-omniglot-root-missing", ("sets", "-S", "sets.datasets=[omniglot]", "-S", "sets.omniglot_root=none",
                                        "-S", "sets.steps=1"), 1,
         ("sets.omniglot_root", "none does not exist", LAYOUT, "images_evaluation", "drop omniglot from")),
    Case("sets-omniglot-root-is-file", (*SETS_OMNIGLOT, "-S", "sets.omniglot_root=params.yaml"), 1,
         ("sets.omniglot_root", "params.yaml is not a directory", LAYOUT)),
    Case("sets-omniglot-part-missing", SETS_OMNIGLOT, 1,
         ("sets.omniglot_root", "images_evaluation is missing", LAYOUT), (omniglot,)),
    Case("sets-omniglot-root-too-deep", (*SETS_OMNIGLOT, "-S", f"sets.omniglot_root={RAW}/omniglot-py"), 1,
         ("sets.omniglot_root", "omniglot-py/omniglot-py/images_background is missing",
          "point sets.omniglot_root at the folder holding omniglot-py"), (omniglot_parts,)),
    Case("sets-omniglot-part-empty", SETS_OMNIGLOT, 1,
         ("sets.omniglot_root", "images_evaluation holds no <Alphabet>/<characterNN> folder", LAYOUT),
         (omniglot_parts, emptied(OMNIGLOT_EVAL))),
    Case("sets-omniglot-character-without-png", SETS_OMNIGLOT, 1,
         ("sets.omniglot_root", "without a .png", "Tengwar/character01", LAYOUT),
         (omniglot_parts, emptied(f"{OMNIGLOT_EVAL}/Tengwar/character01"))),
    Case("sets-omniglot-truncated-png", SETS_OMNIGLOT, 1,
         ("Tengwar/character02/0002_02.png", "cannot be decoded", "re-extract"),
         (omniglot_parts, truncate(f"{OMNIGLOT_EVAL}/Tengwar/character02/0002_02.png", 60))),
    Case("sets-omniglot-k-beyond-characters", (*SETS_OMNIGLOT, "-S", "sets.omniglot_size=8", "-S",
                                               "sets.omniglot_k=[3, 5]"), 2,
         ("sets.omniglot_size (8)", "sets.omniglot_k ([3, 5])", "4 test classes", "min(4, 8) = 4"), (omniglot_parts,)),
    Case("sets-omniglot-size-beyond-drawings", (*SETS_OMNIGLOT, "-S", "sets.omniglot_size=20", "-S",
                                                "sets.omniglot_k=[5, 20]"), 2,
         ("sets.omniglot_size (20)", "5 training classes of 3 to 3 elements", "need at least 20", "got 15"),
         (omniglot_parts,)),
    Case("sets-digits-size-beyond-classes", ("sets", "-S", "sets.datasets=[digits]", "-S", "sets.digits_size=400"), 2,
         ("sets.digits_size (400)", "sets.digits_k ([2, 4])", "digits", "k >= 3", "smaller sets")),
    Case("sets-circles-study-csv-garbled", ("sets", "-S", "sets.datasets=[circles]"), 1,
         ("benchmarks/results/circles.csv", "not the circles study's CSV", "python benchmarks/study_circles.py"),
         (write_file("benchmarks/results/circles.csv", b"part,points\nfull,many\n"),)),
    Case("sets-seed-beyond-32-bit", ("sets", "-S", "sets.seeds=[18446744073709551615]"), 2,
         ("sets.seeds.0", "less than or equal to 4294967295")),
    # ---------------------------------------------------------------- raw data: image_folder (exit 1)
    Case("folder-root-missing", ("prepare", *FOLDER), 1, ("data/raw", "does not exist", "one sub-folder")),
    Case("folder-no-classes", ("prepare", *FOLDER), 1, ("data/raw", "one sub-folder per class"),
         (lambda p: (p / RAW).mkdir(parents=True),)),
    Case("folder-non-image-as-png", ("prepare", *FOLDER), 1, ("red/3.png", "cannot be decoded", "delete or replace"),
         (png_folder, write_file(f"{RAW}/red/3.png", b"this is text, not a PNG"))),
    Case("folder-truncated-png", ("prepare", *FOLDER), 1, ("blue/4.png", "cannot be decoded", "delete or replace"),
         (png_folder, truncate(f"{RAW}/blue/4.png", 60))),
    Case("folder-only-text-files", ("prepare", *FOLDER), 1, ("notes", "Supported extensions", "one sub-folder"),
         (write_file(f"{RAW}/notes/readme.txt", b"hello"),)),
    Case("folder-too-few-per-class", ("prepare", *FOLDER), 1, ("data/raw", "at least 2 samples", "add data"),
         (png_classes({"a": 5, "b": 1}),)),
    # ---------------------------------------------------------------- prepared data (exit 1)
    Case("prepared-dir-missing", ("pretrain",), 1, ("data/prepared/manifest.json", "transfusion prepare")),
    Case("prepared-manifest-missing", ("pretrain", "--no-tracking"), 1,
         ("manifest.json", "does not exist", "transfusion prepare"),
         (valid_prepared, remove(f"{PREPARED}/manifest.json"))),
    Case("prepared-manifest-not-json", ("sweep",), 1, ("manifest.json", "JSON", "transfusion prepare"),
         (valid_prepared, write_file(f"{PREPARED}/manifest.json", b"{not json"))),
    Case("prepared-manifest-bad-shape", ("sweep",), 1, ("manifest.json", "input_shape", "transfusion prepare"),
         (valid_prepared, manifest_edit(lambda m: m.update(input_shape="three by four")))),
    Case("prepared-manifest-no-files", ("pretrain",), 1, ("manifest.json", "files", "transfusion prepare"),
         (valid_prepared, manifest_edit(lambda m: m.pop("files")))),
    Case("prepared-file-missing", ("pretrain",), 1, ("test_x.npy", "missing", "transfusion prepare"),
         (valid_prepared, remove(f"{PREPARED}/test_x.npy"))),
    Case("prepared-labels-missing", ("evaluate",), 1, ("train_y.npy", "missing", "transfusion prepare"),
         (valid_prepared, pretrained(), remove(f"{PREPARED}/train_y.npy"))),
    Case("prepared-sha-mismatch", ("pretrain",), 1, ("train_x.npy", "sha256", "transfusion prepare"),
         (valid_prepared, prepared_file("train_x.npy", flip_byte, fix_hash=False))),
    Case("prepared-truncated", ("sweep",), 1, ("test_x.npy", "sha256", "transfusion prepare"),
         (valid_prepared, prepared_file("test_x.npy", lambda p, b: b[: len(b) // 2], fix_hash=False))),
    Case("prepared-truncated-rehashed", ("pretrain",), 1, ("train_x.npy", "cannot be loaded", "transfusion prepare"),
         (valid_prepared, prepared_file("train_x.npy", lambda p, b: b[: len(b) // 2], fix_hash=True))),
    Case("prepared-truncated-rehashed-read", ("evaluate",), 1, ("test_x.npy", "cannot be loaded", "prepare"),
         (valid_prepared, pretrained(), prepared_file("test_x.npy", lambda p, b: b[: len(b) // 2], fix_hash=True))),
    Case("prepared-nan-pixels", ("pretrain",), 1, ("train_x.npy", "NaN", "regenerate"),
         (valid_prepared, prepared_file("train_x.npy", nan_pixels, fix_hash=True))),
    Case("prepared-wrong-shape", ("pretrain",), 1, ("train_x.npy", "shape", "(N, 3, 8, 8)", "regenerate"),
         (valid_prepared, manifest_edit(lambda m: m.update(input_shape=[3, 8, 8])))),
    Case("prepared-count-mismatch", ("sweep",), 1, ("train_x.npy", "12", "manifest says", "transfusion prepare"),
         (valid_prepared, manifest_edit(lambda m: m.update(n_train=13)))),
    Case("prepared-pickled-code", ("pretrain",), 1, ("train_x.npy", "pickled Python objects", "transfusion prepare"),
         (valid_prepared, prepared_file("train_x.npy", lambda p, b: npy_bytes(np.array([Payload(p / MARKER)] * 12),
                                                                        allow_pickle=True), fix_hash=True))),
    Case("prepared-labels-out-of-range", ("pretrain",), 1, ("test_y.npy", "labels span [2, 7]", "3 classes"),
         (valid_prepared, prepared_file("test_y.npy", lambda p, b: npy_bytes(np.arange(6) + 2), fix_hash=True))),
    Case("prepared-labels-not-int64", ("sweep",), 1, ("train_x.npy", "train_y.npy", "int64", "transfusion prepare"),
         (valid_prepared, prepared_file("train_y.npy", lambda p, b: npy_bytes(np.arange(12, dtype=np.float32)),
                                  fix_hash=True))),
    Case("pretrain-batch-beyond-data", ("pretrain", "--no-tracking"), 2, ("train.batch_size (128)", "12 samples"),
         (valid_prepared,)),
    # ---------------------------------------------------------------- output paths (exit 1)
    Case("out-under-a-file", ("prepare", "-S", "data.limit_train=50", "-S", "data.limit_test=20",
                              "--out", "params.yaml/prepared"), 1,
         ("params.yaml/prepared", "params.yaml is a file", "another output path")),
    Case("theory-plots-under-a-file", ("theory", "--quiet", "--plots", "params.yaml/theory"), 1,
         ("params.yaml/theory", "params.yaml is a file", "another output path")),
    # ---------------------------------------------------------------- model weights / checkpoints (exit 1)
    Case("weights-missing", ("pretrain", *RESNET, "-S", "model.weights=w.pt"), 1,
         ("model.weights", "w.pt", "does not exist", "null"), (valid_prepared,)),
    Case("weights-pickled-code", ("sweep", *RESNET, "-S", "model.weights=w.pt"), 1,
         ("model.weights", "w.pt", "other than tensors"),
         (valid_prepared, write_file("w.pt", lambda p: torch_bytes({"conv1.weight": Payload(p / MARKER)})))),
    Case("weights-not-resnet18", ("pretrain", *RESNET, "-S", "model.weights=w.pt"), 1,
         ("model.weights", "w.pt", "resnet18"),
         (valid_prepared, write_file("w.pt", lambda p: torch_bytes({"layer9.weight": torch.zeros(2)})))),
    Case("evaluate-no-model", ("evaluate", "--no-tracking"), 1, ("models/pretrain", "transfusion pretrain"),
         (valid_prepared,)),
    Case("evaluate-model-pickled-code", ("evaluate", "--no-tracking"), 1,
         ("models/pretrain/model.pt", "other than tensors", "transfusion pretrain"),
         (valid_prepared, pretrained(), write_file(f"{MODELS}/model.pt", lambda p: torch_bytes(Payload(p / MARKER))))),
    Case("evaluate-model-truncated", ("evaluate",), 1, ("models/pretrain/model.pt", "transfusion pretrain"),
         (valid_prepared, pretrained(), truncate(f"{MODELS}/model.pt", 500))),
    Case("evaluate-config-not-json", ("evaluate", "--no-tracking"), 1,
         ("models/pretrain/config.json", "transfusion pretrain"),
         (valid_prepared, pretrained(), write_file(f"{MODELS}/config.json", b"{\"params\": "))),
    Case("evaluate-model-for-other-data", ("evaluate", "--no-tracking"), 1,
         ("(1, 8, 8)", "(3, 4, 4)", "data/prepared", "transfusion pretrain"), (valid_prepared, pretrained((1, 8, 8)))),
    Case("evaluate-no-data", ("evaluate",), 1, ("data/prepared/manifest.json", "transfusion prepare"), (pretrained(),)),
]


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def assert_one_clear_paragraph(output: str, needles: tuple[str, ...]) -> None:
    assert "Traceback" not in output, output
    text = output.strip()
    assert text.startswith("Error:"), output
    lines = text.splitlines()
    assert all(line.strip() for line in lines), f"more than one paragraph:\n{output}"
    assert len(text) < 1200, f"too long for one clear paragraph ({len(text)} chars):\n{output}"
    for needle in needles:
        assert needle in text, f"{needle!r} missing from:\n{output}"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_input(project, case, ray_starts):
    for step in case.setup:
        step(project)
    before = tree(project)

    result = CliRunner().invoke(main, list(case.args))

    assert result.exception is None or isinstance(result.exception, SystemExit), (
        f"uncaught {type(result.exception).__name__}: {result.exception}\n{result.output}")
    assert result.exit_code == case.code, result.output
    assert_one_clear_paragraph(result.output, case.needles)
    after = tree(project)
    assert after == before, f"left behind: {sorted(after - before)}, removed: {sorted(before - after)}"
    assert not (project / MARKER).exists(), "an unpickled payload ran"
    assert not ray_starts, "bad input must fail before Ray starts"


SUBPROCESS_CASES = [
    Case("yaml-syntax", ("check",), 2, ("params.yaml", "not valid YAML"), (params_text("data: [1, 2\n"),)),
    Case("no-prepared-data", ("pretrain",), 1, ("data/prepared/manifest.json", "transfusion prepare")),
    Case("sets-no-omniglot", ("sets", "-S", "sets.datasets=[omniglot]", "-S", "sets.omniglot_root=none", "-S",
                              "sets.steps=1"), 1, ("sets.omniglot_root", LAYOUT, "images_evaluation")),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", SUBPROCESS_CASES, ids=[c.id for c in SUBPROCESS_CASES])
def test_real_process_exit_code(project, case):
    """The real process, as DVC runs it: exit status, stderr, nothing on stdout."""
    for step in case.setup:
        step(project)
    before = tree(project)
    proc = subprocess.run([sys.executable, "-m", "stages.cli", *case.args], capture_output=True, text=True,
                          cwd=project, timeout=120)
    assert proc.returncode == case.code, proc.stderr
    assert proc.stdout == ""
    assert_one_clear_paragraph(proc.stderr, case.needles)
    assert tree(project) == before


def test_odd_batch_is_not_a_conflict(project):
    """Self-supervised views come in pairs of the *same* image (2B rows for B images): an odd B is fine."""
    result = CliRunner().invoke(main, ["check", "-S", "train.batch_size=7", "-S", "train.mode=self_supervised"])
    assert result.exit_code == 0 and "train.batch_size = 7" in result.output


def test_cifar_download_cannot_escape_the_data_root(project, monkeypatch):
    """A downloaded archive is extracted with tarfile's "data" filter: a member escaping data.root is refused."""
    import tarfile

    import torchvision.datasets.cifar as tv_cifar
    from torchvision.datasets.utils import extract_archive

    def fake_download(url, download_root, filename=None, md5=None, **kwargs):  # a hostile mirror, no network
        archive = Path(download_root) / filename
        archive.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archive, "w:gz") as tar:
            info = tarfile.TarInfo("../escaped.txt")
            info.size = 7
            tar.addfile(info, io.BytesIO(b"escaped"))
        extract_archive(str(archive), str(download_root))  # torchvision's own extraction

    monkeypatch.setattr(tv_cifar, "download_and_extract_archive", fake_download)
    before = tree(project)
    result = CliRunner().invoke(main, ["prepare", *CIFAR, "-S", "data.download=true"])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert result.exit_code == 1, result.output
    assert_one_clear_paragraph(result.output, ("CIFAR-10", "outside the destination", "cifar-10-batches-py"))
    assert not (project / "data" / "escaped.txt").exists()
    # only what the download itself fetched (the archive, as torchvision keeps it); no prepared output
    assert tree(project) - before == {"data", "data/raw", f"data/raw/{tv_cifar.CIFAR10.filename}"}


EXTRACTING = {"extractall", "extract", "unpack_archive"}
PRODUCT_SOURCES = sorted([*(ROOT / "pipeline").rglob("*.py"), *(ROOT / "stages").rglob("*.py")])


@functools.cache
def _nodes(path: Path) -> list[ast.AST]:
    """Every node of a product file's syntax tree, parsed once for all the checks below."""
    return list(ast.walk(ast.parse(path.read_text())))


def _calls(path: Path, module: str, names: set[str]) -> list[ast.Call]:
    return [node for node in _nodes(path)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in names
            and isinstance(node.func.value, ast.Name) and node.func.value.id == module]


@pytest.mark.parametrize(("module", "package", "flag", "safe", "at_least"), [
    # checkpoints, prepared tensors, model weights: io.load_torch, the resnet18 weights, the Ray checkpoint
    pytest.param("torch", "torch", "weights_only", True, 3, id="torch-weights-only"),
    # load_prepared's .npy files: an object array is refused, never unpickled
    pytest.param("np", "numpy", "allow_pickle", False, 1, id="numpy-without-pickles"),
])
def test_files_are_only_loaded_with_the_safe_flag(module, package, flag, safe, at_least):
    found = []
    for path in PRODUCT_SOURCES:
        assert f"from {package} import load" not in path.read_text(), path
        for call in _calls(path, module, {"load"}):
            value = {k.arg: k.value for k in call.keywords}.get(flag)
            assert isinstance(value, ast.Constant) and value.value is safe, f"{path.name}:{call.lineno} {module}.load"
            found.append(f"{path.name}:{call.lineno}")
    assert len(found) >= at_least, found


def test_no_unsafe_unpickling_or_archive_extraction():
    """pickle only for CIFAR-10's own format (user-placed or md5-verified files) and between a stage and its own
    tracking process (an anonymous pipe that no other process holds, as multiprocessing's); no tar/zip extraction of
    our own."""
    allowed = {"sources.py": 1, "tracking_process.py": 3}  # tracking_process: the two ends of the pipe, a round trip
    for path in PRODUCT_SOURCES:
        text = path.read_text()
        pickles = _calls(path, "pickle", {"load", "loads", "Unpickler"})
        assert len(pickles) == allowed.get(path.name, 0) or not pickles, f"{path.name}: pickle"
        extracting = [n for n in _nodes(path) if isinstance(n, ast.Call)
                      and isinstance(n.func, ast.Attribute) and n.func.attr in EXTRACTING]
        assert not extracting and "import zipfile" not in text, path.name
        if "tarfile" in text:  # only to make torchvision's extraction use the "data" filter
            assert "tarfile.data_filter" in text, path.name
