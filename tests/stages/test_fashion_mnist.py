"""Fashion-MNIST for real: Debian's package (`dataset-fashion-mnist`, the flat folder of Zalando's four idx files)
through `transfusion prepare`, then a short pretrain + evaluate on a stratified subset of it.

CI installs the package (`.ci/install-datasets`); without it these tests skip, saying so. Nothing is downloaded: the
tests read the folder the package fills. The loaders' details (layouts, messages, corrupt files) are tested on
fabricated files in tests/data/test_datasets.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.data.prepared import load_prepared
from pipeline.data.sources import FMNIST_DEBIAN_ROOT
from tests.conftest import invoke

STEMS = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
_absent = [f"{s}.gz" for s in STEMS if not (FMNIST_DEBIAN_ROOT / f"{s}.gz").is_file()]
if _absent:
    pytest.skip(f"Debian's Fashion-MNIST is not installed ({FMNIST_DEBIAN_ROOT} lacks {', '.join(_absent)}): "
                "install it with .ci/install-datasets (`apt-get install dataset-fashion-mnist`)",
                allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
DEBIAN = ("-S", "data.dataset=fashion_mnist", "-S", f"data.root={FMNIST_DEBIAN_ROOT}")


def test_prepare_reads_debians_flat_folder_whole(project):
    result = invoke("prepare", *DEBIAN)
    assert result.exit_code == 0, result.output
    assert ("prepared fashion_mnist: 54000 train / 6000 validation / 10000 test, input shape (1, 28, 28), 10 classes"
            in result.output)
    manifest = json.loads((project / "data/prepared/manifest.json").read_text())
    assert manifest["classes"] == CLASSES and manifest["dtype"] == "uint8"
    assert manifest["params"]["data"]["root"] == str(FMNIST_DEBIAN_ROOT)
    ds = load_prepared(project / "data/prepared")  # the sha256s of the decoded arrays, verified
    assert ds.train.x.shape == (54_000, 1, 28, 28) and ds.test.x.shape == (10_000, 1, 28, 28)
    assert torch.bincount(ds.train.y).tolist() == [5_400] * 10 and torch.bincount(ds.test.y).tolist() == [1_000] * 10
    assert torch.bincount(ds.val.y).tolist() == [600] * 10  # data.val_size 0.1, stratified
    # Fashion-MNIST's images, not merely its sizes: the mean grey level of each split (0.2860 and 0.2868 of 255, the
    # figures commonly used to normalise it), and bags and trousers look like themselves: a trouser's leg gap leaves
    # its middle column darker at the bottom than a bag's
    whole = torch.cat([ds.train.x, ds.val.x])  # the 60,000 training images
    for x, mean in ((whole, 0.2860), (ds.test.x, 0.2868)):
        assert float(x.float().mean()) / 255 == pytest.approx(mean, abs=5e-4)
    x = ds.train.x[:, 0].float()  # (N, 28, 28)
    trousers, bags = x[ds.train.y == 1], x[ds.train.y == 8]
    assert float(trousers[:, 20:, 13:15].mean()) < 0.5 * float(bags[:, 20:, 13:15].mean())


def test_a_short_pretrain_and_evaluate_on_a_stratified_subset(project, ray_session):
    """1 epoch of the small CNN on 2,000 of the training images (200 a class): the kNN of every layer's frozen
    embeddings on 1,000 real test images is far above chance (0.1), which a reader that mixed up images and labels
    would not be."""
    prepared = invoke("prepare", *DEBIAN, "-S", "data.limit_train=2000", "-S", "data.limit_test=1000",
                      "-S", "data.val_size=500")
    assert prepared.exit_code == 0, prepared.output
    assert "2000 train / 500 validation / 1000 test" in prepared.output
    assert torch.bincount(load_prepared(project / "data/prepared").test.y).tolist() == [100] * 10
    small = [*DEBIAN, "-S", "train.epochs=1", "-S", "train.batch_size=128", "-S", "model.embed_dim=32",
             "-S", "probe.probes=[knn50]", "-S", "probe.label_fractions=[1.0]", "-S", "probe.tsne_points=0",
             "-S", "probe.affinity_points=200"]
    pretrain = invoke("pretrain", *small, "--no-tracking")
    assert pretrain.exit_code == 0, pretrain.output
    evaluate = invoke("evaluate", *small, "--no-tracking")
    assert evaluate.exit_code == 0, evaluate.output
    metrics = json.loads((project / "metrics/evaluate.json").read_text())
    assert metrics["n_test"] == 1000
    accuracy = {layer: by_probe["knn50"]["1"] for layer, by_probe in metrics["probes"].items()}
    assert set(accuracy) == {"input", "backbone", "block_1"}, accuracy
    # chance is 0.1. The pixels themselves (no training: 0.71 here) say the images and labels go together; one epoch
    # of contrastive training leaves the embeddings below the pixels (0.47 here) but far above chance
    assert accuracy["input"] > 0.6 and min(accuracy.values()) > 0.3, accuracy
    assert np.isfinite(json.loads((project / "metrics/pretrain.json").read_text())["knn_acc"])
    # the report carries the recorded studies on the same data (studies/, transfusion tables --out) beside ours
    shutil.copytree(Path(__file__).resolve().parents[2] / "studies", project / "studies")
    report = invoke("report", *small)
    assert report.exit_code == 0, report.output
    text = (project / "reports/REPORT.md").read_text()
    assert "## Recorded studies on fashion_mnist" in text and "| TransFusion 1-Layer | 1 | n/a | 2/2 | 3 | 0.6" in text
    assert "### temperature-cpu-10k-3epochs: 10,000 training images, 3 epochs, batch 256" in text
