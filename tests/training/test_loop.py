"""pipeline/training/loop.py: the data budget (the training set on the device, or each worker's rows read from the
memory-mapped files: the same numbers bit for bit), channels-last, tiles, ABC end to end, callbacks, the monitor."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from pipeline.config.data import DataConfig
from pipeline.config.params import load_params
from pipeline.data.prepared import load_prepared
from pipeline.data.sources import load_dataset
from pipeline.training.loop import (
    DATA_BUDGET_SHARE,
    KNN_BANK,
    KNN_QUERIES,
    Callback,
    EpochMetrics,
    PretrainLoop,
    data_budget,
)
from tests.conftest import ROOT
from tests.data.test_datasets import mapped_file
from tests.evaluation.test_health import assert_same_numbers
from tests.training.ranks import run_ranks
from tests.training.small import MLP, digits, small_loop

DIGITS_TRAIN_MIB = 1293 * 64 * 4 / 2**20  # digits' training set: 1293 float32 images of 8 x 8 (0.32 MiB)
SMALL_BUDGET = "train.data_budget_mb=0.25"  # below it: streamed
TILING_BUDGET = "train.head_budget_mb=0"  # the head and the loss in column tiles (pipeline.core.plan)
COMPARED = ("epoch", "loss", "lr", "view_noise", "knn_acc")  # an epoch's numbers (not its timings)


@pytest.fixture
def digits_dir(prepare_digits) -> Path:  # tests/conftest.py's, all the digits: its data/prepared
    return prepare_digits(None) / "data" / "prepared"


def cpu_loop(overrides: list[str], data, **kwargs) -> PretrainLoop:
    """A CPU loop of params.yaml with ``overrides`` alone (tests.training.small's adds its own) on ``data``."""
    return PretrainLoop(load_params(ROOT / "params.yaml", overrides), data, torch.device("cpu"), **kwargs)


def numbers(history: list[dict]) -> list[dict]:
    """Each epoch's results: the losses, lr, view noise, kNN accuracy and every block's health."""
    return [{k: v for k, v in h.items() if k in COMPARED or k.startswith("block_")} for h in history]


def holds_the_training_set(loop: PretrainLoop) -> bool:
    """Whether the loop keeps a tensor of the training set's size of its own (a copy on the device)."""
    shape = loop.data.train.x.shape
    return any(isinstance(v, torch.Tensor) and v.shape == shape for v in vars(loop).values())


def test_budget_is_the_param_or_a_share_of_the_devices_memory():
    cpu = torch.device("cpu")
    assert data_budget(1.5, cpu) == int(1.5 * 2**20) and data_budget(0, cpu) == 0
    auto, available = data_budget(None, cpu), psutil.virtual_memory().available
    assert auto == pytest.approx(DATA_BUDGET_SHARE * available, rel=0.2)  # free memory moves a little meanwhile


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["self_supervised", "supervised"])
def test_streamed_training_equals_in_memory_bit_for_bit(digits_dir, mode):
    overrides = ["train.epochs=3", f"train.mode={mode}", "model.depth=1"]
    in_memory = cpu_loop(overrides, load_prepared(digits_dir))
    assert not in_memory.streaming and in_memory.x_dev is in_memory.data.train.x  # the default: today's fast path
    assert SMALL_BUDGET.endswith(str(0.25)) and 0.25 < DIGITS_TRAIN_MIB
    streamed = cpu_loop([*overrides, SMALL_BUDGET], load_prepared(digits_dir, mmap=True))
    assert streamed.streaming and streamed.x_dev is None and not holds_the_training_set(streamed)
    assert mapped_file(streamed.data.train.x) == str((digits_dir / "train_x.npy").resolve())  # read from the file

    for loop in (in_memory, streamed):
        loop.fit(lambda m, ckpt: None)
    assert numbers(streamed.history) == numbers(in_memory.history)  # floats compared with ==
    assert len(streamed.history) == 3 and "block_1.positive" in streamed.history[-1]
    a, b = in_memory.model.state_dict(), streamed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_channels_last_trains_the_same_model(digits_dir):
    """``train.memory_format: channels_last``: the image backbone's weights and every input it sees (the steps' views,
    health, the kNN's embeddings) are in channels-last memory, and 2 epochs give the numbers of the contiguous loop
    (the convolutions only sum in another order)."""
    overrides = ["train.epochs=2", "model.depth=1", "train.knn_every=1"]
    runs = {}
    for fmt in ("contiguous", "channels_last"):
        loop = cpu_loop([*overrides, f"train.memory_format={fmt}"], load_prepared(digits_dir))
        # the last convolution: the first one's single input channel is the same memory either way
        conv = [m for m in loop.model.backbone.modules() if isinstance(m, torch.nn.Conv2d)][-1]
        assert conv.weight.is_contiguous(memory_format=torch.channels_last) == (fmt == "channels_last")
        seen = []
        conv.register_forward_hook(lambda m, args, out, seen=seen: seen.append(args[0]))
        loop.fit(lambda m, ckpt: None)
        assert seen and all(x.is_contiguous(memory_format=loop.memory_format) for x in seen)
        runs[fmt] = numbers(loop.history)
    for a, b in zip(runs["contiguous"], runs["channels_last"], strict=True):
        # the health's shares count the pairs over a threshold, many of them near it: another summation order moves
        # 0.9 % of them at epoch 1 (measured), where the loss moves by 1e-4
        assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], rel=1e-3, abs=0.02 if "." in k else 1e-3)
                                            for k in a), (a, b)


