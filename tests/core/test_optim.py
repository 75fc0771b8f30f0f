"""Tests for pipeline.core.optim: LARS against a python reference, build_optimizer grouping, warmup_cosine schedule."""

from __future__ import annotations

import io
import math
import random

import pytest
import torch
from torch import nn

from pipeline.core.model import TransFusion, TransFusionHead
from pipeline.core.optim import LARS, OPTIMIZERS, build_optimizer, warmup_cosine


# ----------------------------------------------------------------------------------------------------- LARS
def _norm(xs: list[float]) -> float:
    return math.sqrt(sum(x * x for x in xs))


def _lars_reference(params: list[list[float]], grads_per_step: list[list[list[float] | None]], excluded: list[bool],
                    lr: float, mu: float, wd: float, eta: float) -> list[list[float]]:
    """Slow LARS: flat python lists per parameter, one python loop per element."""
    params = [list(p) for p in params]
    bufs: list[list[float] | None] = [None] * len(params)
    for grads in grads_per_step:
        for i, (p, g) in enumerate(zip(params, grads, strict=True)):
            if g is None:
                continue
            if excluded[i]:
                g_eff = list(g)
                trust = 1.0
            else:
                g_eff = [g[j] + wd * p[j] for j in range(len(p))]
                pn, gn = _norm(p), _norm(g_eff)
                trust = eta * pn / gn if pn > 0 and gn > 0 else 1.0
            if bufs[i] is None:
                bufs[i] = [0.0] * len(p)
            v = bufs[i]
            for j in range(len(p)):
                v[j] = mu * v[j] + lr * trust * g_eff[j]
                p[j] = p[j] - v[j]
    return params


