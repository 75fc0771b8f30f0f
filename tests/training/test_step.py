"""Global-batch fusion: 2 gloo workers give the loss, gradients and global-BatchNorm statistics of one process on the
concatenated batch, for every backbone family; controls: without the gather, or with per-worker BN, they differ."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pytest
import torch

from pipeline.core.backbones import build_backbone
from pipeline.core.batchnorm import GlobalBatchNorm, convert_batchnorm
from pipeline.core.losses import make_loss
from pipeline.core.model import TransFusion, TransFusionHead, build_projector
from pipeline.training.step import GlobalBatchStep, NonFiniteLossError
from tests.training.ranks import run_ranks, shard
from tests.training.small import digits, small_loop

B, SHAPE = 8, (1, 8, 8)  # 8 images, two views each


@dataclass(frozen=True)
class Spec:
    """One configuration of the equality harness (picklable for the ranks, tests.gloo)."""

    loss_name: str = "jsd"
    mode: str = "self"  # self | sup
    chunk: int | None = None
    truncated: bool = False
    backbone: str = "cnn_small"
    shape: tuple[int, ...] = SHAPE
    dtype: torch.dtype = torch.float64
    global_bn: bool = True  # convert BatchNorm to global BN when world > 1 (False: the plain-BN control)
    no_gather: bool = False  # the control: a step that forgets to gather sees only its shard
    reduce_scatter: bool | None = None  # force the all-gather's backward collective (None: the default)
    layout: str | None = None  # GlobalBatchStep's layout hint (pipeline.core.losses): None, two_view or labels
    projector: str = "none"  # model.projector: none | linear | mlp (row-wise, between the backbone and the head)


def make_model(seed: int = 0, depth: int = 2, truncated: bool = False, backbone: str = "cnn_small",
               shape: tuple[int, ...] = SHAPE, dtype: torch.dtype = torch.float64,
               projector: str = "none") -> TransFusion:
    torch.manual_seed(seed)
    embed = None if backbone in ("pixels", "resnet18_cifar", "resnet18") or backbone.startswith("torchvision:") else 16
    bb, dim = build_backbone(backbone, shape, embed_dim=embed)
    width = dim if projector == "none" else 12  # a projector narrower than the backbone
    return TransFusion(bb, dim, TransFusionHead(width, depth, truncate_last=truncated),
                       build_projector(projector, dim, width), width).to(dtype)


def make_batch(mode: str, shape: tuple[int, ...] = SHAPE, dtype: torch.dtype = torch.float64):
    g = torch.Generator().manual_seed(1)
    v1 = torch.rand(B, *shape, generator=g, dtype=torch.float64)
    v2 = (v1 + 0.1 * torch.rand(B, *shape, generator=g, dtype=torch.float64)).clamp(0, 1)
    img_ids = torch.arange(B) if mode == "self" else torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    return v1.to(dtype), v2.to(dtype), img_ids


def grads_of(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def bn_buffers(model):
    """Running mean / var / num_batches_tracked of every BatchNorm."""
    return {n: b.detach().clone() for n, b in model.named_buffers() if n.rsplit(".", 1)[-1].startswith(
        ("running_", "num_batches"))}


def run_step(spec: Spec, rank: int = 0, world: int = 1):
    """One step on this rank's shard (default: one process on the whole batch); returns (loss, grads, BN buffers,
    this rank's embeddings (2b, m))."""
    model = make_model(truncated=spec.truncated, backbone=spec.backbone, shape=spec.shape, dtype=spec.dtype,
                       projector=spec.projector)
    if world > 1 and spec.global_bn:
        convert_batchnorm(model)
    captured = []
    model.backbone.register_forward_hook(lambda mod, inp, out: captured.append(out.detach().clone()))
    step = GlobalBatchStep(model, make_loss(spec.loss_name), grad_cache_chunk=spec.chunk, layout=spec.layout)
    loss = step(*shard(*make_batch(spec.mode, spec.shape, spec.dtype), rank, world))
    return loss, grads_of(model), bn_buffers(model), captured[0]


def _worker(rank, world, spec: Spec):
    import pipeline.training.step as step_mod

    if spec.no_gather:
        step_mod.gather_views = lambda z, w: z
        step_mod.gather_ids = lambda i, w: i
        step_mod.local_rows = lambda r, b, w: (slice(0, b), slice(b, 2 * b))
    if spec.reduce_scatter is not None:
        step_mod.reduce_scatter_works = lambda t: spec.reduce_scatter
    return run_step(spec, rank, world)


def rel_diff(a: dict, b: dict) -> float:
    """‖a − b‖ / ‖b‖ over all tensors of two dicts with equal keys."""
    num = math.sqrt(sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in b))
    den = math.sqrt(sum(float(b[k].double().pow(2).sum()) for k in b))
    return num / den


