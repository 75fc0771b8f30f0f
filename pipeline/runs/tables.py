"""The tables job: an explicit list of rows, each run once per seed beside the controls, as one Ray Tune job; the
paper's Tables 1-2 (``presets/paper-tables.yaml``) and the studies (``presets/fashion-mnist-*.yaml``) are such jobs.

- Rows (``tables.rows``, :class:`pipeline.config.tables.TableRow`): a name, a table (1: self-supervised, 2:
  supervised) and params overrides on the file's ``model``/``loss``/``augment``/``train``. :func:`resolve_rows` turns
  each into full, validated params before any work (a row's mode must be its table's; a loss must suit the mode; ...).
- Seeds and controls: every row runs once per ``tables.seeds`` (its ``train.seed``); the controls
  (``tables.controls``: the raw pixels once, the backbone at its random initialisation per seed) are probed in trials
  of their own and never trained (:func:`trial_configs`).
- One Tune job (``grid_search`` over the (row, seed) configs), each trial :func:`pipeline.runs.tune.fit_trial` (the
  Train trial the sweep runs too), then, in the trial, ``probe.probes`` on the frozen backbone at 100 % of the labels
  (``pipeline.evaluation.evaluate.probe_frozen``), reported to Tune as the trial's last result.
- Cost per row: the Train run's wall time × its GPUs (GPU-hours), or × its workers on a CPU-only cluster
  (worker-hours); the table labels the column accordingly.
- MLflow, from the driver (:class:`TablesTracker`, a ``pipeline.runs.tune.TrialTracker``): one parent run, one
  child per (row, seed) with its per-epoch metrics (online kNN, health), its probe accuracies and its hours; FAILED
  with the reason for a trial that failed.
- :func:`collect` gives a record per (row, seed) with its per-epoch history; ``pipeline.evaluation.tables_report``
  renders them (mean ± sd over seeds, the paper's layout, the curves).

Probes run after training where the row's resources are (:func:`probe_where_trained`: in the trial of a one-worker
row, as a Ray task of one worker's CPUs and GPU for a row of several workers); ``probe.max_train`` caps their
training set (null: the paper's 100 % of the labels).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray import tune

from pipeline.config.base import ParamsError, flatten
from pipeline.config.names import row_label, stable_name, tables_label
from pipeline.config.params import Params
from pipeline.config.ray import TRIAL_CPU
from pipeline.config.space import trial_params
from pipeline.config.tables import CONTROLS
from pipeline.evaluation.report import NA, PAPER_TABLES, fmt_cell, fmt_minutes
from pipeline.evaluation.tables_report import ALL_PROBES
from pipeline.runs import tracking as trk
from pipeline.runs.train import WorkerSpec, error_reason, say
from pipeline.runs.tune import (
    SweepResult,
    TrialTracker,
    at_once,
    checkpoint_history,
    fit_trial,
    inline,
    last_checkpoint_path,
    max_concurrent,
    trainable,
    trial_placement,
    tune_job,
)

STAGE = "tables"


# ---------------------------------------------------------------------------------------------------- rows
@dataclass(frozen=True)
class Row:
    index: int
    name: str
    table: int  # 0: a control, in every table
    paper: str | None  # the paper's row it stands beside (None: ours only)
    overrides: dict[str, Any]
    params: Params  # the file's base with the overrides, validated
    control: str | None = None  # raw_pixels | random_init: probed, never trained

    def config(self, seed: int) -> dict[str, Any]:
        """What the Tune trial of this row with ``train.seed`` ``seed`` gets (plain values)."""
        return {"index": self.index, "name": self.name, "table": self.table, "paper": self.paper,
                "params": self.overrides, "seed": seed, "control": self.control}


def seeds_of(params: Params) -> list[int]:
    """``tables.seeds``, or the file's ``train.seed`` alone."""
    return list(params.tables.seeds) if params.tables.seeds is not None else [params.train.seed]


