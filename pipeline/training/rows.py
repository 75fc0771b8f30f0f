"""One (row, seed) of a tables job in one process: trained by :class:`~pipeline.training.loop.PretrainLoop` (the loop
a one-worker trial of the job runs), then probed on its frozen backbone
(:func:`~pipeline.evaluation.evaluate.probe_frozen`); a control (``raw_pixels``, ``random_init``) probed untrained.

The tables job's trial (``pipeline.runs.tables``) trains through Ray and probes with :func:`probe_row_model`;
``benchmarks/study_rows.py`` and ``benchmarks/bench_tables.py`` call :func:`train_and_probe` (a tuning trial:
:func:`train_row`), so the three build, seed and probe a row the same way.
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


def last_knn(history: list[Epoch]) -> float | None:
    """The last online kNN accuracy of ``history`` (None: none was measured)."""
    knn = [h["knn_acc"] for h in history if h.get("knn_acc") is not None]
    return knn[-1] if knn else None


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
        return last_knn(self.history)


@dataclass(frozen=True)
class TrainedRow:
    """A (row, seed) trained in one process."""

    model: TransFusion | ABCModel
    history: list[Epoch]  # every epoch's kept record
    seconds: float  # wall: the epochs with their online kNN and health

    @property
    def knn_acc(self) -> float | None:
        """The last online kNN, on the validation split (None: none was measured): what a tuning trial scores."""
        return last_knn(self.history)


def train_row(params: Params, data: Dataset, device: torch.device,
              on_epoch: Callable[[list[Epoch]], None] | None = None) -> TrainedRow:
    """Train ``params`` (a row's, ``train.seed`` its seed) on ``data`` on ``device`` as a one-worker trial of the job
    does; ``on_epoch(history)`` after each epoch, with every kept epoch record so far."""
    start = time.perf_counter()
    history: list[Epoch] = []
    loop = PretrainLoop(params, data, device)

    def each(_metrics: object, _checkpoint_now: bool) -> None:
        history.append(epoch_record(loop.history[-1]))  # the epoch just ended
        if on_epoch:
            on_epoch(list(history))

    loop.fit(each)
    return TrainedRow(loop.model, history, time.perf_counter() - start)


def train_and_probe(params: Params, data: Dataset, device: torch.device, control: str | None = None,
                    on_epoch: Callable[[list[Epoch]], None] | None = None) -> ProbedRow:
    """Train ``params`` (:func:`train_row`), then probe its backbone; a control is probed untrained."""
    trained = train_row(params, data, device, on_epoch) if control is None else None
    model = trained.model if trained else row_model(params, data.input_shape, control)
    start = time.perf_counter()
    accuracies, n_probe = probe_frozen(params, data, model)
    return ProbedRow(accuracies, n_probe, trained.history if trained else [], trained.seconds if trained else 0.0,
                     time.perf_counter() - start)
