"""benchmarks/study_ssl.py on a sliver of Debian's Fashion-MNIST: every row of the preset and both controls per seed,
the curves of every epoch, a rerun that trains nothing again, and the table's mean ± sd over seeds.

Skips, saying so, where the package is not installed (CI installs it: .ci/install-datasets).
"""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import pytest
import yaml

from pipeline.data.sources import FMNIST_DEBIAN_ROOT

ROOT = Path(__file__).resolve().parents[2]
if not (FMNIST_DEBIAN_ROOT / "train-images-idx3-ubyte.gz").is_file():
    pytest.skip(f"Debian's Fashion-MNIST is not installed in {FMNIST_DEBIAN_ROOT} (.ci/install-datasets)",
                allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
SIZES = ["-S", "data.limit_train=300", "-S", "data.limit_test=200", "-S", "train.epochs=2", "-S",
         "train.batch_size=32", "-S", "model.embed_dim=8", "-S", "probe.max_train=250"]


def study():
    spec = importlib.util.spec_from_file_location("study_ssl", ROOT / "benchmarks/study_ssl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_the_preset_compares_what_the_study_claims():
    raw = yaml.safe_load((ROOT / "presets/fashion-mnist-ssl.yaml").read_text())
    table = {(r["name"], r["table"]): r["params"] for r in raw["tables"]["rows"]}
    assert {(n, t) for n, t in table} == {("TransFusion 1-Layer", 1), ("TransFusion 3-Layer", 1), ("InfoNCE", 1),
                                          ("DCL", 1), ("BarlowTwins", 1), ("SupCon", 2)}
    for (name, t), params in table.items():
        assert params["train.mode"] == ("supervised" if t == 2 else "self_supervised"), name
        # only the method differs: loss, depth and mode; the augmentation, batch, epochs and optimiser are the file's
        assert set(params) == {"train.mode", "loss.name", "model.depth"}, name
    assert raw["data"] == {**raw["data"], "dataset": "fashion_mnist", "limit_train": None, "limit_test": None}
    assert raw["probe"]["probes"] == ["knn200", "logreg"] and raw["train"]["knn_every"] == 1


def test_study_runs_every_row_and_control_per_seed_and_resumes(tmp_path, capsys):
    preset = yaml.safe_load((ROOT / "presets/fashion-mnist-ssl.yaml").read_text())
    preset["tables"]["rows"] = preset["tables"]["rows"][:1] + preset["tables"]["rows"][2:3]  # TransFusion, InfoNCE
    params = tmp_path / "ssl.yaml"
    params.write_text(yaml.safe_dump(preset))
    args = ["--params", str(params), *SIZES, "--seeds", "0", "1", "--out", str(tmp_path / "out"), "--device", "cpu"]
    mod = study()
    assert mod.main(args) == 0
    out = rows(tmp_path / "out/ssl.csv")
    methods = ["raw pixels", "random init", "TransFusion 1-Layer", "InfoNCE"]
    assert [(r["method"], r["seed"]) for r in out] == [(m, s) for s in "01" for m in methods]
    for r in out:
        for probe in ("knn200", "logreg"):  # k = 200 of 250 labelled images: near chance (0.1) on a weak embedding
            assert 0.0 < float(r[probe]) <= 1.0, r
        assert r["n_train"] == "300" and r["n_test"] == "200"
    pixels = [r for r in out if r["method"] == "raw pixels"]
    assert float(pixels[0]["logreg"]) > 0.6  # real images: a linear probe on the pixels is far above chance
    curves = rows(tmp_path / "out/ssl_curves.csv")
    assert [(c["method"], c["seed"], c["epoch"]) for c in curves] == [
        (m, s, e) for s in "01" for m in methods[2:] for e in "12"]
    assert all(0 < float(c["online_knn"]) <= 1 and float(c["seconds"]) > 0 for c in curves)
    assert (tmp_path / "out/ssl_knn.png").stat().st_size > 10_000
    table = capsys.readouterr().out
    mine = [float(r["knn200"]) for r in out if r["method"] == "InfoNCE"]
    mean, sd = sum(mine) / 2, abs(mine[0] - mine[1]) / 2 ** 0.5  # the sample sd of two values
    assert f"| InfoNCE | {mean:.3f} ± {sd:.3f} |" in table

    assert mod.main(args) == 0  # every (method, seed) is there: nothing trains again
    assert len(rows(tmp_path / "out/ssl.csv")) == len(out) and len(rows(tmp_path / "out/ssl_curves.csv")) == 8
