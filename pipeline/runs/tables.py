"""The tables job (the paper's Tables 1-2, the studies in ``presets/``): every row of ``tables.rows`` once per seed
beside the controls, as one Ray Tune job (its plan: ``pipeline.evaluation.tables_rows``). Each (row, seed) is a
trial: the sweep's Train trial, then ``probe.probes`` on the frozen backbone, reported with its cost (wall time ×
GPUs, or × workers on a CPU-only cluster). A control only probes.

Rows with a ``space`` are tuned first (``tables.tuning``), as a Tune job of its own (``<job>-tuning``, resumed like
the final one): each tries the same number of points for the same epochs with the same seed, and is scored by the
online kNN of its last epoch, on the validation split; nothing of the tuning phase reads the test set. Each row's best
point then joins its params for the final rows × seeds, the only runs probed on the test images.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from ray import tune

from pipeline.config.names import row_label, tables_label
from pipeline.config.params import Params
from pipeline.config.ray import TRIAL_CPU, torch_threads
from pipeline.config.resources import max_concurrent, trial_shape
from pipeline.config.space import trial_params
from pipeline.data.prepared import load_prepared
from pipeline.evaluation.report import NA, fmt_cell, fmt_minutes
from pipeline.evaluation.tables_report import ALL_PROBES
from pipeline.evaluation.tables_rows import (
    Row,
    Tuned,
    control_rows,
    resolve_rows,
    seeds_of,
    trial_configs,
    trial_row_params,
    tuning_rows,
    with_choices,
)
from pipeline.evaluation.tuning_report import chosen_points
from pipeline.host import use_threads
from pipeline.runs import tracking as trk
from pipeline.runs.cluster import with_worker_cpus
from pipeline.runs.job import (
    TRAINING,
    Job,
    Manifest,
    Tracked,
    WorkerSpec,
    flat_sections,
    open_job,
    read_manifest,
    say,
)
from pipeline.runs.tune import (
    Config,
    JobResult,
    Outcome,
    Result,
    Trial,
    TrialTracker,
    fit_trial,
    inline,
    trainable,
    trial_placement,
    tune_job,
)

STAGE = "tables"


# --------------------------------------------------------------------------------------------------- trial
@dataclass(frozen=True)
class RowProbes:
    """A row's probes, as its trial reports them."""

    accuracies: dict[str, float]  # each probe's test accuracy
    n_probe: int  # the training images the probes were fit on
    held: dict[str, float]  # the Ray resources they ran with ({"CPU": 3.0, "GPU": 1.0}; {} outside Ray)


def probe_row(params: Params, data_dir: str, manifest: Manifest, model_state: dict[str, torch.Tensor] | None,
              control: str | None = None) -> RowProbes:
    """A row's probes on its trained model (``model_state``), or a control's (``raw_pixels``, ``random_init``)."""
    import ray

    from pipeline.data.storage import fetch_prepared
    from pipeline.training.rows import probe_row_model

    use_threads(torch_threads(params.ray.cpus_per_worker))  # a control's trial, a Ray task: Ray's OMP_NUM_THREADS
    accuracies, n_probe = probe_row_model(params, fetch_prepared(data_dir, manifest), model_state, control)
    held = ray.get_runtime_context().get_assigned_resources() if ray.is_initialized() else {}
    return RowProbes(accuracies, n_probe, {k: float(v) for k, v in held.items() if k in ("CPU", "GPU")})


def probe_where_trained(params: Params, job: WorkerSpec, model_state: dict[str, torch.Tensor] | None,
                        control: str | None = None) -> RowProbes:
    """Run :func:`probe_row` where the row's resources are: in a one-worker row's trial (it holds the worker's bundle),
    else as a Ray task of one worker's resources, once the row's Ray Train run has released them."""
    args = (params, job.data_dir, job.manifest, model_state, control)
    if inline(params):
        return probe_row(*args)
    import ray

    # "DEFAULT": outside the trial's placement group, where Tune would put a child task and only TRIAL_CPU is
    task = ray.remote(probe_row).options(num_cpus=params.ray.cpus_per_worker, num_gpus=1 if job.use_gpu else 0,
                                         max_retries=0, scheduling_strategy="DEFAULT")
    return ray.get(task.remote(*args))