def assert_grads_close(a, b, rtol=1e-5):
    """Every tensor within rtol, relative to itself and (for ~0 tensors) to the largest gradient."""
    assert a.keys() == b.keys()
    top = max(float(g.abs().max()) for g in b.values())
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=rtol, atol=rtol * top, msg=name)


def slow(spec: Spec, id: str):
    return pytest.param(spec, marks=pytest.mark.slow, id=id)


CASES = [pytest.param(Spec(), id="jsd"), slow(Spec("supcon", "sup"), "supcon"), slow(Spec("barlow_twins"), "barlow"),
         slow(Spec("jsd_appendix_e", chunk=3, truncated=True), "appendix-e-chunk3-truncated"),
         pytest.param(Spec(layout="two_view"), id="jsd-two_view"),
         # the all-gather's two backward collectives (gloo in torch 2.14 has reduce_scatter too)
         slow(Spec("supcon", "sup", reduce_scatter=False), "supcon-allreduce-slice"),
         slow(Spec("supcon", "sup", reduce_scatter=True), "supcon-reduce-scatter"),
         # a projector any loss may have (model.projector), with gradient caching through it
         pytest.param(Spec(projector="mlp", chunk=3), id="mlp-projector-chunk3"),
         slow(Spec("infonce", projector="linear"), "infonce-linear-projector")]


@pytest.mark.parametrize("spec", CASES)
def test_two_gloo_workers_equal_one_process(tmp_path, spec):
    ref_loss, ref_grads, _, _ = run_step(dataclasses.replace(spec, chunk=None, layout=None, reduce_scatter=None))
    for loss, grads, _, _ in run_ranks(tmp_path, _worker, spec):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert_grads_close(grads, ref_grads)


@pytest.mark.slow
def test_without_the_gather_the_gradients_differ(tmp_path):
    _, ref_grads, _, _ = run_step(Spec())
    (_, grads0, _, _), _ = run_ranks(tmp_path, _worker, Spec(no_gather=True))
    with pytest.raises(AssertionError):
        assert_grads_close(grads0, ref_grads)


@pytest.mark.parametrize("loss_name,mode", [("jsd", "self"), pytest.param("supcon", "sup", marks=pytest.mark.slow),
                                            pytest.param("barlow_twins", "self", marks=pytest.mark.slow)])
@pytest.mark.parametrize("chunk", [pytest.param(1, marks=pytest.mark.slow), 3, pytest.param(5, marks=pytest.mark.slow)])
def test_grad_cache_equals_plain_step(loss_name, mode, chunk):
    loss, grads, _, _ = run_step(Spec(loss_name, mode))
    loss_c, grads_c, _, _ = run_step(Spec(loss_name, mode, chunk))
    assert loss_c == pytest.approx(loss, rel=1e-10)
    assert_grads_close(grads_c, grads, rtol=1e-9)


def test_non_finite_loss_raises_before_touching_grads():
    model = make_model()
    v1, v2, ids = make_batch("self")
    x = torch.cat([v1, v2])
    x[0, 0, 0, 0] = float("nan")
    step = GlobalBatchStep(model, make_loss("jsd"))
    with pytest.raises(NonFiniteLossError, match="non-finite"):
        step(x, torch.cat([ids, ids]))
    assert all(p.grad is None for p in model.parameters())


# ------------------------------------------------------------------------------------- every backbone, global BN
# resnet18 (ImageNet stem) needs 32x32 to keep a spatial map past its stride-32 trunk; fp64 keeps the 1e-5 bound
# meaningful (measured 5e-14 here); resnet18_cifar on 3x8x8 likewise. torchvision:mobilenet_v3_small (any torchvision
# model, adapted: pipeline.core.backbones) stands for torchvision's: BatchNorm throughout, squeeze-excitation, and a
# dropout in its classifier that the adaptation removes (with it the workers' draws would differ from one process's).
BACKBONES = [("pixels", SHAPE), ("mlp", SHAPE), ("cnn_small", SHAPE), ("resnet18_cifar", (3, 8, 8)),
             ("resnet18", (3, 32, 32)), ("torchvision:mobilenet_v3_small", (3, 32, 32))]


