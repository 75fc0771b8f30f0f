"""params.yaml validation: every bad input names its key and what is allowed."""

from __future__ import annotations

import copy

import pytest
import yaml

from pipeline.config.base import ParamsError, apply_overrides, flatten, parse_override
from pipeline.config.params import Params, load_params, validate_params
from tests.conftest import ROOT

DEFAULT_RAW = yaml.safe_load((ROOT / "params.yaml").read_text())


def default_raw() -> dict:
    """params.yaml as a dict of its own, for a test to change."""
    return copy.deepcopy(DEFAULT_RAW)


def test_project_params_are_valid():
    p = load_params(ROOT / "params.yaml")
    assert isinstance(p, Params)
    assert p.data.dataset == "digits"
    flat = flatten(p)
    assert flat["model.depth"] == 1 and flat["data.synthetic.rank"] == 3 and "ray.num_workers" in flat
    assert p.train.data_budget_mb is None  # auto: a share of the device's memory; else MiB, fractions too
    assert load_params(ROOT / "params.yaml", ["train.data_budget_mb=0.25"]).train.data_budget_mb == 0.25
    assert load_params(ROOT / "params.yaml", ["train.data_budget_mb=4096"]).train.data_budget_mb == 4096.0


def test_overrides_parse_yaml_values():
    assert parse_override("model.depth=3") == (["model", "depth"], 3)
    assert parse_override("data.image_size=null") == (["data", "image_size"], None)
    assert parse_override("train.lr=1e-2") == (["train", "lr"], 0.01)
    raw = apply_overrides(default_raw(), ["model.depth=5", "data.synthetic.noise=0.3"])
    p = validate_params(raw)
    assert p.model.depth == 5 and p.data.synthetic.noise == 0.3


ABC_OK = ["model.method=abc", "model.qk_init=default", "loss.name=bce"]  # what method abc needs on params.yaml
# (overrides, substrings the message must contain): the rules' cases that tests/test_hostile_input.py does not run
# through the CLI (its name-*, type-*, range-*, conflict-* and unknown-key cases are not repeated here)
BAD = [
    (["model.backbone=torchvision:", "model.embed_dim=null"],  # YAML reads a mapping
     ["model.backbone: {'torchvision': None} (dict, not a name): unknown backbone", "torchvision:<name>"]),
    (["model.backbone=3"], ["model.backbone: 3 (int, not a name): unknown backbone", "cnn_small"]),
    (["model.backbone=resnet50", "model.embed_dim=null"], ["model.backbone", "torchvision:<name>"]),
    (["model.backbone=torchvision:resnet18", "model.embed_dim=null", "data.dataset=synthetic"],
     ["model.backbone", "torchvision:resnet18", "vectors"]),
    (["model.backbone=torchvision:resnet18", "model.embed_dim=null", "model.weights=w.pt"],
     ["model.weights", "resnet18 backbone"]),
    ([*ABC_OK, "model.abc.pre_embed=false", "model.backbone=torchvision:resnet18", "model.embed_dim=null"],
     ["model.abc.pre_embed", "torchvision:resnet18 gives 512", "model.abc.width (128)"]),
    (["model.activation=gelu"], ["model.activation", "relu", "softmax"]),
    (["model.fusion_scope=pairs"], ["model.fusion_scope", "joint", "per_view"]),
    (["model.qk_init=zeros"], ["model.qk_init", "default", "tied", "identity"]),
    (["train.head_lr_scale=0"], ["train.head_lr_scale", "greater than 0"]),
    (["train.data_budget_mb=-1"], ["train.data_budget_mb", "greater than or equal to 0"]),
    (["train.data_budget_mb=lots"], ["train.data_budget_mb", "valid number"]),
    (["model.depth=-1"], ["model.depth", "greater than or equal to 0"]),
    (["train.epochs=0"], ["train.epochs"]),
    (["data.test_fraction=1.0"], ["data.test_fraction", "less than 1"]),
    (["data.val_size=0"], ["data.val_size", "0 < f < 1", "integer >= 1"]),
    (["data.val_size=1.0"], ["data.val_size", "0 < f < 1", "integer >= 1"]),
    (["data.val_size=true"], ["data.val_size"]),
    (["train.optimizer=rmsprop"], ["train.optimizer", "adam", "lars"]),
    (["train.mode=semi"], ["train.mode", "self_supervised", "supervised"]),
    (["train.mode=supervised", "loss.name=barlow_twins"], ["barlow_twins", "self_supervised"]),
    (["model.head=truncated", "model.depth=0"], ["model.head", "depth >= 1"]),
    (["model.backbone=pixels", "model.depth=0", "model.embed_dim=null"], ["pixels", "nothing to train"]),
    (["model.backbone=resnet18_cifar", "model.embed_dim=128"], ["model.embed_dim", "512"]),
    (["data.synthetic.rank=10", "data.synthetic.dim=20"], ["data.synthetic", "must be < dim"]),
    (["ray.num_workers=0"], ["ray.num_workers", "greater than or equal to 1"]),
    (["ray.use_gpu=true", "train.device=cpu"], ["ray.use_gpu", "train.device"]),
    (["model.backbone=resnet18", "model.embed_dim=null", "train.grad_cache_chunk=64"],
     ["train.grad_cache_chunk", "resnet18", "BatchNorm"]),
    (["loss.temperature=-0.1"], ["loss.temperature", "greater than 0"]),
    (["loss.power=0.5"], ["loss.power", "greater than or equal to 1"]),
    (["loss.name=infonce", "loss.power=8"], ["loss.power", "jsd", "not infonce"]),
    (["model.weights=w.pt"], ["model.weights", "resnet18"]),
    (["data.synthetic.noise=2"], ["data.synthetic.noise", "less than or equal to 1"]),
    # method abc (ABC_OK: the keys it needs on this file)
    (["model.method=kmeans"], ["model.method", "transfusion", "abc"]),
    (["model.method=abc", "model.qk_init=default"], ["model.method: abc", "loss.name: bce", "not jsd"]),
    (["loss.name=bce"], ["loss.name: bce", "model.method: abc"]),
    (["model.method=abc", "loss.name=bce"], ["model.qk_init: identity", "TransFusion", "model.qk_init: default"]),
    ([*ABC_OK, "model.depth=3", "model.head=truncated",
      "model.activation=softmax", "model.block_norm=l2", "model.fusion_scope=per_view"],
     ["model.depth: 3", "model.head: truncated", "model.activation: softmax", "model.block_norm: l2",
      "model.fusion_scope: per_view", "model.abc"]),
    ([*ABC_OK, "model.abc.heads=3"], ["model.abc.width (128)", "multiple of model.abc.heads (3)"]),
    ([*ABC_OK, "model.abc.compatibility=cosine"], ["model.abc.compatibility", "multiplicative", "additive"]),
    ([*ABC_OK, "model.abc.kernel=softmax"], ["model.abc.kernel", "logits", "paper"]),
    ([*ABC_OK, "model.abc.blocks=-1"], ["model.abc.blocks", "greater than or equal to 0"]),
    ([*ABC_OK, "model.abc.pre_embed=false", "model.embed_dim=64"], ["model.abc.pre_embed", "gives 64"]),
    ([*ABC_OK, "model.abc.pre_embed=false", "model.backbone=pixels", "model.embed_dim=null"],
     ["model.abc.pre_embed", "the input size"]),
    ([*ABC_OK, "loss.pos_weight=0"], ["loss.pos_weight", "greater than 0", "balanced"]),
    ([*ABC_OK, "loss.pos_weight=many"], ["loss.pos_weight", "balanced"]),
    (["loss.pos_weight=2"], ["loss.pos_weight", "bce", "not jsd"]),
    (["model.abc.blocks=3"], ["model.abc", "model.method: abc"]),
]


