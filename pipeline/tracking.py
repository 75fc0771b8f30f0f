"""MLflow tracking: where the store is, fail-fast reachability, one run per stage.

Default store: ``sqlite:///<project root>/mlflow.db`` with artifacts in ``<project root>/mlartifacts``,
both absolute, so Ray workers (whose cwd is under /tmp/ray) and ``dvc exp run --temp`` copies (under
``.dvc/tmp/exps``) all write to the project's one store. ``MLFLOW_TRACKING_URI`` overrides it (e.g. a
shared ``mlflow server``). Only the driver and rank 0 ever write.
"""

from __future__ import annotations

import os
import subprocess
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

EXPERIMENT = "transfusion"


class TrackingError(RuntimeError):
    """The tracking store cannot be used; the message names the URI."""


def project_root(start: str | os.PathLike | None = None) -> Path:
    """The real project root, also from inside a ``dvc exp run --temp`` copy under ``.dvc/tmp/exps``."""
    path = Path(start or os.getcwd()).resolve()
    parts = path.parts
    for i in range(len(parts) - 3):
        if parts[i : i + 3] == (".dvc", "tmp", "exps"):
            return Path(*parts[:i])
    return path


def tracking_uri(root: Path | None = None) -> str:
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    return f"sqlite:///{(root or project_root()) / 'mlflow.db'}"


def check_reachable(uri: str, timeout: float = 5.0) -> None:
    """Fail fast, before any training, if the tracking store cannot be reached."""
    if uri.startswith(("http://", "https://")):
        url = uri.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - user-given tracking URI
                if resp.status != 200:
                    raise TrackingError(f"MLflow tracking server {uri} answered {resp.status} on /health")
        except (urllib.error.URLError, OSError) as exc:
            raise TrackingError(
                f"MLflow tracking server {uri} is unreachable ({exc}); start it or unset MLFLOW_TRACKING_URI "
                "to use the project's sqlite store"
            ) from exc
    elif uri.startswith("sqlite:///"):
        parent = Path(uri.removeprefix("sqlite:///")).parent
        if not parent.is_dir():
            raise TrackingError(f"MLflow tracking store {uri}: directory {parent} does not exist")


def experiment_id(uri: str, root: Path | None = None, name: str = EXPERIMENT) -> str:
    """Get or create the project's experiment; local stores get an absolute artifact location."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    location = None
    if uri.startswith("sqlite:///"):
        location = ((root or project_root()) / "mlartifacts").as_uri()
    return client.create_experiment(name, artifact_location=location)


def git_commit(root: Path) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def stage_tags(stage: str, root: Path) -> dict[str, str]:
    tags = {"stage": stage, "dvc.stage": stage}
    commit = git_commit(root)
    if commit:
        tags["mlflow.source.git.commit"] = commit
    return tags


def log_epoch(uri: str, run_id: str, metrics: Mapping[str, float], step: int) -> None:
    """Log one epoch's metrics to ``run_id`` from anywhere (e.g. the rank-0 Ray worker)."""
    import time

    from mlflow import MlflowClient
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    batch = [Metric(k, float(v), now, step) for k, v in metrics.items() if v is not None]
    MlflowClient(uri).log_batch(run_id, metrics=batch, synchronous=True)


def set_tags(run_id: str, tags: Mapping[str, str], root: Path | None = None) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri(root))
    for k, v in tags.items():
        client.set_tag(run_id, k, str(v)[:5000])


def flat_params(flat: Mapping[str, Any]) -> dict[str, str]:
    """MLflow params are strings of at most 6000 characters."""
    return {k: str(v)[:6000] for k, v in flat.items()}
