"""The CUDA paths the CPU suite cannot run, checked and timed on one GPU (exits 0 with a note where there is none).

Each line is a check (``ok`` / ``FAIL`` with the numbers behind it) or a ratio against a baseline measured in the
same run::

    fused global BN vs the exact path (fp64, CPU), fp32 / bf16 input: max |Δ| of y, dx, dγ, dβ, running stats
    head + jsd, bf16 autocast, n = 4096..65536 rows: time, peak, tiled / dense, the plan's estimate / measured peak
    head + jsd, fp32, tiled vs dense on the GPU: max relative |Δ| of the loss and the gradient
    pretraining on digits, 3 epochs: bf16 on the GPU vs fp32 on the CPU, same seed (loss per epoch), s / epoch
    kNN on the GPU equals the CPU (chunked, both temperatures)

The fused BN runs in a one-rank gloo group, calling the autograd functions themselves (a module with one rank takes
``nn.BatchNorm``); several ranks on one GPU are not possible with NCCL. Peak bytes are
``torch.cuda.max_memory_allocated`` above what was allocated before the step.

    python benchmarks/bench_cuda.py --out benchmarks/results/cuda.jsonl   # about 1 minute on one H200
    python benchmarks/bench_cuda.py --only dense_constants                 # some parts (fused_bn, head_at_scale, ...)
    python benchmarks/bench_cuda.py --cpu                                  # a smoke run of the script on the CPU
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch
import torch.distributed as dist

from pipeline.core.batchnorm import FusedGlobalBatchNormFn, GlobalBatchNormFn
from pipeline.core.losses import make_loss
from pipeline.core.model import Rows, TransFusionHead
from pipeline.core.plan import head_bytes
from pipeline.training.measure import best_time, peak_bytes

FAILED: list[str] = []
DEV = "cuda"  # --cpu: a smoke run of the script itself, at small sizes (no numbers worth reading)
SIZES = (4096, 16384, 65536)
RECORDS: list[dict] = []  # --out FILE: one JSON line per measured head step (benchmarks/results/cuda.jsonl)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def record(n: int, depth: int, width: int, dtype: torch.dtype, tile: int | None, seconds: float, peak: int) -> None:
    RECORDS.append({"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "torch": torch.__version__,
                    "n": n, "world": 1, "depth": depth, "width": width, "dtype": dtype_name(dtype),
                    "tile": tile, "seconds": round(seconds, 5), "peak_bytes": peak})


def check(name: str, ok: bool, detail: str) -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        FAILED.append(name)


def fused_bn() -> None:
    if DEV != "cuda":
        print("     fused global BN: skipped (torch's fused batch-norm kernels are CUDA's)")
        return
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/init", rank=0, world_size=1)
        try:
            for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 5e-2)):
                torch.manual_seed(0)
                x64 = torch.randn(64, 32, 8, 8, dtype=torch.float64) * 3 + 1  # (n, C, H, W)
                g64 = torch.randn_like(x64)
                w64, b64 = torch.rand(32, dtype=torch.float64) + 0.5, torch.randn(32, dtype=torch.float64)
                ref = [t.clone().requires_grad_() for t in (x64, w64, b64)]
                y_ref = GlobalBatchNormFn.apply(ref[0], ref[1], ref[2], 1e-5, None)[0]
                y_ref.backward(g64)
                x = x64.to(DEV, dtype).requires_grad_()
                w, b = (t.to(DEV, torch.float32).requires_grad_() for t in (w64, b64))
                rm, rv = torch.zeros(32, device=DEV), torch.ones(32, device=DEV)
                y = FusedGlobalBatchNormFn.apply(x, w, b, rm, rv, 0.1, 1e-5, None)
                y.backward(g64.to(DEV, dtype))
                mean, var = x64.mean((0, 2, 3)), x64.var((0, 2, 3), correction=1)
                errs = {
                    "y": (y.double().cpu() - y_ref).abs().max().item(),
                    "dx": (x.grad.double().cpu() - ref[0].grad).abs().max().item(),
                    "dgamma/n": ((w.grad.double().cpu() - ref[1].grad).abs().max() / x64[:, 0].numel()).item(),
                    "dbeta/n": ((b.grad.double().cpu() - ref[2].grad).abs().max() / x64[:, 0].numel()).item(),
                    "running_mean": (rm.double().cpu() - 0.1 * mean).abs().max().item(),
                    "running_var": (rv.double().cpu() - (0.9 + 0.1 * var)).abs().max().item(),
                }
                worst = max(errs.values())
                check(f"fused global BN, {dtype}", worst < tol,
                      ", ".join(f"{k} {v:.1e}" for k, v in errs.items()) + f" (tolerance {tol:g})")
        finally:
            dist.destroy_process_group()


def head_step(n: int, tile: int | None, depth: int, width: int, dtype: torch.dtype | None):
    """One worker's head + jsd on all n rows of a two-view batch (one GPU), forward and backward; the head under
    autocast to ``dtype`` (None or fp32: none)."""
    torch.manual_seed(0)
    head = TransFusionHead(width, depth, qk_init="identity").to(DEV)
    x = torch.randn(n, width, device=DEV, requires_grad=True)
    rows = Rows(torch.arange(n, device=DEV), n, lambda t: t)
    ids = torch.cat([torch.arange(n // 2, device=DEV)] * 2)
    loss_fn = make_loss("jsd")
    kw = {} if tile is None else {"tile": tile}
    halves = (slice(0, n // 2), slice(n // 2, n))

    def step() -> torch.Tensor:
        head.zero_grad(set_to_none=True)
        x.grad = None
        with torch.autocast(DEV, dtype=dtype or torch.bfloat16, enabled=dtype not in (None, torch.float32)):
            out = head.forward_rows(x, rows, views=2, tile=tile)
        q = out.q.float()
        loss = sum(loss_fn(q, q, ids, rows=s, layout="two_view", **kw) for s in halves)
        loss.backward()
        return loss.detach()

    return step, head, x


def timed(step) -> tuple[float, int]:
    """(seconds: :func:`best_time` of ``step``, synchronised; peak bytes above what was allocated before it) on the
    device; on the CPU (``--cpu``) the peak is :func:`peak_bytes` of one call."""
    if DEV != "cuda":
        return best_time(step, repeats=1), peak_bytes(step)

    def synced() -> None:
        step()
        torch.cuda.synchronize()

    synced()  # the allocator's caches warm, then the peak of the timed calls
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    seconds = best_time(synced)
    return seconds, torch.cuda.max_memory_allocated() - base


def head_at_scale() -> None:
    depth, width, tile = 3, 512, 2048
    free = torch.cuda.mem_get_info()[0] if DEV == "cuda" else 2**34
    for n in SIZES:
        est_tiled = head_bytes(n, 1, depth, width, tile, itemsize=2)
        est_dense = head_bytes(n, 1, depth, width, None, itemsize=2)
        t_tiled, p_tiled = timed(head_step(n, tile, depth, width, torch.bfloat16)[0])
        record(n, depth, width, torch.bfloat16, tile, t_tiled, p_tiled)
        line = (f"n={n}: tiled {t_tiled * 1e3:.1f} ms, peak {p_tiled / 2**30:.2f} GiB "
                f"(plan's estimate / measured {est_tiled / p_tiled:.2f})")
        if est_dense < 0.6 * free:
            t_dense, p_dense = timed(head_step(n, None, depth, width, torch.bfloat16)[0])
            record(n, depth, width, torch.bfloat16, None, t_dense, p_dense)
            line += (f"; dense {t_dense * 1e3:.1f} ms, peak {p_dense / 2**30:.2f} GiB (estimate / measured "
                     f"{est_dense / p_dense:.2f}); tiled / dense: time {t_tiled / t_dense:.2f}, peak "
                     f"{p_tiled / p_dense:.3f}")
            check(f"plan bounds the dense peak, n={n}", 1.0 <= est_dense / p_dense <= 1.5 or p_dense < 2**26,
                  f"estimate / measured {est_dense / p_dense:.2f} (goal 1..1.5)")
        else:
            line += f"; dense not run (estimate {est_dense / 2**30:.0f} GiB > 0.6 of {free / 2**30:.0f} GiB free)"
        print(f"     head + jsd, depth {depth}, width {width}, bf16, tile {tile}, " + line, flush=True)
        check(f"tiled peak within the plan, n={n}", p_tiled <= 1.5 * est_tiled,
              f"measured / estimate {p_tiled / est_tiled:.2f} (goal <= 1.5)")
        torch.cuda.empty_cache()
    # fp32 on the GPU: tiles change the order of sums only
    n = SIZES[0]
    res = {}
    for t in (None, 512):
        step, head, x = head_step(n, t, 2, 64, None)
        loss = step()
        res[t] = (loss.item(), x.grad.clone(), [p.grad.clone() for p in head.parameters()])
    dl = abs(res[None][0] - res[512][0]) / abs(res[None][0])
    dg = max((a - b).abs().max().item() / (a.abs().max().item() + 1e-30)
             for a, b in zip([res[None][1], *res[None][2]], [res[512][1], *res[512][2]], strict=True))
    check(f"fp32 tiled == dense on the GPU, n={n}", dl < 1e-5 and dg < 1e-4, f"loss {dl:.1e}, grads {dg:.1e}")


def dense_constants() -> None:
    """The dense path's (r, n) buffers on this GPU, against the plan's ``DENSE_BLOCK`` (``DENSE_BLOCK_HALF`` at 2
    bytes) and ``DENSE_LOSS``: the n² term of the peak at n and 2n (P(2n) − 2 P(n) = 2 a n²) for depth 1 and 3; a
    block's share (a₃ − a₁) / 2 in buffers of the compute dtype, the loss's a₁ − block in fp32 buffers."""
    from pipeline.core.plan import DENSE_BLOCK, DENSE_BLOCK_HALF, DENSE_LOSS

    n = SIZES[1] // 2
    for width in (64, 512):
        for dtype, itemsize in ((torch.float32, 4), (torch.bfloat16, 2)):
            a = {}
            for depth in (1, 3):
                (t1, p1), (t2, p2) = (timed(head_step(m, None, depth, width, dtype)[0]) for m in (n, 2 * n))
                record(n, depth, width, dtype, None, t1, p1)
                record(2 * n, depth, width, dtype, None, t2, p2)
                a[depth] = (p2 - 2 * p1) / (2 * n * n)  # bytes per (r, n) element
                torch.cuda.empty_cache()
            block, loss = (a[3] - a[1]) / 2 / itemsize, (a[1] - (a[3] - a[1]) / 2) / 4
            planned = DENSE_BLOCK if itemsize == 4 else DENSE_BLOCK_HALF
            print(f"     dense, width {width}, {dtype_name(dtype)}: a block keeps {block:.2f} (r, n) buffers of "
                  f"{itemsize} bytes (plan: {planned}), the loss {loss:.2f} of 4 bytes (plan: {DENSE_LOSS})")


def pretrain_bf16() -> None:
    from pipeline.config.data import DataConfig
    from pipeline.config.params import load_params
    from pipeline.data.sources import load_dataset
    from pipeline.training.loop import PretrainLoop

    data = load_dataset(DataConfig(dataset="digits", root="data/raw", seed=0))
    curves, secs = {}, {}
    for device, precision in (("cpu", "fp32"), (DEV, "auto")):
        params = load_params("params.yaml", ["train.epochs=3", "train.knn_every=0", f"train.precision={precision}",
                                             f"train.device={device}"])
        loop = PretrainLoop(params, data, torch.device(device))
        if device == "cuda" and DEV == "cuda":
            check("auto precision on this GPU is bf16", loop.precision.autocast == torch.bfloat16,
                  f"autocast {loop.precision.autocast}")
        lines: list[dict] = []
        t = time.perf_counter()
        loop.fit(lambda m, ckpt, lines=lines: lines.append(m.as_dict()))
        secs[device] = (time.perf_counter() - t) / 3
        curves[device] = [line["loss"] for line in lines]
    rel = max(abs(a - b) / abs(b) for a, b in zip(curves[DEV], curves["cpu"], strict=True))
    check("pretrain 3 epochs: bf16 GPU loss follows fp32 CPU", rel < 0.05,
          f"GPU {[round(v, 4) for v in curves[DEV]]} vs CPU {[round(v, 4) for v in curves['cpu']]}, "
          f"max relative {rel:.3f} (goal < 0.05); s / epoch: GPU {secs[DEV]:.2f}, CPU {secs['cpu']:.2f}")


def main() -> int:
    global DEV, SIZES
    parts = {p.__name__: p for p in (fused_bn, head_at_scale, dense_constants, pretrain_bf16)}
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="a smoke run of this script on the CPU, at small sizes")
    ap.add_argument("--only", choices=list(parts), nargs="+", help="these parts only (default: all)")
    ap.add_argument("--out", help="write one JSON line per measured head step here")
    args = ap.parse_args()
    if args.cpu:
        DEV, SIZES = "cpu", (1024, 2048)
    elif not torch.cuda.is_available():
        print("no CUDA device: nothing to check here (run this on a GPU machine)")
        return 0
    name = torch.cuda.get_device_name() if DEV == "cuda" else "CPU smoke run"
    print(f"{name}, torch {torch.__version__}", flush=True)
    for part in [parts[name] for name in args.only or parts]:
        try:
            part()
        except Exception as e:  # a part that breaks is a failed check, and the others still run
            check(part.__name__, False, f"{type(e).__name__}: {e}")
    if args.out and RECORDS:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in RECORDS)
    print(f"{len(FAILED)} failed: {', '.join(FAILED)}" if FAILED else "all CUDA checks passed")
    return 1 if FAILED else 0


if __name__ == "__main__":
    raise SystemExit(main())
