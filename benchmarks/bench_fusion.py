"""Fusion health study: does a TransFusion head stay alive, and does depth help? Depth × seeds × remedies.

For each dataset (digits: ``cnn_small``; the paper's union of subspaces: ``mlp``), each remedy (a set of
params overrides, below), each depth and each seed, the stage's own loop (no Ray) pretrains on the default
recipe (``params.yaml``) for ``--epochs`` epochs; then, on frozen embeddings of the test split (batches of the
trained size, as the evaluate stage does), kNN-200, SVM and the 3-layer FFN at 100 % labels on the fused output
(last block) and on the backbone, and the per-block health (``pipeline.evaluation.health``) of a stratified test batch.

Prints one Markdown table per dataset: mean ± sd over seeds, the weakest block's positive-pair fraction, the
largest uniform-row fraction, the last block's same-class attention share (chance in the header), and the
fraction of seeds with a dead block (< 1 % positive pairs). Each run is appended to ``--out`` (JSON lines) as it
ends, so an interrupted study resumes where it stopped.

    python benchmarks/bench_fusion.py                                   # the README's table (about 40 min, 2 cores)
    python benchmarks/bench_fusion.py --remedies baseline identity --depths 3 --seeds 0 1 --datasets digits
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REMEDIES = {  # name -> (what it is, params overrides on top of params.yaml's recipe)
    "paper": ("Appendix E literally: joint fusion, nn.Linear init, LayerNorm, appendix_e head",
              ["model.fusion_scope=joint", "model.qk_init=default", "model.block_norm=layernorm",
               "model.head=appendix_e", "train.head_lr_scale=1.0"]),
    "per_view": ("(a) each view's batch fused separately", ["model.fusion_scope=per_view"]),
    "tied": ("(b) W_K = W_Q at init (Theorem 1)", ["model.qk_init=tied"]),
    "identity": ("(b) W_Q = W_K = I at init (ours)", ["model.qk_init=identity"]),
    "l2": ("(c) block_norm l2", ["model.block_norm=l2"]),
    "no_norm": ("(c) block_norm none", ["model.block_norm=none"]),
    "truncated": ("(d) truncated head (eq. 2)", ["model.head=truncated"]),
    "head_lr_0.1": ("(e) head lr = 0.1 × backbone lr", ["train.head_lr_scale=0.1"]),
    "head_lr_10": ("(e) head lr = 10 × backbone lr", ["train.head_lr_scale=10.0"]),
    "identity+per_view": ("(a)+(b)", ["model.qk_init=identity", "model.fusion_scope=per_view"]),
    "tied+per_view": ("(a)+(b)", ["model.qk_init=tied", "model.fusion_scope=per_view"]),
    "identity+head_lr_0.1": ("(b)+(e)", ["model.qk_init=identity", "train.head_lr_scale=0.1"]),
}
DATASETS = {  # name -> overrides
    "digits": ["data.dataset=digits", "model.backbone=cnn_small"],
    "synthetic": ["data.dataset=synthetic", "model.backbone=mlp"],
}
PROBES = ("knn200", "svm", "ffn")


def _data(name: str):
    from pipeline.config.params import load_params
    from pipeline.data.sources import load_dataset

    d = load_params(ROOT / "params.yaml", DATASETS[name]).data
    return load_dataset(d.model_copy(update={"root": str(ROOT / d.root)}))


def run_one(job: dict) -> dict:
    """Pretrain one configuration and measure it; returns the row written to the JSON lines file."""
    import torch

    from pipeline.config.params import load_params
    from pipeline.evaluation.evaluate import layer_embeddings, test_health
    from pipeline.evaluation.probes import run_probes
    from pipeline.training.loop import PretrainLoop

    torch.set_num_threads(1)
    overrides = [*REMEDIES["paper"][1], *DATASETS[job["dataset"]], *REMEDIES[job["remedy"]][1],
                 f"model.depth={job['depth']}", f"train.seed={job['seed']}", f"train.epochs={job['epochs']}",
                 "train.knn_every=0", "train.warmup_epochs=0"]
    params = load_params(ROOT / "params.yaml", overrides)
    data = _data(job["dataset"])
    t = time.perf_counter()
    loop = PretrainLoop(params, data, torch.device("cpu"))
    loop.fit(lambda m, ckpt: None)
    train_seconds = time.perf_counter() - t
    model = loop.model.eval()
    b, dev = params.train.batch_size, torch.device("cpu")
    reps_tr = layer_embeddings(model, data.train.x, b, dev)
    reps_te = layer_embeddings(model, data.test.x, b, dev)
    row = {**job, "train_seconds": train_seconds, "final_loss": loop.history[-1]["loss"]}
    for rep, i in (("backbone", 0), ("fused", -1)):
        for r in run_probes(reps_tr[i], data.train.y.numpy(), reps_te[i], data.test.y.numpy(), probes=PROBES,
                            fractions=(1.0,), seed=0):
            row[f"{rep}.{r.probe}"] = r.accuracy
    row["health"] = test_health(model, data.test.x, data.test.y, b, dev)
    row["train_health"] = {k: v for k, v in loop.history[-1].items() if k.startswith("block_")}  # last epoch
    row["seconds"] = time.perf_counter() - t
    return row


def _key(r: dict) -> tuple:
    return r["dataset"], r["remedy"], r["depth"], r["seed"], r["epochs"]


def fmt(values: list[float]) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    mean = statistics.mean(values)
    return f"{mean:.3f} ± {statistics.stdev(values):.3f}" if len(values) > 1 else f"{mean:.3f}"


def table(rows: list[dict], dataset: str, remedies: list[str], depths: list[int]) -> list[str]:
    from pipeline.evaluation.health import DEAD_POSITIVE

    chance = [h["same_class_chance"] for r in rows if r["dataset"] == dataset for h in r["health"].values()]
    lines = [f"**{dataset}** ({len({r['seed'] for r in rows if r['dataset'] == dataset})} seeds, "
             f"{rows[0]['epochs']} epochs; same-class share at chance: {statistics.mean(chance):.3f})" if chance
             else f"**{dataset}**", "",
             "| remedy | depth | fused kNN-200 | backbone kNN-200 | fused SVM | backbone SVM | fused FFN "
             "| backbone FFN | weakest block: positive pairs | most uniform rows | last block same-class share "
             "| seeds with a dead block |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for remedy in remedies:
        for depth in depths:
            rs = [r for r in rows if (r["dataset"], r["remedy"], r["depth"]) == (dataset, remedy, depth)]
            if not rs:
                continue
            pos = [min(h["positive"] for h in r["health"].values()) for r in rs]
            uni = [max(h["uniform_rows"] for h in r["health"].values()) for r in rs]
            same = [list(r["health"].values())[-1]["same_class"] for r in rs]
            dead = sum(p < DEAD_POSITIVE for p in pos)
            cells = [fmt([r[f"{rep}.{p}"] for r in rs]) for p in PROBES for rep in ("fused", "backbone")]
            lines.append(f"| {remedy} | {depth} | " + " | ".join(cells) + f" | {fmt(pos)} | {fmt(uni)} | {fmt(same)} "
                         f"| {dead}/{len(rs)} |")
    return lines + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    ap.add_argument("--remedies", nargs="+", default=list(REMEDIES), choices=list(REMEDIES))
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 3, 5])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--jobs", type=int, default=2, help="parallel runs (one thread each)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "fusion.jsonl")
    ap.add_argument("--table-only", action="store_true", help="print the table of what --out holds")
    args = ap.parse_args()

    args.out.parent.mkdir(parents=True, exist_ok=True)
    done = {}
    if args.out.is_file():
        for line in args.out.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                done[_key(r)] = r
    jobs = [{"dataset": d, "remedy": m, "depth": depth, "seed": s, "epochs": args.epochs}  # remedy by remedy
            for m in args.remedies for d in args.datasets for depth in args.depths for s in args.seeds]
    todo = [j for j in jobs if _key(j) not in done] if not args.table_only else []
    print(f"{len(jobs)} runs, {len(jobs) - len(todo)} already in {args.out}, {len(todo)} to go", flush=True)
    start = time.perf_counter()
    if todo:
        with mp.get_context("spawn").Pool(args.jobs) as pool, open(args.out, "a") as f:
            for i, row in enumerate(pool.imap_unordered(run_one, todo), 1):
                done[_key(row)] = row
                f.write(json.dumps(row) + "\n")
                f.flush()
                dead = [b for b, h in row["health"].items() if h["positive"] < 0.01]
                print(f"[{i}/{len(todo)} {time.perf_counter() - start:.0f}s] {row['dataset']} {row['remedy']} "
                      f"depth {row['depth']} seed {row['seed']}: fused kNN-200 {row['fused.knn200']:.3f}, backbone "
                      f"{row['backbone.knn200']:.3f}, dead {dead or 'none'}", flush=True)
    rows = [done[_key(j)] for j in jobs if _key(j) in done]
    for d in args.datasets:
        print("\n".join(table([r for r in rows if r["dataset"] == d], d, args.remedies, args.depths)))


if __name__ == "__main__":
    main()
