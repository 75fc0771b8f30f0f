"""The `pretrain` stage on real Ray Train and a real MLflow sqlite store (tiny params, digits)."""

from __future__ import annotations

import json

import mlflow
import pytest
import torch

from pipeline.data.storage import PLACEMENT_FILE
from tests.conftest import invoke, pretrain_curve

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

EVERY_EPOCH = ["-S", "train.checkpoint_every=1"]
TINY = ["-S", "train.epochs=3", "-S", "train.batch_size=128", "-S", "data.limit_train=256",
        "-S", "model.embed_dim=32", "-S", "train.knn_every=1"]


def mlflow_runs(project):
    client = mlflow.MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    exp = client.get_experiment_by_name("transfusion")
    return client, client.search_runs([exp.experiment_id]) if exp else []


def test_unreachable_tracking_server_fails_before_training(prepared, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    result = invoke("pretrain", *TINY)
    assert result.exit_code == 1
    assert "http://127.0.0.1:9" in result.output and "unreachable" in result.output
    assert not (prepared / "ray_results").exists() and not (prepared / "models").exists()


def test_two_workers_write_outputs_and_track_in_mlflow(prepared, ray_session):
    result = invoke("pretrain", *TINY, "-S", "ray.num_workers=2")
    assert result.exit_code == 0, result.output
    assert "pretrained 3 epochs" in result.output
    # outputs
    state = torch.load(prepared / "models/pretrain/model.pt", weights_only=True)
    config = json.loads((prepared / "models/pretrain/config.json").read_text())
    assert config["params"]["ray"]["num_workers"] == 2 and config["input_shape"] == [1, 8, 8]
    assert any(k.startswith("head.blocks.0.query") for k in state)
    metrics = json.loads((prepared / "metrics/pretrain.json").read_text())
    assert metrics["epochs"] == 3 and 0.0 <= metrics["knn_acc"] <= 1.0 and metrics["samples_per_s"] > 0
    assert 0.0 < metrics["view_noise"] < 1.0
    rows = pretrain_curve(prepared)
    assert [int(r["epoch"]) for r in rows] == [1, 2, 3]
    assert float(rows[-1]["lr"]) < float(rows[0]["lr"])  # cosine schedule
    # a finished run is forgotten so that `dvc repro -f` trains again; the staged data stays for the next run
    assert [p.name for p in (prepared / "ray_results").iterdir()] == ["prepared-data"]
    # MLflow: the run, its params, its per-epoch metrics and the model
    client, runs = mlflow_runs(prepared)
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED" and run.data.tags["stage"] == "pretrain"
    assert run.data.params["model.depth"] == "1" and run.data.params["ray.num_workers"] == "2"
    assert run.info.run_id == metrics["mlflow_run_id"]
    # the head's path on the workers (pipeline.core.plan): sharded over both, dense within the default budget
    assert run.data.tags["head.path"] == "dense" and run.data.tags["head.sharded"] == "true"
    assert run.data.tags["head.tile"] == "none" and float(run.data.tags["head.mib_per_worker"]) > 0
    for key in ("loss", "lr", "samples_per_s", "view_noise", "knn_acc"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, key)] == [1, 2, 3], key
    losses = [m.value for m in client.get_metric_history(run.info.run_id, "loss")]
    assert losses == pytest.approx([float(r["loss"]) for r in rows])
    assert {"pretrain.json", "pretrain.csv", "config.json"} <= {a.path for a in client.list_artifacts(run.info.run_id)}
    mlflow.set_tracking_uri(f"sqlite:///{prepared / 'mlflow.db'}")
    model = mlflow.pytorch.load_model(f"runs:/{run.info.run_id}/model")
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, state[name])


def test_non_finite_loss_stops_with_a_clear_error_and_keeps_the_checkpoint(prepared, ray_session, install_faults):
    install_faults(nan_at_epoch=2)
    result = invoke("pretrain", *TINY, *EVERY_EPOCH)
    assert result.exit_code == 1
    assert "non-finite" in result.output and "last good checkpoint" in result.output
    assert not (prepared / "models").exists() and not (prepared / "metrics").exists()
    runs_dir = [d for d in (prepared / "ray_results").iterdir() if d.name.startswith("pretrain-")]
    assert len(runs_dir) == 1
    assert [c.name for c in runs_dir[0].glob("checkpoint_*")], "the epoch-1 checkpoint must be kept"
    _, runs = mlflow_runs(prepared)
    assert runs[0].info.status == "FAILED"


