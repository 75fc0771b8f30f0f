"""Ray Tune sweeps over depth, batch size and augmentation strength (and lr): the paper's claims, tested.

The sweep's job: its space and every trial's params come from ``pipeline.config.space`` (pure, checked before any
work); here the job (:func:`run_sweep`) and its rows (:func:`trial_rows`).
Each trial runs the pretraining worker loop on its point of the space through ``pipeline.runs.tune`` (the Ray Tune
machinery this job shares with the paper's tables): in the trial itself for one worker, as a Ray Train run for
several; either way Tune gets the same per-epoch metrics (online kNN accuracy, loss, measured view noise ε, the
blocks' health), and ASHA (optional) stops the hopeless trials early.

Resources: a trial holds ``TRIAL_CPU`` and its workers ``ray.num_workers × sweep.cpus_per_worker``;
``max_concurrent_trials`` is ``sweep.max_concurrent_trials``, else what the cluster's limiting resource holds
(``pipeline.runs.tune.max_concurrent``).

Tracking and progress come from one driver-side Tune callback (:class:`SweepTracker`): a progress line per
trial event, and MLflow written live from the driver only (one parent run per sweep, a child per trial with its
point, per-epoch metrics and final status), so trials never contend for the sqlite store. An interrupted
sweep (Ctrl-C, a killed driver) is restored with ``Tuner.restore``: finished trials are kept, unfinished ones
resume from their checkpoints, and the same MLflow parent and children continue.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from ray import tune

from pipeline.config.base import flatten
from pipeline.config.names import sweep_label
from pipeline.config.params import Params
from pipeline.config.space import (
    axes,
    base_params,
    check_points,
    grid_points,
    point_of,
    point_params,
    sweep_name,
    trial_params,
)
from pipeline.evaluation.health import dead_blocks, is_health_key, unflat
from pipeline.runs.cluster import connect, trial_shape, wait_for_workers
from pipeline.runs.storage import PLACEMENT_FILE, check_storage, checkpoint_dirs, join, read_json, stage_prepared
from pipeline.runs.train import (
    EPOCH_METRICS,
    WORKERS_FILE,
    WorkerSpec,
    error_reason,
    load_callbacks,
    mlflow_run,
    say,
    storage_location,
)
from pipeline.runs.tune import (
    TRIAL_CPU,
    SweepResult,
    TrialTracker,
    at_once,
    checkpoint_history,
    fit_trial,
    inline,
    last_checkpoint_path,
    max_concurrent,
    trainable,
    trial_name,
    trial_placement,
    tune_job,
)

# The params.yaml keys a sweep's result depends on: dvc.yaml's sweep stage lists exactly these (a whole section
# where every key is read). Its own section, and every trial's base (`base_params`) without what that overwrites
# (train.epochs, knn_every, checkpoint_every; ray.cpus_per_worker) or always sweeps (model.depth, train.batch_size,
# augment.strength; train.lr only when sweep.lr lists values); of ray only what changes results.
# tests/test_dvc_deps.py checks it against dvc.yaml and against base_params.
DVC_PARAMS = ("sweep", "model.method", "model.backbone", "model.embed_dim", "model.hidden_dim", "model.activation",
              "model.block_norm", "model.head", "model.fusion_scope", "model.qk_init", "model.weights", "model.abc",
              "loss", "augment.preset",
              "train.mode", "train.lr", "train.optimizer", "train.weight_decay", "train.warmup_epochs", "train.seed",
              "train.device", "train.grad_cache_chunk", "train.knn_k", "train.head_lr_scale", "train.precision",
              "train.memory_format",
              "train.data_budget_mb", "train.head_budget_mb", "ray.num_workers", "ray.use_gpu")


def parent_params(params: Params) -> dict[str, Any]:
    """The parent run's params: the sweep's section and the trials' base (model, loss, augment, train)."""
    return {**flatten(params.sweep, "sweep."),
            **{k: v for k, v in flatten(base_params(params)).items() if k.split(".")[0] in ("model", "loss", "augment",
                                                                                            "train")}}


