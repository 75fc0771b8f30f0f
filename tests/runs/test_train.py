"""pipeline/runs/train.py's device choice: ``ray.backend: gloo`` trains on the CPU, also where CUDA sees GPUs.

No GPU here: "CUDA visible" is faked by monkeypatching ``torch.cuda.is_available`` (and ``device_count``) where
:func:`pipeline.runs.train.worker_device` reads them, and Ray Train's ``get_device`` stands in for the worker's GPU.
"""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path

import pytest
import torch

from pipeline.evaluation.health import health_line
from pipeline.runs.job import job_name
from pipeline.runs.train import epoch_metric_names, worker_device
from tests.conftest import ROOT


@pytest.fixture()
def cuda_visible(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    import ray.train.torch  # noqa: F401 the module exists; its get_device is Ray Train's worker's GPU

    monkeypatch.setattr(sys.modules["ray.train.torch"], "get_device", lambda: torch.device("cuda", 1))


@pytest.mark.parametrize("ray_train", [True, False])
def test_gloo_with_cuda_visible_trains_on_the_cpu_and_says_so(cuda_visible, caplog, ray_train):
    with caplog.at_level(logging.WARNING, logger="pipeline.runs.train"):
        assert worker_device(True, "gloo", ray_train=ray_train) == torch.device("cpu")
    assert "ray.backend: gloo trains on the CPU although CUDA sees 2 GPU(s)" in caplog.text


@pytest.mark.parametrize("backend", ["auto", "nccl"])
def test_a_gpu_backend_with_cuda_visible_trains_on_the_gpu(cuda_visible, backend):
    assert worker_device(True, backend) == torch.device("cuda", 1)  # Ray Train's device for this worker
    assert worker_device(True, backend, ray_train=False) == torch.device("cuda")


@pytest.mark.parametrize("backend", ["auto", "nccl", "gloo"])
def test_not_scheduled_on_a_gpu_is_the_cpu(cuda_visible, backend):
    assert worker_device(False, backend) == torch.device("cpu")


def test_declared_gpus_that_cuda_cannot_see(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert worker_device(True, "gloo") == torch.device("cpu")  # the rehearsals' case
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(get_gpu_ids=lambda: [0]))
    with pytest.raises(RuntimeError, match="CUDA sees no GPU here"):
        worker_device(True, "nccl")


def test_the_epoch_metrics_and_the_console_carry_the_blocks_or_abcs_kernel():
    blocks = {"loss": 1.0, "block_1.positive": 0.5, "block_1.uniform_rows": 0.0, "block_2.positive": 0.25}
    kernel = {"loss": 1.0, "kernel.same_class": 0.8, "kernel.other": 0.1, "kernel.above_half": 0.125}
    assert epoch_metric_names([blocks])[-3:] == ("block_1.positive", "block_1.uniform_rows", "block_2.positive")
    assert epoch_metric_names([kernel])[-3:] == ("kernel.same_class", "kernel.other", "kernel.above_half")
    assert health_line(blocks) == " | positive pairs: b1 50.0% b2 25.0%"
    assert health_line(kernel) == " | kernel: same class 0.80, other 0.10, > 0.5 12.5%"
    assert health_line({"loss": 1.0}) == ""


def test_stable_names_follow_what_each_run_reads():
    """A run resumes by its stable name: a key it reads changes it, one it does not read leaves it."""
    from pipeline.config.params import load_params

    def p(*overrides: str):
        return load_params(Path(__file__).resolve().parents[2] / "params.yaml", list(overrides))

    manifest = {"files": {"train.pt": {"sha256": "a" * 64}}}
    name = job_name("pretrain", p(), manifest)
    assert name.startswith("pretrain-") and name == job_name("pretrain", p("sweep.epochs=3", "probe.seed=4"), manifest)
    assert job_name("pretrain", p("train.lr=0.01"), manifest) != name
    assert job_name("pretrain", p("ray.num_workers=2"), manifest) != name
    tables = job_name("tables", p(), manifest)
    assert tables.startswith("tables-") and tables == job_name("tables", p("sweep.epochs=3"), manifest)
    assert job_name("tables", p("probe.seed=4"), manifest) != tables


@pytest.mark.parametrize(("overrides", "env", "here"), [
    ((), {}, True),                                          # the default: one local worker
    (("ray.num_workers=2",), {}, False),                     # workers that fuse their batches
    (("ray.max_failures=1",), {}, False),                    # restarts: Ray Train's
    (("ray.address=10.0.0.1:6379",), {}, False),             # a cluster
    ((), {"RAY_ADDRESS": "10.0.0.1:6379"}, False),
    (("ray.storage_path=s3://bucket/runs",), {}, False),     # a storage for a cluster
])
def test_one_local_worker_without_restarts_trains_in_this_process(monkeypatch, overrides, env, here):
    from pipeline.config.params import load_params
    from pipeline.runs.train import in_process

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert in_process(load_params(ROOT / "params.yaml", list(overrides))) is here