def test_channels_last_leaves_vectors_alone():
    """Inputs that are not images (the synthetic subspaces' vectors) have no channels: the setting changes nothing."""
    data = load_dataset(DataConfig(dataset="synthetic", root="unused"))
    loop = cpu_loop(["model.backbone=mlp", "train.memory_format=channels_last"], data)
    assert loop.memory_format == torch.contiguous_format and loop.embed(data.test.x[:8]).shape == (8, 128)


@pytest.mark.parametrize("mode", ["self_supervised", "supervised"])
def test_every_rank_reads_the_same_shard_either_way(digits_dir, mode):
    """With 2 workers each rank's local batch (inputs, ids) is the same from the device copy and streamed."""
    overrides = ["train.batch_size=64", f"train.mode={mode}", "model.depth=1"]
    perm = torch.randperm(len(load_prepared(digits_dir).train), generator=torch.Generator().manual_seed(3))
    for rank in range(2):
        a = cpu_loop(overrides, load_prepared(digits_dir), rank=rank, world_size=2)
        b = cpu_loop([*overrides, SMALL_BUDGET], load_prepared(digits_dir, mmap=True), rank=rank, world_size=2)
        assert b.streaming and not a.streaming
        for step in range(a.steps_per_epoch):
            (xa, ida), (xb, idb) = a._local_batch(perm, step), b._local_batch(perm, step)  # noqa: SLF001 (white-box)
            assert xa.shape == (32, 1, 8, 8) and torch.equal(xa, xb) and torch.equal(ida, idb)
            mine = perm[step * 64 + rank * 32 : step * 64 + (rank + 1) * 32]
            assert torch.equal(xb, load_prepared(digits_dir).train.x[mine])  # exactly this rank's rows, in order


# ------------------------------------------------------------------------------- two gloo workers, two paths
def _two_paths_worker(rank: int, world: int, data_dir: str) -> dict:
    histories = {}
    for name, extra, mmap in (("in_memory", ["train.epochs=2"], False),
                              ("streamed", ["train.epochs=2", SMALL_BUDGET], True),
                              ("dense", ["train.epochs=5"], False),
                              ("tiled", ["train.epochs=5", SMALL_BUDGET, TILING_BUDGET], True)):
        data = load_prepared(data_dir, mmap=mmap)
        loop = cpu_loop(["train.batch_size=64", *extra], data, rank=rank, world_size=world)
        assert loop.streaming == mmap
        assert (loop.head_plan.tile is not None) == (name == "tiled") and loop.head_plan.sharded
        loop.fit(lambda m, ckpt: None)
        histories[name] = numbers(loop.history)
    return histories