def test_one_worker_in_this_process_equals_its_ray_train_run(prepared, ray_session):
    """The default's one local worker trains in the stage's own process: the same model, curve and MLflow run as that
    worker on Ray Train (``ray.max_failures: 1`` asks for Ray Train's restarts, so it runs there)."""
    here = invoke("pretrain", *TINY)
    assert here.exit_code == 0, here.output
    assert "[pretrain] 1 worker in this process, no Ray (" in here.output
    assert "the run in this process" in here.output
    model = prepared / "models/pretrain/model.pt"
    state_here, curve_here = torch.load(model, weights_only=True), pretrain_curve(prepared)
    on_ray = invoke("pretrain", *TINY, "-S", "ray.max_failures=1")
    assert on_ray.exit_code == 0, on_ray.output
    assert "[pretrain] 1 worker(s) on 1 node(s): rank 0 on node " in on_ray.output
    assert "Ray Train's run" in on_ray.output
    state_ray, curve_ray = torch.load(model, weights_only=True), pretrain_curve(prepared)
    assert state_here.keys() == state_ray.keys()
    for name, tensor in state_here.items():
        torch.testing.assert_close(tensor, state_ray[name], rtol=0, atol=0, msg=name)
    measured = {"seconds", "samples_per_s", "ended_at"}  # wall-clock, not results
    assert [{k: v for k, v in r.items() if k not in measured} for r in curve_here] == [
        {k: v for k, v in r.items() if k not in measured} for r in curve_ray]
    client, runs = mlflow_runs(prepared)
    assert [r.info.status for r in runs] == ["FINISHED", "FINISHED"]
    assert [[m.value for m in client.get_metric_history(r.info.run_id, "loss")] for r in runs] == [
        [float(r["loss"]) for r in curve_here]] * 2
    assert [p.name for p in (prepared / "ray_results").iterdir()] == ["prepared-data"]  # both forgotten once done


def test_an_interrupted_run_in_this_process_resumes_from_its_last_checkpoint(prepared, install_faults):
    """A run in the stage's process that fails after epoch 2 keeps its checkpoints (each a folder written whole) and
    its MLflow run FAILED; the rerun resumes after epoch 2, continues the same MLflow run, and ends where an
    uninterrupted run does (a checkpoint every epoch here; the default's is every 5 and the last)."""
    install_faults(crash_at_epoch=2)
    failed = invoke("pretrain", *TINY, *EVERY_EPOCH)
    assert failed.exit_code == 1
    assert "injected crash after epoch 2" in failed.output and "rerun the stage to resume" in failed.output
    (run_dir,) = [d for d in (prepared / "ray_results").iterdir() if d.name.startswith("pretrain-")]
    assert sorted(c.name for c in run_dir.iterdir()) == ["checkpoint_000001", "checkpoint_000002", PLACEMENT_FILE]
    client, (run,) = mlflow_runs(prepared)
    assert run.info.status == "FAILED" and "injected crash after epoch 2" in run.data.tags["error"]
    install_faults()
    resumed = invoke("pretrain", *TINY, *EVERY_EPOCH)
    assert resumed.exit_code == 0, resumed.output
    assert "[pretrain] resumed from the checkpoint after epoch 2" in resumed.output
    assert "[pretrain] epoch 1/3" not in resumed.output and "[pretrain] epoch 3/3" in resumed.output
    client, (run,) = mlflow_runs(prepared)
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3]
    state_resumed = torch.load(prepared / "models/pretrain/model.pt", weights_only=True)
    whole = invoke("pretrain", *TINY, *EVERY_EPOCH)  # the finished job was forgotten: it trains afresh, uninterrupted
    assert whole.exit_code == 0 and "resumed" not in whole.output
    state_whole = torch.load(prepared / "models/pretrain/model.pt", weights_only=True)
    for name, tensor in state_whole.items():
        torch.testing.assert_close(state_resumed[name], tensor, rtol=0, atol=0, msg=name)