@pytest.mark.slow
@pytest.mark.parametrize("backbone,shape", BACKBONES, ids=[b for b, _ in BACKBONES])
def test_every_backbone_two_gloo_workers_equal_one_process(tmp_path, backbone, shape):
    spec = Spec(backbone=backbone, shape=shape)
    ref_loss, ref_grads, ref_buffers, ref_z = run_step(spec)
    results = run_ranks(tmp_path, _worker, spec)
    for loss, grads, buffers, _ in results:
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert_grads_close(grads, ref_grads)
        assert buffers.keys() == ref_buffers.keys()
        for name, ref in ref_buffers.items():  # running stats: the single process's, after one step
            torch.testing.assert_close(buffers[name], ref, rtol=1e-5, atol=1e-8, msg=name)
    (_, _, buf0, z0), (_, _, buf1, z1) = results
    for name in buf0:  # identical on both ranks, bit for bit
        assert torch.equal(buf0[name], buf1[name]), name
    b = B // 2
    z = torch.cat([z0[:b], z1[:b], z0[b:], z1[b:]])  # the workers' embeddings in the one-process row order
    torch.testing.assert_close(z, ref_z, rtol=1e-5, atol=1e-8)
    if backbone.startswith(("resnet", "torchvision:")):  # BatchNorm: every layer's statistics moved once
        tracked = [v for k, v in ref_buffers.items() if k.endswith("num_batches_tracked")]
        assert len(tracked) >= 20 and all(int(v) == 1 for v in tracked)


@pytest.mark.slow
def test_plain_batchnorm_on_two_workers_differs(tmp_path):
    """The control: per-worker BN (no conversion) normalises each shard by its own statistics."""
    spec = Spec(backbone="resnet18_cifar", shape=(3, 8, 8), global_bn=False)
    ref_loss, ref_grads, ref_buffers, ref_z = run_step(spec)
    (loss0, grads0, buf0, z0), (_, _, buf1, z1) = run_ranks(tmp_path, _worker, spec)
    assert rel_diff(grads0, ref_grads) > 0.5  # measured 2.56 (256 %)
    b = B // 2
    z = torch.cat([z0[:b], z1[:b], z0[b:], z1[b:]])
    assert float((z - ref_z).norm() / ref_z.norm()) > 0.2  # measured 0.95
    assert abs(loss0 - ref_loss) > 0.1  # measured 0.278 -> 0.737
    key = "backbone.bn1.running_mean"
    assert not torch.equal(buf0[key], buf1[key])  # the ranks drift apart


def test_lazy_step_equals_the_checked_step():
    spec = Spec()
    loss, grads, _, _ = run_step(spec)
    model = make_model()
    v1, v2, ids = make_batch("self")
    lazy = GlobalBatchStep(model, make_loss("jsd")).lazy(torch.cat([v1, v2]), torch.cat([ids, ids]))
    assert isinstance(lazy, torch.Tensor) and lazy.dim() == 0 and not lazy.requires_grad
    assert float(lazy) == loss
    assert_grads_close(grads_of(model), grads, rtol=0)


# ------------------------------------------------------------------------------------- broadcast from rank 0
def _broadcast_worker(rank, world, data_dir):
    from pipeline.config.params import load_params
    from pipeline.core.model import build_model
    from pipeline.data.prepared import load_prepared
    from pipeline.training.loop import PretrainLoop
    from tests.conftest import ROOT

    # ranks seeded differently (train.seed = rank): without the broadcast their models would start apart
    params = load_params(ROOT / "params.yaml", ["model.backbone=resnet18_cifar", "model.embed_dim=null",
                                                 "train.batch_size=16", f"train.seed={rank}"])
    data = load_prepared(data_dir)
    torch.manual_seed(rank)
    own = {k: v.clone() for k, v in build_model(params.model, data.input_shape).state_dict().items()}
    loop = PretrainLoop(params, data, torch.device("cpu"), rank=rank, world_size=world)
    kinds = sorted({type(m).__name__ for m in loop.model.modules() if "BatchNorm" in type(m).__name__})
    return own, {k: v.clone() for k, v in loop.model.state_dict().items()}, kinds


@pytest.mark.slow
def test_ranks_seeded_differently_start_identical(tmp_path):
    from pipeline.config.data import DataConfig
    from pipeline.data.prepared import save_prepared
    from pipeline.data.sources import load_dataset

    save_prepared(load_dataset(DataConfig(dataset="digits", root=str(tmp_path), limit_train=64, limit_test=32)),
                  tmp_path / "prepared")
    (own0, state0, kinds0), (own1, state1, kinds1) = run_ranks(tmp_path, _broadcast_worker, str(tmp_path / "prepared"))
    assert any(not torch.equal(own0[k], own1[k]) for k in own0)  # the seeds do give different models
    assert state0.keys() == state1.keys() == own0.keys()  # global BN keeps the state_dict keys
    for k in state0:
        assert torch.equal(state0[k], state1[k]), k
    assert kinds0 == kinds1 == [GlobalBatchNorm.__name__]  # world 2: every BN became global