@pytest.mark.slow
def test_two_gloo_workers_streamed_equal_in_memory(digits_dir, tmp_path):
    ranks = run_ranks(tmp_path, _two_paths_worker, str(digits_dir))
    for histories in ranks:
        assert histories["streamed"] == histories["in_memory"] and len(histories["streamed"]) == 2
    # the head sharded over both workers and tiled (a budget of 0 MiB), streamed, against the dense head: the same
    # loss curve over 5 epochs in fp32. One step's gradients agree to 1e-12 in fp64 (test_sharded_head.py); in fp32
    # the dense step itself is 4e-4 (relative, the qk biases) from the fp64 one and the tiled one 2e-4, and Adam
    # turns such differences into diverging trajectories: the first epoch agrees to 5e-4 (1.7e-4 measured), then
    # within 1 %.
    tiled, dense = ranks[0]["tiled"], ranks[0]["dense"]
    assert len(tiled) == 5 and [h["epoch"] for h in tiled] == [1, 2, 3, 4, 5]
    assert tiled[0]["loss"] == pytest.approx(dense[0]["loss"], rel=5e-4)
    for t, d in zip(tiled, dense, strict=True):
        assert t["loss"] == pytest.approx(d["loss"], rel=1e-2) and t["lr"] == d["lr"]
        assert t["knn_acc"] == pytest.approx(d["knn_acc"], abs=0.03)
    # rank 0 alone runs the kNN monitor and the health; the all-reduced losses are the same on both ranks
    assert [h["loss"] for h in ranks[0]["streamed"]] == [h["loss"] for h in ranks[1]["streamed"]]


@pytest.mark.parametrize("extra", [[], ["model.fusion_scope=per_view"], ["model.head=truncated", "model.depth=2"],
                                   ["model.activation=softmax"]], ids=str)
def test_health_over_tiles_equals_the_dense_health(digits_dir, extra):
    """Where training tiles the head, the health check does too (each affinity a row slice at a time): same numbers."""
    overrides = ["train.batch_size=96", "model.depth=2", *extra]
    dense = cpu_loop(overrides, load_prepared(digits_dir))
    tiled = cpu_loop([*overrides, TILING_BUDGET], load_prepared(digits_dir))
    assert dense.head_plan.tile is None and tiled.head_plan.tile is not None
    want = dense.health()
    assert len(want) == 2 * 5
    assert_same_numbers(tiled.health(), want, rel=1e-5, abs=1e-7)


ABC = ["model.method=abc", "model.qk_init=default", "loss.name=bce", "model.abc.width=16", "model.abc.heads=2",
       "model.abc.blocks=1", "model.backbone=mlp", "model.embed_dim=16", "model.hidden_dim=32", "train.epochs=2",
       "train.batch_size=64", "train.knn_every=0", "train.head_lr_scale=1.0"]