@pytest.mark.parametrize("overrides,needles", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_params_name_the_key_and_the_allowed_values(overrides, needles):
    raw = apply_overrides(default_raw(), overrides)
    with pytest.raises(ParamsError) as info:
        validate_params(raw, source="params.yaml")
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, f"{needle!r} missing from: {msg}"


@pytest.mark.parametrize("mode", ["supervised", "self_supervised"])
def test_method_abc_with_bce_is_valid_in_both_modes(mode):
    """Supervised: ABC's kernel learns same class; self-supervised: same source image (a row's other view)."""
    raw = apply_overrides(default_raw(), ["model.method=abc", "model.qk_init=default", "loss.name=bce",
                                          f"train.mode={mode}", "loss.pos_weight=2", "model.abc.pre_embed=false",
                                          "model.abc.compatibility=additive", "model.abc.kernel=paper"])
    p = validate_params(raw)
    assert (p.model.method, p.loss.pos_weight, p.model.abc.compatibility, p.model.abc.kernel) == ("abc", 2.0,
                                                                                                  "additive", "paper")
    defaults = validate_params(apply_overrides(default_raw(), ["model.method=abc", "model.qk_init=default",
                                                               "loss.name=bce"]))
    assert defaults.loss.pos_weight == "balanced" and defaults.model.abc.blocks == 2 and defaults.model.abc.width == 128


def test_abc_set_norm_is_on_by_default_and_can_be_turned_off():
    """model.abc.set_norm: params.yaml's and the section's default is true; false gives the paper's maths."""
    on = validate_params(apply_overrides(default_raw(), ABC_OK))
    assert on.model.abc.set_norm is True and "set_norm" in default_raw()["model"]["abc"]
    off = validate_params(apply_overrides(default_raw(), [*ABC_OK, "model.abc.set_norm=false"]))
    assert off.model.abc.set_norm is False  # read only with method abc, as every model.abc key (BAD's last row)


def test_backbones_take_their_width_and_grad_cache_without_batchnorm():
    """torchvision:<name>: embed_dim null or the model's width; gradient caching where it has no BatchNorm."""
    from pipeline.config.model import AbcConfig, ModelConfig

    assert validate_params(apply_overrides(default_raw(), ["train.grad_cache_chunk=8"])).train.grad_cache_chunk == 8
    raw = apply_overrides(default_raw(), ["model.backbone=resnet18_cifar", "model.embed_dim=null"])
    assert validate_params(raw).train.grad_cache_chunk is None  # cnn_small above: GroupNorm, caching is exact
    ok = validate_params(apply_overrides(default_raw(), ["model.backbone=torchvision:convnext_tiny",
                                                         "model.embed_dim=null", "train.grad_cache_chunk=8"]))
    assert ok.model.backbone == "torchvision:convnext_tiny" and ok.model.width() == 768
    assert ModelConfig(backbone="torchvision:resnet50", embed_dim=2048).width() == 2048
    abc = ModelConfig(method="abc", backbone="torchvision:resnet18", abc=AbcConfig(width=512, pre_embed=False))
    assert abc.width() == 512 and ModelConfig(backbone="pixels").width() is None


def test_every_problem_is_listed_at_once():
    raw = apply_overrides(default_raw(), ["model.depth=-1", "loss.name=nope", "data.seed=-3"])
    msg = str(pytest.raises(ParamsError, validate_params, raw).value)
    assert "model.depth" in msg and "loss.name" in msg and "data.seed" in msg


