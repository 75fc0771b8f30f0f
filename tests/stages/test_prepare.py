"""The `prepare` stage through the real `transfusion` command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from pipeline.data.prepared import PREPARED_FILES, load_prepared
from stages.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_help_lists_the_stages():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0 and "prepare" in result.output


def test_prepare_writes_tensors_and_manifest(project):
    result = CliRunner().invoke(main, ["prepare"])
    assert result.exit_code == 0, result.output
    assert "prepared digits" in result.output
    out = project / "data" / "prepared"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["dataset"] == "digits" and manifest["n_train"] + manifest["n_val"] + manifest["n_test"] == 1797
    assert manifest["n_val"] == 144 and "1293 train / 144 validation / 360 test" in result.output
    assert manifest["params"]["data"]["seed"] == 0
    ds = load_prepared(out)
    assert ds.train.x.shape[1:] == (1, 8, 8) and len(ds.classes) == 10
    assert sorted(p.name for p in out.iterdir()) == sorted(["manifest.json", *PREPARED_FILES])
    assert not [p for p in project.rglob("*.tmp*")]


def test_overrides_and_params_file_option(project):
    alt = project / "alt.yaml"
    alt.write_text((project / "params.yaml").read_text().replace("dataset: digits", "dataset: synthetic"))
    result = CliRunner().invoke(main, ["prepare", "--params", str(alt), "-S", "model.backbone=mlp",
                                       "-S", "data.synthetic.n_samples=200", "--out", "syn"])
    assert result.exit_code == 0, result.output
    ds = load_prepared(project / "syn")
    assert ds.name == "synthetic" and ds.train.x.shape[1] == 64
    assert len(ds.train) + len(ds.val) + len(ds.test) == 200
    assert torch.allclose(ds.train.x.norm(dim=1), torch.ones(ds.train.x.shape[0]), atol=1e-5)


def test_prepare_validates_the_section_it_reads_and_leaves_the_rest_to_their_stages(project):
    """prepare reads `data` alone (its DVC deps hold no other section's names); a bad value elsewhere is refused by
    `check` and by the stage that reads it, before that stage does any work."""
    bad = ["-S", "loss.name=nope", "-S", "model.depth=-2"]
    ok = CliRunner().invoke(main, ["prepare", *bad])
    assert ok.exit_code == 0, ok.output
    for command in ("check", "pretrain"):
        refused = CliRunner().invoke(main, [command, *bad])
        assert refused.exit_code == 2 and "loss.name" in refused.output and "model.depth" in refused.output


def test_check_validates_without_running(project):
    ok = CliRunner().invoke(main, ["check", "-S", "model.depth=4"])
    assert ok.exit_code == 0 and "model.depth = 4" in ok.output and "params OK" in ok.output
    bad = CliRunner().invoke(main, ["check", "-S", "loss.name=nope"])
    assert bad.exit_code == 2 and "loss.name" in bad.output and "jsd" in bad.output
    abc = CliRunner().invoke(main, ["check", "-S", "model.method=abc", "-S", "model.qk_init=default", "-S",
                                    "loss.name=bce"])
    assert abc.exit_code == 0 and "model.abc.blocks = 2" in abc.output and "head: ABC's, not planned" in abc.output
    half = CliRunner().invoke(main, ["check", "-S", "model.method=abc", "-S", "loss.name=bce"])
    assert half.exit_code == 2 and "model.qk_init: identity" in half.output
    assert sorted(p.name for p in project.iterdir()) == ["params.yaml"]


# The child: the modules either way of preparing uses, imported; the peak resident memory reset (Linux's clear_refs
# "5") once they are; one way of preparing the image folder; the peak's growth over the memory at the reset.
MEASURE = r"""
import json, re, sys
from pathlib import Path
import PIL.Image, sklearn.model_selection, torchvision.datasets, torchvision.transforms.v2
from pipeline.config.params import load_params
from pipeline.data.prepared import save_prepared
from pipeline.data.sources import load_dataset
from stages.prepare import run

def kib(field):
    return int(re.search(field + r":\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))

how, params_file, root, out = sys.argv[1:]
params = load_params(params_file, ["data.dataset=image_folder", f"data.root={root}", "data.image_size=256"])
Path("/proc/self/clear_refs").write_text("5")
start = kib("VmRSS")
if how == "stage":
    run(params.data, Path(out))
else:  # the whole data set in memory, then written: what the cap must catch
    save_prepared(load_dataset(params.data), Path(out))
print(json.dumps({"start": start * 1024, "growth": (kib("VmHWM") - start) * 1024}))
"""


def write_jpeg_folder(root: Path, n: int, size: int) -> None:
    """``n`` RGB JPEGs of ``size`` x ``size`` (smooth gradients, small files) in 4 classes."""
    from PIL import Image

    yy, xx = np.mgrid[0:size, 0:size]
    for i in range(n):
        folder = root / f"class{i % 4}"
        folder.mkdir(parents=True, exist_ok=True)
        rgb = np.stack([(xx + 7 * i) % 256, (yy + 3 * i) % 256, ((xx + yy) // 2 + i) % 256], -1).astype(np.uint8)
        Image.fromarray(rgb).save(folder / f"{i}.jpg", quality=90)


def peak_growth(how: str, project: Path, root: Path, out: Path) -> int:
    """Bytes the peak resident memory of a fresh process grows by while it prepares ``root`` ``how``."""
    proc = subprocess.run([sys.executable, "-c", MEASURE, how, str(project / "params.yaml"), str(root), str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])["growth"]


@pytest.mark.slow  # two fresh processes, 500 images each
def test_an_image_folder_is_prepared_in_bounded_memory(project):
    """500 images of 256 x 256 decode to 98 MB: the stage stays under half of that, loading them does not."""
    n, size = 500, 256
    write_jpeg_folder(project / "raw", n, size)
    decoded = n * 3 * size * size
    cap = decoded // 2
    bounded = peak_growth("stage", project, project / "raw", project / "bounded")
    in_memory = peak_growth("in_memory", project, project / "raw", project / "in_memory")
    print(f"decoded {decoded / 2**20:.1f} MiB, cap {cap / 2**20:.1f} MiB: prepare stage's peak grew by "
          f"{bounded / 2**20:.1f} MiB, loading the folder whole by {in_memory / 2**20:.1f} MiB")
    assert in_memory > 0.9 * decoded  # the meter sees a data set held whole (a list then stacked: twice that)
    assert bounded < cap
    for name in PREPARED_FILES:  # the same files either way
        assert (project / "bounded" / name).read_bytes() == (project / "in_memory" / name).read_bytes()
    ds = load_prepared(project / "bounded", mmap=True)
    assert ds.input_shape == (3, size, size) and len(ds.train) + len(ds.val) + len(ds.test) == n
