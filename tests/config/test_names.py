"""What every run is called (``pipeline.config.names``): the MLflow run names from params, and the stable names runs
and jobs resume by."""

from __future__ import annotations

import json

import pytest

from pipeline.config.names import data_digest, evaluate_label, pretrain_label, stable_name, sweep_label, tables_label
from tests.conftest import ROOT

MANIFEST = {"dataset": "digits", "files": {"train.pt": {"sha256": "a" * 64}, "test.pt": {"sha256": "b" * 64}}}


def test_run_names_follow_the_params():
    """Runs are named by what they are: the pretraining run by its stage, backbone, depth, loss, batch and seed; a
    sweep by its size and the axes it varies; a trial by its point; a tables row by its name and table."""
    from pipeline.config.base import flatten
    from pipeline.config.params import load_params
    from pipeline.config.space import axes, grid_points

    params = load_params(ROOT / "params.yaml", ["model.depth=3", "loss.name=supcon", "train.mode=supervised",
                                                "train.batch_size=64", "train.seed=7", "model.backbone=mlp"])
    assert pretrain_label(flatten(params)) == "pretrain · mlp · depth 3 · supcon · b64 · s7"
    abc = load_params(ROOT / "params.yaml", ["model.method=abc", "model.qk_init=default", "loss.name=bce",
                                             "model.abc.compatibility=additive", "model.abc.blocks=0"])
    assert pretrain_label(flatten(abc)) == (f"pretrain · {abc.model.backbone} · abc additive 0 blocks · bce · "
                                            f"b{abc.train.batch_size} · s{abc.train.seed}")
    default = load_params(ROOT / "params.yaml")
    assert pretrain_label(flatten(default)) == (f"pretrain · {default.model.backbone} · depth {default.model.depth} · "
                                                f"{default.loss.name} · b{default.train.batch_size} · "
                                                f"s{default.train.seed}")
    assert sweep_label(len(grid_points(default)), axes(default)) == "sweep · 8 trials · depth×batch×strength"
    one = load_params(ROOT / "params.yaml", ["sweep.depth=[1]", "sweep.strength=[1.0]", "sweep.batch_size=[50,100]"])
    assert sweep_label(len(grid_points(one)), axes(one)) == "sweep · 2 trials · batch"
    fig5 = load_params(ROOT / "params.yaml", ["sweep.depth=[1]", "sweep.strength=[0.0]", "sweep.batch_size=[64]",
                                              "sweep.lr=[0.001,0.01]", "sweep.loss=[jsd,kl_relu,kl_squared]"])
    assert sweep_label(len(grid_points(fig5)), axes(fig5)) == "sweep · 6 trials · lr×loss"
    assert tables_label([r.table for r in default.tables.rows]) == "tables · 8 rows · table 1: 5, table 2: 3"
    assert tables_label([1, 1], seeds=3) == "tables · 2 rows · table 1: 2 · 3 seeds"
    assert evaluate_label(["svm", "knn50"], [0.1, 1.0]) == "evaluate · 2 probes · labels 10%, 100%"


def test_one_digest_names_the_data_and_every_run_as_before():
    """The data's digest (the staged copy's folder; MLflow's dataset digest its first 8) and the stable names of runs
    and jobs (``pretrain-``, ``sweep-``, ``tables-``): sha256 of the file digests, and of the keyed params with them."""
    import hashlib

    def sha(value) -> str:
        return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()

    files = {"test.pt": "b" * 64, "train.pt": "a" * 64}
    assert data_digest(MANIFEST) == sha(files)[:16] == "84dfceeaae1608ed"
    keyed = {"model": {"depth": 1}, "ray": {"num_workers": 2}}
    assert stable_name("sweep", keyed, MANIFEST) == "sweep-" + sha({**keyed, "data": files})[:16]
    assert stable_name("sweep", keyed, {**MANIFEST, "files": {"x": {"sha256": "c" * 64}}}) != stable_name(
        "sweep", keyed, MANIFEST)


@pytest.mark.parametrize(("flat", "fusing", "words"), [
    ({"model.depth": 0}, 0, "no projector, no head"),
    ({"model.depth": 1, "model.head": "truncated", "model.projector": "mlp"}, 0,
     "MLP projector, 1 block truncated (fusing 0)"),
    ({"model.depth": 2, "model.head": "truncated", "model.projector": "linear", "model.projector_dim": 64}, 1,
     "linear projector (64-d), 2 blocks truncated (fusing 1)"),
    ({"model.depth": 1, "model.head": "appendix_e"}, 1, "no projector, 1 block (fusing 1)"),
    ({"model.depth": 1, "model.method": "abc", "model.abc.blocks": 2}, 2, "no projector, ABC 2 SABs (fusing 2)"),
])
def test_a_runs_head_says_its_projector_and_how_many_blocks_fuse(flat, fusing, words):
    from pipeline.config.names import fusing_blocks, head_description

    assert fusing_blocks(flat) == fusing and head_description(flat) == words