def control_rows(params: Params) -> list[Row]:
    """``tables.controls`` as rows of table 0 (indices below the trained rows': listed first), on the file's base."""
    chosen = params.tables.controls
    return [Row(i - len(chosen), CONTROLS[c], 0, None, {}, params, c) for i, c in enumerate(chosen)]


def trial_configs(params: Params, rows: list[Row]) -> list[dict[str, Any]]:
    """One Tune trial per (row, seed), the controls included; ``raw_pixels`` once (it has no randomness)."""
    seeds = seeds_of(params)
    return [r.config(s) for r in [*control_rows(params), *rows]
            for s in (seeds[:1] if r.control == "raw_pixels" else seeds)]


def resolve_rows(params: Params, n_train: int | None = None) -> list[Row]:
    """Every row's full params; raises :class:`ParamsError` naming each bad row and key, before any work."""
    base = params.model_dump()  # what every row starts from
    modes = {1: "self_supervised", 2: "supervised"}
    rows, problems = [], []
    for i, r in enumerate(params.tables.rows):
        where = f"tables.rows[{i}] ({r.name!r}, table {r.table})"
        try:
            p = trial_params(base, r.params, source=where)
        except ParamsError as exc:
            problems.append(str(exc))
            continue
        if p.train.mode != modes[r.table]:
            problems.append(f"{where}: train.mode is {p.train.mode}, but table {r.table} is {modes[r.table]}; set "
                            f"train.mode: {modes[r.table]} in the row's params (or move the row)")
        if n_train is not None and p.train.batch_size > n_train:
            problems.append(f"{where}: train.batch_size {p.train.batch_size} exceeds the training set ({n_train} "
                            "samples)")
        names = [n for n, *_ in PAPER_TABLES[r.table][1]]
        if r.paper is not None and r.paper not in names:
            problems.append(f"{where}: paper: {r.paper!r} is not a row of the paper's table {r.table} "
                            f"({', '.join(names)}); use one of those or null")
        paper = r.paper if r.paper is not None else (r.name if r.name in names else None)
        rows.append(Row(i, r.name, r.table, paper, dict(r.params), p))
    if problems:
        raise ParamsError("invalid tables rows:\n  " + "\n  ".join(problems))
    return rows


def job_name(params: Params, manifest: dict[str, Any]) -> str:
    """Stable name from everything that determines the job's result: the rows and their base, probes, data."""
    keyed = {s: getattr(params, s).model_dump() for s in ("model", "loss", "augment", "train", "probe", "tables")}
    keyed["ray"] = {"num_workers": params.ray.num_workers}
    return stable_name(STAGE, keyed, manifest)


# --------------------------------------------------------------------------------------------------- trial
def probe_row(params: dict[str, Any], data_dir: str, manifest: dict[str, Any], model_state: dict[str, Any] | None,
              control: str | None = None) -> tuple[dict[str, float], int, dict[str, float]]:
    """A row's probes on its trained model (``model_state``), or a control's (``raw_pixels``: the pixels;
    ``random_init``: the model as ``train.seed`` initialises it, as the training loop does), wherever this runs
    (``pipeline.evaluation.evaluate.probe_frozen``); also returns the Ray resources it ran with (``{"CPU": 3.0,
    "GPU": 1.0}``)."""
    import ray
    import torch

    from pipeline.core.model import build_model
    from pipeline.evaluation.evaluate import probe_frozen
    from pipeline.runs.storage import fetch_prepared

    p = Params.model_validate(params, strict=False)
    data = fetch_prepared(data_dir, manifest)
    model = None
    if control != "raw_pixels":
        torch.manual_seed(p.train.seed)  # as pipeline.training.loop.PretrainLoop before it builds the model
        model = build_model(p.model, data.input_shape)
        if model_state is not None:
            model.load_state_dict(model_state)
    accuracies, n_probe = probe_frozen(p, data, model)
    held = ray.get_runtime_context().get_assigned_resources() if ray.is_initialized() else {}
    return accuracies, n_probe, {k: float(v) for k, v in held.items() if k in ("CPU", "GPU")}


