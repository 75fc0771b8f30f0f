"""Quality benchmark on the embedded default (digits): TransFusion vs baselines, several seeds, equal epochs.

Every method trains the same backbone for the same epochs with the stage's own loop (no Ray: quality
does not depend on it), then the evaluate stage's probes (3-layer FFN, SVM, kNN-50, kNN-200, 100 % labels)
run on frozen backbone embeddings of digits' test split. Prints mean ± std over seeds as a Markdown table,
with the raw-pixel baseline measured in the same run.

    python benchmarks/bench_quality.py --seeds 0 1 2
    python benchmarks/bench_quality.py --only tf1 -S train.epochs=40     # explore one method
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from pipeline.config.params import load_params
from pipeline.data.sources import load_dataset
from pipeline.evaluation.evaluate import evaluate
from pipeline.training.loop import PretrainLoop

ROOT = Path(__file__).resolve().parents[1]
PROBES = ["ffn", "svm", "knn50", "knn200"]
METHODS = {  # name -> overrides on top of params.yaml
    "tf1": ("TransFusion 1-block (JSD)", ["model.depth=1", "loss.name=jsd"]),
    "tf3": ("TransFusion 3-block (JSD)", ["model.depth=3", "loss.name=jsd"]),
    "infonce": ("InfoNCE", ["model.depth=0", "loss.name=infonce"]),
    "barlow": ("BarlowTwins", ["model.depth=0", "loss.name=barlow_twins"]),
    "tf1_sup": ("TransFusion 1-block (JSD), supervised", ["model.depth=1", "loss.name=jsd", "train.mode=supervised"]),
    "supcon": ("SupCon, supervised", ["model.depth=0", "loss.name=supcon", "train.mode=supervised"]),
}


def run(overrides: list[str], seed: int, data) -> dict[str, float]:
    params = load_params(ROOT / "params.yaml", [*overrides, f"train.seed={seed}", "train.knn_every=0",
                                                  "probe.probes=[ffn, svm, knn50, knn200]",
                                                  "probe.label_fractions=[1.0]", "probe.tsne_points=0"])
    loop = PretrainLoop(params, data, torch.device("cpu"))
    t = time.perf_counter()
    loop.fit(lambda m, ckpt: None)
    seconds = time.perf_counter() - t
    ev = evaluate(params, data, loop.model.eval(), params.train.batch_size, progress=lambda s: None)
    out = {f"{rep}.{p}": ev.metrics["probes"][rep][p]["1"] for rep in ("input", "backbone") for p in PROBES}
    out["seconds"] = seconds
    return out


def fmt(values: list[float]) -> str:
    mean = statistics.mean(values)
    return f"{mean:.4f} ± {statistics.stdev(values):.4f}" if len(values) > 1 else f"{mean:.4f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--only", nargs="+", choices=list(METHODS), default=list(METHODS))
    ap.add_argument("-S", dest="overrides", action="append", default=[], help="extra overrides for every method")
    ap.add_argument("--json", type=Path, help="also write the raw results here")
    args = ap.parse_args()
    torch.set_num_threads(2)
    base = load_params(ROOT / "params.yaml", args.overrides)
    d = base.data
    data = load_dataset(d)
    results: dict[str, list[dict[str, float]]] = {}
    for key in args.only:
        name, overrides = METHODS[key]
        for seed in args.seeds:
            r = run([*overrides, *args.overrides], seed, data)
            results.setdefault(key, []).append(r)
            print(f"# {name} seed {seed}: " + ", ".join(f"{p} {r['backbone.' + p]:.4f}" for p in PROBES)
                  + f" ({r['seconds']:.0f} s)", flush=True)
    epochs = base.train.epochs
    print(f"\n{base.data.dataset}, backbone {base.model.backbone}, {epochs} epochs, batch {base.train.batch_size}, "
          f"augment {base.augment.preset}@{base.augment.strength}, seeds {args.seeds}; probes on backbone embeddings")
    print("\n| method | 3-FFN | SVM | kNN-50 | kNN-200 | train s |\n|---|---|---|---|---|---|")
    first = next(iter(results.values()))
    print("| raw pixels | " + " | ".join(fmt([r[f"input.{p}"] for r in first]) for p in PROBES) + " | - |")
    for key, rs in results.items():
        cells = " | ".join(fmt([r[f"backbone.{p}"] for r in rs]) for p in PROBES)
        print(f"| {METHODS[key][0]} | {cells} | {statistics.mean(r['seconds'] for r in rs):.0f} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
