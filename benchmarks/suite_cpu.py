"""Where a command's CPU time goes, by kind of process: by default the test suite as CI runs it (``pytest -n 2``).

The suite is bound by CPU (docs/results.md), so its wall time is about its CPU-seconds over the cores; this says
whose CPU-seconds they are. It runs the command and, every ``--every`` seconds, reads the CPU time of every process
started after it (the command's own, the test processes, the Ray instances they start and every Ray worker, the
commands the tests run; orphans too, which a tree walk from the command would miss) and charges each increase to the
process's kind *at that moment*: a Ray worker is ``ray::IDLE`` while it starts (Python, ``import ray``, joining its
raylet) and ``ray::TrainController`` once it is the controller of a Ray Train run. The kinds:

- a Ray actor or task by its title (``RayTrainWorker``, ``TrainController``, ``ImplicitFunc``: a Tune trial of a
  function, ``PlacementGroupCleaner``, ...), ``IDLE`` (a worker process starting);
- Ray's own processes (``raylet``, ``gcs_server``, the dashboard and its agent, ``log_monitor``, ...);
- the test processes (the command and its direct Python children: pytest-xdist's workers), ``transfusion``
  commands the tests start, ``dvc``, the MLflow UI, chromium, other.

A process that ends loses the CPU it spent after its last sample (at most ``--every`` seconds of it).

    python benchmarks/suite_cpu.py                       # the suite, ~16 min on 2 cores
    python benchmarks/suite_cpu.py -- python -m pytest tests/stages/test_sweep.py
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from collections import Counter

import psutil

RAY_SYSTEM = ("raylet", "gcs_server", "dashboard", "log_monitor", "runtime_env", "monitor.py", "client_server")


def kind(proc: psutil.Process, root: int) -> str | None:
    """The kind of ``proc`` now (None: a kernel thread, not counted)."""
    cmd = proc.cmdline()
    if not cmd:
        return None
    line, name = " ".join(cmd)[:400], proc.name()
    if line.startswith("ray::"):
        return "Ray worker: " + line.split()[0].removeprefix("ray::").split(".")[0]
    if name in ("raylet", "gcs_server"):
        return "Ray system: " + name
    for part in RAY_SYSTEM:
        if part in line:
            return "Ray system: " + part
    if proc.pid == root or (proc.ppid() == root and "python" in name):
        return "test processes (pytest and its workers)"
    if "stages.cli" in line or "bin/transfusion" in line:
        return "transfusion commands the tests start"
    if "dvc" in line.split()[0] or " -m dvc" in line or "bin/dvc" in line:
        return "dvc"
    if "mlflow" in line or "uvicorn" in line or "huey" in line:
        return "MLflow UI"
    if "chrom" in line:
        return "chromium"
    return "other: " + name


def sample(start: float, root: int, spent: dict[tuple[int, float], float], charged: Counter) -> None:
    for proc in psutil.process_iter():
        try:
            with proc.oneshot():
                created = proc.create_time()
                if created < start and proc.pid != root:
                    continue
                times = proc.cpu_times()
                now = times.user + times.system
                what = kind(proc, root)
        except psutil.Error:
            continue
        if what is None:
            continue
        key = (proc.pid, created)
        charged[what] += now - spent.get(key, 0.0)
        spent[key] = now


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=float, default=0.5, help="seconds between samples")
    parser.add_argument("command", nargs="*", default=[sys.executable, "-m", "pytest", "-n", "2", "-q"])
    args = parser.parse_args()
    start = time.time() - 1.0  # create_time is rounded; nothing of the machine starts within this second
    proc = subprocess.Popen(args.command)
    spent: dict[tuple[int, float], float] = {}
    charged: Counter = Counter()
    done = threading.Event()

    def poll() -> None:
        while not done.wait(args.every):
            sample(start, proc.pid, spent, charged)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    code = proc.wait()
    wall = time.time() - start
    done.set()
    thread.join()
    total = sum(charged.values())
    cores = os.cpu_count() or 1
    print(f"\n$ {' '.join(args.command)}  (exit {code})")
    print(f"wall {wall:.0f} s on {cores} cores; CPU {total:.0f} s sampled ({total / cores:.0f} s of the cores' "
          f"wall, {100 * total / (wall * cores):.0f} % of it)")
    ray_workers = sum(v for k, v in charged.items() if k.startswith("Ray worker"))
    ray_system = sum(v for k, v in charged.items() if k.startswith("Ray system"))
    print(f"Ray's worker processes {ray_workers:.0f} CPU-s ({100 * ray_workers / total:.0f} %), its system processes "
          f"{ray_system:.0f} ({100 * ray_system / total:.0f} %)")
    for what, seconds in charged.most_common():
        if seconds >= 1.0:
            print(f"{seconds:8.1f} CPU-s {100 * seconds / total:5.1f} %  {what}")
    sys.exit(code)


if __name__ == "__main__":
    main()
