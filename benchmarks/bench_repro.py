"""The default pipeline end to end: `dvc repro -f` per stage, then a `dvc repro` with nothing to do.

By default in a fresh clone of this checkout's HEAD (no ``mlflow.db``, no ``ray_results/``, no ``__pycache__``: what
a new user meets), with the `transfusion` command of the active environment. Each stage's wall time is taken from
the moment DVC announces it to the next announcement; the table also gives the stage's own account where it prints
one (pretraining's seconds of training steps, the sweep's and the theory grid's own durations), so that start-up and
bookkeeping show as the difference. Ratios are against the goals (whole run <= 240 s on 2 cores, no-op <= 5 s).
A record of the run is appended to ``benchmarks/results/repro.jsonl`` (``--no-record`` skips it).

    python benchmarks/bench_repro.py               # fresh clone of HEAD, about 2-4 min on 2 cores
    python benchmarks/bench_repro.py --in-place    # this checkout (its mlflow.db, ray_results and caches)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOAL_S, NOOP_GOAL_S = 240.0, 5.0
STAGE = re.compile(r"^Running stage '([\w-]+)':")
# the stages' own accounts of their work, from their closing lines
OWN = {
    "sweep": re.compile(r"^\[sweep\] \d+ trials in ([\d.]+) s"),
    "theory": re.compile(r"^theory: learned in .*; ([\d.]+) s ->"),
    "sets": re.compile(r"^sets: ([\d.]+) s ->"),
}
# the stages that say where their time went, in a line of their own
SPLIT = re.compile(r"^\[(pretrain|evaluate|sweep)\] \d+ s in all: (.*)$")


def run_repro(cwd: Path, log) -> tuple[float, dict[str, float], dict[str, float], dict[str, str]]:
    """`dvc repro -f` in cwd, its output echoed to ``log``: (total s, wall s per stage, own s per stage, the stages'
    own lines on where their time went)."""
    start = time.perf_counter()
    marks: list[tuple[str, float]] = []
    own: dict[str, float] = {}
    split: dict[str, str] = {}
    proc = subprocess.Popen(["dvc", "repro", "-f"], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    assert proc.stdout is not None
    for line in proc.stdout:
        log.write(line)
        if m := STAGE.match(line):
            marks.append((m.group(1), time.perf_counter()))
        for stage, pattern in OWN.items():
            if m := pattern.match(line):
                own[stage] = float(m.group(1))
        if m := SPLIT.match(line.strip()):
            split[m.group(1)] = m.group(2)
    if proc.wait() != 0:
        sys.exit(f"dvc repro -f failed (exit {proc.returncode}); its output is above")
    end = time.perf_counter()
    ends = [t for _, t in marks[1:]] + [end]
    wall = {name: e - t for (name, t), e in zip(marks, ends, strict=True)}
    train = json.loads((cwd / "metrics" / "pretrain.json").read_text()).get("train_seconds")
    if train is not None:
        own["pretrain"] = float(train)
    return end - start, wall, own, split


def cpu_model() -> str:
    """The CPU's model name (Linux), else the machine type."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--in-place", action="store_true", help="run in this checkout instead of a fresh clone")
    ap.add_argument("--quiet", action="store_true", help="do not echo the pipeline's output")
    ap.add_argument("--no-record", action="store_true", help="do not append to benchmarks/results/repro.jsonl")
    args = ap.parse_args()
    if shutil.which("dvc") is None or shutil.which("transfusion") is None:
        sys.exit("needs `dvc` and `transfusion` on PATH: activate the project's environment")
    import torch  # only for the record: which build ran the numbers

    tmp = None
    if args.in_place:
        cwd = ROOT
    else:
        tmp = Path(tempfile.mkdtemp(prefix="bench-repro-"))
        cwd = tmp / "clone"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(cwd)], check=True)
    log = open(os.devnull, "w") if args.quiet else sys.stdout  # noqa: SIM115 - closed below
    try:
        total, wall, own, split = run_repro(cwd, log)
        t0 = time.perf_counter()
        noop = subprocess.run(["dvc", "repro"], cwd=cwd, capture_output=True, text=True)
        noop_s = time.perf_counter() - t0
        if noop.returncode != 0 or "Running stage" in noop.stdout:
            sys.exit(f"the second `dvc repro` was not a no-op:\n{noop.stdout}{noop.stderr}")
    finally:
        if log is not sys.stdout:
            log.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

    where = "this checkout" if args.in_place else "a fresh clone of HEAD"
    print(f"\n`dvc repro -f` of the default params in {where}, torch {torch.__version__}, {os.cpu_count()} CPUs")
    print(f"  {'stage':<10}{'wall s':>8}{'share':>8}{'own s':>8}  (own: the stage's account of its work)")
    for name, s in wall.items():
        mine = f"{own[name]:8.1f}" if name in own else f"{'':8}"
        print(f"  {name:<10}{s:8.1f}{s / total:8.0%}{mine}")
    print(f"  {'total':<10}{total:8.1f}          {total / GOAL_S:.2f}x the {GOAL_S:.0f} s goal")
    print(f"  no-op `dvc repro`: {noop_s:.1f} s, {noop_s / NOOP_GOAL_S:.2f}x the {NOOP_GOAL_S:.0f} s goal")
    for stage, text in split.items():
        print(f"  {stage}: {text}")

    if not args.no_record:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
        record = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit,
                  "where": "in-place" if args.in_place else "fresh-clone", "torch": torch.__version__,
                  "cpus": os.cpu_count(), "cpu": cpu_model(),
                  "total_s": round(total, 1), "noop_s": round(noop_s, 1),
                  "stages_s": {k: round(v, 1) for k, v in wall.items()},
                  "own_s": {k: round(v, 1) for k, v in own.items()}, "split": split}
        out = ROOT / "benchmarks" / "results" / "repro.jsonl"
        with out.open("a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"  recorded in {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
