"""``pretrain`` stage: TransFusion pretraining, on Ray Train (several workers, a cluster) or in this process (one
local worker: ``pipeline.runs.train.in_process``), tracked in MLflow.

Reads params: ``model``, ``loss``, ``augment``, ``train``, ``ray``; input ``data/prepared/``.
Writes (atomically): ``models/pretrain/{model.pt,config.json}``, ``metrics/pretrain.json``,
``plots/pretrain.csv`` (per-epoch curves).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import click
import torch

from pipeline.config.params import Params, load_params
from pipeline.data.storage import StorageError
from pipeline.data.types import DatasetError
from pipeline.evaluation.health import unflat, warnings_for
from pipeline.io import atomic_dir, save_torch, write_csv, write_json
from pipeline.runs.cluster import ClusterError
from pipeline.runs.job import close_job
from pipeline.runs.tracking import TrackingError
from pipeline.runs.train import PretrainError, PretrainResult, Worker, epoch_metric_names, pretrain
from stages._common import (
    around,
    params_options,
    process_started,
    runtime_errors,
    time_line,
)
from stages._job import run_job


def write_outputs(params: Params, res: PretrainResult, models: Path, metrics: Path, plots: Path) -> dict:
    history, run_id = res.state.history, res.job.run.run_id if res.job.run else None
    with atomic_dir(models) as d:
        save_torch(d / "model.pt", res.state.model)
        write_json(d / "config.json", {"params": params.model_dump(), "input_shape": list(res.input_shape),
                                       "n_classes": res.n_classes, "run_name": res.job.name, "mlflow_run_id": run_id})
    last = history[-1]
    knn = [h["knn_acc"] for h in history if h.get("knn_acc") is not None]
    summary = {
        "epochs": res.state.epoch,
        "loss": last["loss"],
        "knn_acc": knn[-1] if knn else None,
        "view_noise": sum(h["view_noise"] for h in history) / len(history),
        "samples_per_s": sorted(h["samples_per_s"] for h in history)[len(history) // 2],  # median epoch
        "train_seconds": sum(h["seconds"] for h in history),
        "health": unflat(last),  # the last epoch's, on a training batch of two views (pipeline.evaluation.health)
        "mlflow_run_id": run_id,
    }
    write_json(metrics, summary)
    write_csv(plots, history, ("epoch", *epoch_metric_names(history)))  # the per-epoch metrics, then the health
    return summary


def health_warnings(summary: dict) -> list[str]:
    """One console line per dead or mostly uniform block at the end of pretraining ([] when all are alive)."""
    return [f"[pretrain] warning: {line}; what to change: docs/fusion.md" for line in warnings_for(summary["health"])]


def time_parts(started: float, res: PretrainResult, now: float) -> list[tuple[str, float]]:
    """Where the stage's time went: before the run (imports, Ray's start when on Ray, the checks, the MLflow run); the
    run (``res.fit_seconds``) and, within it, the training steps of the epochs it trained (a resumed run's earlier
    epochs are not counted; the rest of the run is each epoch's kNN, health, report and checkpoint, and on Ray Train
    its start and stop); after it, the outputs and the MLflow model."""
    before, after = around(started, res.fit_started, res.fit_seconds, now)
    steps = sum(h["seconds"] for h in res.state.history if h["ended_at"] >= res.fit_started)
    start, run = (("start (imports, Ray, checks, MLflow run)", "Ray Train's run") if res.in_ray else
                  ("start (imports, checks, MLflow run)", "the run in this process"))
    return [(start, before), (run, res.fit_seconds), ("of which training steps", steps),
            ("outputs and MLflow model", after)]


def placement_line(workers: list[Worker]) -> str:
    """``1 worker(s) on 1 node(s): rank 0 on node 1a2b3c4d5e6f (host, cpu)``, or ``1 worker in this process (host,
    cpu)`` for a run outside Ray."""
    def where(w: Worker) -> str:
        return f"({w['host']}, {w['device']}" + (f", GPU {','.join(w['gpu_ids'])}" if w.get("gpu_ids") else "") + ")"

    if len(workers) == 1 and not workers[0]["node_id"]:
        return f"1 worker in this process, no Ray {where(workers[0])}"
    nodes = sorted({w["node_id"] for w in workers})
    return f"{len(workers)} worker(s) on {len(nodes)} node(s): " + ", ".join(
        f"rank {w['rank']} on node {w['node_id'][:12]} {where(w)}" for w in workers)


def trained_model(params: Params, res: PretrainResult) -> torch.nn.Module:
    """The model as trained, for MLflow's pytorch flavour."""
    from pipeline.core.model import build_model

    model = build_model(params.model, res.input_shape)
    model.load_state_dict(res.state.model)
    return model.eval()


@click.command("pretrain")
@params_options(load_params)
@click.option("--data", "data_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("data/prepared"),
              show_default=True, help="Prepared data (output of `prepare`).")
@click.option("--no-tracking", is_flag=True, help="Do not log to MLflow.")
@runtime_errors(DatasetError, PretrainError, TrackingError, ClusterError, StorageError)
def pretrain_cmd(params: Params, data_dir: Path, no_tracking: bool) -> None:
    """Pretrain TransFusion on the prepared data: on Ray Train, or in this process for one local worker (resumes an
    interrupted run)."""
    started = process_started()
    paths = (Path("models/pretrain"), Path("metrics/pretrain.json"), Path("plots/pretrain.csv"))
    with run_job(pretrain, params, data_dir, no_tracking) as res:  # the MLflow run ends with the block
        summary = write_outputs(params, res, *paths)
        workers = res.state.workers
        close_job(res.job, [paths[0] / "config.json", paths[1], paths[2]], tags={"workers": json.dumps(workers)},
                  model=trained_model(params, res) if res.job.run else None)
    click.echo(f"[pretrain] {placement_line(workers)}")
    knn = f", kNN acc {summary['knn_acc']:.4f}" if summary["knn_acc"] is not None else ""
    click.echo(f"pretrained {summary['epochs']} epochs: loss {summary['loss']:.5f}{knn}, "
               f"{summary['samples_per_s']:,.0f} samples/s -> models/pretrain/")
    for line in health_warnings(summary):
        click.echo(line, err=True)
    now = time.time()
    click.echo(time_line("pretrain", started, time_parts(started, res, now), now))
