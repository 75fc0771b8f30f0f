"""The ``train`` section: epochs, the global batch, the optimizer, device and precision, checkpoints.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pipeline.config.base import MAX_SEED, Section


class TrainConfig(Section):
    mode: Literal["self_supervised", "supervised"] = "self_supervised"
    epochs: int = Field(20, ge=1, le=100_000)
    batch_size: int = Field(256, ge=2, le=1_000_000)
    lr: float = Field(1e-3, gt=0.0, le=10.0)
    optimizer: Literal["adam", "sgd", "lars"] = "adam"
    weight_decay: float = Field(0.0, ge=0.0, le=1.0)
    warmup_epochs: int = Field(0, ge=0)
    seed: int = Field(0, ge=0, le=MAX_SEED)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    checkpoint_every: int = Field(1, ge=1)
    grad_cache_chunk: int | None = Field(None, ge=1)
    knn_every: int = Field(1, ge=0)  # epochs between the online checks, kNN and health (0 = only after the last)
    knn_k: int = Field(20, ge=1)
    head_lr_scale: float = Field(1.0, gt=0.0, le=1000.0)  # ours: the head's lr = train.lr * this
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"  # the step's autocast (pipeline.training.precision)
    # channels_last: an image backbone and its inputs in torch.channels_last (cnn_small on 28x28, 2 CPU threads: a step
    # 0.76x the time, benchmarks/bench_backbone.py); inputs that are not images stay as they are
    memory_format: Literal["contiguous", "channels_last"] = "contiguous"
    # MiB the training set may take on a worker's device (above: streamed from memory-mapped files, same results);
    # None: a share of the device's memory (pipeline.training.loop.data_budget); 0 always streams
    data_budget_mb: float | None = Field(None, ge=0.0, le=1e9)
    # MiB the head and the loss may take on a worker (pipeline.core.plan): the dense path within it, column tiles
    # beyond it (same numbers); None: a share of the device's memory; 0 always tiles
    head_budget_mb: float | None = Field(None, ge=0.0, le=1e9)

    @model_validator(mode="after")
    def _warmup(self) -> TrainConfig:
        if self.warmup_epochs >= self.epochs:
            raise ValueError(
                f"train.warmup_epochs ({self.warmup_epochs}) must be < train.epochs ({self.epochs})"
            )
        return self


__all__ = ['TrainConfig']
