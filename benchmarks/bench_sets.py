"""The set-clustering study on a process per CPU vs in one process: wall time and whether the rows agree.

Both run ``run_study`` on the same ``sets`` params (the project's params.yaml by default), in one run of this
script: first in this process (``workers=1``), then as the ``sets`` stage runs it (a spawned process per usable CPU
once the study trains ``POOL_MIN_STEPS`` steps or more). Each row's own seconds aside, the rows must be equal.

    python benchmarks/bench_sets.py
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from pipeline.config.base import load_section
from pipeline.config.sets import SetsConfig
from pipeline.evaluation.set_study import run_study

ROOT = Path(__file__).resolve().parents[1]


def timed(cfg: SetsConfig, workers: int | None) -> tuple[float, list[dict]]:
    start = time.perf_counter()
    rows = run_study(cfg, progress=None, workers=workers)
    return time.perf_counter() - start, [{k: v for k, v in r.items() if k != "seconds"} for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default=str(ROOT / "params.yaml"))
    ap.add_argument("-S", dest="overrides", action="append", default=[], help="extra sets.* overrides")
    args = ap.parse_args()
    cfg = load_section(args.params, "sets", SetsConfig, args.overrides)
    one, rows_one = timed(cfg, 1)
    pooled, rows_pooled = timed(cfg, None)
    print(f"sets study, {len(rows_one)} rows: one process {one:.1f} s, the stage's default {pooled:.1f} s, "
          f"ratio {pooled / one:.2f}; rows equal: {rows_one == rows_pooled}")


if __name__ == "__main__":  # the pool spawns processes that import this file
    main()