@pytest.mark.slow
@pytest.mark.parametrize("mode,compatibility", [("supervised", "multiplicative"), ("self_supervised", "additive")])
def test_pretrain_with_method_abc_trains_reports_its_kernel_and_evaluates(mode, compatibility):
    """model.method abc end to end on digits: the loop trains ABC's head with BCE (same class, or same image), reports
    the kernel's statistics as its health (no blocks), and the evaluation embeds, clusters and checks it."""
    from pipeline.core.model import ABCModel
    from pipeline.evaluation.evaluate import layer_affinities, layer_embeddings, test_health
    from pipeline.evaluation.report import health_section

    data = load_dataset(DataConfig(dataset="digits", root="unused", limit_train=320, limit_test=100))
    params = load_params(ROOT / "params.yaml", [*ABC, f"train.mode={mode}", f"model.abc.compatibility={compatibility}"])
    loop = PretrainLoop(params, data, torch.device("cpu"))
    assert isinstance(loop.model, ABCModel) and loop.head_plan.tile is None
    reported = []
    loop.fit(lambda m, ckpt: reported.append(m))
    first, last = loop.history
    assert math.isfinite(last["loss"]) and last["loss"] < first["loss"]  # BCE from its start, falling
    kernel = {k: v for k, v in last.items() if k.startswith("kernel.")}
    assert set(kernel) == {"kernel.same_class", "kernel.other", "kernel.above_half"}
    assert all(0.0 <= v <= 1.0 for v in kernel.values()) and not any(k.startswith("block_") for k in last)
    assert 0.0 <= last["knn_acc"] <= 1.0 and reported[-1].health == kernel
    # evaluation of the trained model: [backbone, T(X)], the kernel as the final affinity, the kernel's health
    model, cpu = loop.model.eval(), torch.device("cpu")
    reps = layer_embeddings(model, data.test.x, 64, cpu)
    assert [r.shape for r in reps] == [(100, 16), (100, 16)]
    named = layer_affinities(model, data.test.x[:30], cpu)
    assert [n for n, _ in named] == ["backbone", "kernel"]
    kappa = named[1][1]
    assert kappa.shape == (30, 30) and np.allclose(kappa, kappa.T) and ((kappa > 0) & (kappa < 1)).all()
    health = test_health(model, data.test.x, data.test.y, 64, cpu)
    assert set(health) == {"kernel"} and set(health["kernel"]) == {"same_class", "other", "above_half"}
    text = "\n".join(health_section(health, params.model.depth))
    assert "Kernel health (ABC)" in text and "Warning" not in text and "Fusion health" not in text


# ------------------------------------------------------------------------------------------------- callbacks
class Recorder(Callback):
    """A user's callback: records every call in order; each step gets ``replace(x)`` (None: the inputs unchanged)."""

    def __init__(self, events: list, replace=None) -> None:
        self.events, self.replace = events, replace

    def on_train_start(self, loop):
        self.events.append(("start", loop.epoch))

    def on_step_start(self, loop, epoch, step, x):
        self.events.append(("step", epoch, step, tuple(x.shape), x.dtype))
        return None if self.replace is None else self.replace(x)

    def on_epoch_end(self, loop, metrics):
        self.events.append(("end", metrics.epoch, loop.epoch))


def tiny(data, epochs: int) -> PretrainLoop:  # epochs of 3 steps on 96 digits
    return small_loop(f"train.epochs={epochs}", *MLP, data=data)


def test_a_user_callback_sees_every_step_and_epoch_in_order_from_where_the_run_resumes(one_thread):
    data = digits(96)
    loop, events = tiny(data, 2), []
    loop.fit(lambda m, ckpt: events.append(("report", m.epoch, ckpt)), [Recorder(events)])
    steps = [("step", e, s, (32, 1, 8, 8), torch.float32) for e in (1, 2) for s in (1, 2, 3)]
    assert loop.steps_per_epoch == 3 and data.input_shape == (1, 8, 8)
    # a checkpoint every train.checkpoint_every (5) epochs and after the last
    assert events == [("start", 0), *steps[:3], ("report", 1, False), ("end", 1, 1), *steps[3:], ("report", 2, True),
                      ("end", 2, 2)]

    resumed = tiny(data, 2)
    resumed.load_state_dict({**loop.state_dict(), "epoch": 1, "history": loop.history[:1]})
    events.clear()
    resumed.fit(lambda m, ckpt: None, [Recorder(events)])
    assert events == [("start", 1), *steps[3:], ("end", 2, 2)]  # only the epoch it trains


