"""ABC's Figure 2 on the circles, measured: ARI with k known and with the eigengap's k̂ for ABC additive, ABC
multiplicative, pairwise, TransFusion and RBF spectral clustering, on ≥ 3 seeds, at the length of ABC's code and
against the points per set.

Two parts, every (points, seed, method) one cell of :func:`pipeline.evaluation.set_study.run_cell` on a process per
usable CPU, the costliest first:

- ``full``: 20 points per set at the code's length (``circles.py``: 7,812 steps of 128 sets = 1,000,000 training
  sets, Adam lr 1e-3, width 128, 2 SABs), ABC's SABs as the code builds them (``sets.abc_attention: matched``,
  1 head, no W_O), the circles as the code draws them (stratified arcs); 100 test sets a seed.
- ``points``: 20, 50 and 100 points per set at a shorter length, the same for every size (``--short-steps`` steps of
  ``--short-sets`` sets; the additive SABs cost n² · width a set: 100-point sets at the full length take ~7 h of a
  core per seed and method).

Each finished cell is appended to ``--out`` (CSV) at once, and a rerun skips the cells already there, so an
interrupted study resumes. ``--plot`` only draws the figure and prints the tables from the CSV.

    python benchmarks/study_circles.py                      # both parts (≈ 2 h on 2 cores)
    python benchmarks/study_circles.py --plot               # docs/sets-circles.png and the Markdown tables
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

import numpy as np

from pipeline.config.base import load_section
from pipeline.config.sets import SetsConfig
from pipeline.evaluation.set_study import cell_cost, run_cell
from pipeline.host import spawned_map, usable_cpus

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks/results/circles.csv"
FIGURE = ROOT / "docs/sets-circles.png"
METHODS = ("abc_additive", "abc_multiplicative", "transfusion", "pairwise", "rbf")
FULL_METHODS = METHODS
LABELS = {"abc_additive": "ABC additive", "abc_multiplicative": "ABC multiplicative", "transfusion": "TransFusion",
          "pairwise": "pairwise (no context)", "rbf": "RBF spectral"}
FIELDS = ("part", "points", "steps", "batch_sets", "dataset", "method", "seed", "nmi_known", "ari_known",
          "nmi_unknown", "ari_unknown", "k_error", "final_loss", "rbf_c", "seconds")


def configs(args: argparse.Namespace) -> list[tuple[str, SetsConfig, tuple[str, ...]]]:
    """(part, cfg, methods) of the study: the preset's ``sets`` section with the circles' overrides."""
    base = ["sets.datasets=[circles]", f"sets.seeds={list(args.seeds)}", f"sets.test_sets={args.test_sets}",
            f"sets.rbf_select_sets={args.test_sets}", "sets.abc_attention=matched", "sets.abc_projection=false",
            "sets.circles_heads=1", "sets.circles_angles=stratified"]
    preset = str(ROOT / "presets/set-clustering.yaml")
    out = [("full", load_section(preset, "sets", SetsConfig, [*base, "sets.circles_points=20"]), FULL_METHODS)]
    for points in args.points:
        out.append(("points", load_section(preset, "sets", SetsConfig, [
            *base, f"sets.circles_points={points}", f"sets.steps={args.short_steps}",
            f"sets.batch_sets={args.short_sets}"]), METHODS))
    return [c for c in out if c[0] in args.parts]


def done_keys(path: Path) -> set[tuple]:
    if not path.exists():
        return set()
    with path.open() as f:
        return {(r["part"], int(r["points"]), r["method"], int(r["seed"])) for r in csv.DictReader(f)}


def run(args: argparse.Namespace) -> None:
    cells, meta = [], []
    have = done_keys(args.out)
    for part, cfg, methods in configs(args):
        for seed in cfg.seeds:
            for method in methods:
                if (part, cfg.circles_points, method, seed) not in have:
                    cells.append((cfg, "circles", seed, method))
                    meta.append({"part": part, "points": cfg.circles_points, "batch_sets": cfg.batch_sets})
    print(f"{len(cells)} cells to run ({len(have)} in {args.out}) on {usable_cpus()} processes", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    new = not args.out.exists()

    def collect(i: int, row: dict) -> None:
        row = {**meta[i], **row}
        with args.out.open("a", newline="") as f:
            w = csv.DictWriter(f, FIELDS, extrasaction="ignore")
            if new and f.tell() == 0:
                w.writeheader()
            w.writerow(row)
        print(f"[circles] {row['part']:<6} {row['points']:>3} pts {row['method']:<18} seed {row['seed']}: ARI "
              f"{row['ari_known']:.3f} (k), {row['ari_unknown']:.3f} (k̂) in {row['seconds']:.0f} s", flush=True)

    order = sorted(range(len(cells)), key=lambda i: -cell_cost(cells[i][0], "circles", cells[i][3]))
    spawned_map(run_cell, cells, max(1, min(usable_cpus(), len(cells))), collect, order=order)


def load(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def stats(rows: list[dict], metric: str) -> tuple[float, float, int]:
    v = np.array([float(r[metric]) for r in rows])
    return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else math.nan, v.size


def tables(rows: list[dict]) -> str:
    out = []
    full = [r for r in rows if r["part"] == "full"]
    if full:
        r0 = full[0]
        out.append(f"20 points per set, {r0['steps']} steps of {r0['batch_sets']} sets, mean ± sd over seeds:\n")
        out.append("| method | seeds | ARI, k known | ARI, k̂ | NMI, k known | mean \\|k̂ − k\\| | final BCE |")
        out.append("|---|---|---|---|---|---|---|")
        for m in METHODS:
            mine = [r for r in full if r["method"] == m]
            if not mine:
                continue
            cells = [f"{a:.3f} ± {s:.3f}" for a, s, _ in (stats(mine, k) for k in ("ari_known", "ari_unknown",
                                                                                     "nmi_known"))]
            kerr = stats(mine, "k_error")
            loss = stats(mine, "final_loss") if m != "rbf" else None
            out.append(f"| {LABELS[m]} | {len(mine)} | {' | '.join(cells)} | {kerr[0]:.2f} ± {kerr[1]:.2f} | "
                       f"{'' if loss is None else f'{loss[0]:.3f} ± {loss[1]:.3f}'} |")
    pts = [r for r in rows if r["part"] == "points"]
    if pts:
        sizes = sorted({int(r["points"]) for r in pts})
        r0 = pts[0]
        out.append(f"\nARI with k known / with k̂ against the points per set, {r0['steps']} steps of "
                   f"{r0['batch_sets']} sets:\n")
        out.append("| method | " + " | ".join(f"{p} points" for p in sizes) + " |")
        out.append("|---|" + "---|" * len(sizes))
        for m in METHODS:
            row = []
            for p in sizes:
                mine = [r for r in pts if r["method"] == m and int(r["points"]) == p]
                if not mine:
                    row.append("n/a")
                    continue
                (a, sa, _), (b, sb, _) = stats(mine, "ari_known"), stats(mine, "ari_unknown")
                row.append(f"{a:.3f} ± {sa:.3f} / {b:.3f} ± {sb:.3f}")
            out.append(f"| {LABELS[m]} | " + " | ".join(row) + " |")
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    from pipeline.plots import new_figure, save_figure

    pts = [r for r in rows if r["part"] == "points"]
    full = [r for r in rows if r["part"] == "full"]
    fig = new_figure(10, 4.2)
    axes = fig.subplots(1, 2)
    for ax, metric, title in ((axes[0], "ari_known", "ARI, k known"), (axes[1], "ari_unknown", "ARI, eigengap k̂")):
        for m in METHODS:
            sizes = sorted({int(r["points"]) for r in pts if r["method"] == m})
            if sizes:
                ms = [stats([r for r in pts if r["method"] == m and int(r["points"]) == p], metric) for p in sizes]
                line = ax.errorbar(sizes, [a for a, _, _ in ms], yerr=[0 if math.isnan(s) else s for _, s, _ in ms],
                                   marker="o", capsize=3, label=LABELS[m])
                mine = [r for r in full if r["method"] == m]
                if mine:
                    a, s, _ = stats(mine, metric)
                    ax.errorbar([20], [a], yerr=[0 if math.isnan(s) else s], marker="*", markersize=12,
                                color=line[0].get_color(), capsize=3, linestyle="none")
        ax.set_xlabel("points per set")
        ax.set_ylabel(title)
        ax.set_xscale("log")
        ax.set_xticks([20, 50, 100], ["20", "50", "100"])
        ax.grid(alpha=0.3)
    short = pts[0] if pts else None
    note = f"lines: {short['steps']} steps of {short['batch_sets']} sets" if short else ""
    if full:
        note += f"; stars: 20 points, {full[0]['steps']} steps of {full[0]['batch_sets']} sets (ABC's code)"
    axes[0].legend(fontsize=8)
    fig.suptitle(f"The circles, ABC's Figure 2 measured (mean ± sd over seeds)\n{note}", fontsize=9)
    save_figure(fig, path, None, None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--parts", nargs="+", default=["full", "points"], choices=["full", "points"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--points", type=int, nargs="+", default=[20, 50, 100])
    ap.add_argument("--short-steps", type=int, default=500)
    ap.add_argument("--short-sets", type=int, default=32)
    ap.add_argument("--test-sets", type=int, default=100)
    ap.add_argument("--plot", action="store_true", help="only draw the figure and print the tables from --out")
    args = ap.parse_args()
    if not args.plot:
        run(args)
    rows = load(args.out)
    plot(rows, FIGURE)
    print(tables(rows))


if __name__ == "__main__":
    main()
