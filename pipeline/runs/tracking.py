"""MLflow tracking, the one module that imports MLflow (tests/runs/test_tracking.py checks it).

Default store: ``sqlite:///<project root>/mlflow.db``, artifacts in ``<project root>/mlartifacts``, both absolute,
so Ray workers (cwd under /tmp/ray) and ``dvc exp run --temp`` copies write to the project's one store;
``MLFLOW_TRACKING_URI`` overrides it. Only the driver's node writes (the driver, Ray Train's controller).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import subprocess
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.config.names import data_digest

if TYPE_CHECKING:
    import torch
    from mlflow import MlflowClient

EXPERIMENT = "transfusion"
IDENTITY_TAG = "identity"  # the stable name a job resumes by (Ray's run name, ``pretrain-<digest>``)
# the variables DVC sets for the stage commands of an experiment (dvc/env.py, dvc/repo/experiments/queue/base.py)
DVC_EXP_NAME, DVC_EXP_BASELINE_REV = "DVC_EXP_NAME", "DVC_EXP_BASELINE_REV"
DVC_EXP_TAGS = {DVC_EXP_NAME: "dvc.exp_name", DVC_EXP_BASELINE_REV: "dvc.exp_baseline"}


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
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(root or project_root()) / 'mlflow.db'}"


def check_reachable(uri: str, timeout: float = 5.0) -> None:
    """Fail fast, before any training, if the tracking store cannot be reached."""
    if uri.startswith(("http://", "https://")):
        url = uri.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - user-given tracking URI
                if resp.status != 200:
                    raise TrackingError(f"MLflow tracking server {uri} answered {resp.status} on /health")
        except (urllib.error.URLError, OSError) as exc:
            raise TrackingError(f"MLflow tracking server {uri} is unreachable ({exc}); start it or unset "
                                "MLFLOW_TRACKING_URI to use the project's sqlite store") from exc
    elif uri.startswith("sqlite:///"):
        path = Path(uri.removeprefix("sqlite:///"))
        if not path.parent.is_dir():
            raise TrackingError(f"MLflow tracking store {uri}: directory {path.parent} does not exist")
        _check_sqlite(path, uri)


SQLITE_MAGIC = b"SQLite format 3\x00"


def _check_sqlite(path: Path, uri: str) -> None:
    """A store file that is not a sound SQLite database fails here in one paragraph, not deep in SQLAlchemy."""
    if not path.exists() or (path.is_file() and path.stat().st_size == 0):
        return
    fix = (f"move {path} aside (MLflow starts a new store) or point MLFLOW_TRACKING_URI at a working store; "
           "runs logged in it are lost unless you restore a backup")
    try:
        with open(path, "rb") as f:
            head = f.read(len(SQLITE_MAGIC))
    except OSError as exc:
        raise TrackingError(f"MLflow tracking store {uri} cannot be read ({exc.strerror or exc}); {fix}") from None
    if head != SQLITE_MAGIC:
        raise TrackingError(f"MLflow tracking store {uri} is not an SQLite database (it starts with {head[:8]!r}); "
                            f"{fix}")
    import sqlite3

    try:  # read-write: a hot journal (a writer killed mid-transaction) is rolled back on open, which a read-only
        # connection cannot do ("attempt to write a readonly database"); quick_check itself writes nothing
        con = sqlite3.connect(f"file:{path}?mode=rw", uri=True, timeout=10)
        try:
            result = con.execute("PRAGMA quick_check").fetchone()
        finally:
            con.close()
    except sqlite3.Error as exc:
        raise TrackingError(f"MLflow tracking store {uri} is a damaged SQLite database ({exc}); {fix}") from None
    if result is None or result[0] != "ok":
        raise TrackingError(f"MLflow tracking store {uri} is a damaged SQLite database (quick_check: "
                            f"{result[0] if result else 'no answer'}); {fix}")


def _client(uri: str) -> MlflowClient:
    """An ``MlflowClient`` of ``uri``; a new sqlite store is one line of ours, not MLflow's and alembic's INFO."""
    from mlflow import MlflowClient

    path = Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None
    new = path is not None and (not path.exists() or path.stat().st_size == 0)
    with _quiet("mlflow.store.db.utils", logging.WARNING), _quiet("alembic", logging.WARNING):
        client = MlflowClient(uri)
    if new:
        print(f"[mlflow] new tracking store {path} (browse it with `transfusion ui`)")
    return client


def experiment_id(uri: str, root: Path | None = None, name: str = EXPERIMENT) -> str:
    """Get or create the project's experiment: the first call that touches the store, its errors a TrackingError."""
    try:
        client = _client(uri)
        exp = client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        local = uri.startswith("sqlite:///")
        location = ((root or project_root()) / "mlartifacts").as_uri() if local else None
        return client.create_experiment(name, artifact_location=location)
    except Exception as exc:  # MlflowException, SQLAlchemy's errors, ...: the store is unusable
        first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
        raise TrackingError(f"MLflow tracking store {uri} cannot be used ({type(exc).__name__}: {first[:400]}); "
                            "fix or move the store, or point MLFLOW_TRACKING_URI at a working one") from None


