"""Ray Tune sweeps over depth, batch size and augmentation strength (and lr): the paper's claims, tested.

Train V2 pattern: each Tune trial is a plain function that launches a ``TorchTrainer`` running the
pretraining worker loop (``pipeline.train.train_loop_per_worker``), named after the trial id so that a
restored sweep resumes each trial's own run; ``TuneReportCallback`` passes rank 0's per-epoch metrics
(online kNN accuracy, loss, measured view noise ε) to Tune, and ASHA stops the hopeless trials early.

Resources: a trial's function holds ``TRIAL_CPU`` and its workers ``ray.num_workers × sweep.cpus_per_worker``;
``max_concurrent_trials`` follows from the cluster's CPUs (two 1-CPU workers under a 1-CPU trial never
start on 2 cores). The driver is the only MLflow writer: after the sweep it logs one parent run and a
child per trial from Tune's results (no sqlite lock contention between trials).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pipeline.config import Params, flatten, validate_params
from pipeline.train import WorkerSpec, train_loop_per_worker, wants_gpu

TRIAL_CPU = 0.25
SPACE_KEYS = {"depth": "model.depth", "batch_size": "train.batch_size", "strength": "augment.strength",
              "lr": "train.lr"}
COUNT_ENV = "TRANSFUSION_TRIAL_LOG"  # tests: each trial start appends a line to this file


def grid_points(params: Params) -> list[dict[str, Any]]:
    """Every combination of the sweep's values, as ``{"model.depth": 1, ...}`` (lr only if listed)."""
    s = params.sweep
    axes = {SPACE_KEYS[k]: getattr(s, k) for k in SPACE_KEYS if getattr(s, k)}
    keys = list(axes)
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*(axes[k] for k in keys))]


def trial_params(base: dict[str, Any], point: dict[str, Any]) -> Params:
    """The base params with one point of the space applied (validated: e.g. batch vs workers)."""
    raw = json.loads(json.dumps(base))
    for dotted, value in point.items():
        section, key = dotted.split(".")
        raw[section][key] = value
    return validate_params(raw, source=f"sweep point {point}")


def _trial(config: dict[str, Any], fixed: dict[str, Any]) -> None:
    """One Tune trial: a Ray Train run of the pretraining loop on this point of the space.

    ``config`` holds the point (``{"model.depth": 1, ...}``); ``fixed`` what every trial shares.
    """
    import ray.train
    import ray.tune
    from ray.train.torch import TorchTrainer
    from ray.tune.integration.ray_train import TuneReportCallback

    config = {**fixed, **config}
    point = {k: config[k] for k in config if "." in k}
    params = trial_params(config["__base"], point)
    trial_id = ray.tune.get_context().get_trial_id()
    count_file = config.get("__count_file")
    if count_file:
        with open(count_file, "a") as f:
            f.write(f"{trial_id} {json.dumps(point, sort_keys=True)}\n")
    storage = config["__storage"]
    spec = WorkerSpec(params=params.model_dump(), data_dir=config["__data"],
                      run_dir=os.path.join(storage, f"trial-{trial_id}"), use_gpu=config["__use_gpu"])
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=asdict(spec),
        scaling_config=ray.train.ScalingConfig(
            num_workers=params.ray.num_workers, use_gpu=config["__use_gpu"],
            resources_per_worker={"CPU": params.sweep.cpus_per_worker},
        ),
        run_config=ray.train.RunConfig(
            name=f"trial-{trial_id}", storage_path=storage, callbacks=[TuneReportCallback()],
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=1),
        ),
    )
    trainer.fit()


def sweep_name(params: Params, manifest: dict[str, Any]) -> str:
    keyed = {s: getattr(params, s).model_dump() for s in ("model", "loss", "augment", "train", "sweep")}
    keyed["data"] = {n: f["sha256"] for n, f in sorted(manifest["files"].items())}
    return "sweep-" + hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:16]


