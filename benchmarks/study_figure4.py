"""The paper's Figure 4 on Fashion-MNIST, measured: do the classes condense with depth in a 5-block TransFusion?

Section 4.1: five TransFusion blocks directly on the 784-d pixels (``model.backbone: pixels``, W_Q, W_K, W_V of
784 x 784 each), self-supervised contrastive training, Adam; then every block's output on unseen test images, shown
by t-SNE. This script runs that with the pipeline's own stages (``transfusion prepare``, ``pretrain``, ``evaluate``
on ``params.yaml`` with the overrides of :func:`overrides`), one project per seed under ``--work``, and gathers
per layer (``input`` = ``backbone`` = the pixels, then ``block_1`` … ``block_5``):

- kNN-200 accuracy on the test images (``probe.probes: [knn200]``, fitted on the training embeddings);
- spectral NMI / ARI of the layer's cosine affinity on ``probe.affinity_points`` test images, and its cosine
  silhouette (how condensed the classes are), ``pipeline.evaluation.evaluate.layer_clusters``;

into ``--out`` (CSV, one row per seed and layer; a rerun skips the seeds already there). From the CSV it draws
``benchmarks/results/figure4.png`` (mean ± sd over seeds per layer) and copies the first seed's t-SNE of every
layer (the stage's ``plots/evaluate/tsne.png``) to ``benchmarks/results/figure4_tsne.png``; ``dvc plots`` shows both
(``dvc.yaml``'s top-level ``plots``). ``--plot`` redraws them and prints the Markdown table.

The paper trains 200 epochs at lr 0.1 on all 60,000 images. What runs here by default, and why, is in
docs/results.md (Figure 4). Needs ``apt-get install dataset-fashion-mnist`` (or ``--root`` with the IDX files).

    python benchmarks/study_figure4.py                 # 3 seeds at the defaults below
    python benchmarks/study_figure4.py --plot          # the table and figures of the CSV
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks/results/figure4.csv"
FIELDS = ("seed", "layer", "knn200", "nmi", "ari", "silhouette", "epochs", "lr", "batch_size", "n_train", "n_test",
          "final_loss", "online_knn", "train_seconds")
METRICS = (("knn200", "kNN-200 accuracy"), ("nmi", "spectral NMI"), ("silhouette", "cosine silhouette"))


def overrides(args: argparse.Namespace, seed: int) -> list[str]:
    """``-S`` overrides of params.yaml: section 4.1's model and optimiser, our sizes (module docstring)."""
    sets = [
        "data.dataset=fashion_mnist", f"data.root={args.root}", f"data.limit_train={args.limit_train}",
        f"data.limit_test={args.limit_test}",
        "model.backbone=pixels", "model.embed_dim=null", "model.depth=5", "model.qk_init=default",
        "train.mode=self_supervised", "train.optimizer=adam", f"train.lr={args.lr}", "train.head_lr_scale=1.0",
        f"train.epochs={args.epochs}", f"train.batch_size={args.batch_size}", f"train.seed={seed}",
        f"train.knn_every={args.knn_every}", f"ray.cpus_per_worker={args.cpus}",
        "probe.probes=[knn200]", "probe.label_fractions=[1.0]", "probe.max_train=null",
        f"probe.tsne_points={args.tsne_points}", f"probe.affinity_points={args.affinity_points}", f"probe.seed={seed}",
    ]
    return [a for s in sets for a in ("-S", s)]


def stage(name: str, cwd: Path, args: argparse.Namespace, seed: int, *extra: str) -> None:
    """One ``transfusion`` stage in ``cwd``, its output streamed (the pipeline's own progress lines)."""
    cmd = ["transfusion", name, *overrides(args, seed), *extra]
    print(f"[figure4] seed {seed}: {' '.join(cmd[:2])} in {cwd}", flush=True)
    subprocess.run(cmd, cwd=cwd, check=True)


def run_seed(args: argparse.Namespace, seed: int) -> list[dict]:
    """prepare (once, shared), pretrain and evaluate of one seed; its rows, one per layer."""
    work = Path(args.work)
    data = work / "data/prepared"
    if not (data / "manifest.json").is_file():
        work.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / "params.yaml", work / "params.yaml")
        stage("prepare", work, args, seed)
    project = work / f"seed{seed}"
    project.mkdir(exist_ok=True)
    shutil.copy(ROOT / "params.yaml", project / "params.yaml")
    started = time.time()
    stage("pretrain", project, args, seed, "--data", str(data.resolve()))
    stage("evaluate", project, args, seed, "--data", str(data.resolve()))
    pre = json.loads((project / "metrics/pretrain.json").read_text())
    ev = json.loads((project / "metrics/evaluate.json").read_text())
    print(f"[figure4] seed {seed} done in {time.time() - started:.0f} s", flush=True)
    return [{"seed": seed, "layer": layer, "knn200": ev["probes"][layer]["knn200"]["1"], **{
        k: scores[k] for k in ("nmi", "ari", "silhouette")}, "epochs": args.epochs, "lr": args.lr,
        "batch_size": args.batch_size, "n_train": args.limit_train, "n_test": ev["n_test"],
        "final_loss": pre.get("loss"), "online_knn": pre.get("knn_acc"), "train_seconds": pre.get("train_seconds")}
        for layer, scores in ev["layers"].items()]


