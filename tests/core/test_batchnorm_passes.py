"""Global BatchNorm's fused (CUDA) path, run on CPU: passes over the activations, and equality with the exact path.

torch 2.14.1 has no CPU and no Meta kernel for the five fused ops the CUDA path calls (checked below), so these tests
register *reference* CPU kernels for them (``torch.library``, removed after each test), written from the CUDA kernels'
semantics with their dtype checks (``Expected ... to have type``): a dtype the GPU would refuse fails here too. Then
the very code of ``FusedGlobalBatchNormFn`` runs on CPU under gloo. The reference kernels are checked against torch's
own SyncBatchNorm autograd Function (which calls the same five ops) and ``F.batch_norm`` on the concatenated batch.

A "pass" (``ActivationPasses``): during the layer's forward (``module(x)``), resp. backward (``torch.autograd.grad``),
a TorchDispatchMode sees every aten op below autograd; view ops (``is_view``) move no data and are skipped. An op is a
*kernel pass* if any of its input or output tensors has the activation's numel; its *traversals* are the distinct such
tensors it reads plus those it writes (an fp32 copy of a bf16 activation is one traversal and twice the bytes, which
``bytes`` counts in activation sizes). A fused reference kernel is one op to the mode (its body runs with the mode
popped), as the CUDA kernel is one launch. ``input`` of ``batch_norm_gather_stats_with_counts`` is not counted as a
read: that kernel uses it for dtype, device and index width only (it reduces the gathered (W, C) statistics, never x).
"""

from __future__ import annotations

import contextlib
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import pipeline.core.batchnorm as bn
from pipeline.core.batchnorm import FusedGlobalBatchNormFn, GlobalBatchNorm
from tests import gloo

HALF = (torch.float16, torch.bfloat16)
FUSED_OPS = ("batch_norm_stats", "batch_norm_gather_stats_with_counts", "batch_norm_elemt",
             "batch_norm_backward_reduce", "batch_norm_backward_elemt")


# ------------------------------------------------------------------------ reference CPU kernels for the fused ops
def acc_type(dtype: torch.dtype) -> torch.dtype:
    """at::acc_type<T, /*is_cuda=*/true>: float for half types and float, double for double."""
    return torch.float32 if dtype in HALF else dtype


def expect(t: torch.Tensor | None, dtype: torch.dtype, what: str) -> None:
    """The CUDA kernels' accessor check."""
    if t is not None and t.dtype != dtype:
        raise RuntimeError(f"Expected {what} to have type {dtype} but got {t.dtype}")


def stat_scalar(x: torch.Tensor, *params: torch.Tensor | None) -> torch.dtype:
    """The kernels' stat_scalar_t: the accumulation type if the (first defined) parameter's dtype differs."""
    first = next((p.dtype for p in params if p is not None), None)
    return acc_type(x.dtype) if first is not None and first != x.dtype else x.dtype


