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
interrupted study resumes. The ``sets`` stage reads that CSV (a DVC dependency): ``reports/sets.md`` and
``reports/REPORT.md`` show its tables, ``plots/sets/circles.png`` its figure. ``--plot`` only prints the tables.

    python benchmarks/study_circles.py                      # both parts (1 h 46 min on 2 cores)
    python benchmarks/study_circles.py --plot               # the Markdown tables of the CSV
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from pipeline.config.base import load_section
from pipeline.config.sets import SetsConfig
from pipeline.evaluation import set_report
from pipeline.evaluation.set_study import cell_cost, run_cell
from pipeline.host import spawned_map, usable_cpus

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks/results/circles.csv"
METHODS = ("abc_additive", "abc_multiplicative", "transfusion", "pairwise", "rbf")
FULL_METHODS = METHODS
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

    def collect(i: int, row: dict) -> None:
        row = {**meta[i], **row}
        with args.out.open("a", newline="") as f:
            w = csv.DictWriter(f, FIELDS, extrasaction="ignore")
            if f.tell() == 0:  # a new file: its header first
                w.writeheader()
            w.writerow(row)
        print(f"[circles] {row['part']:<6} {row['points']:>3} pts {row['method']:<18} seed {row['seed']}: ARI "
              f"{row['ari_known']:.3f} (k), {row['ari_unknown']:.3f} (k̂) in {row['seconds']:.0f} s", flush=True)

    # the costliest first, TransFusion at full length last (not in ABC's Figure 2: the rest lands first)
    order = sorted(range(len(cells)), key=lambda i: (meta[i]["part"] == "full" and cells[i][3] == "transfusion",
                                                     -cell_cost(cells[i][0], "circles", cells[i][3])))
    spawned_map(run_cell, cells, max(1, min(usable_cpus(), len(cells))), collect, order=order)


def load(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--parts", nargs="+", default=["full", "points"], choices=["full", "points"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--points", type=int, nargs="+", default=[20, 50, 100])
    ap.add_argument("--short-steps", type=int, default=500)
    ap.add_argument("--short-sets", type=int, default=32)
    ap.add_argument("--test-sets", type=int, default=100)
    ap.add_argument("--plot", action="store_true", help="only print the tables of --out (the sets stage draws them)")
    args = ap.parse_args()
    if not args.plot:
        run(args)
    print(set_report.circles_section(set_report.circles_summary(load(args.out))))


if __name__ == "__main__":
    main()
