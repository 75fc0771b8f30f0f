"""The ``sweep`` section: the Ray Tune grid over depth, batch size and augmentation strength (and lr, the loss).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from pipeline.config.base import Section
from pipeline.config.loss import LossName


class SweepConfig(Section):
    """The sweep stage (Ray Tune): the grid over the paper's two knobs and depth."""

    # model.depth; with model.method: abc, ABC's SAB blocks (model.abc.blocks), the results still say model.depth
    depth: list[Annotated[int, Field(ge=0, le=64)]] = Field(default_factory=lambda: [0, 1, 2], min_length=1)
    batch_size: list[Annotated[int, Field(ge=2)]] = Field(default_factory=lambda: [32, 256], min_length=1)
    strength: list[Annotated[float, Field(ge=0.0, le=1.0)]] = Field(default_factory=lambda: [0.0, 1.0], min_length=1)
    lr: list[Annotated[float, Field(gt=0.0, le=10.0)]] = Field(default_factory=list)  # empty: keep train.lr
    loss: list[LossName] = Field(default_factory=list)  # loss.name; empty: keep it (Appendix B's Figure 5: lr x loss)
    search: Literal["grid", "random"] = "grid"
    num_samples: int = Field(1, ge=1)  # grid: seeds per point (train.seed + 0, 1, ...); random: sampled points
    epochs: int = Field(6, ge=1)
    asha: bool = False
    grace_period: int = Field(2, ge=1)
    cpus_per_worker: float = Field(0.5, gt=0.0)
    max_concurrent_trials: int | None = Field(None, ge=1)  # None: as many as the cluster's CPUs hold


__all__ = ['SweepConfig']
