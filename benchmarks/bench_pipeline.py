"""What the pipeline costs on real data: ``transfusion pretrain``'s training against a plain PyTorch loop.

Both train the same model, loss, augmentation, global batch and number of steps on the same Fashion-MNIST subset,
in one run of this script, with the same torch threads:

- **plain loop**: one process, no Ray, no MLflow, no kNN, no health, no checkpoint: the model of
  ``pipeline.core.model.build_model`` in ``train.memory_format``'s layout, Adam, ``BatchAugment``'s two views, the
  loss of ``make_loss``, and nothing else;
- **pipeline**: the pretrain stage's :func:`pipeline.runs.train.pretrain` as the stage calls it, MLflow tracking on
  (a sqlite store in a temporary folder, its calls in a tracking process as the command makes them,
  ``pipeline.runs.tracking_process``): its one worker in this process (``pipeline.runs.train.in_process``; on Ray
  Train with ``-S ray.num_workers=2`` or ``-S ray.max_failures=1``), the per-epoch online kNN, fusion health, report
  and checkpoint, the MLflow epoch logging; ``--no-ray`` runs the pipeline's ``PretrainLoop`` alone instead (what the
  loop's per-epoch work costs, without the job around it).

It prints samples/s of both, ``pipeline / plain loop: R`` (wall time over the same steps), and where the pipeline's
extra time goes: MLflow (and Ray) before the run, the run's start (Ray Train's, on Ray), the steps, the work between
epochs (kNN, health, report, checkpoint), the last epoch's work (and Ray Train's stop). This machine's speed
drifts by a few per cent over minutes, as much as the overhead itself: the plain loop runs before the pipeline and
again after it, and the pipeline is compared with their mean (a drift that is linear in time cancels out); it also
prints the pipeline's wall time over its own training steps.

    python benchmarks/bench_pipeline.py                        # 10,000 images, 6 epochs, 2 threads (about 11 minutes)
    python benchmarks/bench_pipeline.py --no-ray --device cuda # on a GPU machine (60,000 images: --limit-train 0)
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from pipeline.config.params import Params, load_params
from pipeline.core.losses import make_loss
from pipeline.core.model import build_model, memory_format
from pipeline.core.optim import build_optimizer
from pipeline.data.augment import BatchAugment
from pipeline.data.prepared import load_prepared, save_prepared
from pipeline.data.sources import load_dataset
from pipeline.data.split import to_float
from pipeline.data.types import Dataset
from pipeline.training.precision import for_device

ROOT = Path(__file__).resolve().parents[1]


def plain_step(model, opt, loss_fn, views: torch.Tensor, ids: torch.Tensor, autocast: torch.dtype | None) -> None:
    """One step of the plain loop: the model on the two views (2b, ...) under ``autocast``, the loss in fp32 on the
    head's output, backward, Adam."""
    with torch.autocast(views.device.type, dtype=autocast, enabled=autocast is not None):
        out = model(views, views=2)
    loss = loss_fn(out.q.float(), out.k.float(), ids, layout="two_view")
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def plain_loop(params: Params, data: Dataset, device: torch.device) -> float:
    """The steps of ``train.epochs`` epochs in a bare loop; returns the wall seconds (the data on the device)."""
    t = params.train
    torch.manual_seed(t.seed)
    fmt = memory_format(t.memory_format, data.input_shape)  # train.memory_format, as the pipeline's loop
    model = build_model(params.model, data.input_shape).to(device, memory_format=fmt)
    opt = build_optimizer(t.optimizer, model, lr=t.lr, weight_decay=t.weight_decay, head_lr_scale=t.head_lr_scale)
    loss_fn = make_loss(params.loss.name, temperature=params.loss.temperature, barlow_lambda=params.loss.barlow_lambda,
                        power=params.loss.power)
    augment = BatchAugment(params.augment.preset, params.augment.strength)
    autocast = for_device(t.precision, device).autocast
    x_all, b = data.train.x.to(device), t.batch_size  # (N, ...) stored dtype
    ids = torch.arange(b, device=device).repeat(2)  # (2b,) positive = the other view
    gen = torch.Generator(device).manual_seed(t.seed)
    steps = len(data.train.y) // b
    start = time.perf_counter()
    for _ in range(t.epochs):
        perm = torch.randperm(len(x_all), device=device)
        for s in range(steps):
            x = to_float(x_all[perm[s * b:(s + 1) * b]])  # (b, ...)
            with torch.no_grad():
                views = torch.cat([augment(x, gen), augment(x, gen)]).contiguous(memory_format=fmt)  # (2b, ...)
            plain_step(model, opt, loss_fn, views, ids, autocast)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def breakdown(history: list[dict], fit_started: float, fit_seconds: float, called: float) -> dict[str, float]:
    """Where the pipeline's seconds went, from the epochs' ``seconds`` and ``ended_at`` (wall clock)."""
    steps = sum(h["seconds"] for h in history)
    first, last = history[0], history[-1]
    between = (last["ended_at"] - first["ended_at"]) - sum(h["seconds"] for h in history[1:])
    return {"before the run (MLflow; Ray on Ray Train)": fit_started - called,
            "the run's start (data, model; Ray Train's)": first["ended_at"] - first["seconds"] - fit_started,
            "training steps": steps,
            "between epochs (kNN, health, report, checkpoint)": between,
            "last epoch's kNN/health/checkpoint (+ Ray Train's stop)": fit_started + fit_seconds - last["ended_at"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default="/usr/share/datasets/fashion-mnist", help="Fashion-MNIST's IDX files")
    ap.add_argument("--limit-train", type=int, default=10_000, help="0: all 60,000")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2, help="torch threads = ray.cpus_per_worker")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--no-ray", action="store_true", help="the pipeline's PretrainLoop in this process")
    ap.add_argument("-S", dest="overrides", action="append", default=[], help="more params overrides")
    args = ap.parse_args()
    limit = args.limit_train or "null"
    params = load_params(ROOT / "params.yaml", [
        "data.dataset=fashion_mnist", f"data.root={args.root}", f"data.limit_train={limit}", "data.limit_test=2000",
        "train.batch_size=256", f"train.epochs={args.epochs}", f"train.device={args.device}",
        f"ray.cpus_per_worker={float(args.threads)}", f"ray.use_gpu={str(args.device == 'cuda').lower()}",
        *args.overrides])
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        save_prepared(load_dataset(params.data), tmp / "data/prepared")
        data = load_prepared(tmp / "data/prepared")
        n, b = len(data.train.y), params.train.batch_size
        samples = args.epochs * (n // b) * b
        before = plain_loop(params, data, device)
        called = time.time()
        if args.no_ray:
            from pipeline.training.loop import PretrainLoop

            loop = PretrainLoop(params, data, device)
            fit_started = time.time()
            loop.fit(lambda m, ckpt: None)
            history, fit_seconds = loop.history, time.time() - fit_started
        else:
            from pipeline.runs.job import cleanup
            from pipeline.runs.tracking_process import start
            from pipeline.runs.train import pretrain

            start()  # its MLflow calls in a process of their own, as `transfusion pretrain` makes them
            os.chdir(tmp)  # MLflow's sqlite store, Ray's storage and the stage's state folder live here
            params = params.model_copy(update={"ray": params.ray.model_copy(update={"storage_path": str(tmp / "r")})})
            res = pretrain(params, tmp / "data/prepared", tmp, tracking=True)
            history, fit_started, fit_seconds = res.state.history, res.fit_started, res.fit_seconds
            cleanup(params, tmp, res.job.name)
            os.chdir(ROOT)
        total = time.time() - called
        after = plain_loop(params, data, device)  # before and after: the machine's drift in between cancels out
    plain = (before + after) / 2
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {args.threads} thread(s)"
    print(f"{name}: Fashion-MNIST {n:,} images, {params.model.backbone}, depth {params.model.depth}, "
          f"{params.loss.name}, batch {b}, {args.epochs} epochs ({samples:,} samples), online kNN every "
          f"{params.train.knn_every} epoch(s), checkpoint every {params.train.checkpoint_every}")
    print(f"  plain loop: {plain:7.1f} s, {samples / plain:8,.0f} samples/s (the mean of {before:.1f} s before the "
          f"pipeline and {after:.1f} s after it)")
    which = "PretrainLoop alone" if args.no_ray else f"pipeline ({'Ray Train' if res.in_ray else 'in process'}, MLflow)"
    print(f"  {which}: {total:7.1f} s, {samples / total:8,.0f} samples/s")
    parts = breakdown(history, fit_started, fit_seconds, called)
    for part, seconds in parts.items():
        print(f"    {part}: {seconds:.1f} s")
    print(f"pipeline / plain loop: {total / plain:.3f}")
    # the machine's speed drifts between the two runs by as much as the overhead: the pipeline against its own steps
    print(f"pipeline / its own training steps: {total / parts['training steps']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