def create_run(uri: str, root: Path, name: str, tags: Mapping[str, str], params: Mapping[str, object],
               inputs: Sequence[object] = ()) -> str:
    """A new run of the project's experiment named ``name``, with ``tags``, ``params`` and dataset ``inputs``."""
    return _new_run(_client(uri), experiment_id(uri, root), name, tags, params, inputs)


def _new_run(client: MlflowClient, exp_id: str, name: str, tags: Mapping[str, str], params: Mapping[str, object],
             inputs: Sequence[object]) -> str:
    """Create the run (tagged also :func:`dvc_experiment_tags`), log its params and inputs; returns its id."""
    from mlflow.entities import Param

    run = client.create_run(exp_id, run_name=name, tags={**dvc_experiment_tags(), **tags})
    client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in flat_params(params).items()])
    if inputs:
        client.log_inputs(run.info.run_id, datasets=list(inputs))
    return run.info.run_id


def create_job_run(uri: str, root: Path, name: str, tags: Mapping[str, str], params: Mapping[str, object],
                   manifest: Mapping[str, object], source: Path) -> str:
    """:func:`create_run` with the prepared data in ``source`` (its ``manifest``) as its dataset input."""
    return create_run(uri, root, name, tags, params, inputs=[dataset_input(manifest, source)])


def warm() -> None:
    """Import what opening a store and a run takes (MLflow, its SQL store): a tracking process does it first."""
    import mlflow.store.tracking.sqlalchemy_store  # noqa: F401
    from mlflow import MlflowClient  # noqa: F401


def prepare_model_logging() -> None:
    """Pay, while the stage trains, what :func:`log_pytorch_model` pays on its first call: MLflow's pytorch flavour
    imported, and a first model saved as it saves one (MLflow then maps every installed package to its modules, to
    check the model's requirements against them: about 0.4 s here)."""
    import mlflow.pytorch
    import torch

    with tempfile.TemporaryDirectory() as tmp, _quiet("mlflow.pytorch"):
        mlflow.pytorch.save_model(torch.nn.Identity(), Path(tmp, "model"), serialization_format="pickle",
                                  pip_requirements=_model_requirements())


def _model_requirements() -> list[str]:
    """A logged model's requirements: this torch, without its local label (``+cu130``). MLflow's check of them by
    ``pip install --dry-run`` is skipped: it needs a package index, and the pin is this process's own torch."""
    import torch

    os.environ.setdefault("MLFLOW_SKIP_PIP_REQUIREMENTS_CHECK", "true")
    return [f"torch=={torch.__version__.split('+')[0]}"]


def resume_run(uri: str, run_id: str) -> None:
    """Mark a run that is being continued (a resumed stage) RUNNING again."""
    _client(uri).update_run(run_id, status="RUNNING")