def _row_trial(config: Config, job: WorkerSpec) -> None:
    """One (row, seed): the Train trial with ``train.seed`` the seed, then the probes (a control's only); a tuning
    trial only trains, scored by its online kNN on the validation split."""
    row = config["row"]
    params = trial_row_params(job.params, row)
    run = None if row["control"] else fit_trial(job, params)
    if row.get("phase") == "tuning":
        assert run is not None  # a tuning row is never a control
        knn = [h["knn_acc"] for h in run.state.history if h.get("knn_acc") is not None]
        workers = params.ray.num_workers
        tune.report({"evaluated": 1, "epoch": run.state.epoch, "knn_acc": knn[-1] if knn else math.nan,
                     "train_seconds": float(sum(h["seconds"] for h in run.state.history)), "fit_seconds": run.seconds,
                     "workers": workers, "hours": run.seconds * workers / 3600})
        return
    start = time.time()
    probes = probe_where_trained(params, job, run.state.model if run else None, row["control"])
    history = run.state.history if run else []
    knn = [h["knn_acc"] for h in history if h.get("knn_acc") is not None]
    workers, seconds = (params.ray.num_workers, run.seconds) if run else (0, 0.0)
    tune.report({
        "evaluated": 1, "epoch": run.state.epoch if run else 0, "knn_acc": knn[-1] if knn else math.nan,
        **{f"probe.{k}": v for k, v in probes.accuracies.items()}, "n_probe_train": probes.n_probe,
        "train_seconds": float(sum(h["seconds"] for h in history)), "fit_seconds": seconds,
        "eval_seconds": time.time() - start, "workers": workers, "gpus": workers if job.use_gpu else 0,
        "hours": seconds * workers / 3600, "checkpoint_path": (run.state.path or "") if run else "",
        "probe_cpus": probes.held.get("CPU", 0.0), "probe_gpus": probes.held.get("GPU", 0.0),
    })


class TablesTracker(TrialTracker):
    """The driver-side tracker of rows: a child run per (row, seed), with its probes and hours."""

    PREFIX = "[tables]"
    STAGE = "tables-row"

    def __init__(self, epochs: int, record_dir: str, run: Tracked | None, unit: str, phase: str = "final") -> None:
        super().__init__(epochs, record_dir, run)
        self.unit, self.phase = unit, phase
        self.PREFIX = "[tables tuning]" if phase == "tuning" else "[tables]"

    def child_tags(self) -> dict[str, str]:
        """A row's child run is told apart by its phase: ``tuning`` (scored on validation) or ``final``."""
        return {**super().child_tags(), "phase": self.phase}

    def labels(self, config: Config) -> dict[str, object]:
        row = config["row"]  # its identity: the MLflow params of its child run
        control = {"control": row["control"]} if row["control"] else {}
        return {"table": row["table"], "row": row["name"], "seed": row["seed"], **control, **row["params"]}

    def child_name(self, config: Config) -> str:
        """A row's MLflow run name: ``TransFusion 9-Layer (table 1) · seed 0``."""
        return trial_label(config["row"])

    def epochs_of(self, trial: Trial) -> int:
        """A row's epochs; a control's 0 (it trains none, and does not stop early)."""
        row = trial.config["row"]
        return 0 if row["control"] else int(row["params"].get("train.epochs", self.epochs))

    def on_trial_start(self, iteration: int, trials: list[Trial], trial: Trial, **info: object) -> None:
        row = trial.config["row"]
        params = ", ".join(f"{k} {v}" for k, v in row["params"].items())
        say(f"{self.PREFIX} {self._done(trials)} done; trial {trial.trial_id} started: {trial_label(row)}"
            + (f" ({params})" if params else ""))
        self._child(trial)

    def on_trial_result(self, iteration: int, trials: list[Trial], trial: Trial, result: Result,
                        **info: object) -> None:
        if not result.get("evaluated"):
            return super().on_trial_result(iteration, trials, trial, result, **info)
        if self.phase == "tuning":
            say(f"{self.PREFIX} {trial_label(trial.config['row'])}: validation kNN {fmt_cell(result['knn_acc'])}")
            return None
        probes = {k.removeprefix("probe."): v for k, v in result.items() if k.startswith("probe.")}
        accs = ", ".join(f"{k} {fmt_cell(NA if v is None else v)}" for k, v in probes.items())
        cost = "" if trial.config["row"]["control"] else (
            f"; trained {fmt_minutes(result['train_seconds'] / 60)} min, {result['hours']:.2g} {self.unit}")
        say(f"{self.PREFIX} {trial_label(trial.config['row'])}: {accs}{cost}")
        child = self._child(trial)
        if child:
            keys = [f"probe.{k}" for k in probes] + ["train_seconds", "fit_seconds", "eval_seconds", "hours"]
            trk.log_metrics_batch(self.run.uri, child, [result], tuple(keys))
            trk.set_tags(child, {"hours_unit": self.unit}, uri=self.run.uri)