def probe_where_trained(params: Params, job: WorkerSpec, model_state: dict[str, Any] | None,
                        control: str | None = None):
    """Run :func:`probe_row` where the row's resources are: a one-worker row in its trial, which holds the worker's
    bundle (its CPUs and GPU); a row of several workers, whose trial function holds only ``TRIAL_CPU`` on the head,
    as a Ray task with one worker's resources, scheduled like the row's workers (on a GPU node when they train on
    GPUs) once its Ray Train run has released them."""
    args = (params.model_dump(), job.data_dir, job.manifest, model_state, control)
    if inline(params):
        return probe_row(*args)
    import ray

    # "DEFAULT": outside the trial's placement group (Tune's capture of child tasks would put it there, where only
    # the trial's own TRIAL_CPU is)
    task = ray.remote(probe_row).options(num_cpus=params.ray.cpus_per_worker, num_gpus=1 if job.use_gpu else 0,
                                         max_retries=0, scheduling_strategy="DEFAULT")
    return ray.get(task.remote(*args))


def _row_trial(config: dict[str, Any], job: WorkerSpec) -> None:
    """One (row, seed): the Train trial on the row's params with ``train.seed`` the seed, then the probes, reported to
    Tune as the last result; a control only probes."""
    row = config["row"]
    params = trial_params(job.params, {**row["params"], "train.seed": row["seed"]},
                          source=f"tables row {row['name']!r}")
    workers = params.ray.num_workers
    if row["control"]:
        start = time.time()
        accuracies, n_probe, held = probe_where_trained(params, job, None, control=row["control"])
        tune.report({"evaluated": 1, "epoch": 0, "knn_acc": math.nan,
                     **{f"probe.{k}": v for k, v in accuracies.items()}, "n_probe_train": n_probe,
                     "train_seconds": 0.0, "fit_seconds": 0.0, "eval_seconds": time.time() - start, "workers": 0,
                     "gpus": 0, "hours": 0.0, "checkpoint_path": "", "probe_cpus": held.get("CPU", 0.0),
                     "probe_gpus": held.get("GPU", 0.0)})
        return
    run = fit_trial(job, params)
    state = run.state
    start = time.time()
    accuracies, n_probe, held = probe_where_trained(params, job, state["model"])
    history = state["history"]
    knn = [h["knn_acc"] for h in history if h.get("knn_acc") is not None]
    tune.report({
        "evaluated": 1, "epoch": int(state["epoch"]), "knn_acc": knn[-1] if knn else math.nan,
        **{f"probe.{k}": v for k, v in accuracies.items()}, "n_probe_train": n_probe,
        "train_seconds": float(sum(h["seconds"] for h in history)), "fit_seconds": run.seconds,
        "eval_seconds": time.time() - start, "workers": workers, "gpus": workers if job.use_gpu else 0,
        "hours": run.seconds * workers / 3600, "checkpoint_path": run.checkpoint_path,
        "probe_cpus": held.get("CPU", 0.0), "probe_gpus": held.get("GPU", 0.0),
    })


