"""The stages' closing time lines: where a stage's wall time went (quick: no Ray, no probes)."""

from __future__ import annotations

import pytest

from pipeline.config.params import load_params
from pipeline.evaluation.evaluate import Evaluation
from pipeline.runs.job import Job, WorkerSpec
from pipeline.runs.train import PretrainResult, TrainedState
from pipeline.runs.tune import JobResult
from stages import evaluate, pretrain, sweep
from stages._common import time_line


def result(fit_started: float, fit_seconds: float, ended: list[float], seconds: list[float]) -> PretrainResult:
    history = [{"epoch": i + 1, "ended_at": e, "seconds": s} for i, (e, s) in
               enumerate(zip(ended, seconds, strict=True))]
    return PretrainResult(state=TrainedState({}, history, len(history), []), job=job(), input_shape=(1, 8, 8),
                          n_classes=10, fit_started=fit_started, fit_seconds=fit_seconds)


def job() -> Job:
    params = load_params("params.yaml")
    return Job("x", params, None, False, {}, WorkerSpec(params, "", {}, "", "x", False), None)


def test_the_line_names_the_total_and_each_part():
    assert time_line("x", 100.0, [("a", 1.25), ("b c", 30.0)], now=131.4) == "[x] 31 s in all: a 1.2 s, b c 30.0 s"


def test_pretrain_parts_add_up_to_the_whole():
    res = result(fit_started=110.0, fit_seconds=20.0, ended=[115.0, 125.0], seconds=[3.0, 3.5])
    assert pretrain.time_parts(100.0, res, now=140.0) == [
        ("start (imports, Ray, checks, MLflow run)", 10.0), ("Ray Train's run", 20.0), ("of which training steps", 6.5),
        ("outputs and MLflow model", 10.0)]


@pytest.mark.parametrize("ended, steps", [([105.0, 108.0, 115.0], 3.0), ([105.0, 108.0, 109.9], 0.0)])
def test_a_resumed_pretrain_counts_only_the_epochs_it_trained(ended, steps):
    # epochs that ended before this run's start come from the checkpoint of an earlier, interrupted run
    res = result(fit_started=110.0, fit_seconds=20.0, ended=ended, seconds=[3.0, 3.0, 3.0])
    assert dict(pretrain.time_parts(100.0, res, now=140.0))["of which training steps"] == steps


def test_evaluate_splits_the_evaluation_into_embeddings_probes_and_the_rest():
    ev = Evaluation(metrics={"embed_seconds": 1.5}, probe_rows=[{"seconds": 2.0}, {"seconds": 0.5}])
    assert evaluate.time_parts(100.0, [104.0, 110.0, 113.0, 114.5], ev) == [
        ("start (imports, model, data)", 4.0), ("embeddings", 1.5), ("probes", 2.5),
        ("affinities, clustering and health", 2.0), ("figures (t-SNE included)", 3.0), ("MLflow run", 1.5)]


def test_sweep_parts_are_the_start_the_trials_and_the_outputs():
    res = JobResult(job=job(), outcomes=[], seconds=18.0, started=108.0)
    assert sweep.time_parts(100.0, res, now=128.5) == [
        ("start (imports, Ray, checks, MLflow run)", 8.0), ("trials", 18.0), ("outputs, figures and MLflow", 2.5)]