def trial_label(row: Config) -> str:
    """A (row, seed) trial's name (:func:`pipeline.config.names.row_label`) from its config."""
    return row_label(row["name"], row["table"], row["seed"], bool(row["control"]))


# -------------------------------------------------------------------------------------------------- driver
def collect(trials: list[Outcome], rows: list[Row], unit: str) -> list[dict[str, object]]:
    """One record per (row, seed) in ``tables.rows``' order, controls first: who it is (:meth:`Row.record`),
    accuracies, cost, history."""
    by_index = {r.index: r for r in rows}
    out = []
    for t in trials:
        config = t.config["row"]
        row = by_index[config["index"]]
        m, p = t.last, row.params
        done = not t.error and bool(m.get("evaluated"))
        knn = m.get("knn_acc") if done else None
        out.append({
            **row.record(config["seed"]), "trial_id": t.trial_id,
            "epochs": int(m["epoch"]) if done else max((int(h["epoch"]) for h in t.history), default=0),
            **{k: (m.get(f"probe.{k}") if done else None) for k in ALL_PROBES},
            "knn_acc": knn if knn is not None and math.isfinite(knn) else None,
            "train_minutes": m["train_seconds"] / 60 if done else None,
            "fit_seconds": m.get("fit_seconds"), "eval_seconds": m.get("eval_seconds"),
            "workers": 0 if row.control else p.ray.num_workers, "gpus": int(m["gpus"]) if done else None,
            "hours": m.get("hours") if done else None, "hours_unit": unit,
            "probe_cpus": m.get("probe_cpus") if done else None, "probe_gpus": m.get("probe_gpus") if done else None,
            **t.ending(done, "" if done else "no evaluation reported"),
        })
    return sorted(out, key=lambda r: (r["index"], r["seed"]))


def tune_rows(job: Job, params: Params, tuned: list[Tuned], unit: str) -> list[dict[str, object]]:
    """The tuning phase: every (searched row, point) once with ``tables.tuning.seed``, as the Tune job
    ``<job>-tuning`` (resumed like the final one); a record per trial (:data:`TUNING_COLUMNS`), in plan order."""
    seed = params.tables.tuning.seed if params.tables.tuning else 0
    tjob = replace(job, spec=replace(job.spec, name=f"{job.name}-tuning"))
    tjob.state_dir.mkdir(parents=True, exist_ok=True)
    configs = [t.config(seed) for t in tuned]
    base = params.model_dump()
    trainer = trainable(_row_trial, tjob.spec,
                        lambda config: trial_placement(trial_params(base, config["row"]["params"]), job.gpu))
    shape = trial_shape(params, job.gpu, trial_cpu=TRIAL_CPU)
    concurrent = max_concurrent(params.tables.max_concurrent_trials, shape, job.totals, len(configs))
    rows = len({t.of for t in tuned})
    announce = (f"[tables tuning] {tjob.name}: {rows} row(s) x {len(tuned) // rows} point(s), "
                f"{tuned[0].row.params.train.epochs} epoch(s) each, train.seed {seed}, scored on the validation split: "
                f"{len(configs)} trials, up to {concurrent} at a time")
    tracker = TablesTracker(params.train.epochs, str(tjob.state_dir), job.run, unit, phase="tuning")
    result = tune_job(tjob, trainer, {"row": tune.grid_search(configs)}, tracker=tracker, concurrent=concurrent,
                      announce=announce, metric=None, reuse_actors=all(inline(t.row.params) for t in tuned))
    by_index, records = {t.row.index: t for t in tuned}, {}
    for o in result.outcomes:
        t, m = by_index[o.config["row"]["index"]], o.last
        knn = m.get("knn_acc") if not o.error and m.get("evaluated") else None
        knn = knn if isinstance(knn, float) and math.isfinite(knn) else None
        records[t.row.index] = {
            "table": t.row.table, "name": params.tables.rows[t.of].name, "of": t.of,
            "point": json.dumps(t.point, sort_keys=True), "seed": seed, "epochs": m.get("epoch"), "knn_acc": knn,
            "train_minutes": m["train_seconds"] / 60 if knn is not None else None, "trial_id": o.trial_id,
            "status": "ERROR" if o.error else "TERMINATED", "error": o.error}
    return [records[t.row.index] for t in tuned]