def child_run(uri: str, experiment_id: str, parent_id: str, name: str, match: Mapping[str, str],
              tags: Mapping[str, str], params: Mapping[str, object]) -> str:
    """The child of ``parent_id`` tagged ``match`` (e.g. a trial id), found again and set RUNNING, or else created
    named ``name``, tagged ``tags``, with ``params`` and the parent's dataset inputs. Returns its id."""
    client = _client(uri)
    found = find_child(uri, experiment_id, parent_id, match)
    if found:
        client.update_run(found, status="RUNNING")
        return found
    inherited = client.get_run(parent_id).inputs
    return _new_run(client, experiment_id, name, {"mlflow.parentRunId": parent_id, **match, **tags}, params,
                    inherited.dataset_inputs if inherited and inherited.dataset_inputs else ())


def find_child(uri: str, experiment_id: str, parent_id: str, match: Mapping[str, str]) -> str | None:
    """The id of the child of ``parent_id`` tagged ``match`` (e.g. a trial id), None if there is none."""
    wanted = {"mlflow.parentRunId": parent_id, **match}
    found = _client(uri).search_runs([experiment_id], filter_string=" and ".join(f"tags.{k} = '{v}'"
                                                                                 for k, v in wanted.items()))
    return found[0].info.run_id if found else None


def end_run(uri: str | None, run_id: str | None, status: str, tags: Mapping[str, object] | None = None) -> None:
    """Set ``tags`` on the run, then end it with ``status`` (FINISHED, FAILED, KILLED); nothing without a run."""
    if not (uri and run_id):
        return
    if tags:
        set_tags(run_id, tags, uri=uri)
    _client(uri).set_terminated(run_id, status)


VIEW_KEY = "transfusion"  # the saved view of the runs table: `?viewStateShareKey=transfusion` opens it
VIEW_METRICS = ("knn_acc", "loss")
VIEW_PARAMS = ("model.depth", "loss.name", "train.batch_size", "augment.strength", "train.seed")


def save_view(uri: str, exp_id: str) -> str:
    """Save the runs table's view :data:`VIEW_KEY` on the experiment; returns the URL query that opens it."""
    from pipeline.runs.undocumented import save_shared_view

    columns = ["attributes.`Dataset`", *(f"metrics.`{k}`" for k in VIEW_METRICS),
               *(f"params.`{k}`" for k in VIEW_PARAMS)]
    return save_shared_view(_client(uri), exp_id, VIEW_KEY, columns)


class EpochLog:
    """Log one epoch's metrics (rank 0's report) to ``run_id``, one small write each; tracking never stops training:
    a failure is one warning line, then nothing more is logged (the driver logs the missing epochs at the end from
    the checkpoints, :func:`log_missing_epochs`). Pickles without its client (a Ray Train callback's ships).

    As a context manager (a run in this process), each write runs on a thread of its own, in order, so that the
    training loop does not wait for the store; leaving the block waits for the last one."""

    def __init__(self, uri: str, run_id: str) -> None:
        self.uri, self.run_id = uri, run_id
        self.client: MlflowClient | None = None
        self.warned = False
        self.writer: ThreadPoolExecutor | None = None

    def __getstate__(self) -> dict:
        return {"uri": self.uri, "run_id": self.run_id, "warned": self.warned}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.client, self.writer = None, None

    def __enter__(self) -> EpochLog:
        self.open()
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlflow-epochs")
        return self

    def __exit__(self, *exc: object) -> None:
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.shutdown(wait=True)

    def open(self) -> None:
        """Open the store (the first MLflow import and store initialisation take seconds): before the first epoch."""
        try:
            self.client = _client(self.uri)
            self.client.get_run(self.run_id)
        except Exception as exc:
            self._warn(exc)

    def _warn(self, exc: Exception) -> None:
        if not self.warned:
            self.warned = True
            print(f"[pretrain] warning: MLflow logging to {self.uri} failed ({exc}); the driver logs the epochs "
                  "from the checkpoints when training ends")

    def __call__(self, metrics: Mapping[str, object]) -> None:
        if self.writer is not None:
            self.writer.submit(self._write, dict(metrics))
        else:
            self._write(metrics)

    def _write(self, metrics: Mapping[str, object]) -> None:
        if "epoch" not in metrics or self.warned:
            return
        try:
            log_metrics_batch(self.uri, self.run_id, [metrics],
                              tuple(k for k in metrics if k not in ("epoch", "ended_at")), client=self.client)
        except Exception as exc:
            self._warn(exc)