def max_concurrent(params: Params, cluster_cpus: float) -> int:
    per_trial = TRIAL_CPU + params.ray.num_workers * params.sweep.cpus_per_worker
    return max(1, int(cluster_cpus // per_trial))


def run_sweep(params: Params, data_dir: Path, root: Path, *, count_file: str | None = None):
    """Run (or resume) the sweep; returns (rows, name). Rows: one per trial with config, metrics, status."""
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    from pipeline.train import _init_ray, _storage

    manifest = json.loads((data_dir / "manifest.json").read_text())
    name = sweep_name(params, manifest)
    storage = _storage(params, root)
    base = params.model_dump()
    base["train"]["epochs"] = params.sweep.epochs
    base["train"]["knn_every"] = 1  # ASHA needs the metric every epoch
    base["train"]["warmup_epochs"] = min(base["train"]["warmup_epochs"], params.sweep.epochs - 1)
    base["train"]["checkpoint_every"] = 1
    for point in grid_points(params):  # fail before any work if a point is invalid
        trial_params(base, point)
    _init_ray(params)
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
    fixed = {"__base": base, "__data": str(data_dir.resolve()), "__storage": storage,
             "__use_gpu": wants_gpu(params), "__count_file": count_file or os.environ.get(COUNT_ENV)}
    s = params.sweep
    space: dict[str, Any] = {}
    if s.search == "grid":
        for dotted in grid_points(params)[0]:
            key = next(k for k, v in SPACE_KEYS.items() if v == dotted)
            space[dotted] = tune.grid_search(getattr(s, key))
        samples = s.num_samples
    else:
        for dotted in grid_points(params)[0]:
            key = next(k for k, v in SPACE_KEYS.items() if v == dotted)
            space[dotted] = tune.choice(getattr(s, key))
        samples = s.num_samples
    scheduler = (ASHAScheduler(time_attr="epoch", max_t=s.epochs, grace_period=min(s.grace_period, s.epochs),
                               reduction_factor=2) if s.asha else FIFOScheduler())
    trainable = tune.with_resources(tune.with_parameters(_trial, fixed=fixed), {"CPU": TRIAL_CPU})
    path = os.path.join(storage, name)
    if tune.Tuner.can_restore(path):
        print(f"[sweep] resuming {path}", flush=True)
        tuner = tune.Tuner.restore(path, trainable=trainable, resume_errored=True, param_space=space)
    else:
        tuner = tune.Tuner(
            trainable,
            param_space=space,
            tune_config=tune.TuneConfig(metric="knn_acc", mode="max", scheduler=scheduler, num_samples=samples,
                                        max_concurrent_trials=max_concurrent(params, ray.cluster_resources()["CPU"]),
                                        trial_dirname_creator=lambda t: f"trial-{t.trial_id}"),
            run_config=tune.RunConfig(name=name, storage_path=storage, verbose=1),
        )
    start = time.time()
    grid = tuner.fit()
    rows = []
    for result in grid:
        cfg = {k: v for k, v in result.config.items() if "." in k}
        df = result.metrics_dataframe
        history = [] if df is None else df.to_dict("records")
        last = history[-1] if history else {}
        rows.append({
            "trial_id": (result.metrics or {}).get("trial_id") or Path(result.path).name.removeprefix("trial-"),
            **cfg,
            "view_noise": last.get("view_noise", math.nan),
            "knn_acc": last.get("knn_acc", math.nan),
            "best_knn_acc": max((h.get("knn_acc", math.nan) for h in history), default=math.nan),
            "loss": last.get("loss", math.nan),
            "epochs": int(last.get("epoch", 0) or 0),
            "stopped_early": bool(history) and int(last.get("epoch", 0) or 0) < s.epochs,
            "seconds": float(sum(h.get("seconds", 0.0) for h in history)),
            "status": "ERROR" if result.error else "TERMINATED",
            "history": history,
        })
    print(f"[sweep] {len(rows)} trials in {time.time() - start:.0f} s", flush=True)
    return rows, name


def log_sweep(params: Params, rows: list[dict[str, Any]], root: Path, name: str, files: list[Path]) -> str:
    """One MLflow parent run for the sweep, a child per trial (params, per-epoch metrics, status)."""
    import mlflow
    from mlflow.entities import Metric, Param

    from pipeline import tracking as trk

    uri = trk.tracking_uri(root)
    client = mlflow.MlflowClient(uri)
    exp = trk.experiment_id(uri, root)
    parent = client.create_run(exp, run_name=name, tags=trk.stage_tags("sweep", root))
    pid = parent.info.run_id
    client.log_batch(pid, params=[Param(k, v) for k, v in trk.flat_params(flatten(params.sweep, "sweep.")).items()])
    now = int(time.time() * 1000)
    for row in rows:
        tags = {"mlflow.parentRunId": pid, "stage": "sweep-trial", "trial_id": str(row["trial_id"])}
        child = client.create_run(exp, run_name=f"trial-{row['trial_id']}", tags=tags)
        cid = child.info.run_id
        point = {k: v for k, v in row.items() if "." in k}
        metrics = [Metric(k, float(h[k]), now, int(h["epoch"])) for h in row["history"]
                   for k in ("loss", "knn_acc", "view_noise", "samples_per_s") if h.get(k) is not None
                   and not (isinstance(h[k], float) and math.isnan(h[k]))]
        client.log_batch(cid, params=[Param(k, str(v)) for k, v in point.items()], metrics=metrics)
        client.set_tag(cid, "stopped_early", str(row["stopped_early"]))
        client.set_terminated(cid, "FAILED" if row["status"] == "ERROR" else "FINISHED")
    best = max((r for r in rows if not math.isnan(r["knn_acc"])), key=lambda r: r["knn_acc"], default=None)
    if best is not None:
        client.log_metric(pid, "best_knn_acc", best["knn_acc"])
    with mlflow.start_run(run_id=pid):
        for f in files:
            if f.is_file():
                mlflow.log_artifact(str(f))
    return pid
