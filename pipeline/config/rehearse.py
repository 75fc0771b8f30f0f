"""Rehearse a shipped params file on one machine before renting a cluster: its jobs end to end, shrunk only in size.

What fails on a cluster is a *control* setting (a kNN check every 10 epochs, ASHA and its grace period, checkpoints
every 5 epochs, retries, several workers per trial, the loss, the mode, the head); what a laptop cannot hold is a
*size* (CIFAR-10, ResNet-18, 200 epochs, a 240-point grid, 3 CPUs and a GPU per worker). A rehearsal keeps every
control key as the file ships it and changes only the keys of :data:`SIZE_KEYS`, each within its rule:

- data, backbone and width: anything (digits and ``cnn_small`` by default);
- epochs: at least 2 (an epoch inside the run, and the last); with ASHA, ``sweep.epochs`` beyond
  ``sweep.grace_period`` (else ASHA would never stop a trial, and the rehearsal would not rehearse it);
- the validation split (``data.val_size``): anything (a share of the rehearsal's digits by default);
- the tuning budget (``tables.tuning``): ``trials`` from 1 to the shipped count (2 by default), ``epochs`` as epochs;
  the rows' spaces as shipped;
- grid lengths (``sweep.depth``/``batch_size``/``strength``/``lr``, ``tables.rows``, ``tables.seeds``): a non-empty
  subset of the shipped values, in their order (never a value the file does not have); a grid's seeds per point
  (``sweep.num_samples``): from 1 to the shipped count;
- ``ray.num_workers``: at most the shipped count and at least ``min(shipped, 2)`` (several workers stay several);
- CPUs per worker: anything (fractional, so that the workers fit this machine);
- the storage path; GPUs: ``ray.use_gpu: false`` when the rehearsal declares none, ``ray.backend: gloo`` when it
  declares some (a node that declares GPUs it does not have trains on its CPU, scheduled as on GPUs);
- trials at once (``sweep.max_concurrent_trials``, ``tables.max_concurrent_trials``: the cluster's size): null, what
  this machine's Ray holds, or any count.

:func:`plan` turns a params file and overrides into the shrunk params (defaults from :func:`default_sizes`), or a
:class:`RehearsalError` naming the key and its rule (exit 2). ``transfusion rehearse`` (``stages/rehearse.py``) runs
the file's jobs on them: ``prepare``, ``pretrain``, ``evaluate``, ``report`` and ``sweep``, and ``tables`` when the
file has a ``tables`` section; a file with a ``sets`` section only (the set-clustering study) runs ``sets``, shrunk
by :func:`set_sizes`. Pure: no Ray, no MLflow.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config.base import ParamsError, parse_override, read_params_file, set_dotted
from pipeline.config.params import validate_params
from pipeline.config.ray import TRIAL_CPU
from pipeline.config.tables import TablesConfig

GRID_KEYS = ("sweep.depth", "sweep.batch_size", "sweep.strength", "sweep.lr", "tables.rows", "tables.seeds",
             "sets.seeds", "sets.datasets")

#: The keys a rehearsal may change, and the rule each follows (see the module docstring). Everything else is control.
SIZE_KEYS: dict[str, str] = {
    "data.dataset": "data", "data.root": "data", "data.limit_train": "data", "data.limit_test": "data",
    "data.val_size": "data",
    "data.image_size": "data", "data.synthetic.n_samples": "data", "data.synthetic.dim": "data",
    "probe.max_train": "data", "probe.tsne_points": "data", "probe.affinity_points": "data",
    "model.backbone": "backbone", "model.weights": "backbone", "model.embed_dim": "width", "model.hidden_dim": "width",
    "model.projector_dim": "width",
    "train.epochs": "epochs", "sweep.epochs": "epochs",
    **{k: "grid" for k in GRID_KEYS}, "sweep.num_samples": "samples",
    "tables.tuning.trials": "samples", "tables.tuning.epochs": "epochs",
    "ray.num_workers": "workers",
    "ray.cpus_per_worker": "cpus", "sweep.cpus_per_worker": "cpus",
    "ray.storage_path": "storage",
    "ray.use_gpu": "gpus", "ray.backend": "gpus",
    "sweep.max_concurrent_trials": "concurrency", "tables.max_concurrent_trials": "concurrency",
    # the set-clustering study (a file with a `sets` section only): its lengths, counts and widths
    "sets.steps": "sets", "sets.batch_sets": "sets", "sets.test_sets": "sets", "sets.rbf_select_sets": "sets",
    "sets.width": "width", "sets.omniglot_size": "sets",
}
JOBS = ("prepare", "pretrain", "evaluate", "report", "sweep", "tables")  # what a params file runs (tables: its rows,
# or the paper's rows every file has by default)
SETS_JOBS = ("sets",)  # what a file with only a `sets` section runs (presets/set-clustering.yaml)


class RehearsalError(ParamsError):
    """A rehearsal asked to change a control key, or a size beyond its rule; the message names the key."""


@dataclass(frozen=True)
class Plan:
    raw: dict[str, Any]  # the shrunk params file (what the jobs read)
    changed: dict[str, Any]  # every key the rehearsal changed, with its new value
    jobs: tuple[str, ...]


def get(raw: dict[str, Any], dotted: str) -> Any:
    node: Any = raw
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _quarter_floor(x: float) -> float:
    return max(0.25, math.floor(x * 4 + 1e-9) / 4)


def with_default_rows(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with ``tables.rows`` as the jobs see them: the file's, else the paper's rows (the default)."""
    if get(raw, "tables.rows"):
        return raw
    out = copy.deepcopy(raw)
    out.setdefault("tables", {})["rows"] = [r.model_dump(exclude_none=True) for r in TablesConfig().rows]
    return out


