"""The ``data`` section: which dataset ``prepare`` reads and how it splits it. The ``prepare`` stage reads only
this section (and :mod:`pipeline.config.base`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pipeline.config.base import MAX_SEED, Section

# the readers of pipeline.data.sources (its READERS), by name (tests/config/test_params.py checks the two agree)
DATASET_NAMES = ("digits", "synthetic", "cifar10", "fashion_mnist", "omniglot", "image_folder")
DatasetName = Literal[DATASET_NAMES]  # type: ignore[valid-type]


class SyntheticConfig(Section):
    """Union of K subspaces of rank r in R^m with noise bounded as eq. 8 (``x·x̃ >= 1 - noise``)."""

    n_samples: int = Field(2000, ge=4, le=10_000_000)
    n_clusters: int = Field(10, ge=2, le=10_000)
    rank: int = Field(3, ge=1)
    dim: int = Field(64, ge=2, le=100_000)
    noise: float = Field(0.1, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _independent(self) -> SyntheticConfig:
        if (self.n_clusters - 1) * self.rank >= self.dim:
            raise ValueError(
                f"data.synthetic: (n_clusters - 1) * rank = {(self.n_clusters - 1) * self.rank} must be < dim "
                f"= {self.dim} (the paper's independence assumption); lower rank or n_clusters, or raise dim"
            )
        if self.n_samples < 2 * self.n_clusters:
            raise ValueError("data.synthetic: n_samples must be >= 2 * n_clusters (every class in both splits)")
        return self


class DataConfig(Section):
    dataset: DatasetName = "digits"
    root: str = "data/raw"
    download: bool = False
    test_fraction: float = Field(0.2, gt=0.0, lt=1.0)
    seed: int = Field(0, ge=0, le=MAX_SEED)
    image_size: int | None = Field(None, ge=4, le=4096)
    # held out of the training images before limit_train, stratified and seeded: the split every selection reads
    # (online kNN, Tune's metric, the stop-rising epoch); a share of the training images (0 < f < 1) or a count
    val_size: int | float = 0.1
    limit_train: int | None = Field(None, ge=2)
    limit_test: int | None = Field(None, ge=2)
    synthetic: SyntheticConfig = SyntheticConfig()

    @model_validator(mode="after")
    def _val_size(self) -> DataConfig:
        v = self.val_size
        if isinstance(v, bool) or (isinstance(v, int) and v < 1) or (isinstance(v, float) and not 0.0 < v < 1.0):
            raise ValueError(f"data.val_size: {v!r} is neither a share of the training images (0 < f < 1) nor a "
                             "count of them (an integer >= 1); e.g. 0.1 or 5000")
        return self

    @model_validator(mode="after")
    def _image_folder_size(self) -> DataConfig:
        if self.dataset == "image_folder" and self.image_size is None:
            raise ValueError("data.image_size is required for data.dataset: image_folder (e.g. 32)")
        return self


__all__ = ['DATASET_NAMES', 'DataConfig', 'SyntheticConfig']
