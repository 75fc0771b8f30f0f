"""pipeline.training.precision: the step's precision by device, and the fp16 + gradient scaler path run on the CPU."""

from __future__ import annotations

import typing

import pytest
import torch

from pipeline.training.precision import BF16, FP16, FP32, PRECISIONS, choose
from tests.training.small import MLP, small_loop

# (GPU, compute capability) -> what `auto` must choose (NVIDIA's table of compute capabilities)
DEVICES = [
    ("K80", (3, 7), FP32), ("P100", (6, 0), FP32), ("GTX 1080", (6, 1), FP32),
    ("V100", (7, 0), FP16), ("T4", (7, 5), FP16), ("RTX 2080", (7, 5), FP16),
    ("A100", (8, 0), BF16), ("A10G", (8, 6), BF16), ("L4", (8, 9), BF16), ("H100", (9, 0), BF16),
    ("B200", (10, 0), BF16),
]


@pytest.mark.parametrize("gpu, capability, want", DEVICES, ids=[d[0] for d in DEVICES])
def test_auto_uses_what_the_gpu_computes_natively(gpu, capability, want):
    assert choose("auto", "cuda", capability) == want
    assert want.scaler == (want is FP16)  # fp16 always with the scaler


def test_auto_is_fp32_on_the_cpu_and_an_explicit_choice_wins_everywhere():
    assert choose("auto", "cpu") == FP32 and FP32.autocast is None
    for device, capability in (("cpu", None), ("cuda", (7, 5)), ("cuda", (9, 0))):
        assert choose("bf16", device, capability) == BF16 and BF16.autocast is torch.bfloat16
        assert choose("fp16", device, capability) == FP16 and FP16.autocast is torch.float16
        assert choose("fp32", device, capability) == FP32
    with pytest.raises(ValueError, match="compute capability"):
        choose("auto", "cuda")


def test_the_params_key_allows_exactly_the_choices():
    from pipeline.config.base import ParamsError
    from pipeline.config.params import load_params
    from pipeline.config.train import TrainConfig

    assert typing.get_args(TrainConfig.model_fields["precision"].annotation) == PRECISIONS
    assert load_params("params.yaml").train.precision == "auto"
    with pytest.raises(ParamsError, match="train.precision"):
        load_params("params.yaml", ["train.precision=fp8"])


def _loop(precision: str):
    return small_loop("train.epochs=2", *MLP, "model.depth=1", f"train.precision={precision}")


def test_fp16_trains_through_the_gradient_scaler_and_resumes_with_its_state():
    """The fp16 path (autocast float16, GradScaler) is the same code on the CPU as on a T4: it trains, its loss
    stays near fp32's, the scaler's state is checkpointed and restored."""
    fp32, fp16, auto = _loop("fp32"), _loop("fp16"), _loop("auto")
    assert fp32.scaler is None and "scaler" not in fp32.state_dict()
    assert auto.precision is FP32 and auto.step.autocast_dtype is None and auto.scaler is None  # on the CPU
    assert fp16.step.autocast_dtype is torch.float16 and fp16.step.scaler is fp16.scaler is not None
    a, b = fp32.train_epoch(), fp16.train_epoch()
    assert b.loss == pytest.approx(a.loss, rel=0.05) and b.loss != a.loss  # really in fp16, and close
    state = fp16.state_dict()
    assert state["scaler"]["scale"] == fp16.scaler.get_scale() > 0
    resumed = _loop("fp16")
    resumed.load_state_dict(state)
    assert resumed.scaler.get_scale() == fp16.scaler.get_scale()
    assert resumed.scaler.state_dict()["_growth_tracker"] == fp16.scaler.state_dict()["_growth_tracker"]


@pytest.mark.parametrize("compatibility,kernel", [("multiplicative", "logits"), ("additive", "paper")])
def test_abcs_step_under_bf16_autocast_is_the_fp32_step_within_bf16s_precision(compatibility, kernel):
    """model.method: abc under autocast: the head in bf16, its similarity and BCE upcast (as TransFusion's loss)."""
    from pipeline.core.abc import ABCHead
    from pipeline.core.backbones import build_backbone
    from pipeline.core.model import ABCModel, bce_loss
    from pipeline.training.step import GlobalBatchStep

    torch.manual_seed(0)
    bb, dim = build_backbone("mlp", (1, 6, 6), embed_dim=12, hidden_dim=16)
    model = ABCModel(bb, dim, ABCHead(dim, depth=2, heads=2, width=8, compatibility=compatibility, kernel=kernel))
    x, ids = torch.rand(16, 1, 6, 6), torch.tensor([0, 1, 2, 0, 1, 2, 0, 3] * 2)
    got = GlobalBatchStep(model, bce_loss(), layout="labels", autocast_dtype=torch.bfloat16)(x, ids)
    grads = [p.grad.clone() for p in model.parameters()]
    want = GlobalBatchStep(model, bce_loss(), layout="labels")(x, ids)
    assert got == pytest.approx(want, rel=2e-2) and got != want  # bf16 did run, and close
    got_g, want_g = torch.cat([g.flatten() for g in grads]), torch.cat([p.grad.flatten() for p in model.parameters()])
    assert torch.isfinite(got_g).all() and float((got_g - want_g).norm() / want_g.norm()) < 0.05