def parent_title(params: Params) -> str:
    """The parent run's name: ``sweep · 8 trials · depth×batch×strength``."""
    trials = len(grid_points(params)) if params.sweep.search == "grid" else params.sweep.num_samples
    return sweep_label(trials, axes(params))


# ------------------------------------------------------------------------------------------------- trial
def _trial(config: dict[str, Any], job: WorkerSpec) -> None:
    """One Tune trial: the pretraining loop on this point of the space.

    ``config`` holds the point (``{"model.depth": 1, ...}``); ``job`` what every trial shares (its params: the base).
    """
    fit_trial(job, point_params(job.params, point_of(config)))


class SweepTracker(TrialTracker):
    """The sweep's driver-side tracker (``pipeline.runs.tune.TrialTracker``): ``[sweep]`` progress lines, a child run
    per trial (stage ``sweep-trial``) with its point as params."""

    PREFIX = "[sweep]"
    STAGE = "sweep-trial"


# ------------------------------------------------------------------------------------------------ driver
def run_sweep(params: Params, data_dir: Path, root: Path, *, tracking: bool = True) -> SweepResult:
    """Run (or resume) the sweep. Raises ``pipeline.runs.tune.SweepError`` if it was interrupted or every trial
    failed."""
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    callbacks = load_callbacks()  # a wrong name fails here, before Ray starts
    manifest = json.loads((data_dir / "manifest.json").read_text())
    name = sweep_name(params, manifest)
    storage = storage_location(params, root)
    base = base_params(params)
    check_points(params, manifest.get("n_train"))
    check_storage(storage)
    s = params.sweep
    gpu, totals = connect(params, root, tracking=tracking, cpus_per_worker=s.cpus_per_worker, trial_cpu=TRIAL_CPU,
                          what="a sweep trial")
    wait_for_workers(params, gpu=gpu, cpus_per_worker=s.cpus_per_worker, trial_cpu=TRIAL_CPU)
    uri = exp = parent = None
    if tracking:  # the parent run only once the cluster can serve the sweep
        uri, exp, parent = mlflow_run(root, name, stage="sweep", title=parent_title(params),
                                      logged=parent_params(params), manifest=manifest, data_dir=data_dir,
                                      tags={"sweep": name})
    job = WorkerSpec(params=base, data_dir=stage_prepared(data_dir, storage), manifest=manifest, storage=storage,
                     name=name, use_gpu=gpu, callbacks=callbacks)
    sample = tune.grid_search if s.search == "grid" else tune.choice
    space = {k: sample(v) for k, v in axes(params).items()}
    samples = 1 if s.search == "grid" else s.num_samples
    scheduler = (ASHAScheduler(time_attr="epoch", max_t=s.epochs, grace_period=min(s.grace_period, s.epochs),
                               reduction_factor=2) if s.asha else FIFOScheduler())
    trainer = trainable(_trial, job, trial_placement(trial_params(base, {}), gpu))
    tracker = SweepTracker(s.epochs, uri, exp, parent)
    n = len(grid_points(params)) if s.search == "grid" else samples
    shape = trial_shape(params, gpu, s.cpus_per_worker, TRIAL_CPU)
    concurrent = max_concurrent(s.max_concurrent_trials, shape, totals, n)
    announce = (f"[sweep] {name}: {n} trials ({s.search}), {s.epochs} epochs each, up to {concurrent} at a time"
                + (", ASHA early stopping" if s.asha else ""))
    grid, resumed, seconds = tune_job(trainer, space, name=name, storage=storage, tracker=tracker,
                                      concurrent=concurrent, announce=announce, scheduler=scheduler,
                                      num_samples=samples, reuse_actors=inline(trial_params(base, {})))
    started = time.time() - seconds
    rows = trial_rows(grid, s.epochs, storage=storage)
    say(f"[sweep] {len(rows)} trials in {seconds:.0f} s, {at_once(tracker, concurrent)}")
    return SweepResult(rows=rows, name=name, mlflow_run_id=parent, seconds=seconds, resumed=resumed, started=started,
                       concurrent=concurrent, peak=tracker.peak_at_once())