def default_sizes(shipped: dict[str, Any], cpus: int, gpus: int = 0) -> dict[str, Any]:
    """The sizes a rehearsal uses unless told otherwise, from the shipped file and this machine's ``cpus`` (and the
    ``gpus`` it declares): digits (512 train images), ``cnn_small`` of width 16, the fewest epochs that still pass
    through every control (a periodic checkpoint, an epoch without kNN, ASHA's first rung), the first two values of
    each grid axis (one strength: the file's strongest, one lr; one seed a point), every row of the file's own
    tables (of the paper's default rows, the 1-layer TransFusion of each table) with its first ``tables.seeds``,
    workers cut to at most 2 (never below the shipped count's min with 2) of CPUs that let two trials run at once."""
    sizes: dict[str, Any] = {
        "data.dataset": "digits", "data.root": "data/raw", "data.limit_train": 512, "data.limit_test": 200,
        "data.image_size": None, "data.val_size": 0.1, "model.backbone": "cnn_small", "model.weights": None,
        "model.embed_dim": 16,
        "probe.max_train": 500, "probe.tsne_points": 200, "probe.affinity_points": 200,
        "ray.storage_path": "ray_results",
    }
    train = shipped.get("train", {})
    sizes["train.epochs"] = min(int(train.get("epochs", 2)), max(2, int(train.get("checkpoint_every", 1) or 1) + 1))
    sweep = shipped.get("sweep", {})
    if sweep.get("asha"):  # its first rung, and an epoch beyond it
        sizes["sweep.epochs"] = min(int(sweep.get("epochs", 2)), int(sweep.get("grace_period", 1)) + 1)
    else:
        sizes["sweep.epochs"] = min(int(sweep.get("epochs", 2)), 2)
    limit = sizes["data.limit_train"]
    for key, take in (("sweep.depth", 2), ("sweep.batch_size", 2), ("sweep.lr", 1)):
        values = list(get(shipped, key) or [])
        if key == "sweep.batch_size":
            values = [b for b in values if b <= limit] or values[:1]
        if values:
            sizes[key] = values[:take]
    if get(shipped, "sweep.strength"):
        sizes["sweep.strength"] = [max(get(shipped, "sweep.strength"))]
    if sweep.get("search", "grid") == "grid" and sweep.get("num_samples"):  # a grid's first seed, as tables.seeds
        sizes["sweep.num_samples"] = 1
    if get(shipped, "tables.seeds"):  # its first seed (tests/stages/test_tables.py runs two: the mean and spread)
        sizes["tables.seeds"] = list(get(shipped, "tables.seeds"))[:1]
    tuning = get(shipped, "tables.tuning")
    if tuning:  # the same budget for every row, shrunk: two points a row (a choice stays a choice), 2 epochs each
        sizes["tables.tuning.trials"] = min(int(tuning.get("trials", 4)), 2)
        if tuning.get("epochs") is not None:
            sizes["tables.tuning.epochs"] = min(int(tuning["epochs"]), 2)
    if not get(shipped, "tables.rows"):
        sizes["tables.rows"] = [r for r in with_default_rows(shipped)["tables"]["rows"]
                                if r["name"] == "TransFusion 1-Layer"]
    workers = int(get(shipped, "ray.num_workers") or 1)
    workers = min(workers, 2)
    sizes["ray.num_workers"] = workers
    each = _quarter_floor((cpus / 2 - TRIAL_CPU) / workers)  # two trials (their functions and workers) at once
    for key in ("ray.cpus_per_worker", "sweep.cpus_per_worker"):
        shipped_cpus = get(shipped, key)
        sizes[key] = min(float(shipped_cpus), each) if shipped_cpus is not None else each
    for key in ("sweep.max_concurrent_trials", "tables.max_concurrent_trials"):
        if get(shipped, key) is not None:  # sized for the file's cluster: here, what this machine's Ray holds
            sizes[key] = None
    if gpus > 0:
        sizes["ray.backend"] = "gloo"
    else:
        sizes["ray.use_gpu"] = False
    return sizes


