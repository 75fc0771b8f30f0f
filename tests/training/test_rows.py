"""pipeline/training/rows.py: a tables row trained and probed in one process, the model its probes read, a control."""

from __future__ import annotations

import pytest
import torch

from pipeline.evaluation.evaluate import probe_frozen
from pipeline.training.loop import PretrainLoop, epoch_metrics, epoch_record
from pipeline.training.rows import probe_row_model, row_model, train_and_probe
from tests.training.small import MLP, digits, params

PROBES = ("probe.probes=[knn50, logreg]",)


@pytest.fixture(scope="module")
def data():
    return digits(limit_train=128, limit_test=60)


def same_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_raw_pixels_has_no_model_and_random_init_is_the_loops_model_before_training(data):
    p = params(*MLP)
    assert row_model(p, data.input_shape, "raw_pixels") is None
    untrained = PretrainLoop(p, data, torch.device("cpu")).model  # the loop seeds and builds before any step
    assert same_state(row_model(p, data.input_shape, "random_init"), untrained)
    other = row_model(params(*MLP, "train.seed=1"), data.input_shape, "random_init")
    assert not same_state(other, untrained)


@pytest.mark.parametrize("epochs", [1, 2])
def test_a_trained_row_reports_every_epoch_then_probes_what_it_trained(data, epochs):
    p = params(*MLP, *PROBES, f"train.epochs={epochs}", "train.knn_every=1")
    seen: list[list[dict]] = []
    done = train_and_probe(p, data, torch.device("cpu"), on_epoch=seen.append)
    assert [len(h) for h in seen] == list(range(1, epochs + 1)) and seen[-1] == done.history
    kept = ["epoch", *epoch_metrics()]  # kept records: then the block's health, no wall clock
    assert list(done.history[0])[:len(kept)] == kept and "block_1.positive" in done.history[0]
    assert "ended_at" not in done.history[0]
    assert done.knn_acc == done.history[-1]["knn_acc"] and set(done.accuracies) == {"knn50", "logreg"}
    assert done.n_probe == 128 and done.train_seconds > 0 and done.probe_seconds > 0

    loop = PretrainLoop(p, data, torch.device("cpu"))  # the same row trained here: the same numbers
    loop.fit(lambda m, now: None)
    assert [epoch_record(h)["loss"] for h in loop.history] == [h["loss"] for h in done.history]
    assert probe_row_model(p, data, loop.model.state_dict()) == (done.accuracies, done.n_probe)


@pytest.mark.parametrize("control", ["raw_pixels", "random_init"])
def test_a_control_is_probed_untrained(data, control):
    p = params(*MLP, *PROBES)
    done = train_and_probe(p, data, torch.device("cpu"), control=control, on_epoch=pytest.fail)
    assert done.history == [] and done.knn_acc is None and done.train_seconds < 1.0
    assert (done.accuracies, done.n_probe) == probe_frozen(p, data, row_model(p, data.input_shape, control))