def per_channel(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return t.view([1, -1] + [1] * (x.dim() - 2))


def reduce_dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def ref_stats(x, eps):
    """(mean, invstd) of this rank per channel, biased variance, in the accumulation type."""
    var, mean = torch.var_mean(x.to(acc_type(x.dtype)), reduce_dims(x), correction=0)
    return mean, 1 / torch.sqrt(var + eps)


def ref_gather_stats_with_counts(x, mean, invstd, running_mean, running_var, momentum, eps, counts):
    """Chan's merge over the ranks in order, from (mean, invstd, count) each; running stats updated in place."""
    scalar = running_mean.dtype if running_mean is not None else x.dtype
    acc = acc_type(scalar)
    for t, what, dtype in ((mean, "mean", acc), (invstd, "invstd", acc), (running_mean, "running_mean", scalar),
                           (running_var, "running_var", scalar), (counts, "counts", scalar)):
        expect(t, dtype, what)
    avg = torch.zeros(mean.shape[1], dtype=acc)
    m2 = torch.zeros_like(avg)
    n = 0.0
    for j in range(mean.shape[0]):
        cnt = float(counts[j])
        m, m2_j = mean[j], ((1 / invstd[j]).square() - eps) * cnt  # this rank's centred M2 from its invstd
        f = 1.0 / (n + cnt)
        m2 = m2 + m2_j + (avg - m).square() * (n * cnt * f)
        avg = avg * (n * f) + m * (cnt * f)
        n += cnt
    if running_mean is not None:
        running_mean.copy_((1 - momentum) * running_mean.to(acc) + momentum * avg)
        running_var.copy_((1 - momentum) * running_var.to(acc) + momentum * m2 / (n - 1))
    return avg, 1 / torch.sqrt(m2 / n + eps)


def ref_elemt(x, weight, bias, mean, invstd, eps):
    stat = stat_scalar(x, weight, bias)
    acc = acc_type(stat)
    for t, what, dtype in ((weight, "weight", stat), (bias, "bias", stat), (mean, "mean", acc),
                           (invstd, "invstd", acc)):
        expect(t, dtype, what)
    y = (x.to(acc) - per_channel(mean, x)) * per_channel(invstd, x)
    if weight is not None:
        y = y * per_channel(weight.to(acc), x)
    if bias is not None:
        y = y + per_channel(bias.to(acc), x)
    return y.to(x.dtype)


def ref_backward_reduce(g, x, mean, invstd, weight, input_g, weight_g, bias_g):
    """(Σg, Σg(x − μ), ι Σg(x − μ), Σg) of this rank, each only if asked for."""
    expect(g, x.dtype, "grad_output")
    stat = stat_scalar(x, weight)
    acc = acc_type(stat)
    for t, what, dtype in ((weight, "weight", stat), (mean, "mean", acc), (invstd, "invstd", acc)):
        expect(t, dtype, what)
    if (weight_g or bias_g) and weight is None:
        raise RuntimeError("grad_weight / grad_bias asked for without a weight")
    ga = g.to(acc)
    sum_dy = ga.sum(reduce_dims(x))
    sum_dy_xmu = (ga * (x.to(acc) - per_channel(mean, x))).sum(reduce_dims(x))
    return (sum_dy if input_g else None, sum_dy_xmu if input_g else None,
            (sum_dy_xmu * invstd).to(weight.dtype) if weight_g else None,
            sum_dy.to(weight.dtype) if bias_g else None)


def ref_backward_elemt(g, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
    """γι (g − Σg/N − (x − μ) ι² Σg(x − μ)/N), N = Σ count (int32, one entry per rank)."""
    expect(x, g.dtype, "input")
    expect(count, torch.int32, "count")
    stat = acc_type(g.dtype) if g.dtype in HALF and mean.dtype == torch.float32 else g.dtype
    acc = acc_type(stat)
    for t, what, dtype in ((weight, "weight", stat), (mean, "mean", acc), (invstd, "invstd", acc),
                           (sum_dy, "sum_dy", acc), (sum_dy_xmu, "sum_dy_xmu", acc)):
        expect(t, dtype, what)
    n = int(count.sum())
    scale = invstd if weight is None else invstd * weight.to(acc)
    dx = (g.to(acc) - per_channel(sum_dy / n, x)
          - (x.to(acc) - per_channel(mean, x)) * per_channel(invstd.square() * sum_dy_xmu / n, x))
    return (dx * per_channel(scale, x)).to(g.dtype)


REFERENCE_KERNELS = dict(zip(FUSED_OPS, (ref_stats, ref_gather_stats_with_counts, ref_elemt, ref_backward_reduce,
                                         ref_backward_elemt), strict=True))


@contextlib.contextmanager
def cpu_fused_kernels():
    """The five fused ops get the reference CPU kernels while inside; torch's registrations are restored after."""
    lib = torch.library.Library("aten", "IMPL")
    try:
        for name, fn in REFERENCE_KERNELS.items():
            lib.impl(name, fn, "CPU")
        yield
    finally:
        lib._destroy()  # noqa: SLF001 (torch.library offers no public way to drop a registration)


@contextlib.contextmanager
def on_path(monkeypatch, path: str):
    """``path`` "fused": the fused path, on the reference CPU kernels; "exact": today's CPU path, unchanged."""
    if path == "fused":
        monkeypatch.setattr(bn, "use_fused_kernels", lambda x: True)
    with cpu_fused_kernels() if path == "fused" else contextlib.nullcontext():
        yield


@pytest.fixture
def fused_on_cpu(monkeypatch):
    with on_path(monkeypatch, "fused"):
        yield


# --------------------------------------------------------------------------------------------- the torch facts
def test_torch_has_no_cpu_or_meta_kernel_for_the_fused_ops():
    """Why the CPU path is the exact one (and the tests bring reference kernels): if this fails, torch grew them."""
    assert not bn.use_fused_kernels(torch.zeros(2, 3))
    for device in ("cpu", "meta"):
        x = torch.randn(4, 3, 2, device=device)
        with pytest.raises(NotImplementedError):
            torch.batch_norm_stats(x, 1e-5)
        c = torch.ones(3, device=device)
        with pytest.raises(NotImplementedError):
            torch.batch_norm_elemt(x, c, c, c, c, 1e-5)
        with pytest.raises(NotImplementedError):
            torch.batch_norm_backward_reduce(x, x, c, c, c, True, True, True)
    with cpu_fused_kernels():
        assert torch.batch_norm_stats(torch.randn(4, 3), 1e-5)[0].shape == (3,)
    with pytest.raises(NotImplementedError):  # removed again
        torch.batch_norm_stats(torch.randn(4, 3), 1e-5)


# ----------------------------------------------------------------------------------------------- pass counting
METADATA_ONLY = {"aten.batch_norm_gather_stats_with_counts.default": {0}}  # op -> positions not read


class ActivationPasses(TorchDispatchMode):
    """Records every non-view aten op that reads or writes a tensor of ``numel`` elements (see the docstring)."""

    def __init__(self, numel: int, nbytes: int) -> None:
        super().__init__()
        self.numel, self.nbytes, self.ops = numel, nbytes, []

    def _big(self, tree) -> list[torch.Tensor]:
        seen, big = set(), []
        for t in tree_leaves(tree):
            if isinstance(t, torch.Tensor) and t.numel() == self.numel and id(t) not in seen:
                seen.add(id(t))
                big.append(t)
        return big

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            skip = METADATA_ONLY.get(str(func), set())
            reads = self._big(([a for i, a in enumerate(args) if i not in skip], kwargs))
            writes = self._big(out)
            if reads or writes:
                self.ops.append((str(func), [t.dtype for t in reads], [t.dtype for t in writes],
                                 sum(t.nbytes for t in reads + writes) / self.nbytes))
        return out

    def summary(self) -> tuple[int, int, float]:
        """(kernel passes, traversals, bytes moved in units of the activation's bytes)."""
        return len(self.ops), sum(len(r) + len(w) for _, r, w, _ in self.ops), sum(b for *_, b in self.ops)


def count_passes(module: torch.nn.Module, x: torch.Tensor) -> tuple[ActivationPasses, ActivationPasses]:
    x = x.requires_grad_()
    with ActivationPasses(x.numel(), x.nbytes) as fwd:
        y = module(x)
    g = torch.randn_like(y)
    with ActivationPasses(x.numel(), x.nbytes) as bwd:
        torch.autograd.grad(y, [x, *module.parameters()], g)
    return fwd, bwd


# (kernels, traversals, bytes / activation bytes) forward and backward; exact = today's CPU path, unchanged
EXPECTED_PASSES = {
    ("fused", torch.float32): ((2, 3, 3.0), (2, 5, 5.0)),
    ("fused", torch.float64): ((2, 3, 3.0), (2, 5, 5.0)),
    ("fused", torch.bfloat16): ((2, 3, 3.0), (2, 5, 5.0)),
    ("exact", torch.float32): ((4, 7, 7.0), (9, 18, 18.0)),
    ("exact", torch.float64): ((4, 7, 7.0), (9, 18, 18.0)),
    ("exact", torch.bfloat16): ((6, 11, 20.0), (12, 24, 45.0)),
}


@pytest.mark.parametrize("shape", [(16, 3), (4, 3, 5, 6)], ids=["1d", "2d"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("path", ["fused", "exact"])
def test_passes_over_the_activations(world_of_one, monkeypatch, path, dtype, shape):
    with on_path(monkeypatch, path):
        m = GlobalBatchNorm(3).train()
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(dtype)
        fwd, bwd = count_passes(m, x)
    ops = {"forward": fwd.ops, "backward": bwd.ops}
    assert (fwd.summary(), bwd.summary()) == EXPECTED_PASSES[path, dtype], ops
    if path == "fused":
        assert [op for op, *_ in fwd.ops] == ["aten.batch_norm_stats.default", "aten.batch_norm_elemt.default"]
        assert [op for op, *_ in bwd.ops] == ["aten.batch_norm_backward_reduce.default",
                                              "aten.batch_norm_backward_elemt.default"]
        # no activation-sized tensor in any other dtype: bf16 activations are never copied to fp32
        assert {d for _, r, w, _ in fwd.ops + bwd.ops for d in r + w} == {dtype}, ops
        fk, ft, _ = fwd.summary()
        bk, bt, _ = bwd.summary()
        assert fk <= 3 and bk <= 4  # the goal, in kernel passes
        assert ft == 3 and bt == 5  # read x; read x, write y | read g, x; read g, x, write dx (the floor, see module)


# ------------------------------------------------------------------------------- the fused path in one process
CONFIGS = {  # input dtype, parameter / buffer dtype, tolerance against fp64 F.batch_norm
    "fp64": (torch.float64, torch.float64, 1e-12),
    "fp32": (torch.float32, torch.float32, 1e-5),
    "bf16-fp32-params": (torch.bfloat16, torch.float32, 3e-2),
    "bf16-all": (torch.bfloat16, torch.bfloat16, 3e-2),
}


def assert_near(actual, expected, tol, msg=""):
    """Relative to the tensor's own scale (so near-zero entries of a large tensor are not over-demanded)."""
    actual, expected = actual.detach(), expected.detach().double()
    torch.testing.assert_close(actual.double(), expected, rtol=tol, atol=tol * float(expected.abs().max()), msg=msg)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("shape", [(9, 3), (3, 3, 4, 5)], ids=["1d", "2d"])
def test_fused_path_in_a_world_of_one_is_batch_norm(world_of_one, fused_on_cpu, config, momentum, shape):
    """Every dtype combination the kernels accept (their dtype checks are emulated), 3 steps of running stats."""
    xdt, pdt, tol = CONFIGS[config]
    g = torch.Generator().manual_seed(1)
    ours, ref = GlobalBatchNorm(3, momentum=momentum).to(pdt), torch.nn.BatchNorm1d(3, momentum=momentum).double()
    with torch.no_grad():
        for m in (ours, ref):
            m.weight.copy_(torch.rand(3, generator=torch.Generator().manual_seed(2)) + 0.5)
            m.bias.copy_(torch.randn(3, generator=torch.Generator().manual_seed(3)))
    for step in range(3):
        x = (torch.randn(*shape, generator=g, dtype=torch.float64) * 3 + 2).to(xdt)
        up = torch.randn(*shape, generator=g, dtype=torch.float64)
        xa, xb = x.clone().requires_grad_(), x.double().requires_grad_()
        ya = ours(xa)
        yb = F.batch_norm(xb, ref.running_mean, ref.running_var, ref.weight, ref.bias, True,
                          ref.momentum if momentum is not None else 1.0 / (step + 1), ref.eps)
        assert ya.dtype == xdt
        assert_near(ya, yb, tol, "y")
        (ya.double() * up).sum().backward(), (yb * up).sum().backward()
        assert xa.grad.dtype == xdt and ours.weight.grad.dtype == pdt
        assert_near(xa.grad, xb.grad, tol, "dx")
        for a, b in ((ours.weight, ref.weight), (ours.bias, ref.bias)):
            assert_near(a.grad, b.grad, tol, "dw/db")
            a.grad, b.grad = None, None
        assert ours.running_mean.dtype == pdt and int(ours.num_batches_tracked) == step + 1
        assert_near(ours.running_mean, ref.running_mean, tol, "running_mean")
        assert_near(ours.running_var, ref.running_var, tol, "running_var")


@pytest.mark.parametrize("shape", [(7, 3), (4, 3, 5, 5)])
def test_fused_function_gradcheck(world_of_one, fused_on_cpu, shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, dtype=torch.float64) * 3 + 2
    w = torch.rand(3, generator=g, dtype=torch.float64) + 0.5
    b = torch.randn(3, generator=g, dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda x_, w_, b_: FusedGlobalBatchNormFn.apply(x_, w_, b_, None, None, 0.0, 1e-5, None),
        (x.requires_grad_(), w.requires_grad_(), b.requires_grad_()))


def test_fused_path_without_affine_or_running_stats(world_of_one, fused_on_cpu):
    x = torch.randn(6, 4, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64) + 5
    for xdt in (torch.float64, torch.bfloat16):  # bf16 without buffers: accumulation-dtype stand-ins
        m = GlobalBatchNorm(4, affine=False, track_running_stats=False)
        xa = x.to(xdt).clone().requires_grad_()
        y = m(xa)
        ref = F.batch_norm(x, None, None, training=True)
        assert_near(y, ref, 1e-12 if xdt == torch.float64 else 3e-2)
        y.double().square().sum().backward()
        assert xa.grad.dtype == xdt and m.running_mean is None


@pytest.mark.parametrize("path", ["exact", "fused"])
def test_too_few_values_is_an_error_and_leaves_the_buffers(world_of_one, monkeypatch, path):
    m = GlobalBatchNorm(3).train()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with on_path(monkeypatch, path), pytest.raises(ValueError, match="more than 1 value per channel"):
        m(torch.randn(1, 3))
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())


# ------------------------------------------------------------------------------------ two gloo workers, all cases
ROWS = (5, 3)  # uneven shards: the count-weighted merge and N = Σ counts matter
STEPS = 3
CASES = [(dim, momentum, dtype) for dim in ("1d", "2d") for momentum in (0.1, None)
         for dtype in (torch.float64, torch.float32)] + [("2d", 0.1, torch.bfloat16)]
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 3e-2}


def case_id(case) -> str:
    dim, momentum, dtype = case
    return f"{dim}-m{momentum}-{str(dtype)[6:]}"


def case_data(case):
    """Per step: the global batch x (sum(ROWS), C, *) and the upstream gradient; weight and bias (C,)."""
    dim, _, _ = case
    shape = (sum(ROWS), 3) if dim == "1d" else (sum(ROWS), 3, 4, 5)
    g = torch.Generator().manual_seed(7)
    steps = [(torch.randn(*shape, generator=g, dtype=torch.float64) * 3 + 2,
              torch.randn(*shape, generator=g, dtype=torch.float64)) for _ in range(STEPS)]
    return steps, torch.rand(3, generator=g, dtype=torch.float64) + 0.5, torch.randn(3, generator=g,
                                                                                     dtype=torch.float64)


def run_case(case, path: str, rank: int):
    """This rank's (y, dx, dw, db) per step and its final buffers, on ``path`` (exact | fused | torch_sync)."""
    _, momentum, dtype = case
    steps, w, b = case_data(case)
    rows = slice(sum(ROWS[:rank]), sum(ROWS[: rank + 1]))
    m = GlobalBatchNorm(3, momentum=momentum).to(dtype).train()
    with torch.no_grad():
        m.weight.copy_(w), m.bias.copy_(b)
    out = []
    for x, up in steps:
        xr = x[rows].to(dtype).requires_grad_()
        if path == "torch_sync":  # torch's own SyncBatchNorm Function on the same kernels
            m.num_batches_tracked.add_(1)
            factor = 0.1 if momentum is not None else 1.0 / float(m.num_batches_tracked)
            sync_bn = torch.nn.modules._functions.SyncBatchNorm  # noqa: SLF001 (the Function nn.SyncBatchNorm runs)
            y = sync_bn.apply(xr, m.weight, m.bias, m.running_mean, m.running_var, m.eps, factor, dist.group.WORLD, 2)
        else:
            y = m(xr)
        dx, dw, db = torch.autograd.grad((y.double() * up[rows]).sum(), [xr, m.weight, m.bias])
        out.append((y.detach(), dx, dw, db))
    return out, (m.running_mean.clone(), m.running_var.clone(), int(m.num_batches_tracked))


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        results = {}
        for case in CASES:
            results[case_id(case), "exact"] = run_case(case, "exact", rank)
            bn.use_fused_kernels = lambda x: True  # this process only
            with cpu_fused_kernels():
                results[case_id(case), "fused"] = run_case(case, "fused", rank)
                results[case_id(case), "torch_sync"] = run_case(case, "torch_sync", rank)
            bn.use_fused_kernels = lambda x: x.is_cuda
        Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    """Both ranks' results of every case and path, from one spawn of 2 gloo workers."""
    d = tmp_path_factory.mktemp("bn2")
    gloo.spawn(_worker, (str(d / "init"), str(d)))
    return [pickle.loads((d / f"rank{r}.pkl").read_bytes()) for r in range(2)]


def one_process(case):
    """nn.BatchNorm in fp64 on the concatenated batch: per step (y, dx, dw, db), final buffers."""
    _, momentum, _ = case
    steps, w, b = case_data(case)
    m = torch.nn.BatchNorm1d(3, momentum=momentum).double().train()
    with torch.no_grad():
        m.weight.copy_(w), m.bias.copy_(b)
    out = []
    for x, up in steps:
        x = x.clone().requires_grad_()
        y = F.batch_norm(x, m.running_mean, m.running_var, m.weight, m.bias, True,
                         momentum if momentum is not None else 1.0 / (len(out) + 1), m.eps)
        out.append((y.detach(), *torch.autograd.grad((y * up).sum(), [x, m.weight, m.bias])))
    return out, (m.running_mean, m.running_var, STEPS)


QUICK = ("2d", 0.1, torch.float32)  # one case in the quick loop (the one spawn computes every case, ~5 s)


@pytest.mark.parametrize("case", [c if c == QUICK else pytest.param(c, marks=pytest.mark.slow) for c in CASES],
                         ids=case_id)
def test_two_gloo_workers_fused_equals_exact_and_one_process(two_workers, case):
    """fp64 ~1e-12, fp32 ~1e-5 (measured: 2e-15 and 4e-7 vs one fp64 process; fused vs exact 3e-16, 2e-7)."""
    tol = TOL[case[2]]
    ref_steps, ref_buffers = one_process(case)
    runs = {path: [two_workers[r][case_id(case), path] for r in range(2)] for path in ("exact", "fused", "torch_sync")}
    for path, ((steps0, buf0), (steps1, buf1)) in runs.items():
        for step, (ref, a, b) in enumerate(zip(ref_steps, steps0, steps1, strict=True)):
            msg = f"{path} step {step}"
            assert a[0].dtype == case[2] and a[1].dtype == case[2] and a[2].dtype == case[2]
            assert_near(torch.cat([a[0], b[0]]), ref[0], tol, f"{msg}: y")
            assert_near(torch.cat([a[1], b[1]]), ref[1], tol, f"{msg}: dx")
            assert_near(a[2].double() + b[2].double(), ref[2], tol, f"{msg}: dw (local shares sum to the total)")
            assert_near(a[3].double() + b[3].double(), ref[3], tol, f"{msg}: db")
        for name, x0, x1, r in zip(("running_mean", "running_var"), buf0, buf1, ref_buffers, strict=False):
            assert torch.equal(x0, x1), f"{path}: {name} differs between ranks"
            assert_near(x0, r, tol, f"{path}: {name}")
        assert buf0[2] == buf1[2] == STEPS
    for r in range(2):  # each rank's local dw / db shares (their sum is checked above): fused as exact
        for f, e in zip(runs["fused"][r][0], runs["exact"][r][0], strict=True):
            assert_near(f[2], e[2], tol, f"rank {r}: dw share")
            assert_near(f[3], e[3], tol, f"rank {r}: db share")


# --------------------------------------------------------------------------------------------- host syncs
@pytest.mark.parametrize("path", ["exact", "fused"])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_global_batchnorm_reads_nothing_on_the_host(world_of_one, monkeypatch, path, momentum):
    """Forward and backward of 3 training steps, the cumulative average (momentum None) included: 0 host syncs
    (``measure.OpCounter``; before, momentum None read ``float(num_batches_tracked)`` once per layer and step), and
    the running statistics still those of ``F.batch_norm`` with the factor 1/step."""
    from pipeline.training import measure

    g = torch.Generator().manual_seed(4)
    m = GlobalBatchNorm(3, momentum=momentum).double().train()
    rm, rv = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    with on_path(monkeypatch, path):
        for step in range(3):
            x = (torch.randn(6, 3, 4, generator=g, dtype=torch.float64) * 2 + 1).requires_grad_()
            assert measure.count(lambda x=x: m(x).square().sum().backward()).syncs == []
            F.batch_norm(x.detach(), rm, rv, None, None, True, 0.1 if momentum is not None else 1.0 / (step + 1))
    torch.testing.assert_close(m.running_mean, rm, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m.running_var, rv, rtol=1e-12, atol=1e-12)
    assert int(m.num_batches_tracked) == 3
