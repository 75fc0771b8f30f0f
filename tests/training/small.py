"""Small pretraining loops on digits for the tests: params.yaml with a few overrides, a CPU ``PretrainLoop``."""

from __future__ import annotations

import torch

from pipeline.config.data import DataConfig
from pipeline.config.params import load_params
from pipeline.data.sources import load_dataset
from pipeline.training.loop import PretrainLoop
from tests.conftest import ROOT

MLP = ("model.backbone=mlp", "model.embed_dim=16", "model.hidden_dim=32")  # seconds an epoch here


def digits(limit_train: int | None = 128, limit_test: int = 40):
    """Stratified subsets of scikit-learn's digits (seed 0)."""
    return load_dataset(DataConfig(dataset="digits", root="unused", limit_train=limit_train, limit_test=limit_test))


def params(*overrides: str):
    """params.yaml with batches of 32 and no kNN monitor, then ``overrides``."""
    return load_params(ROOT / "params.yaml", ["train.batch_size=32", "train.knn_every=0", *overrides])


def small_loop(*overrides: str, data=None, **kwargs) -> PretrainLoop:
    """A CPU loop of :func:`params` on ``data`` (default: :func:`digits`); ``kwargs`` go to ``PretrainLoop``."""
    return PretrainLoop(params(*overrides), digits() if data is None else data, torch.device("cpu"), **kwargs)
