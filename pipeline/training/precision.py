"""The training step's numeric precision, chosen by device (``train.precision``).

``auto`` picks what the device computes natively:

=====================================  ==========================================================
device                                  precision
=====================================  ==========================================================
CPU                                     fp32 (no autocast: the exact path every test compares against)
CUDA, compute capability >= 8.0         bf16 autocast (A100, A10G, L4, H100: native bf16 tensor cores)
CUDA, compute capability 7.0 - 7.x      fp16 autocast with a gradient scaler (V100 = 7.0, T4 = 7.5: bf16 is
                                        emulated there and slower than fp32; fp16 tensor cores are native)
CUDA, compute capability < 7.0          fp32 (no tensor cores: P100, K80)
=====================================  ==========================================================

``bf16``, ``fp16`` and ``fp32`` force a choice on any device (fp16 always with the scaler: its 5 exponent bits
underflow small gradients without one). The loss itself is computed in fp32 whatever the autocast
(``pipeline.training.step``). With the scaler, each optimizer step checks the gradients for inf/NaN on the host (torch's
``GradScaler.step``): the one host sync per step that fp16 costs; bf16 and fp32 have none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

PRECISIONS = ("auto", "bf16", "fp16", "fp32")
Setting = Literal["auto", "bf16", "fp16", "fp32"]
BF16_MIN_CAPABILITY = (8, 0)  # Ampere: native bf16
FP16_MIN_CAPABILITY = (7, 0)  # Volta: fp16 tensor cores


@dataclass(frozen=True)
class Precision:
    """What the step runs in: ``autocast`` None = no autocast (fp32); ``scaler`` whether a GradScaler is needed."""

    name: str  # "bf16" | "fp16" | "fp32"
    autocast: torch.dtype | None
    scaler: bool

    def grad_scaler(self, device: torch.device) -> torch.amp.GradScaler | None:
        return torch.amp.GradScaler(device.type) if self.scaler else None


FP32 = Precision("fp32", None, False)
BF16 = Precision("bf16", torch.bfloat16, False)
FP16 = Precision("fp16", torch.float16, True)
BY_NAME = {"fp32": FP32, "bf16": BF16, "fp16": FP16}


def choose(setting: Setting, device_type: str, capability: tuple[int, int] | None = None) -> Precision:
    """The precision for ``setting`` on a device of type ``device_type`` ("cpu", "cuda") whose CUDA compute
    capability is ``capability`` (major, minor); see the module's table for ``auto``."""
    if setting != "auto":
        return BY_NAME[setting]
    if device_type != "cuda":
        return FP32
    if capability is None:
        raise ValueError("a CUDA device needs its compute capability to choose a precision")
    if capability >= BF16_MIN_CAPABILITY:
        return BF16
    if capability >= FP16_MIN_CAPABILITY:
        return FP16
    return FP32


def for_device(setting: Setting, device: torch.device) -> Precision:
    """:func:`choose` for a live device (reads a CUDA device's compute capability)."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return choose(setting, device.type, capability)
