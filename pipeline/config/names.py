"""What every run is called: the names people read in MLflow, and the stable names a run or job resumes by.

- **Labels** (MLflow run names, from params): :func:`pretrain_label` (``pretrain · cnn_small · depth 1 · jsd · b128 ·
  s0``), :func:`point_label` (a sweep trial), :func:`sweep_label`, :func:`row_label` (a tables row),
  :func:`evaluate_label`, :func:`tables_label`; their parts joined by :data:`SEP`. What sits on a run's backbone, for
  the reports: :func:`head_description` (its projector and head), :func:`fusing_blocks` (how many of its blocks fuse).
- **Stable names** (``pretrain-<16 hex digits>``: Ray's run name, the MLflow tag ``identity``, the driver's state
  folder): :func:`stable_name` of everything that determines the result (the params it reads, the prepared data's
  files), so that a rerun resumes exactly when it would compute the same thing, and a changed one starts afresh.
  ``pipeline.runs.job.job_name`` keys each job's (pretrain, sweep, tables).
- **The prepared data's digest** (:func:`data_digest`): the name of its staged copy on the run storage, and (its first
  8 hex digits) MLflow's dataset digest.

Pure: the stages' and jobs' names are checked without Ray or MLflow.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

SEP = " · "


def _short(key: str, value: Any) -> str:
    """One part of a run name: ``b128`` (batch size), ``s0`` (seed), else ``<last part of the key> <value>``."""
    if key.endswith("batch_size"):
        return f"b{value}"
    if key.endswith(".seed"):
        return f"s{value}"
    return f"{key.rsplit('.', 1)[-1]} {value}"


def axis_label(key: str) -> str:
    """``model.depth`` -> ``depth``, ``train.batch_size`` -> ``batch``, ``loss.name`` -> ``loss``."""
    section, _, last = key.rpartition(".")
    return "batch" if last == "batch_size" else section if last == "name" else last


def pretrain_label(flat: Mapping[str, Any], stage: str = "pretrain") -> str:
    """``pretrain · cnn_small · depth 1 · jsd · b128 · s0``: a pretraining run's name from its flat params
    (``model.method: abc``: ``pretrain · cnn_small · abc multiplicative 2 blocks · bce · b128 · s0``; with a projector:
    ``pretrain · cnn_small · mlp projector · depth 1 · ...``)."""
    head = f"depth {flat['model.depth']}"
    if flat.get("model.method") == "abc":
        head = f"abc {flat['model.abc.compatibility']} {flat['model.abc.blocks']} blocks"
    projector = flat.get("model.projector", "none")
    parts = [stage, str(flat["model.backbone"]), *([f"{projector} projector"] if projector != "none" else []), head]
    return SEP.join([*parts, str(flat["loss.name"]), _short("train.batch_size", flat["train.batch_size"]),
                     _short("train.seed", flat["train.seed"])])


PROJECTOR_WORDS = {"none": "no projector", "linear": "linear projector", "mlp": "MLP projector"}


def fusing_blocks(flat: Mapping[str, Any]) -> int:
    """How many blocks of a run's head fuse, i.e. mix the rows of a batch, from its flat params (``model.*``):

    - TransFusion: ``model.depth``, less one with ``model.head: truncated``, whose last block only supplies the
      affinity (depth 1 truncated: 0; depth 0: 0);
    - ABC (``model.method: abc``): its SAB blocks (``model.abc.blocks``): each attends across the set, as a block does.

    Keys a run saved before they existed read as their defaults (``model.head: appendix_e``)."""
    if flat.get("model.method") == "abc":
        return int(flat["model.abc.blocks"])
    depth = int(flat["model.depth"])
    return max(depth - int(flat.get("model.head", "appendix_e") == "truncated"), 0)


def head_description(flat: Mapping[str, Any]) -> str:
    """What sits on a run's backbone, from its flat params (``model.*``), for the reports:
    ``MLP projector, 1 block (fusing 1)``, ``no projector, no head``, ``linear projector (64-d), 1 block truncated
    (fusing 0)``, ``no projector, ABC 2 SABs (fusing 2)`` (:func:`fusing_blocks` counts the blocks that fuse)."""
    projector = str(flat.get("model.projector", "none"))
    words = PROJECTOR_WORDS.get(projector, f"{projector} projector")
    if projector != "none" and flat.get("model.projector_dim") is not None:
        words += f" ({flat['model.projector_dim']}-d)"
    fusing = fusing_blocks(flat)
    if flat.get("model.method") == "abc":
        sabs = int(flat["model.abc.blocks"])
        return f"{words}, ABC {sabs} SAB{'s' if sabs != 1 else ''} (fusing {fusing})"
    depth = int(flat["model.depth"])
    if depth == 0:
        return f"{words}, no head"
    truncated = " truncated" if flat.get("model.head", "appendix_e") == "truncated" else ""
    return f"{words}, {depth} block{'s' if depth != 1 else ''}{truncated} (fusing {fusing})"


def point_label(point: Mapping[str, Any]) -> str:
    """``depth 1 · b16 · strength 1.0``: a sweep trial's name from its point (``{"model.depth": 1, ...}``)."""
    return SEP.join(_short(k, v) for k, v in point.items()) or "trial"