# ------------------------------------------------------------------------------------------------- outputs
def trial_rows(grid, epochs: int, labels=point_of, storage: str | None = None) -> list[dict[str, Any]]:
    """One row per trial (``labels(config)``: the columns that identify it; ``error``: why it failed, or ""); where
    each rank ran from the trial's Ray Train run directory under ``storage`` (its ``PLACEMENT_FILE``), else from its
    checkpoints.

    The history comes from the trial's newest complete checkpoint, which holds every epoch up to it also across a
    resume (Tune's own table of a restored trial starts at the resumed epoch), and Tune's results after it."""
    keep = ("epoch", *EPOCH_METRICS)
    rows = []
    for result in grid:
        df = result.metrics_dataframe
        reported = [] if df is None else df.to_dict("records")
        paths = [h.get("checkpoint_path") for h in reported if isinstance(h.get("checkpoint_path"), str)]
        trial_id = Path(result.path).name.removeprefix("trial-")
        run_dir = join(storage, trial_name(trial_id)) if storage else None
        # newest first: the last reported checkpoint, the ones reported before it, then those in the trial's run dir
        # (a resumed trial's table starts at the resumed epoch, so what it reported may not reach back to epoch 1)
        newest = dict.fromkeys([last_checkpoint_path(paths[-1] if paths else None, result), *reversed(paths),
                                *(checkpoint_dirs(run_dir) if run_dir else [])])
        # where each rank ran, from the run dir, else the newest checkpoint that has it: a trial stopped (ASHA) while
        # its last checkpoint was still uploading has it in the one before
        placed = read_json(run_dir, PLACEMENT_FILE) if run_dir else None
        found = (checkpoint_history(path, WORKERS_FILE) for path in newest)
        workers = sorted(placed or next((w for w in found if w), []), key=lambda w: w["rank"])
        # the newest complete checkpoint's history, then the epochs Tune's table reported after it
        history = next((h for h in map(checkpoint_history, newest) if h), [])
        seen = int(history[-1]["epoch"]) if history else 0
        history = [*history, *(h for h in reported if int(h.get("epoch", 0) or 0) > seen)]
        history = [{k: v for k, v in h.items() if k in keep or is_health_key(k)} for h in history]
        last = history[-1] if history else {}
        blocks = unflat(last)  # the last epoch's health of each block ({} at depth 0)
        epoch = int(last.get("epoch", 0) or 0)
        knn = [h["knn_acc"] for h in history if isinstance(h.get("knn_acc"), float) and not math.isnan(h["knn_acc"])]
        rows.append({
            "trial_id": trial_id,
            **labels(result.config),
            "view_noise": float(last.get("view_noise", math.nan)),
            "knn_acc": float(last.get("knn_acc", math.nan)),
            "best_knn_acc": max(knn, default=math.nan),
            "loss": float(last.get("loss", math.nan)),
            "min_positive": min((h.get("positive", math.nan) for h in blocks.values()), default=math.nan),
            "max_uniform_rows": max((h.get("uniform_rows", math.nan) for h in blocks.values()), default=math.nan),
            "dead_blocks": len(dead_blocks(blocks)),
            "epochs": epoch,
            "stopped_early": bool(history) and result.error is None and epoch < epochs,
            "seconds": float(sum(h.get("seconds", 0.0) for h in history)),
            "workers": len(workers),
            "gpu_ids": " ".join(",".join(w.get("gpu_ids", [])) or "-" for w in workers)
            if any(w.get("gpu_ids") for w in workers) else "",  # per rank: "0 1"
            "status": "ERROR" if result.error else "TERMINATED",
            "error": error_reason(result.error),
            "history": history,
        })
    return rows