class TablesTracker(TrialTracker):
    """The driver-side tracker of rows: a child run per (row, seed), and its probes and hours at its end."""

    PREFIX = "[tables]"
    STAGE = "tables-row"

    def __init__(self, *args: Any, unit: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.unit = unit

    def labels(self, config: dict[str, Any]) -> dict[str, Any]:
        row = config["row"]  # its identity: the MLflow params of its child run
        control = {"control": row["control"]} if row["control"] else {}
        return {"table": row["table"], "row": row["name"], "seed": row["seed"], **control, **row["params"]}

    def child_name(self, config: dict[str, Any]) -> str:
        """A row's MLflow run name: ``TransFusion 9-Layer (table 1) · seed 0``."""
        return trial_label(config["row"])

    def epochs_of(self, trial) -> int:
        """A row's epochs; a control's 0 (it trains none, and does not stop early)."""
        row = trial.config["row"]
        return 0 if row["control"] else int(row["params"].get("train.epochs", self.epochs))

    def on_trial_start(self, iteration, trials, trial, **info) -> None:
        row = trial.config["row"]
        params = ", ".join(f"{k} {v}" for k, v in row["params"].items())
        say(f"{self.PREFIX} {self._done(trials)} done; trial {trial.trial_id} started: {trial_label(row)}"
            + (f" ({params})" if params else ""))
        self._child(trial)

    def on_trial_result(self, iteration, trials, trial, result, **info) -> None:
        if not result.get("evaluated"):
            return super().on_trial_result(iteration, trials, trial, result, **info)
        probes = {k.removeprefix("probe."): v for k, v in result.items() if k.startswith("probe.")}
        accs = ", ".join(f"{k} {fmt_cell(NA if v is None else v)}" for k, v in probes.items())
        cost = "" if trial.config["row"]["control"] else (
            f"; trained {fmt_minutes(result['train_seconds'] / 60)} min, {result['hours']:.2g} {self.unit}")
        say(f"{self.PREFIX} {trial_label(trial.config['row'])}: {accs}{cost}")
        child = self._child(trial)
        if child:
            keys = [f"probe.{k}" for k in probes] + ["train_seconds", "fit_seconds", "eval_seconds", "hours"]
            trk.log_metrics_batch(self.uri, child, [result], tuple(keys))
            trk.set_tags(child, {"hours_unit": self.unit}, uri=self.uri)


def trial_label(row: dict[str, Any]) -> str:
    """A (row, seed) trial's name (:func:`pipeline.config.names.row_label`) from its config."""
    return row_label(row["name"], row["table"], row["seed"], bool(row["control"]))


# -------------------------------------------------------------------------------------------------- driver
def collect(grid, rows: list[Row], unit: str) -> list[dict[str, Any]]:
    """One record per (row, seed), controls first, then in the order of ``tables.rows``: its params, accuracies
    (None: not computed), cost and per-epoch ``history`` (the online kNN curve, read from its last checkpoint)."""
    by_index = {r.index: r for r in rows}
    out = []
    for result in grid:
        config = result.config["row"]
        row = by_index[config["index"]]
        # the row's evaluation, also if Tune received the last epoch's metrics after it (they travel separately)
        reported = [] if result.metrics_dataframe is None else result.metrics_dataframe.to_dict("records")
        evaluated = [h for h in reported if h.get("evaluated") == 1]
        m = evaluated[-1] if evaluated else (result.metrics or {})
        p = row.params
        done = result.error is None and bool(m.get("evaluated"))
        history = checkpoint_history(last_checkpoint_path(m, result)) or []
        knn = m.get("knn_acc") if done else None
        out.append({
            "index": row.index, "table": row.table, "name": row.name, "paper": row.paper, "seed": config["seed"],
            "control": row.control or "", "trial_id": Path(result.path).name.removeprefix("trial-"),
            "train.mode": p.train.mode, "loss.name": p.loss.name, "model.depth": p.model.depth,
            "model.backbone": p.model.backbone, "train.batch_size": p.train.batch_size,
            "epochs": int(m["epoch"]) if done else max((int(h["epoch"]) for h in history), default=0),
            **{k: (m.get(f"probe.{k}") if done else None) for k in ALL_PROBES},
            "knn_acc": knn if knn is not None and math.isfinite(knn) else None,
            "train_minutes": m["train_seconds"] / 60 if done else None,
            "fit_seconds": m.get("fit_seconds"), "eval_seconds": m.get("eval_seconds"),
            "workers": 0 if row.control else p.ray.num_workers, "gpus": int(m["gpus"]) if done else None,
            "hours": m.get("hours") if done else None, "hours_unit": unit,
            "probe_cpus": m.get("probe_cpus") if done else None, "probe_gpus": m.get("probe_gpus") if done else None,
            "status": "TERMINATED" if done else "ERROR",
            "error": error_reason(result.error) if result.error else ("" if done else "no evaluation reported"),
            "history": history,
        })
    return sorted(out, key=lambda r: (r["index"], r["seed"]))


def run_tables(params: Params, data_dir: Path, root: Path, *, tracking: bool = True) -> tuple[SweepResult, str]:
    """Run (or resume) the tables job; returns its result (``rows`` from :func:`collect`) and the hours' unit.

    Raises :class:`ParamsError` for bad rows (before Ray and tracking) and :class:`pipeline.runs.tune.SweepError` if the
    job was interrupted or every row failed.
    """
    from pipeline.runs.cluster import connect, trial_shape, wait_for_workers, with_worker_cpus
    from pipeline.runs.storage import check_storage, stage_prepared
    from pipeline.runs.train import load_callbacks, mlflow_run, storage_location

    callbacks = load_callbacks()  # a wrong name fails here, before Ray starts
    params = with_worker_cpus(params, TRIAL_CPU)  # null: this machine's CPUs less the trial's own
    manifest = json.loads((data_dir / "manifest.json").read_text())
    rows = resolve_rows(params, manifest.get("n_train"))
    name = job_name(params, manifest)
    storage = storage_location(params, root)
    check_storage(storage)
    gpu, totals = connect(params, root, tracking=tracking, trial_cpu=TRIAL_CPU, what="a tables row")
    wait_for_workers(params, gpu=gpu, trial_cpu=TRIAL_CPU)
    uri = exp = parent = None
    if tracking:  # the parent run only once the cluster can serve the job
        logged = {**{k: v for k, v in flatten(params).items() if k.split(".")[0] in ("model", "loss", "augment",
                                                                                        "train", "probe")},
                  **{f"tables.{r.table}.{r.name}": json.dumps(r.overrides, sort_keys=True) for r in rows},
                  "tables.seeds": json.dumps(seeds_of(params)), "tables.controls": json.dumps(params.tables.controls)}
        title = tables_label([r.table for r in rows], len(seeds_of(params)))
        uri, exp, parent = mlflow_run(root, name, stage=STAGE, title=title, logged=logged, manifest=manifest,
                                      data_dir=data_dir, tags={STAGE: name})
    unit = "GPU-hours" if gpu else "worker-hours"
    base = params.model_dump()  # what every row starts from
    job = WorkerSpec(params=base, data_dir=stage_prepared(data_dir, storage), manifest=manifest, storage=storage,
                     name=name, use_gpu=gpu, callbacks=callbacks)
    configs = trial_configs(params, rows)
    space = {"row": tune.grid_search(configs)}
    trainer = trainable(_row_trial, job,  # a row's workers may differ from the base's: its own placement
                        lambda config: trial_placement(trial_params(base, config["row"]["params"]), gpu))
    tracker = TablesTracker(params.train.epochs, uri, exp, parent, unit=unit)
    shape = trial_shape(params, gpu, trial_cpu=TRIAL_CPU)  # a row's workers: ray.cpus_per_worker
    concurrent = max_concurrent(params.tables.max_concurrent_trials, shape, totals, len(configs))
    seeds = seeds_of(params)
    announce = (f"[tables] {name}: {len(rows)} rows (table 1: {sum(r.table == 1 for r in rows)}, table 2: "
                f"{sum(r.table == 2 for r in rows)}) x {len(seeds)} seed(s) {seeds}"
                + (f", controls {', '.join(params.tables.controls)}" if params.tables.controls else "")
                + f": {len(configs)} trials, up to {concurrent} at a time, {'GPU' if gpu else 'CPU'} workers")
    # no scheduler: results need not carry knn_acc (train.knn_every), and one-worker rows may reuse a process
    grid, resumed, seconds = tune_job(trainer, space, name=name, storage=storage, tracker=tracker,
                                      concurrent=concurrent, announce=announce, what="tables job", metric=None,
                                      reuse_actors=all(inline(r.params) for r in rows))
    records = collect(grid, [*control_rows(params), *rows], unit)
    say(f"[tables] {len(records)} trials in {seconds:.0f} s, {at_once(tracker, concurrent)}")
    return SweepResult(rows=records, name=name, mlflow_run_id=parent, seconds=seconds, resumed=resumed,
                       concurrent=concurrent, peak=tracker.peak_at_once()), unit