def sweep_label(trials: int, axes: Mapping[str, list[Any]]) -> str:
    """``sweep · 8 trials · depth×batch×strength``: the axes with more than one value."""
    varied = "×".join(axis_label(k) for k, values in axes.items() if len(values) > 1)
    return SEP.join(["sweep", f"{trials} trial{'s' if trials != 1 else ''}", *([varied] if varied else [])])


def row_label(name: str, table: int, seed: int | None = None, control: bool = False) -> str:
    """``TransFusion 9-Layer (table 1)``: a tables row's name; with its seed, a trial's: ``TransFusion 9-Layer (table 1)
    · seed 0``, ``raw pixels (control) · seed 0``."""
    label = f"{name} (control)" if control else f"{name} (table {table})"
    return label if seed is None else SEP.join([label, f"seed {seed}"])


def evaluate_label(probes: Sequence[str], fractions: Sequence[float]) -> str:
    """``evaluate · 5 probes · labels 10%, 100%``: an evaluation's name from its probes and label fractions."""
    labels = ", ".join(f"{100 * f:g}%" for f in fractions)
    return SEP.join(["evaluate", f"{len(probes)} probe{'s' if len(probes) != 1 else ''}", f"labels {labels}"])


def tables_label(tables: Sequence[int], seeds: int = 1) -> str:
    """``tables · 8 rows · table 1: 5, table 2: 3`` (``· 3 seeds`` when more than one): a tables job's name from its
    rows' tables and its number of seeds."""
    counts = ", ".join(f"table {t}: {tables.count(t)}" for t in sorted(set(tables)))
    parts = ["tables", f"{len(tables)} row{'s' if len(tables) != 1 else ''}", counts]
    return SEP.join(parts + ([f"{seeds} seeds"] if seeds > 1 else []))


def _digest(value: Any) -> str:
    """16 hex digits of the sha256 of ``value`` as JSON (keys sorted)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def _files(manifest: Mapping[str, Any]) -> dict[str, str]:
    return {name: f["sha256"] for name, f in sorted(manifest["files"].items())}


def data_digest(manifest: Mapping[str, Any]) -> str:
    """One version of the prepared data: 16 hex digits of a sha256 over its files' sha256 (the manifest's ``files``).
    The name of its staged copy (``pipeline.data.storage``); MLflow's dataset digest is its first 8
    (``pipeline.runs.tracking.dataset_input``)."""
    return _digest(_files(manifest))


def stable_name(prefix: str, keyed: Mapping[str, Any], manifest: Mapping[str, Any]) -> str:
    """``<prefix>-<16 hex digits>``: the name of a Ray run or Tune job from everything that determines its result,
    ``keyed`` (the params it reads) and the prepared data's files, so that a rerun resumes it exactly when it would
    compute the same thing."""
    return f"{prefix}-{_digest({**keyed, 'data': _files(manifest)})}"
