"""One (row, seed) of a tables job in one process: trained by :class:`~pipeline.training.loop.PretrainLoop` (the loop
a one-worker trial of the job runs), then probed on its frozen backbone
(:func:`~pipeline.evaluation.evaluate.probe_frozen`); a control (``raw_pixels``, ``random_init``) probed untrained.

The tables job's trial (``pipeline.runs.tables``) trains through Ray and probes with :func:`probe_row_model`;
``benchmarks/study_rows.py`` and ``benchmarks/bench_tables.py`` call :func:`train_and_probe`, so the three build, seed
and probe a row the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from pipeline.config.params import Params
from pipeline.core.model import ABCModel, TransFusion, build_model
from pipeline.data.types import Dataset
from pipeline.evaluation.evaluate import probe_frozen
from pipeline.training.loop import PretrainLoop, epoch_record

Epoch = dict[str, float]  # a kept epoch record (pipeline.training.loop.epoch_record)


def row_model(params: Params, input_shape: tuple[int, ...], control: str | None = None,
              state: Mapping[str, torch.Tensor] | None = None) -> TransFusion | ABCModel | None:
    """The model a row's probes read: none for ``raw_pixels`` (they read the pixels), else built as
    :class:`PretrainLoop` builds it (``torch.manual_seed(train.seed)`` first), with a trained row's ``state``."""
    if control == "raw_pixels":
        return None
    torch.manual_seed(params.train.seed)
    model = build_model(params.model, input_shape)
    if state is not None:
        model.load_state_dict(state)
    return model


def probe_row_model(params: Params, data: Dataset, state: Mapping[str, torch.Tensor] | None,
                    control: str | None = None) -> tuple[dict[str, float], int]:
    """``probe.probes`` on a row's model (:func:`row_model`): ({probe: test accuracy}, probe training samples)."""
    return probe_frozen(params, data, row_model(params, data.input_shape, control, state))


@dataclass(frozen=True)
class ProbedRow:
    """A (row, seed) trained and probed in one process."""

    accuracies: dict[str, float]  # probe -> test accuracy
    n_probe: int  # the probes' training samples
    history: list[Epoch]  # every epoch's kept record ([] for a control)
    train_seconds: float  # wall: the epochs with their online kNN and health (0 for a control)
    probe_seconds: float

    @property
    def knn_acc(self) -> float | None:
        """The last online kNN (None: none was measured)."""
        knn = [h["knn_acc"] for h in self.history if h.get("knn_acc") is not None]
        return knn[-1] if knn else None


def train_and_probe(params: Params, data: Dataset, device: torch.device, control: str | None = None,
                    on_epoch: Callable[[list[Epoch]], None] | None = None) -> ProbedRow:
    """Train ``params`` (a row's, ``train.seed`` its seed) on ``data`` on ``device``, then probe its backbone; a control
    is probed untrained. ``on_epoch(history)`` after each epoch, with every kept epoch record so far."""
    start = time.perf_counter()
    history: list[Epoch] = []
    if control is None:
        loop = PretrainLoop(params, data, device)

        def each(_metrics: object, _checkpoint_now: bool) -> None:
            history.append(epoch_record(loop.history[-1]))  # the epoch just ended
            if on_epoch:
                on_epoch(list(history))

        loop.fit(each)
    model = loop.model if control is None else row_model(params, data.input_shape, control)
    trained = time.perf_counter()
    accuracies, n_probe = probe_frozen(params, data, model)
    return ProbedRow(accuracies, n_probe, history, trained - start, time.perf_counter() - trained)