# ------------------------------------------------------------------------------------- the loop's deferred sync
def _loop(defer_sync: bool):
    return small_loop("train.epochs=3", "model.embed_dim=null", data=digits(160), defer_sync=defer_sync)


@pytest.mark.slow
def test_deferred_sync_gives_the_per_step_results_bit_for_bit():
    """The CUDA path (0-d loss/noise tensors, one sync per epoch) run on CPU: the very same epoch metrics."""
    runs = []
    for defer in (False, True):
        loop = _loop(defer)
        assert loop.defer_sync is defer
        loop.fit(lambda m, ckpt: None)
        runs.append([(h["loss"], h["view_noise"]) for h in loop.history])
    assert len(runs[0]) == 3 and runs[0] == runs[1]


@pytest.mark.parametrize("defer", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["per-step", "deferred"])
def test_nan_mid_epoch_raises_before_the_epoch_is_reported(defer):
    from tests.faults import FaultPlan, Faults

    loop = _loop(defer)
    reported = []
    with pytest.raises(NonFiniteLossError, match="non-finite"):  # NaN inputs at epoch 2, its third of five steps
        loop.fit(lambda m, ckpt: reported.append(m.epoch), [Faults(FaultPlan(nan_at_step=(2, 3)))])
    assert reported == [1]  # epoch 2 never reported (nor checkpointed)
    assert loop.epoch == 1 and len(loop.history) == 1


# ------------------------------------------------------------------------------------- layout hints (no host sync)
@pytest.mark.parametrize("loss_name,mode,layout,exact", [
    ("jsd", "self", "two_view", True), ("barlow_twins", "self", "two_view", True),
    ("infonce", "self", "two_view", True), ("supcon", "sup", "labels", False), ("kl_relu", "sup", "labels", False),
    ("jsd", "self", "labels", False)])
@pytest.mark.parametrize("chunk", [None, 3])
def test_layout_hint_gives_the_same_step(loss_name, mode, layout, exact, chunk):
    """``two_view``: the step of the validated path bit for bit; ``labels``: up to rounding."""
    loss, grads, _, _ = run_step(Spec(loss_name, mode, chunk))
    loss_h, grads_h, _, _ = run_step(Spec(loss_name, mode, chunk, layout=layout))
    if exact:
        assert loss_h == loss
        assert grads_h.keys() == grads.keys() and all(torch.equal(grads_h[k], grads[k]) for k in grads)
    else:
        assert loss_h == pytest.approx(loss, rel=1e-12)
        assert_grads_close(grads_h, grads, rtol=1e-10)


def test_two_view_ids_are_checked_once_per_batch_size(monkeypatch):
    import pipeline.training.step as step_mod

    calls = []
    monkeypatch.setattr(step_mod, "check_layout", lambda ids, layout: calls.append((ids.shape[0], layout)))
    step = GlobalBatchStep(make_model(), make_loss("jsd"), layout="two_view")
    v1, v2, ids = make_batch("self")
    x, ids2 = torch.cat([v1, v2]), torch.cat([ids, ids])
    step.lazy(x, ids2)
    step.lazy(x, ids2)
    step(x, ids2)
    assert calls == [(2 * B, "two_view")]
    step.lazy(torch.cat([v1[:4], v2[:4]]), torch.cat([ids[:4], ids[:4]]))  # another batch size: checked again
    assert calls == [(2 * B, "two_view"), (8, "two_view")]


def test_wrong_ids_for_the_layout_and_grad_cache_with_batchnorm_are_refused():
    v1, v2, labels = make_batch("sup")
    x = torch.cat([v1, v2])
    with pytest.raises(ValueError, match="two_view"):
        GlobalBatchStep(make_model(), make_loss("supcon"), layout="two_view").lazy(x, torch.cat([labels, labels]))
    with pytest.raises(ValueError, match="one positive per row"):
        GlobalBatchStep(make_model(), make_loss("infonce"), layout="labels").lazy(x, torch.cat([labels, labels]))
    with pytest.raises(ValueError, match="unknown layout 'dense'"):
        GlobalBatchStep(make_model(), make_loss("jsd"), layout="dense")
    model = make_model(backbone="resnet18_cifar", shape=(3, 8, 8))
    with pytest.raises(ValueError, match="grad_cache_chunk=4 with a BatchNorm model.*different BatchNorm batches"):
        GlobalBatchStep(model, make_loss("jsd"), grad_cache_chunk=4)
    GlobalBatchStep(model, make_loss("jsd"))  # without gradient caching it is fine
    GlobalBatchStep(make_model(), make_loss("jsd"), grad_cache_chunk=4)  # GroupNorm: caching is exact
