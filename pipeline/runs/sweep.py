"""Ray Tune sweeps over depth, batch size and augmentation strength (and lr): the paper's claims, tested. The space
and every trial's params come from ``pipeline.config.space``; here the job (:func:`run_sweep`) and its rows.
"""

from __future__ import annotations

import math
from pathlib import Path

from ray import tune

from pipeline.config.base import flatten
from pipeline.config.names import sweep_label
from pipeline.config.params import Params
from pipeline.config.ray import TRIAL_CPU
from pipeline.config.resources import max_concurrent, trial_shape
from pipeline.config.space import axes, base_params, check_points, grid_points, point_of, point_params, trial_params
from pipeline.data.prepared import load_prepared
from pipeline.evaluation.health import dead_blocks, unflat
from pipeline.runs.job import TRAINING, WorkerSpec, flat_sections, open_job, read_manifest
from pipeline.runs.tune import JobResult, Outcome, TrialTracker, fit_trial, inline, trainable, trial_placement, tune_job
from pipeline.training.loop import epoch_metrics

# The params.yaml keys a sweep's result depends on (dvc.yaml's sweep stage lists them; tests/test_dvc_deps.py checks):
# its section and the trials' base (`base_params`) without what that overwrites or always sweeps; of ray what counts.
DVC_PARAMS = ("sweep", "model.method", "model.backbone", "model.embed_dim", "model.hidden_dim", "model.projector",
              "model.projector_dim", "model.activation", "model.block_norm", "model.head", "model.fusion_scope",
              "model.qk_init", "model.weights", "model.abc",
              "loss", "augment.preset",
              "train.mode", "train.lr", "train.optimizer", "train.weight_decay", "train.warmup_epochs", "train.seed",
              "train.device", "train.grad_cache_chunk", "train.knn_k", "train.head_lr_scale", "train.precision",
              "train.memory_format", "train.data_budget_mb", "train.head_budget_mb", "ray.num_workers", "ray.use_gpu")


# ------------------------------------------------------------------------------------------------- trial
def _trial(config: dict[str, object], job: WorkerSpec) -> None:
    """One Tune trial: pretraining on the point in ``config`` (``{"model.depth": 1, ...}``) over the base's params."""
    fit_trial(job, point_params(job.params.model_dump(), point_of(config)))


class SweepTracker(TrialTracker):
    """The sweep's driver-side tracker: a child run per trial with its point as params."""

    PREFIX = "[sweep]"
    STAGE = "sweep-trial"


# ------------------------------------------------------------------------------------------------ driver
def run_sweep(params: Params, data_dir: Path, root: Path, *, tracking: bool = True) -> JobResult:
    """Run (or resume) the sweep (``rows``: :func:`trial_rows`); ``SweepError`` if interrupted or every trial failed."""
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    check_points(params)  # the params first, every point of the grid: exit 2 before the data is read
    load_prepared(data_dir, verify=True, mmap=True)  # a corrupt input fails here (mapped: never read whole)
    base = base_params(params)
    check_points(params, read_manifest(data_dir).get("n_train"))  # and each batch against the training set
    s = params.sweep
    samples = 1 if s.search == "grid" else s.num_samples
    n = len(grid_points(params)) if s.search == "grid" else samples
    job = open_job("sweep", params, data_dir, root, tracking=tracking, title=sweep_label(n, axes(params)),
                   logged={**flatten(s, "sweep."), **flat_sections(base, TRAINING)},
                   worker_params=Params.model_validate(base, strict=False),
                   cpus_per_worker=s.cpus_per_worker, trial_cpu=TRIAL_CPU, what="a sweep trial")
    sample = tune.grid_search if s.search == "grid" else tune.choice
    space = {k: sample(v) for k, v in axes(params).items()}
    scheduler = (ASHAScheduler(time_attr="epoch", max_t=s.epochs, grace_period=min(s.grace_period, s.epochs),
                               reduction_factor=2) if s.asha else FIFOScheduler())
    trainer = trainable(_trial, job.spec, trial_placement(trial_params(base, {}), job.gpu))
    shape = trial_shape(params, job.gpu, s.cpus_per_worker, TRIAL_CPU)
    concurrent = max_concurrent(s.max_concurrent_trials, shape, job.totals, n)
    announce = (f"[sweep] {job.name}: {n} trials ({s.search}), {s.epochs} epochs each, up to {concurrent} at a time"
                + (", ASHA early stopping" if s.asha else ""))
    result = tune_job(job, trainer, space, tracker=SweepTracker(s.epochs, str(job.state_dir), job.run),
                      concurrent=concurrent, announce=announce, scheduler=scheduler, num_samples=samples,
                      reuse_actors=inline(trial_params(base, {})))
    result.rows = trial_rows(result.outcomes, s.epochs)
    return result


# ------------------------------------------------------------------------------------------------- outputs
def trial_rows(trials: list[Outcome], epochs: int) -> list[dict[str, object]]:
    """One row per trial: its point, its last epoch's metrics and health, how long it trained, where, its status."""
    rows = []
    for t in trials:
        last = t.history[-1] if t.history else {}
        blocks = unflat(last)  # the last epoch's health of each block ({} at depth 0)
        epoch = int(last.get("epoch", 0) or 0)
        knn = [h["knn_acc"] for h in t.history if isinstance(h.get("knn_acc"), float) and not math.isnan(h["knn_acc"])]
        rows.append({
            "trial_id": t.trial_id, **point_of(t.config),
            # the last epoch's per-epoch metrics (seconds: below, the trial's in all)
            **{m: math.nan if last.get(m) is None else float(last[m]) for m in epoch_metrics()},
            "best_knn_acc": max(knn, default=math.nan),
            "min_positive": min((h.get("positive", math.nan) for h in blocks.values()), default=math.nan),
            "max_uniform_rows": max((h.get("uniform_rows", math.nan) for h in blocks.values()), default=math.nan),
            "dead_blocks": len(dead_blocks(blocks)), "epochs": epoch,
            "stopped_early": bool(t.history) and not t.error and epoch < epochs,
            "seconds": float(sum(h.get("seconds", 0.0) for h in t.history)), "workers": len(t.workers),
            "gpu_ids": " ".join(",".join(w.get("gpu_ids", [])) or "-" for w in t.workers)
            if any(w.get("gpu_ids") for w in t.workers) else "",  # per rank: "0 1"
            **t.ending(not t.error),
        })
    return rows
