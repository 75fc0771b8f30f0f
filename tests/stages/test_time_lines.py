"""The stages' closing time lines: where a stage's wall time went (quick: no Ray, no probes)."""

from __future__ import annotations

import pytest

from pipeline.evaluation import Evaluation
from pipeline.train import PretrainResult
from stages import evaluate, pretrain


def result(fit_started: float, fit_seconds: float, ended: list[float], seconds: list[float]) -> PretrainResult:
    history = [{"epoch": i + 1, "ended_at": e, "seconds": s} for i, (e, s) in
               enumerate(zip(ended, seconds, strict=True))]
    return PretrainResult(state={"history": history}, run_name="x", mlflow_run_id=None, input_shape=(1, 8, 8),
                          n_classes=10, fit_started=fit_started, fit_seconds=fit_seconds)


def test_the_parts_add_up_to_the_whole():
    res = result(fit_started=110.0, fit_seconds=20.0, ended=[115.0, 125.0], seconds=[3.0, 3.5])
    assert pretrain.time_line(100.0, res, now=140.0) == (
        "[pretrain] 40 s in all: 10.0 s before training (imports, Ray's start, checks, MLflow run), Ray Train's run "
        "20.0 s (6.5 s of training steps), 10.0 s after (outputs, MLflow model)")


@pytest.mark.parametrize("ended, steps", [([105.0, 108.0, 115.0], "3.0 s"), ([105.0, 108.0, 109.9], "0.0 s")])
def test_a_resumed_run_counts_only_the_epochs_it_trained(ended, steps):
    # epochs that ended before this run's start come from the checkpoint of an earlier, interrupted run
    res = result(fit_started=110.0, fit_seconds=20.0, ended=ended, seconds=[3.0, 3.0, 3.0])
    assert f"({steps} of training steps)" in pretrain.time_line(100.0, res, now=140.0)


def test_evaluate_splits_the_evaluation_into_embeddings_probes_and_the_rest():
    ev = Evaluation(metrics={"embed_seconds": 1.5}, probe_rows=[{"seconds": 2.0}, {"seconds": 0.5}])
    assert evaluate.time_line(100.0, [104.0, 110.0, 113.0, 114.5], ev) == (
        "[evaluate] 14 s in all: 4.0 s of start (imports, model, data), embeddings 1.5 s, probes 2.5 s, affinities, "
        "clustering and health 2.0 s, figures (t-SNE included) 3.0 s, MLflow run 1.5 s")