def set_sizes(shipped: dict[str, Any]) -> dict[str, Any]:
    """The sizes of a set-clustering rehearsal: 3 steps of at most 4 sets, 3 test sets, 3 sets choosing the RBF's
    γ, the first two seeds, every data set but Omniglot (kept only if it is the only one), width 4 per head. Every
    method, lr, kernel, loss weight, k cap and set size (the circles' points, the clusters per set) as shipped."""
    sets = shipped.get("sets", {})
    datasets = [d for d in sets.get("datasets", []) if d != "omniglot"] or sets.get("datasets", [])
    sizes = {"sets.steps": 3, "sets.batch_sets": min(int(sets.get("batch_sets", 4)), 4), "sets.test_sets": 3,
             "sets.rbf_select_sets": 3, "sets.width": 4 * int(sets.get("heads", 4))}
    if sets.get("seeds"):
        sizes["sets.seeds"] = list(sets["seeds"])[:2]
    if datasets:
        sizes["sets.datasets"] = datasets
    return sizes


def violation(shipped: dict[str, Any], key: str, value: Any, gpus: int = 0) -> str | None:
    """Why ``key=value`` is not a size a rehearsal may set (one sentence naming the key), or None."""
    kind = SIZE_KEYS.get(key)
    if kind is None:
        return (f"{key} is a control key: a rehearsal keeps it as the file ships it ({get(shipped, key)!r}); it may "
                f"change only the size keys {', '.join(SIZE_KEYS)}")
    old = get(shipped, key)
    if kind == "epochs" and not (isinstance(value, int) and value >= 2):
        return f"{key}: {value!r}; a rehearsal trains at least 2 epochs (an epoch inside the run, and the last)"
    if kind == "grid":
        old = list(old or [])
        new = value if isinstance(value, list) else None
        if not new or any(v not in old for v in new) or sorted(new, key=old.index) != new:
            return (f"{key}: {value!r}; a rehearsal shortens a grid to a non-empty subset of the shipped values "
                    f"{old!r}, in their order")
    if kind == "samples" and not (isinstance(value, int) and 1 <= value <= int(old or 1)):
        return (f"{key}: {value!r}; a rehearsal runs from 1 to the shipped {int(old or 1)} (seeds a grid point, "
                "trials a row)")
    if kind == "workers":
        old = int(old or 1)
        if not (isinstance(value, int) and min(old, 2) <= value <= old):
            return (f"{key}: {value!r}; a rehearsal keeps between {min(old, 2)} and {old} workers (the file ships "
                    f"{old}: several workers stay several)")
    if key == "ray.use_gpu" and gpus == 0 and value:
        return "ray.use_gpu: true needs GPUs: declare them (--gpus N) or keep ray.use_gpu: false"
    if key == "ray.backend" and value not in ("gloo", old):
        return f"ray.backend: {value!r}; a rehearsal keeps {old!r} or trains on gloo (GPUs it only declares)"
    return None


def plan(path: str | Path, overrides: Iterable[str] = (), *, cpus: int = 2, gpus: int = 0) -> Plan:
    """The rehearsal of ``path``: the shipped file with :func:`default_sizes` and then ``overrides`` (``key=value``
    as ``-S``) applied, validated as params. Raises :class:`RehearsalError` naming every key that is not a size or
    breaks its rule, and :class:`ParamsError` for params that are invalid anyway."""
    sets_only = set(read_params_file(path)) == {"sets"}
    shipped = read_params_file(path) if sets_only else with_default_rows(read_params_file(path))
    changed = set_sizes(shipped) if sets_only else default_sizes(read_params_file(path), cpus, gpus)
    problems = []
    for text in overrides:
        parts, value = parse_override(text)
        key = ".".join(parts)
        reason = violation(shipped, key, value, gpus)
        if reason:
            problems.append(reason)
        else:
            changed[key] = value
    raw = copy.deepcopy(shipped)
    for key, value in changed.items():
        if key not in ("sweep.lr",) or get(shipped, key):
            set_dotted(raw, key, value)
    sweep = raw.get("sweep", {})
    if sweep.get("asha") and int(sweep.get("epochs", 0)) <= int(sweep.get("grace_period", 0)):
        problems.append(f"sweep.epochs: {sweep['epochs']} with sweep.asha and sweep.grace_period "
                        f"{sweep['grace_period']}; a rehearsal runs more epochs than the grace period, or ASHA would "
                        "never stop a trial")
    if problems:
        raise RehearsalError(f"cannot rehearse {path}:\n  " + "\n  ".join(problems))
    if sets_only:
        from pydantic import ValidationError

        from pipeline.config.base import format_error
        from pipeline.config.sets import SetsConfig

        try:
            SetsConfig.model_validate(raw["sets"])
        except ValidationError as err:
            raise ParamsError(format_error(err, f"{path} as rehearsed", SetsConfig, prefix=("sets",))) from None
        return Plan(raw=raw, changed={k: get(raw, k) for k in changed}, jobs=SETS_JOBS)
    validate_params(raw, source=f"{path} as rehearsed")
    return Plan(raw=raw, changed={k: get(raw, k) for k in changed}, jobs=JOBS)