def read_rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with open(path) as f:
        return list(csv.DictReader(f))


def summary(rows: list[dict]) -> list[tuple[str, dict[str, tuple[float, float]], int]]:
    """(layer, {metric: (mean, sd)}, seeds) in the layers' order; sd over seeds (0 with one seed)."""
    def depth(layer: str) -> int:  # input, backbone, block_1, block_2, ... (metrics files sort their keys)
        return {"input": -2, "backbone": -1}.get(layer, int(layer.rpartition("_")[2]) if "_" in layer else 0)

    layers = sorted(dict.fromkeys(r["layer"] for r in rows), key=depth)
    out = []
    for layer in layers:
        mine = [r for r in rows if r["layer"] == layer]
        stats = {}
        for key, _ in METRICS:
            v = [float(r[key]) for r in mine if r[key] not in ("", "None")]
            stats[key] = (statistics.fmean(v), statistics.stdev(v) if len(v) > 1 else 0.0) if v else (float("nan"),) * 2
        out.append((layer, stats, len(mine)))
    return out


def table(rows: list[dict]) -> str:
    lines = ["| layer | " + " | ".join(label for _, label in METRICS) + " | seeds |",
             "|---|" + "---|" * (len(METRICS) + 1)]
    for layer, stats, n in summary(rows):
        lines.append(f"| {layer} | " + " | ".join(f"{m:.3f} ± {s:.3f}" for m, s in stats.values()) + f" | {n} |")
    return "\n".join(lines)


def figure(rows: list[dict], path: Path) -> None:
    """Per-layer mean ± sd of each metric (one panel each), the layers in order, and each seed's own line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = summary(rows)
    names = [p[0] for p in parts]
    fig, axes = plt.subplots(1, len(METRICS), figsize=(4.2 * len(METRICS), 3.4))
    for ax, (key, label) in zip(axes, METRICS, strict=True):
        mean = [p[1][key][0] for p in parts]
        sd = [p[1][key][1] for p in parts]
        for seed in sorted({r["seed"] for r in rows}, key=int):  # each seed (a dead block shows as its own line)
            by_layer = {r["layer"]: float(r[key]) for r in rows if r["seed"] == seed and r[key] not in ("", "None")}
            ax.plot(range(len(names)), [by_layer.get(n, float("nan")) for n in names], lw=0.8, alpha=0.5,
                    label=f"seed {seed}")
        ax.errorbar(range(len(names)), mean, yerr=sd, marker="o", capsize=3, color="black", label="mean ± sd")
        ax.set_xticks(range(len(names)), names, rotation=30)
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    seeds = max((p[2] for p in parts), default=0)
    fig.suptitle(f"Figure 4 in numbers: 5 TransFusion blocks on Fashion-MNIST pixels (mean ± sd, {seeds} seeds)")
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--limit-train", type=int, default=10000)
    ap.add_argument("--limit-test", type=int, default=2000)
    ap.add_argument("--knn-every", type=int, default=1)
    ap.add_argument("--tsne-points", type=int, default=1000)
    ap.add_argument("--affinity-points", type=int, default=1000)
    ap.add_argument("--cpus", type=float, default=2.0, help="ray.cpus_per_worker (the torch threads of the worker)")
    ap.add_argument("--root", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--work", default=str(ROOT / ".study/figure4"), help="the seeds' projects (git-ignored)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--plot", action="store_true", help="only the table and figures of --out")
    args = ap.parse_args()
    if not args.plot:
        done = {int(r["seed"]) for r in read_rows(args.out)}
        for seed in args.seeds:
            if seed in done:
                print(f"[figure4] seed {seed} already in {args.out}: skipped", flush=True)
                continue
            rows = run_seed(args, seed)
            new = not args.out.is_file() or args.out.stat().st_size == 0
            with open(args.out, "a", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=FIELDS)
                if new:
                    writer.writeheader()
                writer.writerows(rows)
            tsne = Path(args.work) / f"seed{seed}/plots/evaluate/tsne.png"
            target = args.out.parent / "figure4_tsne.png"
            if tsne.is_file() and (seed == min(args.seeds) or not target.is_file()):
                shutil.copy(tsne, target)
    rows = read_rows(args.out)
    if not rows:
        sys.exit(f"{args.out}: no rows yet; run without --plot first")
    figure(rows, args.out.with_suffix(".png"))
    print(table(rows))


if __name__ == "__main__":
    main()
