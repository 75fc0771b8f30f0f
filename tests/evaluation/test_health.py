"""pipeline.evaluation.health against loops over i, j; a deliberately dead block is seen dead and warned about."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.core.model import EPS, TransFusionHead
from pipeline.evaluation.health import (
    DEAD_POSITIVE,
    block_health,
    dead_blocks,
    flat,
    head_health,
    is_health_key,
    kernel_health,
    read_health,
    unflat,
    verdict,
    warnings_for,
)
from tests.training.small import MLP, digits, small_loop


def naive_health(raw: list[list[float]], labels: list[int] | None, other: list[int] | None) -> dict:
    n = len(raw)
    pos = sum(1 for i in range(n) for j in range(n) if i != j and raw[i][j] > 0)
    uniform = sum(1 for i in range(n) if all(raw[i][j] <= 0 for j in range(n) if j != i))
    ent, same, chance, partner = 0.0, 0.0, 0.0, 0.0
    for i in range(n):
        total = sum(raw[i][j] + EPS for j in range(n))
        w = [(raw[i][j] + EPS) / total for j in range(n)]
        ent += -sum(p * math.log(p) for p in w) / math.log(n) / n
        if labels is not None:
            same += sum(w[j] for j in range(n) if j != i and labels[j] == labels[i]) / n
            chance += sum(1 for j in range(n) if j != i and labels[j] == labels[i]) / n / n
        if other is not None:
            partner += w[other[i]] / n
    return {"positive": pos / (n * (n - 1)), "uniform_rows": uniform / n, "entropy": ent,
            "same_class": same if labels is not None else None,
            "same_class_chance": chance if labels is not None else None,
            "other_view": partner if other is not None else None}


def relu_affinity(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(n, n, generator=g, dtype=torch.float64) - 0.5).clamp_min(0)
    a.fill_diagonal_(0)
    return a


@pytest.mark.parametrize("n", [2, 5, 16, 33])
@pytest.mark.parametrize("with_labels", [False, True])
def test_block_health_matches_loops(n: int, with_labels: bool) -> None:
    raw = relu_affinity(n, n)
    raw[0] = 0  # one uniform row at least
    labels = torch.arange(n) % 3 if with_labels else None
    other = torch.roll(torch.arange(n), 1)
    got = block_health(raw, labels, other)
    want = naive_health(raw.tolist(), None if labels is None else labels.tolist(), other.tolist())
    for k, v in want.items():
        if v is None:
            assert got[k] is None
        else:
            assert got[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k


def test_batched_groups_are_the_mean_of_each_group() -> None:
    a, b = relu_affinity(8, 1), relu_affinity(8, 2)
    y = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    both = block_health(torch.stack([a, b]), torch.stack([y, y]))
    one, two = block_health(a, y), block_health(b, y)
    for k in ("positive", "uniform_rows", "entropy", "same_class"):
        assert both[k] == pytest.approx((one[k] + two[k]) / 2)


def test_dead_and_uniform_blocks() -> None:
    dead = torch.zeros(10, 10)
    h = block_health(dead, torch.arange(10) % 2)
    assert h["positive"] == 0 and h["uniform_rows"] == 1 and h["entropy"] == pytest.approx(1.0)
    assert h["same_class"] == pytest.approx(h["same_class_chance"])  # uniform attention: chance exactly
    assert verdict(h) == "dead"
    sparse = torch.zeros(10, 10)
    sparse[0, 1] = sparse[1, 0] = 1.0  # 2 % positive pairs, 80 % uniform rows
    assert verdict(block_health(sparse)) == "mostly uniform"
    alive = relu_affinity(10, 0) + 0.1
    alive.fill_diagonal_(0)
    assert verdict(block_health(alive)) is None
    hs = {"block_1": block_health(alive), "block_2": block_health(dead)}
    assert dead_blocks(hs) == ["block_2"]
    (line,) = warnings_for(hs)
    assert line.startswith("block 2 is dead: 0.0% of its pairs")
    assert DEAD_POSITIVE == 0.01


def test_flat_round_trip() -> None:
    hs = head_health([relu_affinity(6, 0), relu_affinity(6, 1)], torch.arange(6) % 2)
    f = flat(hs)
    assert set(f) == {f"block_{b}.{k}" for b in (1, 2) for k in
                      ("positive", "uniform_rows", "entropy", "same_class", "other_view")}
    back = unflat({**f, "loss": 1.0, "block_x": 3})
    assert list(back) == ["block_1", "block_2"]
    assert back["block_2"]["positive"] == hs["block_2"]["positive"]


@pytest.mark.parametrize("n", [5, 12])
def test_abcs_kernel_health_is_its_kernel_stats_by_loops_and_never_warns(n: int) -> None:
    """ABC (model.method: abc): kernel.same_class / other / above_half over i != j; no dead-block verdict."""
    g = torch.Generator().manual_seed(n)
    a = torch.rand(n, n, generator=g, dtype=torch.float64)
    kappa, labels = (a + a.T) / 2, torch.arange(n) % 3
    h = read_health(kernel_health(kappa, labels))
    pairs = [(i, j) for i in range(n) for j in range(n) if i != j]
    same = [float(kappa[i, j]) for i, j in pairs if labels[i] == labels[j]]
    other = [float(kappa[i, j]) for i, j in pairs if labels[i] != labels[j]]
    assert h["kernel"]["same_class"] == pytest.approx(sum(same) / len(same))
    assert h["kernel"]["other"] == pytest.approx(sum(other) / len(other))
    assert h["kernel"]["above_half"] == pytest.approx(sum(float(kappa[i, j]) > 0.5 for i, j in pairs) / len(pairs))
    f = flat(h)
    assert set(f) == {"kernel.same_class", "kernel.other", "kernel.above_half"} and all(map(is_health_key, f))
    assert not is_health_key("loss") and is_health_key("block_1.positive")
    assert unflat({**f, "loss": 1.0}) == h
    dead = {"kernel": {**h["kernel"], "above_half": 0.0}, **head_health([torch.zeros(4, 4)])}  # a dead block too
    assert dead_blocks(dead) == ["block_1"] and len(warnings_for(dead)) == 1 and "block 1" in warnings_for(dead)[0]


def kill(head: TransFusionHead) -> None:
    """Make every block dead: all queries ≈ u, all keys ≈ -u, so every QKᵀ entry ≈ -1 and ReLU gives 0."""
    with torch.no_grad():
        for block in head.blocks:
            dim = block.query.weight.shape[0]
            u = torch.zeros(dim)
            u[0] = 1000.0
            block.query.weight.mul_(1e-3)
            block.key.weight.mul_(1e-3)
            block.query.bias.copy_(u)
            block.key.bias.copy_(-u)


def test_a_deliberately_dead_block_is_reported_dead_in_training_and_warned_about(tmp_path, monkeypatch) -> None:
    from pipeline.runs.job import Job, WorkerSpec
    from pipeline.runs.train import PretrainResult, TrainedState
    from stages.pretrain import health_warnings, write_outputs

    data = digits(200, 100)
    loop = small_loop("train.epochs=2", *MLP, "model.depth=2", data=data)
    params = loop.params
    kill(loop.model.head)
    lines = []
    loop.fit(lambda m, ckpt: lines.append(m.as_dict()))
    assert lines[-1]["block_1.positive"] == 0.0 and lines[-1]["block_2.positive"] == 0.0
    assert lines[-1]["block_1.uniform_rows"] == 1.0
    assert lines[-1]["block_1.other_view"] == pytest.approx(1 / 64)  # uniform over 2B = 64 rows
    job = Job("pretrain", params, tmp_path, False, {}, WorkerSpec(params, "", {}, "", "x", False), None)
    res = PretrainResult(state=TrainedState.of(loop.state_dict(), workers=[]), job=job, input_shape=data.input_shape,
                         n_classes=10)
    summary = write_outputs(params, res, tmp_path / "models", tmp_path / "metrics.json", tmp_path / "curves.csv")
    assert list(summary["health"]) == ["block_1", "block_2"]
    header = (tmp_path / "curves.csv").read_text().splitlines()[0].split(",")
    assert "block_2.positive" in header and "block_1.same_class" in header
    warned = health_warnings(summary)
    assert len(warned) == 2 and all("is dead" in w and "docs/fusion.md" in w for w in warned)


def test_a_live_block_gets_no_warning_and_per_view_has_no_other_view() -> None:
    loop = small_loop(*MLP, "model.depth=1", "model.qk_init=identity", "model.fusion_scope=per_view",
                      data=digits(200, 100))
    h = loop.health()
    assert h["block_1.positive"] > 0.2  # identity init: ReLU of the inputs' cosine, alive from the start
    assert h["block_1.other_view"] is None  # the other view is not in a per-view fused batch: n/a
    assert warnings_for(unflat(h)) == []


@pytest.mark.parametrize("n", [5, 33, 130])
@pytest.mark.parametrize("rows", [1, 4, 128])
def test_row_slices_give_the_numbers_of_the_whole(n: int, rows: int) -> None:
    raw = relu_affinity(n, 3 * n)
    labels, other = torch.arange(n) % 4, torch.roll(torch.arange(n), 2)
    whole = block_health(raw, labels, other, rows=n)
    sliced = block_health(raw, labels, other, rows=rows)
    assert_same_numbers(sliced, whole, rel=1e-12)
    grouped = torch.stack([raw, relu_affinity(n, 7)])
    assert_same_numbers(block_health(grouped, torch.stack([labels] * 2), rows=rows),
                        block_health(grouped, torch.stack([labels] * 2), rows=n), rel=1e-12)


def assert_same_numbers(got: dict, want: dict, rel: float, abs: float = 1e-12) -> None:
    """Same keys; None ("n/a") exactly where the other has None; numbers within ``rel`` / ``abs``. Spelled out key by
    key: ``pytest.approx`` of a mapping that holds None raises TypeError from pytest 9.2 on."""
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert (got[key] is None) == (value is None), key
        assert value is None or got[key] == pytest.approx(value, rel=rel, abs=abs), key


@pytest.mark.parametrize("scope", ["joint", "per_view"])
def test_health_in_chunks_equals_one_forward(scope: str) -> None:
    """The health batch loaded, augmented and embedded in chunks gives the numbers of one forward (strength 0: the
    chunks draw no augmentation, so both see the same views)."""

    loop = small_loop(*MLP, "model.depth=2", "augment.strength=0.0", f"model.fusion_scope={scope}",
                      data=digits(200, 100))
    whole = loop.health()
    assert whole["block_2.positive"] > 0
    assert_same_numbers(loop.health(chunk=7), whole, rel=1e-6, abs=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("depth", [1, 3])
def test_health_at_a_large_batch_needs_no_more_memory_than_a_training_step(depth: int) -> None:
    """B = 1024 (2B = 2048 fused rows): the health check's peak stays below one training step's; the whole-matrix
    way (every block's affinity collected, fp64 statistics over all of it) would not."""
    from pipeline.evaluation.health import attention_weights
    from pipeline.training.measure import peak_bytes

    data = digits(1100, 100)
    loop = small_loop(*MLP, f"model.depth={depth}", "train.batch_size=1024", data=data)
    perm = torch.randperm(len(data.train.y), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        x, ids = loop._local_batch(perm, 0)  # noqa: SLF001 (white-box: one step's batch)
        with torch.no_grad():
            gen = torch.Generator().manual_seed(0)
            v1, v2 = loop.augment(x, gen), loop.augment(x, gen)
        loop.step.lazy(torch.cat([v1, v2]), torch.cat([ids, ids]))
        loop.optimizer.step()

    def whole_matrix() -> None:  # every affinity collected at once, fp64 weights of each whole
        with torch.no_grad():
            x = torch.cat([data.train.x[:1024]] * 2).float()
            for a in loop.model(x, collect=True, views=2).affinities:
                w = attention_weights(a)  # (2B, 2B) fp64
                (w * w.clamp_min(1e-300).log()).sum(-1)

    training, health, naive = peak_bytes(step), peak_bytes(loop.health), peak_bytes(whole_matrix)
    assert health <= training < naive, (health, training, naive)
    assert health >= 2048 * 2048 * 4  # it does hold one fp32 (2B)² affinity: the meter sees the tensors


# ------------------------------------------------------------------------------------- host syncs
@pytest.mark.parametrize("n,rows", [(5, 128), (40, 16), (70, 7)])
def test_the_numbers_stay_on_the_device_until_one_read(n, rows):
    """``block_stats`` reads nothing on the host (``measure.OpCounter``: before, 2-3 ``int()`` per slice of rows);
    ``read_health`` reads every block's numbers in one transfer, and gives ``block_health``'s floats exactly."""
    from pipeline.evaluation.health import block_stats, read_health
    from pipeline.training import measure

    g = torch.Generator().manual_seed(n)
    raw = torch.relu(torch.randn(2, n, n, generator=g))
    raw[:, torch.arange(n), torch.arange(n)] = 0
    labels = torch.randint(0, 3, (2, n), generator=g)
    other = torch.stack([torch.randperm(n, generator=g) for _ in range(2)])
    stats = {}
    counter = measure.count(lambda: stats.update(block_1=block_stats(raw, labels, other, rows),
                                                 block_2=block_stats(raw[0], None, None, rows)))
    assert counter.syncs == []
    assert all(v is None or (v.ndim == 0 and v.dtype == torch.float64) for h in stats.values() for v in h.values())
    read = read_health(stats)
    assert read == {"block_1": block_health(raw, labels, other, rows), "block_2": block_health(raw[0], rows=rows)}
    assert read["block_2"]["same_class"] is None and isinstance(read["block_1"]["same_class"], float)