def epoch_logger(uri: str, run_id: str):
    """A Ray Train callback that logs rank 0's per-epoch metrics (:class:`EpochLog`) from the controller (on the
    driver's node). ``after_report`` runs in the loop that registers checkpoints: the store is opened on arrival
    (``__setstate__``), leaving one small write per epoch."""
    import ray.train

    class EpochLogger(ray.train.UserCallback):
        def __init__(self) -> None:
            self.log = EpochLog(uri, run_id)

        def __getstate__(self) -> dict:
            return {"log": self.log}

        def __setstate__(self, state: dict) -> None:
            self.__dict__.update(state)
            self.log.open()

        def after_report(self, run_context, metrics, checkpoint) -> None:
            self.log(metrics[0] if metrics else {})

    return EpochLogger()


def git_commit(root: Path) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def stage_tags(stage: str, root: Path) -> dict[str, str]:
    commit = git_commit(root)
    return {"stage": stage, "dvc.stage": stage, **({"mlflow.source.git.commit": commit} if commit else {})}


def dvc_experiment_tags(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Under ``dvc exp run``: the tags ``dvc.exp_name`` and ``dvc.exp_baseline`` from DVC's variables; else ``{}``."""
    env = os.environ if env is None else env
    return {tag: env[var] for var, tag in DVC_EXP_TAGS.items() if env.get(var)}


def dataset_input(manifest: Mapping[str, object], source: str | os.PathLike, context: str = "training"):
    """The prepared data as an MLflow dataset input (name, digest, directory, profile), tagged with ``context``."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    profile = {"train": manifest.get("n_train"), "val": manifest.get("n_val"), "test": manifest.get("n_test"),
               "classes": len(manifest.get("classes", [])), "input_shape": manifest.get("input_shape"),
               "dtype": manifest.get("dtype"), "prepared_with": manifest.get("params", {}).get("data")}
    dataset = Dataset(name=str(manifest["dataset"]), digest=data_digest(manifest)[:8], source_type="local",
                      source=json.dumps({"uri": str(source)}), profile=json.dumps(profile))
    return DatasetInput(dataset, tags=[InputTag("mlflow.data.context", context)])


def log_missing_epochs(uri: str, run_id: str, history: list[Mapping[str, object]], keys: tuple[str, ...]) -> int:
    """Log the epochs of ``history`` that ``run_id`` lacks (checkpointed but never logged); returns how many."""
    client = _client(uri)
    logged = {m.step for m in client.get_metric_history(run_id, "loss")}
    missing = [h for h in history if int(h["epoch"]) not in logged]
    log_metrics_batch(uri, run_id, missing, keys, client=client)
    return len(missing)


def log_metrics_batch(uri: str, run_id: str, rows: list[Mapping[str, object]], keys: tuple[str, ...],
                      client: MlflowClient | None = None) -> None:
    """Log the finite numbers of ``keys`` of every row with step = its ``epoch``, in one batch."""
    import math
    import time

    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    batch = [Metric(k, float(h[k]), now, int(h["epoch"])) for h in rows for k in keys
             if isinstance(h.get(k), int | float) and not isinstance(h.get(k), bool) and math.isfinite(h[k])]
    if batch:
        (client or _client(uri)).log_batch(run_id, metrics=batch, synchronous=True)


def log_artifacts(uri: str, run_id: str, files: list[Path]) -> None:
    """Upload the files of ``files`` that exist to the root of ``run_id``'s artifacts."""
    client = _client(uri)
    for f in files:
        if f.is_file():
            client.log_artifact(run_id, str(f))


def set_tags(run_id: str, tags: Mapping[str, object], root: Path | None = None, *, uri: str | None = None) -> None:
    """Set ``tags`` (as strings of at most 5000 characters) on ``run_id`` in ``uri`` (default: ``root``'s store)."""
    client = _client(uri or tracking_uri(root))
    for k, v in tags.items():
        client.set_tag(run_id, k, str(v)[:5000])


def log_stage_run(stage: str, root: Path, *, params: Mapping[str, object], metrics: Mapping[str, float],
                  files: list[Path], parent: str | None = None, artifact_path: str | None = None,
                  name: str | None = None, inputs: Sequence[object] = ()) -> str:
    """One finished run named ``name`` (default ``stage``; a child of ``parent`` when given) with ``params``,
    ``metrics``, dataset ``inputs`` and the existing ``files`` (under ``artifact_path``); returns its id."""
    import mlflow

    uri = tracking_uri(root)
    mlflow.set_tracking_uri(uri)
    tags = {**dvc_experiment_tags(), **stage_tags(stage, root), **({"mlflow.parentRunId": parent} if parent else {})}
    with mlflow.start_run(experiment_id=experiment_id(uri, root), run_name=name or stage, tags=tags) as run:
        mlflow.log_params(flat_params(params))
        mlflow.log_metrics(dict(metrics))
        if inputs:
            _client(uri).log_inputs(run.info.run_id, datasets=list(inputs))
        for f in files:
            if f.is_file():
                mlflow.log_artifact(str(f), artifact_path=artifact_path)
        return run.info.run_id


def log_pytorch_model(uri: str, run_id: str, model: torch.nn.Module, files: list[Path]) -> None:
    """Continue ``run_id`` to upload ``files`` and ``model`` (pickled, pinned to this torch), then end it FINISHED."""
    import mlflow
    import mlflow.pytorch

    mlflow.set_tracking_uri(uri)
    with mlflow.start_run(run_id=run_id), _quiet("mlflow.pytorch"):  # pickle is our choice: no caution notice
        for f in files:
            mlflow.log_artifact(str(f))
        mlflow.pytorch.log_model(model, name="model", serialization_format="pickle",
                                 pip_requirements=_model_requirements())


@contextlib.contextmanager
def _quiet(logger: str, level: int = logging.ERROR):
    """Raise one MLflow logger's level for the block: its INFO/WARNING lines are about what we chose on purpose."""
    log = logging.getLogger(logger)
    before = log.level
    log.setLevel(level)
    try:
        yield
    finally:
        log.setLevel(before)


@contextlib.contextmanager
def system_metrics(uri: str | None, run_id: str | None, interval_s: float = 5.0) -> Iterator[None]:
    """MLflow's system metrics (CPU, memory, GPU) of this node logged to ``run_id`` during the block; nothing without
    a run. The run stays RUNNING after it, KILLED when it is interrupted, FAILED when it fails."""
    if not (uri and run_id):
        yield
        return
    import mlflow

    # its start/stop/"skip GPU metrics" INFO lines would sit between the epochs' progress lines
    logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
    mlflow.set_tracking_uri(uri)
    mlflow.set_system_metrics_sampling_interval(interval_s)
    mlflow.set_system_metrics_samples_before_logging(1)
    mlflow.start_run(run_id=run_id, log_system_metrics=True)
    status = "RUNNING"
    try:
        yield
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    except BaseException:
        status = "FAILED"
        raise
    finally:
        mlflow.end_run(status)


def flat_params(flat: Mapping[str, object]) -> dict[str, str]:
    """MLflow params: strings of at most 6000 characters, keys of alphanumerics and ``_-. :/`` only (any other
    character, as in a row named ``JSD (no head)``, becomes ``_``)."""
    return {_PARAM_KEY.sub("_", k): str(v)[:6000] for k, v in flat.items()}


_PARAM_KEY = re.compile(r"[^\w\-. :/]")