def test_the_inputs_a_callback_returns_are_what_the_step_trains_on(one_thread):
    """A callback zeroing every step's inputs trains as a loop on a training set of zeros does: the same losses, bit for
    bit (the kNN monitor and the health read the real images, so they differ)."""
    data = digits(96)
    zeros = replace(data, train=replace(data.train, x=torch.zeros_like(data.train.x)))
    reference, zeroed, plain = tiny(zeros, 1), tiny(data, 1), tiny(data, 1)
    reference.fit(lambda m, ckpt: None)
    zeroed.fit(lambda m, ckpt: None, [Recorder([], torch.zeros_like)])
    plain.fit(lambda m, ckpt: None, [Recorder([])])  # returning None keeps the inputs

    def losses(loop):
        return [(h["loss"], h["view_noise"]) for h in loop.history]

    assert losses(zeroed) == losses(reference)
    assert losses(plain) != losses(reference) and all(math.isfinite(v) for v, _ in losses(plain))


# ------------------------------------------------------------------------------------------- the online kNN monitor
@pytest.mark.slow
@pytest.mark.parametrize("limit_train", [256, None])
def test_the_monitors_cost_is_bounded_whatever_the_training_set(limit_train, one_thread):
    """What a monitored epoch embeds beyond its steps, in eval mode: the kNN's clean bank (min(KNN_BANK, training
    set)) and validation queries (min(KNN_QUERIES, validation set)), and the health's one global batch of two views.
    Bounded: on 60,000 images as on 5,000, 7,000 forwards and a batch."""
    data = load_dataset(DataConfig(dataset="digits", root="unused", limit_train=limit_train))
    loop = cpu_loop(["train.epochs=1", "train.knn_every=1", "train.batch_size=64", "model.depth=1"], data)
    rows = []
    loop.model.backbone.register_forward_hook(
        lambda m, args, out: rows.append(len(args[0])) if not m.training else None)
    loop.fit(lambda m, ckpt: None)
    n, q = len(data.train.y), len(data.val.y)
    assert sum(rows) == min(KNN_BANK, n) + min(KNN_QUERIES, q) + 2 * 64


@pytest.mark.parametrize(("every", "epochs", "checked"), [(2, 5, [2, 4, 5]), (0, 3, [3]), (1, 2, [1, 2])])
def test_the_online_checks_follow_knn_every_and_the_last_epoch(every, epochs, checked, one_thread):
    """The kNN and the blocks' health run together, on the epochs ``train.knn_every`` names and after the last; between
    them an epoch carries neither (its console line no health either)."""
    loop = small_loop(f"train.epochs={epochs}", f"train.knn_every={every}", "model.depth=1", *MLP, data=digits(96))
    reported: list[EpochMetrics] = []
    loop.fit(lambda m, ckpt: reported.append(m))
    assert [m.epoch for m in reported if m.knn_acc is not None] == checked
    assert [m.epoch for m in reported if m.health] == checked
    assert all(set(m.health) >= {"block_1.positive", "block_1.entropy"} for m in reported if m.health)
    assert all("positive pairs" not in m.line(epochs) for m in reported if not m.health)


def _noise(split):
    """``split`` with random inputs and shuffled labels: a split no choice may read."""
    g = torch.Generator().manual_seed(7)
    shuffled = split.y[torch.randperm(len(split.y), generator=g)]
    return replace(split, x=torch.rand(split.x.shape, generator=g), y=shuffled)


def test_the_online_knn_reads_the_validation_split_never_the_test_split(one_thread):
    """Every choice (Tune's metric and best trial, a sweep's best, the stop-rising epoch) reads the online kNN: with the
    test split replaced by noise a run's numbers are the same bit for bit; with the validation split replaced, the kNN
    moves."""
    data = digits(96)
    runs = [small_loop("train.epochs=2", "train.knn_every=1", *MLP, data=d)
            for d in (data, replace(data, test=_noise(data.test)), replace(data, val=_noise(data.val)))]
    for loop in runs:
        loop.fit(lambda m, ckpt: None)
    clean, test_poisoned, val_poisoned = (numbers(loop.history) for loop in runs)
    assert test_poisoned == clean and all(h["knn_acc"] is not None for h in clean)
    assert [h["knn_acc"] for h in val_poisoned] != [h["knn_acc"] for h in clean]