def run_tables(params: Params, data_dir: Path, root: Path, *, tracking: bool = True) -> JobResult:
    """Run (or resume) the tables job: the tuning phase of the rows with a space, then the final rows × seeds with
    each row's chosen point; returns its result (``rows``: :func:`collect`; ``tuning``: :func:`tune_rows`'s records;
    ``unit``: the hours'). Raises ``ParamsError`` for bad rows (before Ray) and ``SweepError`` if interrupted or every
    row failed."""
    params = with_worker_cpus(params, TRIAL_CPU)  # null: this machine's CPUs less the trial's own
    tuning_rows(params, resolve_rows(params))  # the params first, every row and point of a space: exit 2 before data
    load_prepared(data_dir, verify=True, mmap=True)  # a corrupt input fails here (mapped: never read whole)
    n_train = read_manifest(data_dir).get("n_train")
    rows = resolve_rows(params, n_train)
    tuned = tuning_rows(params, rows, n_train)  # every point of every searched row, validated before any work
    seeds = seeds_of(params)
    tuning = params.tables.tuning
    logged = {**flat_sections(params, (*TRAINING, "probe")),
              **{f"tables.{r.table}.{r.name}": json.dumps(r.overrides, sort_keys=True) for r in rows},
              **{f"tables.space.{r.table}.{r.name}": json.dumps(params.tables.rows[r.index].space, sort_keys=True)
                 for r in rows if params.tables.rows[r.index].space},
              "tables.seeds": json.dumps(seeds), "tables.controls": json.dumps(params.tables.controls),
              "tables.reference": str(params.tables.reference),
              "tables.tuning": json.dumps(tuning.model_dump() if tuning else None)}
    job = open_job(STAGE, params, data_dir, root, tracking=tracking, title=tables_label([r.table for r in rows],
                   len(seeds)), logged=logged, trial_cpu=TRIAL_CPU, what="a tables row")
    unit = "GPU-hours" if job.gpu else "worker-hours"
    tried = tune_rows(job, params, tuned, unit) if tuned else []
    if tried:  # each searched row runs its best point (on the validation split) from here on
        params = with_choices(params, {i: json.loads(r["point"]) for i, r in chosen_points(tried).items()})
        rows = resolve_rows(params, n_train)
    base = params.model_dump()  # what every row starts from
    configs = trial_configs(params, rows)
    space = {"row": tune.grid_search(configs)}
    trainer = trainable(_row_trial, job.spec,  # a row's workers may differ from the base's: its own placement
                        lambda config: trial_placement(trial_params(base, config["row"]["params"]), job.gpu))
    shape = trial_shape(params, job.gpu, trial_cpu=TRIAL_CPU)  # a row's workers: ray.cpus_per_worker
    concurrent = max_concurrent(params.tables.max_concurrent_trials, shape, job.totals, len(configs))
    announce = (f"[tables] {job.name}: {len(rows)} rows (table 1: {sum(r.table == 1 for r in rows)}, table 2: "
                f"{sum(r.table == 2 for r in rows)}) x {len(seeds)} seed(s) {seeds}"
                + (f", controls {', '.join(params.tables.controls)}" if params.tables.controls else "")
                + f": {len(configs)} trials, up to {concurrent} at a time, {'GPU' if job.gpu else 'CPU'} workers")
    # no scheduler: results need not carry knn_acc (train.knn_every), and one-worker rows may reuse a process
    tracker = TablesTracker(params.train.epochs, str(job.state_dir), job.run, unit)
    result = tune_job(job, trainer, space, tracker=tracker, concurrent=concurrent, announce=announce, metric=None,
                      reuse_actors=all(inline(r.params) for r in rows))
    result.rows = collect(result.outcomes, [*control_rows(params), *rows], unit)
    result.tuning, result.unit = tried, unit
    return result
