"""What a Ray Train run costs before its first step and after its last, against a Tune trial that trains in itself.

Why a sweep's or a tables job's one-worker trial trains inside the Tune trial (``pipeline.runs.tune.inline``) and
only a trial of several workers launches a Ray Train run: this measures both on one Ray, with a training function
that does nothing but note the time and report once.

- **Ray Train run**: ``TorchTrainer.fit`` of 1 and of 2 workers (``ScalingConfig``, gloo), with the controller's poll
  at 0.2 s, as ``pipeline.runs.undocumented.poll_reports_fast`` sets it, and at Ray's default 2 s;
- **Tune trial**: ``Tuner.fit`` of one trial of the same function (what a one-worker trial is, without its
  training).

Both functions import torch before they note the time, as every training function of the pipeline does (a Ray
Train worker imports it for its process group anyway). Each is run ``--repeat`` times, alternating; it prints the
median seconds from the call to the function's start ("start") and from its report to the call's return ("stop"),
each side's total over the Tune trial's, and the CPU-seconds Ray's processes (this driver's child processes: GCS,
raylet, the dashboard, every worker and actor) spent during the call, with the last run's by process title (a Ray
Train run's support actors among them).

    python benchmarks/bench_train_start.py            # a few minutes on 2 cores
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"  # read by Ray Train's controller when a run starts


def note_and_report(config: dict) -> None:
    """The training function of both sides: import torch, note the time, report once."""
    import torch  # noqa: F401 - what a trial's training imports first

    Path(config["mark"]).write_text(str(time.time()))
    from ray import tune

    tune.report({"done": 1})


def train_run(workers: int, storage: str, mark: str) -> tuple[float, float]:
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    def loop(config: dict) -> None:
        import torch  # noqa: F401 - as note_and_report

        Path(config["mark"]).write_text(str(time.time()))
        ray.train.report({"done": 1})

    called = time.time()
    TorchTrainer(loop, train_loop_config={"mark": mark}, torch_config=TorchConfig(backend="gloo"),
                 scaling_config=ray.train.ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 0.5}),
                 run_config=ray.train.RunConfig(name=f"train-{workers}-{called}", storage_path=storage)).fit()
    ended, started = time.time(), float(Path(mark).read_text())
    return started - called, ended - started


def tune_trial(storage: str, mark: str) -> tuple[float, float]:
    from ray import tune

    called = time.time()
    tuner = tune.Tuner(tune.with_resources(note_and_report, {"cpu": 0.5}), param_space={"mark": mark},
                       run_config=tune.RunConfig(name=f"tune-{called}", storage_path=storage, verbose=0))
    tuner.fit()
    ended, started = time.time(), float(Path(mark).read_text())
    return started - called, ended - started


def cpu_of_ray(call: Callable[[], tuple[float, float]]) -> tuple[tuple[float, float], dict[str, float]]:
    """``call()``, and the CPU-seconds each of Ray's processes spent during it, by process title (``ray::IDLE``,
    ``ray::TrainController``, ...). Sampled every 0.1 s: a process that ends loses its last 0.1 s. It first waits
    3 s, for the actors of the call before to end (they would count here)."""
    time.sleep(3)

    def sample() -> dict[int, tuple[str, float]]:
        out = {}
        for proc in psutil.Process().children(recursive=True):
            try:
                with proc.oneshot():
                    cpu = proc.cpu_times()
                    out[proc.pid] = ((proc.cmdline() or [""])[0].split(" ")[0], cpu.user + cpu.system)
            except psutil.Error:
                pass
        return out

    before, seen, done = sample(), {}, threading.Event()

    def poll() -> None:
        while not done.wait(0.1):
            keep(sample())

    def keep(now: dict[int, tuple[str, float]]) -> None:  # a process ending has no title any more: keep its last
        for pid, (title, cpu) in now.items():
            seen[pid] = (title or seen.get(pid, ("?", 0.0))[0], cpu)

    thread = threading.Thread(target=poll)
    thread.start()
    try:
        result = call()
    finally:
        done.set()
        thread.join()
    keep(sample())
    spent: dict[str, float] = {}
    for pid, (title, cpu) in seen.items():
        name = title if title.startswith("ray::") else Path(title).name
        spent[name] = spent.get(name, 0.0) + cpu - before.get(pid, (title, 0.0))[1]
    return result, spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    import ray

    ray.init(num_cpus=2, log_to_driver=False, include_dashboard=False)
    sides = {"Tune trial (inline)": (0, "")}  # name: (Ray Train workers, the controller's poll)
    sides |= {f"Ray Train, {w} worker(s), poll {p} s": (w, p) for w in (1, 2) for p in ("0.2", "2")}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
    cpus: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    with tempfile.TemporaryDirectory() as tmp:
        mark, storage = str(Path(tmp, "started")), str(Path(tmp, "runs"))
        for _ in range(args.repeat):
            for name, (workers, poll) in sides.items():
                if workers:
                    os.environ[POLL_ENV] = poll
                run, spent = cpu_of_ray(lambda w=workers: train_run(w, storage, mark) if w else
                                        tune_trial(storage, mark))
                times[name].append(run)
                cpus[name].append(spent)
                print(f"  {name}: start {run[0]:.1f} s, stop {run[1]:.1f} s, Ray's processes "
                      f"{sum(spent.values()):.1f} CPU-s", flush=True)
    ray.shutdown()
    base = statistics.median(a + b for a, b in times["Tune trial (inline)"])
    print(f"median of {args.repeat}, 2 CPUs:")
    for name, runs in times.items():
        start, stop = statistics.median(a for a, _ in runs), statistics.median(b for _, b in runs)
        total = statistics.median(a + b for a, b in runs)
        cpu = statistics.median(sum(s.values()) for s in cpus[name])
        print(f"  {name:36s} start {start:5.1f} s  stop {stop:4.1f} s  total {total:5.1f} s  "
              f"/ Tune trial {total / base:4.2f}  Ray's processes {cpu:4.1f} CPU-s")
    print("CPU-seconds by process title, the last run of each side (>= 0.1):")
    for name, runs in cpus.items():
        parts = sorted(((v, k) for k, v in runs[-1].items() if v >= 0.1), reverse=True)
        print(f"  {name}: " + ", ".join(f"{k} {v:.1f}" for v, k in parts))


if __name__ == "__main__":
    main()