@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("mu", [0.0, 0.9])
@pytest.mark.parametrize("eta", [1e-3, 0.5])
@pytest.mark.parametrize("seed", [0, 1])
def test_lars_matches_reference(wd: float, mu: float, eta: float, seed: int) -> None:
    """Two trusted tensors and two excluded 1-d ones (given a weight decay that lars_exclude must ignore), 5 steps,
    one gradient missing at step 2."""
    rng = random.Random(seed)
    shapes, excluded, lr = [(3, 2), (2, 2, 2), (3,), (1,)], [False, False, True, True], 0.7
    init = [[rng.gauss(0, 1) for _ in range(math.prod(s))] for s in shapes]
    grads = [[None if (step == 2 and i == 1) else [rng.gauss(0, 1) for _ in range(math.prod(s))]
              for i, s in enumerate(shapes)] for step in range(5)]
    ps = [torch.tensor(v, dtype=torch.float64).reshape(s).requires_grad_() for v, s in zip(init, shapes, strict=True)]
    opt = LARS([{"params": ps[:2], "weight_decay": wd}, {"params": ps[2:], "weight_decay": 0.3, "lars_exclude": True}],
               lr=lr, momentum=mu, trust_coefficient=eta)
    for step_grads in grads:
        for p, g, s in zip(ps, step_grads, shapes, strict=True):
            p.grad = None if g is None else torch.tensor(g, dtype=torch.float64).reshape(s)
        opt.step()
    expected = _lars_reference(init, grads, excluded, lr, mu, wd, eta)
    for p, e in zip(ps, expected, strict=True):
        torch.testing.assert_close(p.detach().flatten(), torch.tensor(e, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_lars_zero_grad_and_zero_param() -> None:
    # zero gradient, no weight decay: ||g|| = 0 -> trust 1, v = 0 -> the parameter does not move (no nan)
    a = torch.tensor([[1.0, -2.0]], requires_grad=True)
    # zero parameter: ||p|| = 0 -> trust 1 -> plain momentum-SGD step p = -lr * g
    b = torch.zeros(2, 2, requires_grad=True)
    # no gradient at all: untouched, no state
    c = torch.ones(2, 2, requires_grad=True)
    opt = LARS([a, b, c], lr=0.5, momentum=0.9, trust_coefficient=1e-3)
    a.grad = torch.zeros_like(a)
    b.grad = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    opt.step()
    torch.testing.assert_close(a.detach(), torch.tensor([[1.0, -2.0]]))
    torch.testing.assert_close(b.detach(), -0.5 * b.grad)
    torch.testing.assert_close(c.detach(), torch.ones(2, 2))
    assert c not in opt.state
    # the zero-gradient step still decays the momentum of a parameter that moved before
    a.grad = torch.tensor([[1.0, 0.0]])
    opt.step()
    moved = a.detach().clone()
    a.grad = torch.zeros_like(a)
    opt.step()
    v = opt.state[a]["momentum_buffer"]
    assert torch.isfinite(a).all() and torch.isfinite(v).all()
    torch.testing.assert_close(a.detach(), moved - v)
    # with weight decay, g = 0 + wd p: trust = eta ||p|| / (wd ||p||) = eta / wd; v = lr (eta / wd) wd p = lr eta p
    p = torch.tensor([[2.0, -1.0, 0.5]], dtype=torch.float64, requires_grad=True)
    opt = LARS([p], lr=0.3, momentum=0.9, weight_decay=0.01, trust_coefficient=1e-2)
    p.grad = torch.zeros_like(p)
    opt.step()
    torch.testing.assert_close(p.detach(), torch.tensor([[2.0, -1.0, 0.5]], dtype=torch.float64) * (1 - 0.3 * 1e-2))


def test_lars_rejects_bad_hyperparameters_and_returns_the_closures_loss() -> None:
    for kwargs in ({"lr": -1.0}, {"lr": 0.1, "momentum": -0.1}, {"lr": 0.1, "weight_decay": -1.0},
                   {"lr": 0.1, "trust_coefficient": 0.0}):
        with pytest.raises(ValueError):
            LARS([torch.zeros(2, 2, requires_grad=True)], **kwargs)
    w = torch.ones(2, 2, requires_grad=True)
    opt = LARS([w], lr=0.1)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (w**2).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == pytest.approx(4.0)
    assert (w.detach() < 1.0).all()


# ---------------------------------------------------------------------------------------------- build_optimizer
def _small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


@pytest.mark.parametrize("name", ["sgd", "Lars", "adam"])
def test_build_optimizer_groups(name: str) -> None:
    """Momentum optimisers: weights (ndim >= 2) decay, biases and norms (ndim <= 1) do not and LARS excludes them;
    Adam: one group with the weight decay."""
    model = _small_model()
    opt = build_optimizer(name, model, lr=0.2, weight_decay=1e-4, momentum=0.8)
    assert isinstance(opt, {"sgd": torch.optim.SGD, "lars": LARS, "adam": torch.optim.Adam}[name.lower()])
    if name == "adam":
        assert len(opt.param_groups) == 1 and opt.param_groups[0]["weight_decay"] == 1e-4
        assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
        return
    decay, no_decay = opt.param_groups
    assert [id(p) for p in decay["params"]] == [id(model[0].weight), id(model[3].weight)]
    assert [id(p) for p in no_decay["params"]] == [id(p) for p in (model[0].bias, *model[1].parameters(),
                                                                    model[3].bias)]
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (1e-4, 0.0)
    assert all(g["lr"] == 0.2 and g["momentum"] == 0.8 for g in opt.param_groups)
    if name == "Lars":
        assert (decay["lars_exclude"], no_decay["lars_exclude"], decay["trust_coefficient"]) == (False, True, 1e-3)
    else:
        assert all(g["nesterov"] is False for g in opt.param_groups)


def test_build_optimizer_params_iterable_unknown_name_and_empty() -> None:
    w = nn.Parameter(torch.ones(3, 3))
    frozen = nn.Parameter(torch.ones(3), requires_grad=False)
    opt = build_optimizer("sgd", iter([w, frozen]), lr=0.1, weight_decay=0.1)  # frozen skipped
    assert len(opt.param_groups) == 1  # the empty no-decay group is dropped
    assert opt.param_groups[0]["params"] == [w] and opt.param_groups[0]["weight_decay"] == 0.1
    with pytest.raises(ValueError) as err:
        build_optimizer("adagrad", _small_model(), lr=0.1)
    for name in OPTIMIZERS:
        assert name in str(err.value)
    with pytest.raises(ValueError):
        build_optimizer("sgd", [frozen], lr=0.1)


@pytest.mark.parametrize(("name", "lr", "steps"), [("adam", 0.05, 80), ("sgd", 0.02, 80), ("lars", 3.0, 80)])
def test_build_optimizer_reduces_convex_quadratic(name: str, lr: float, steps: int) -> None:
    # f(W, b) = mean ||x W^T + b - y||^2 for a linear target: convex, minimum 0 at (W*, b*)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 5, generator=g, dtype=torch.float64)
    w_star = torch.randn(3, 5, generator=g, dtype=torch.float64)
    b_star = torch.randn(3, generator=g, dtype=torch.float64)
    y = x @ w_star.T + b_star
    lin = nn.Linear(5, 3).double()
    with torch.no_grad():
        lin.weight.copy_(torch.randn(3, 5, generator=g, dtype=torch.float64))
        lin.bias.zero_()
    opt = build_optimizer(name, lin, lr=lr, weight_decay=0.0, momentum=0.9)

    def loss_fn() -> torch.Tensor:
        return ((lin(x) - y) ** 2).mean()

    initial = loss_fn().item()
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        opt.step()
    final = loss_fn().item()
    assert math.isfinite(final)
    assert final < 0.01 * initial, (name, initial, final)


# ------------------------------------------------------------------------------------------------ warmup_cosine
def _expected_factor(s: int, total: int, warmup: int, m: float) -> float:
    """The schedule written directly from its definition."""
    if s < warmup:
        return (s + 1) / warmup
    if s >= total:
        return m
    n_cos = total - warmup  # steps warmup .. total-1
    if n_cos == 1:
        return 1.0
    t = (s - warmup) / (n_cos - 1)
    return m + (1 - m) * (1 + math.cos(math.pi * t)) / 2


def _run_lrs(opt: torch.optim.Optimizer, sched, n: int) -> list[list[float]]:
    """lrs of every group used at each of n optimiser steps."""
    lrs = []
    for _ in range(n):
        lrs.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    return lrs


def _opt(lrs: tuple[float, ...] = (0.4,)) -> torch.optim.Optimizer:
    return torch.optim.SGD([{"params": [nn.Parameter(torch.zeros(1))], "lr": lr} for lr in lrs], lr=lrs[0])


CASES = [(10, 0), (10, 3), (4, 3), (1, 0), (2, 1), (2, 0), (3, 0), (7, 7), (50, 5), (25, 24)]


@pytest.mark.parametrize(("total", "warmup"), CASES)
@pytest.mark.parametrize("m", [0.0, 0.2])
def test_warmup_cosine_matches_closed_form(total: int, warmup: int, m: float) -> None:
    base = (0.4, 0.01)
    opt = _opt(base)
    sched = warmup_cosine(opt, total_steps=total, warmup_steps=warmup, min_lr_ratio=m)
    all_lrs = _run_lrs(opt, sched, total + 3)  # run past the end too
    for s, step_lrs in enumerate(all_lrs):
        for lr, b in zip(step_lrs, base, strict=True):
            assert lr == pytest.approx(b * _expected_factor(s, total, warmup, m), rel=1e-12, abs=1e-15), (s, lr)
    assert all_lrs[0][0] > 0 and all_lrs[max(warmup, 1) - 1][0] == pytest.approx(base[0])  # then the peak


@pytest.mark.parametrize(("total", "warmup", "stop"), [(20, 5, 3), (20, 5, 5), (20, 5, 12), (9, 0, 4), (6, 5, 6)])
def test_warmup_cosine_state_dict_round_trip(total: int, warmup: int, stop: int) -> None:
    base = (0.3, 0.05)
    ref_opt = _opt(base)
    ref_sched = warmup_cosine(ref_opt, total_steps=total, warmup_steps=warmup, min_lr_ratio=0.05)
    reference = _run_lrs(ref_opt, ref_sched, total)

    opt = _opt(base)
    sched = warmup_cosine(opt, total_steps=total, warmup_steps=warmup, min_lr_ratio=0.05)
    first = _run_lrs(opt, sched, stop)
    buf = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)

    # a fresh process: new optimiser and scheduler (built with the same arguments), then load
    opt2 = _opt(base)
    sched2 = warmup_cosine(opt2, total_steps=total, warmup_steps=warmup, min_lr_ratio=0.05)
    opt2.load_state_dict(ckpt["opt"])
    sched2.load_state_dict(ckpt["sched"])
    rest = _run_lrs(opt2, sched2, total - stop)
    assert first + rest == reference  # same arithmetic, so bit-identical
    assert sched2.last_epoch == ref_sched.last_epoch == total
    assert ckpt["sched"]["lr_lambdas"][0] == {"total_steps": total, "warmup_steps": warmup, "min_lr_ratio": 0.05}


@pytest.mark.parametrize(("total", "warmup", "m"), [(0, 0, 0.0), (5, 6, 0.0), (5, -1, 0.0), (5, 1, -0.1), (5, 1, 1.5)])
def test_warmup_cosine_rejects_bad_arguments(total: int, warmup: int, m: float) -> None:
    with pytest.raises(ValueError):
        warmup_cosine(_opt(), total_steps=total, warmup_steps=warmup, min_lr_ratio=m)


@pytest.mark.parametrize("name", ["adam", "sgd", "lars"])
def test_head_lr_scale_gives_the_head_its_own_groups(name: str) -> None:
    model = TransFusion(torch.nn.Linear(4, 8), 8, TransFusionHead(8, 2))
    head = {id(p) for p in model.head.parameters()}
    opt = build_optimizer(name, model, lr=0.1, head_lr_scale=5.0)
    seen = 0
    for g in opt.param_groups:
        kinds = {id(p) in head for p in g["params"]}
        assert len(kinds) == 1  # a group is all head or all backbone
        assert g["lr"] == pytest.approx(0.5 if kinds.pop() else 0.1)
        seen += len(g["params"])
    assert seen == len(list(model.parameters()))
    plain = build_optimizer(name, model, lr=0.1)
    assert all(g["lr"] == 0.1 for g in plain.param_groups)
