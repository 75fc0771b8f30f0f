"""Self-supervised quality on Fashion-MNIST: TransFusion against InfoNCE, Barlow Twins and DCL, with controls.

The methods are the rows of ``presets/fashion-mnist-ssl.yaml`` (``tables.rows``: TransFusion at depth 1 and 3,
InfoNCE, DCL, Barlow Twins, all self-supervised; SupCon as the label-using reference). Everything else is the
preset's and the same for every row: backbone, augmentation, global batch, epochs, optimiser, seeds. Per seed, two
controls stand in the same table:

- ``raw pixels``: the probes on the flattened images (the ``input`` layer);
- ``random init``: the same backbone at its initialisation with that seed, never trained.

Each row trains with the pipeline's own training loop (``pipeline.training.loop.PretrainLoop``: the loop the Ray
Train workers run, on one device, without Ray or MLflow, so this also runs on a GPU machine that has neither), with
the online kNN after every epoch (``train.knn_every: 1``: a fixed 5,000-image bank and 2,000 test queries). Then the
frozen backbone's embeddings are probed on the official 10,000 test images: kNN-200 and logistic regression
(``pipeline.evaluation.probes``), fitted on a stratified ``probe.max_train`` subset of the training embeddings, as
the evaluate stage does.

Outputs (``--out`` folder, default ``benchmarks/results/ssl/local``; a rerun skips the (method, seed) pairs
already there):

- ``ssl.csv``: one row per method and seed (controls included): kNN-200, logistic regression, seconds, samples/s;
- ``ssl_curves.csv``: one row per method, seed and epoch: the online kNN, the loss, wall-clock seconds since the
  row's training started (kNN and health included);
- ``ssl_knn.png``: the online kNN of every method against epochs and against wall-clock seconds (``dvc plots``).

    python benchmarks/study_ssl.py                               # the preset as shipped (a GPU: see docs/results.md)
    python benchmarks/study_ssl.py -S data.limit_train=10000 -S train.epochs=5   # sizes shrunk for 2 CPU cores
    python benchmarks/study_ssl.py --budget-s 2700 --seeds 0           # as many epochs as fit 45 minutes
    python benchmarks/study_ssl.py --plot                        # the table (Markdown) and figure of the CSVs
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from pathlib import Path

from pipeline.evaluation.ssl_report import CONTROLS, PROBES, read_rows, table

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "presets/fashion-mnist-ssl.yaml"
FIELDS = ("method", "table", "seed", "knn200", "logreg", "epochs", "batch_size", "n_train", "n_test", "device",
          "train_seconds", "samples_per_s", "final_loss", "final_online_knn")
CURVE_FIELDS = ("method", "seed", "epoch", "seconds", "online_knn", "loss", "samples_per_s")


def row_overrides(params: dict) -> list[str]:
    """A row's ``params`` dict -> ``-S``-style ``key=value`` overrides (values as JSON, which YAML reads)."""
    return [f"{k}={json.dumps(v)}" for k, v in params.items()]


def append_csv(path: Path, fields: tuple[str, ...], rows: list[dict]) -> None:
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        if new:
            w.writeheader()
        w.writerows(rows)


def probe(train_z, train_y, test_z, test_y, seed: int, max_train: int | None) -> dict[str, float | None]:
    """kNN-200 and logistic regression fitted on a stratified ``max_train`` subset, scored on every test image."""
    import numpy as np

    from pipeline.data.split import stratified_subset
    from pipeline.evaluation.probes import run_probes

    idx = np.arange(len(train_y))
    if max_train is not None and len(idx) > max_train:
        idx = stratified_subset(train_y, max_train, seed=seed)
    results = run_probes(train_z[idx], train_y[idx], test_z, test_y, probes=PROBES, fractions=(1.0,), seed=seed)
    return {r.probe: r.accuracy for r in results}


def fit_budget(args: argparse.Namespace, data, device) -> int:
    """The most epochs (at most the preset's) with which every row and seed fits ``args.budget_s`` seconds: one
    epoch of the deepest row (kNN and health included) and one probing are timed first, and count in the budget."""
    from pipeline.config.params import load_params
    from pipeline.training.loop import PretrainLoop

    start = time.time()
    base = load_params(args.params, args.set)
    row = max(base.tables.rows, key=lambda r: r.params.get("model.depth", base.model.depth))
    params = load_params(args.params, [*args.set, *row_overrides(row.params), "train.epochs=1", "train.knn_every=1"])
    loop = PretrainLoop(params, data, device)
    t = time.time()
    loop.fit(lambda m, ckpt: None)
    epoch_s, t = time.time() - t, time.time()
    probe(loop.embed(data.train.x).numpy(), data.train.y.numpy(), loop.embed(data.test.x).numpy(),
          data.test.y.numpy(), 0, base.probe.max_train)
    probe_s = time.time() - t
    runs = len(base.tables.rows) * len(args.seeds)
    left = args.budget_s - (time.time() - start) - (runs + len(CONTROLS) * len(args.seeds)) * probe_s
    epochs = max(1, min(base.train.epochs, int(left / (runs * epoch_s))))
    print(f"budget {args.budget_s:.0f} s: an epoch of {row.name} takes {epoch_s:.1f} s, a probing {probe_s:.1f} s; "
          f"{runs} runs of {epochs} epochs", file=sys.stderr, flush=True)
    return epochs


