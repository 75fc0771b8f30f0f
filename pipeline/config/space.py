"""The sweep's space and its trials' params: pure params work (no Ray), checked before any job starts.

:func:`axes` and :func:`grid_points` (grid, or random draws; repeats as seeds), every trial's base params
(:func:`base_params`), a point applied to them (:func:`point_params`, :func:`trial_params`: validated, errors name the
point) and the check of every point before any work (:func:`check_points`). The jobs that run the trials are
``pipeline.runs.sweep`` and ``pipeline.runs.tables``.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

from pipeline.config.base import ParamsError, set_dotted
from pipeline.config.names import axis_label
from pipeline.config.params import Params, validate_params

SPACE_KEYS = {"depth": "model.depth", "batch_size": "train.batch_size", "strength": "augment.strength",
              "lr": "train.lr", "loss": "loss.name"}
SEED_KEY = "train.seed"
ABC_DEPTH = "model.abc.blocks"  # what the depth axis sets with model.method: abc (point_params)


def axes(params: Params) -> dict[str, list[Any]]:
    """The swept keys and their values, ``{"model.depth": [0, 1], ...}``; lr and the loss only if listed.

    In grid mode ``sweep.num_samples`` > 1 repeats the grid with seeds ``train.seed + 0 .. num_samples - 1``
    (identical repeats would only measure the same run twice).
    """
    s = params.sweep
    out = {SPACE_KEYS[k]: list(getattr(s, k)) for k in SPACE_KEYS if getattr(s, k)}
    if s.search == "grid" and s.num_samples > 1:
        out[SEED_KEY] = [params.train.seed + i for i in range(s.num_samples)]
    return out


def grid_points(params: Params) -> list[dict[str, Any]]:
    """Every combination of the sweep's values, as ``{"model.depth": 1, ...}``."""
    a = axes(params)
    return [dict(zip(a, combo, strict=True)) for combo in itertools.product(*a.values())]


def base_params(params: Params) -> dict[str, Any]:
    """What every trial shares: the params with the sweep's epochs, a kNN check every epoch (ASHA's metric),
    a checkpoint every epoch (resume loses at most one) and the sweep's per-worker CPUs."""
    base = params.model_dump()
    base["train"]["epochs"] = params.sweep.epochs
    base["train"]["knn_every"] = 1
    base["train"]["warmup_epochs"] = min(base["train"]["warmup_epochs"], params.sweep.epochs - 1)
    base["train"]["checkpoint_every"] = 1
    base["ray"]["cpus_per_worker"] = params.sweep.cpus_per_worker
    return base


def point_params(base: dict[str, Any], point: dict[str, Any]) -> Params:
    """A trial's params: the base with the point applied. With ``model.method: abc`` the depth axis sets ABC's SAB
    blocks (``model.abc.blocks``; ABC has no TransFusion blocks), while the point, its labels and the result columns
    keep the name ``model.depth``."""
    if base["model"].get("method") == "abc":
        point = {ABC_DEPTH if k == SPACE_KEYS["depth"] else k: v for k, v in point.items()}
    return trial_params(base, point)


def check_points(params: Params, n_train: int | None = None) -> None:
    """Validate every point of the space before any work; raises ParamsError naming the point, the key and the
    sweep's lists it comes from."""
    base = base_params(params)
    try:
        for point in grid_points(params):
            p = point_params(base, point)
            if n_train is not None and p.train.batch_size > n_train:
                raise ParamsError(f"sweep.batch_size: {p.train.batch_size} exceeds the training set ({n_train} "
                                  "samples)")
    except ParamsError as exc:
        axes = ", ".join(f"sweep.{k} (sets {v})" for k, v in SPACE_KEYS.items())
        raise ParamsError(f"{exc}\n  the point comes from {axes}: change those lists or the base params") from None


def trial_params(base: dict[str, Any], point: dict[str, Any], source: str | None = None) -> Params:
    """The base params with one point of the space applied (validated: e.g. batch vs workers); errors name
    ``source`` (default: the sweep point)."""
    raw = json.loads(json.dumps(base))
    for dotted, value in point.items():  # "model.depth", or nested: "model.abc.blocks"
        set_dotted(raw, dotted, value)
    return validate_params(raw, source=source or f"sweep point {point}")


def point_of(config: dict[str, Any]) -> dict[str, Any]:
    """A trial's point: the dotted keys of its config (``{"model.depth": 1, ...}``)."""
    return {k: v for k, v in config.items() if "." in k}


def describe(point: dict[str, Any]) -> str:
    """``"depth 1, batch 32, strength 0.5, loss jsd"`` for progress lines (each key by :func:`axis_label`)."""
    return ", ".join(f"{axis_label(k)} {v}" for k, v in point.items())


def sweep_keyed(params: Params) -> dict[str, dict[str, Any]]:
    """What a sweep's result depends on, the input of its stable name (``pipeline.runs.job.job_name``): its trials'
    base without the swept keys (their base value never reaches a trial), and the sweep's section."""
    base = base_params(params)
    keyed = {s: base[s] for s in ("model", "loss", "augment", "train", "sweep")}
    for dotted in axes(params):
        section, key = dotted.split(".")
        keyed[section].pop(key, None)
        if dotted == SPACE_KEYS["depth"] and params.model.method == "abc":
            keyed["model"]["abc"].pop("blocks", None)
    return keyed
