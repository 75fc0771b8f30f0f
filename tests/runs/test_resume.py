"""Resuming keeps the optimizer's step counters on the host: no host sync per parameter and step after a resume.

A GPU is stood for by the ``meta`` device (no GPU here): the resumed loop's model is moved to ``meta`` in place
(its parameters keep their identity, so the optimizer still holds them), restored through the worker's own path
(:func:`pipeline.runs.train.restore`), and then where each tensor landed is read and the optimizer's step is counted
with :class:`pipeline.training.measure.OpCounter` standing for that device (a read of host memory is no sync).
"""

from __future__ import annotations

import pytest
import torch

from pipeline.training import measure
from tests.conftest import ROOT


def make_loop(optimizer: str):
    from pipeline.config.data import DataConfig
    from pipeline.config.params import load_params
    from pipeline.data.sources import load_dataset
    from pipeline.training.loop import PretrainLoop

    params = load_params(ROOT / "params.yaml", ["train.batch_size=16", "model.embed_dim=16",
                                                 f"train.optimizer={optimizer}"])
    data = load_dataset(DataConfig(dataset="digits", root="data/raw", limit_train=32, limit_test=16))
    torch.manual_seed(0)
    return PretrainLoop(params, data, torch.device("cpu"))


def one_step(loop) -> None:
    x = torch.rand(32, *loop.data.input_shape)
    ids = torch.cat([torch.arange(16), torch.arange(16)])
    loop.step(x, ids)
    loop.optimizer.step()
    loop.scheduler.step()


@pytest.fixture()
def swap_in_place():
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)  # Module.to keeps each Parameter object
    yield
    torch.__future__.set_swap_module_params_on_conversion(before)


@pytest.mark.slow  # ~4 s: two loops on digits
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
@pytest.mark.filterwarnings("ignore:for .*copying from a non-meta parameter")
def test_resume_keeps_steps_on_the_host_and_the_step_has_no_host_sync(tmp_path, optimizer, swap_in_place):
    from pipeline.runs.train import STATE_FILE, restore

    trained = make_loop(optimizer)
    one_step(trained)
    torch.save(trained.state_dict(), tmp_path / STATE_FILE)

    loop = make_loop(optimizer)
    loop.model.to("meta")  # the stand-in GPU
    loop.device = torch.device("meta")
    params = [p for g in loop.optimizer.param_groups for p in g["params"]]
    assert {p.device.type for p in params} == {"meta"}
    restore(loop, tmp_path)

    assert loop.epoch == trained.epoch
    state = [loop.optimizer.state[p] for p in params]
    assert len(state) == len(params) and all(state)
    for s in state:  # the step counter on the host, the buffers beside their parameter
        for key, value in s.items():
            assert value.device.type == ("cpu" if key == "step" else "meta"), key
    for p in params:
        p.grad = torch.zeros_like(p)  # (meta) what a backward leaves

    def step():
        loop.optimizer.step()
        loop.scheduler.step()

    assert measure.count(step, device="meta").syncs == []
    # the control: read as if everything were on the device, the step does read values (Adam: one step per parameter)
    reads = measure.count(step).syncs
    assert len(reads) == (len(params) if optimizer == "adam" else 0)


def test_the_counter_counts_a_read_of_device_memory():
    t = torch.ones(3, device="meta")
    assert measure.count(lambda: t.sum() + 1, device="meta").syncs == []
    with pytest.raises(Exception):  # noqa: B017 a meta tensor has no value to read; the read is recorded first
        with measure.OpCounter("meta") as c:
            t.sum().item()
    assert c.syncs == ["_local_scalar_dense"]
    assert measure.count(lambda: torch.ones(2).sum().item(), device="meta").syncs == []
    assert measure.count(lambda: torch.ones(2).sum().item()).syncs == ["_local_scalar_dense"]