def run_seed(args: argparse.Namespace, seed: int, data, device, done: set[tuple[str, int]]) -> None:
    """Seed ``seed`` of every row and both controls on ``data``, those not in ``done``, appended to the CSVs."""
    import torch

    from pipeline.config.params import load_params
    from pipeline.data.split import to_float
    from pipeline.training.loop import PretrainLoop

    base = load_params(args.params, [*args.set, f"train.seed={seed}"])
    n_train, n_test = len(data.train.y), len(data.test.y)
    common = {"seed": seed, "batch_size": base.train.batch_size, "n_train": n_train, "n_test": n_test,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    out, curves = args.out / "ssl.csv", args.out / "ssl_curves.csv"

    def record(method: str, table: int, loop: PretrainLoop | None, extra: dict) -> None:
        if loop is None:  # raw pixels
            zt, ze = to_float(data.train.x).flatten(1), to_float(data.test.x).flatten(1)
        else:
            zt, ze = loop.embed(data.train.x), loop.embed(data.test.x)
        acc = probe(zt.numpy(), data.train.y.numpy(), ze.numpy(), data.test.y.numpy(), seed, base.probe.max_train)
        row = {"method": method, "table": table, **common, **acc, **extra}
        append_csv(out, FIELDS, [row])
        print(json.dumps(row), flush=True)

    for method in CONTROLS:
        if (method, seed) not in done:
            loop = None if method == "raw pixels" else PretrainLoop(base, data, device)
            record(method, 0, loop, {"epochs": 0})
    for row in base.tables.rows:
        if (row.name, seed) in done:
            continue
        params = load_params(args.params, [*args.set, *row_overrides(row.params), f"train.seed={seed}",
                                           "train.knn_every=1"])
        loop = PretrainLoop(params, data, device)
        lines: list[dict] = []
        start = time.time()

        def report(m, _ckpt, lines=lines, start=start, name=row.name, epochs=params.train.epochs) -> None:
            lines.append({"method": name, "seed": seed, "epoch": m.epoch, "seconds": round(m.ended_at - start, 2),
                          "online_knn": m.knn_acc, "loss": round(m.loss, 5), "samples_per_s": round(m.samples_per_s)})
            print(f"  {name} seed {seed} epoch {m.epoch}/{epochs}: loss {m.loss:.4f}, "
                  f"online kNN {m.knn_acc}, {m.samples_per_s:.0f} samples/s", file=sys.stderr, flush=True)

        loop.fit(report)
        seconds = time.time() - start
        append_csv(curves, CURVE_FIELDS, lines)
        record(row.name, row.table, loop, {
            "epochs": params.train.epochs, "train_seconds": round(seconds, 1),
            "samples_per_s": round(statistics.mean(line["samples_per_s"] for line in lines)),
            "final_loss": lines[-1]["loss"], "final_online_knn": lines[-1]["online_knn"]})


def plot(curves: list[dict], path: Path) -> None:
    """Online kNN (mean over seeds) against epochs and against wall-clock seconds, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for method in dict.fromkeys(r["method"] for r in curves):
        mine = [r for r in curves if r["method"] == method and r["online_knn"] not in ("", "None")]
        epochs = sorted({int(r["epoch"]) for r in mine})
        knn = [statistics.mean(float(r["online_knn"]) for r in mine if int(r["epoch"]) == e) for e in epochs]
        secs = [statistics.mean(float(r["seconds"]) for r in mine if int(r["epoch"]) == e) for e in epochs]
        axes[0].plot(epochs, knn, marker=".", label=method)
        axes[1].plot(secs, knn, marker=".", label=method)
    axes[0].set(xlabel="epoch", ylabel="online kNN accuracy (mean over seeds)")
    axes[1].set(xlabel="wall-clock seconds of training (kNN and health included)")
    axes[0].legend(fontsize=8)
    fig.suptitle("Fashion-MNIST, self-supervised: online kNN per epoch")
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    tmp.replace(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=Path, default=PRESET)
    ap.add_argument("-S", "--set", action="append", default=[], help="key=value override of the preset (sizes)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/ssl/local",
                    help="a folder of benchmarks/results/ssl/ is one recorded run (the report shows each)")
    ap.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when there is one")
    ap.add_argument("--threads", type=int, default=2, help="torch threads on the CPU")
    ap.add_argument("--budget-s", type=float, help="fewer epochs than the preset's so that every run fits this")
    ap.add_argument("--plot", action="store_true", help="only the table and the figure of the CSVs")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.plot:
        import torch

        from pipeline.config.params import load_params
        from pipeline.data.sources import load_dataset

        base = load_params(args.params, args.set)
        data = load_dataset(base.data)  # the same images for every seed (data.seed is not train.seed)
        cuda = torch.cuda.is_available() and base.train.device != "cpu"
        device = torch.device(args.device or ("cuda" if cuda else "cpu"))
        if device.type == "cpu":
            torch.set_num_threads(args.threads)
        if args.budget_s and not any(s.startswith("train.epochs=") for s in args.set):
            args.set.append(f"train.epochs={fit_budget(args, data, device)}")
        done = {(r["method"], int(r["seed"])) for r in read_rows(args.out / "ssl.csv")}
        for seed in args.seeds:
            run_seed(args, seed, data, device, done)
    curves = read_rows(args.out / "ssl_curves.csv")
    if curves:
        plot(curves, args.out / "ssl_knn.png")
    print(table(read_rows(args.out / "ssl.csv")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
