"""``evaluate`` stage: probes, cluster quality and figures from the pretrained model.

Reads params: ``probe``; inputs ``data/prepared/``, ``models/pretrain/``, ``plots/pretrain.csv``.
Writes (atomically): ``metrics/evaluate.json`` and ``plots/evaluate/`` (probes.csv, sharpness.{csv,png},
tsne.{csv,png}, curves.png). Logged to MLflow as a child of the pretraining run that made the model.
"""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from pipeline.config.base import flatten
from pipeline.config.names import evaluate_label
from pipeline.config.params import Params, load_params
from pipeline.data.types import DatasetError
from pipeline.evaluation.evaluate import Evaluation, PretrainedConfig, evaluate, load_data, load_pretrained
from pipeline.io import TensorFileError, atomic_dir, json_safe, write_csv, write_json
from pipeline.runs.tracking import TrackingError
from stages._common import params_options, process_started, runtime_errors, time_line

if TYPE_CHECKING:
    from pipeline.core.model import ABCModel, TransFusion

PLOTS = Path("plots/evaluate")


def write_figures(ev: Evaluation, out: Path, curves_csv: Path) -> None:
    from pipeline.evaluation import figures

    write_csv(out / "probes.csv", ev.probe_rows)
    layers = [r["layer"] for r in ev.sharpness_rows]
    # Definition 2's worst pair is 0 for nearly every ReLU affinity: the figure shows the 10 % quantile version
    figures.sharpness_per_layer([r["sharpness_q10"] for r in ev.sharpness_rows], out / "sharpness.png",
                                out / "sharpness.csv", labels=layers, name="sharpness_q10")
    figures.sharpness_per_layer([r["contrast"] for r in ev.sharpness_rows], out / "contrast.png",
                                out / "contrast.csv", labels=layers, name="contrast")
    if ev.tsne is not None:
        reps, labels, names = ev.tsne
        figures.tsne_layers(reps, labels, names, out / "tsne.png", out / "tsne.csv")
    if curves_csv.is_file():
        with open(curves_csv) as f:
            rows = [{k: (float(v) if v not in ("", None) else None) for k, v in r.items()} for r in csv.DictReader(f)]
        figures.line_curves(rows, "epoch", ["loss", "knn_acc", "view_noise"], out / "curves.png",
                            title="pretraining")


def log_to_mlflow(params: Params, ev: Evaluation, parent_run_id: str | None, files: list[Path],
                  data_dir: Path = Path("data/prepared")) -> str:
    """The stage's run (a child of the pretraining run, named by its probes and label fractions): probe params, the
    metrics' flat numbers, the figures, the prepared data as its dataset input (context ``evaluation``)."""
    from pipeline.runs import tracking as trk

    root = trk.project_root()
    manifest = json.loads((data_dir / "manifest.json").read_text())
    data = trk.dataset_input(manifest, data_dir if data_dir.is_absolute() else root / data_dir, context="evaluation")
    return trk.log_stage_run("evaluate", root, params=flatten(params.probe, "probe."), metrics=ev.flat_metrics(),
                             files=files, parent=parent_run_id, artifact_path="evaluate", inputs=[data],
                             name=evaluate_label(params.probe.probes, params.probe.label_fractions))


def time_parts(started: float, marks: list[float], ev: Evaluation) -> list[tuple[str, float]]:
    """Where the stage's time went: ``marks`` are the ``time.time()`` of the evaluation's start, its end, the figures'
    end and the MLflow run's end; ``started`` the process's start (imports, loading the model and data)."""
    evaluation, figures, mlflow = (b - a for a, b in zip(marks[:-1], marks[1:], strict=True))
    probes = sum(r["seconds"] for r in ev.probe_rows)
    embed = ev.metrics["embed_seconds"]
    return [("start (imports, model, data)", marks[0] - started), ("embeddings", embed), ("probes", probes),
            ("affinities, clustering and health", evaluation - probes - embed),
            ("figures (t-SNE included)", figures), ("MLflow run", mlflow)]


class ModelError(RuntimeError):
    """The pretrained model is missing, unreadable or does not fit the data; the message names the file."""


def load_model(model_dir: Path) -> tuple[TransFusion | ABCModel, PretrainedConfig]:
    """The pretrained model and its config; a missing or unreadable one raises :class:`ModelError`."""
    hint = "run `transfusion pretrain` (or `dvc repro`)"
    if not (model_dir / "config.json").is_file():
        raise ModelError(f"no pretrained model in {model_dir}: {hint}")
    try:
        return load_pretrained(model_dir)
    except TensorFileError as exc:
        raise ModelError(f"pretrained model {exc}; {hint} again") from exc
    except FileNotFoundError as exc:
        raise ModelError(f"pretrained model file {exc.filename} is missing; {hint} again") from exc
    except Exception as exc:  # bad JSON, missing keys, params or weights that do not fit the model
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ModelError(f"the pretrained model in {model_dir} cannot be loaded ({type(exc).__name__}: "
                         f"{first}) from {model_dir / 'config.json'} and {model_dir / 'model.pt'}; "
                         f"{hint} again") from exc


@click.command("evaluate")
@params_options(load_params)
@click.option("--data", "data_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("data/prepared"),
              show_default=True)
@click.option("--model", "model_dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("models/pretrain"), show_default=True)
@click.option("--no-tracking", is_flag=True, help="Do not log to MLflow.")
@runtime_errors(DatasetError, TrackingError, ModelError, FileNotFoundError)
def evaluate_cmd(params: Params, data_dir: Path, model_dir: Path, no_tracking: bool) -> None:
    """Probe the frozen embeddings of every layer, cluster the learned affinity, draw the figures."""
    started = process_started()
    if not no_tracking:  # fail fast, before the probes, if the store is unreachable
        from pipeline.runs.tracking import check_reachable, project_root, tracking_uri

        check_reachable(tracking_uri(project_root()))
    model, config = load_model(model_dir)
    data = load_data(data_dir)
    if tuple(config["input_shape"]) != data.input_shape:
        raise ModelError(f"the model in {model_dir} was pretrained on inputs of shape {tuple(config['input_shape'])}"
                         f" but {data_dir} holds {data.input_shape}; run `transfusion pretrain` again on this data "
                         "(or `dvc repro`)")
    marks = [time.time()]  # the evaluation, the figures, the MLflow run
    ev = evaluate(params, data, model, config["params"]["train"]["batch_size"], progress=click.echo)
    ev.metrics["pretrain_mlflow_run_id"] = config.get("mlflow_run_id")
    marks.append(time.time())
    with atomic_dir(PLOTS) as out:
        write_figures(ev, out, Path("plots/pretrain.csv"))
    marks.append(time.time())
    metrics_path = Path("metrics/evaluate.json")
    if not no_tracking:
        ev.metrics["mlflow_run_id"] = log_to_mlflow(
            params, ev, config.get("mlflow_run_id"), [*sorted(PLOTS.iterdir())], data_dir)
    marks.append(time.time())
    write_json(metrics_path, json_safe(ev.metrics))
    best = ev.metrics["probes"].get("backbone", {})
    line = ", ".join(f"{k} {max(a for a in v.values() if a is not None):.4f}" for k, v in best.items()
                     if any(a is not None for a in v.values()))
    click.echo(f"evaluated: backbone {line}; spectral NMI {ev.metrics['spectral']['nmi']:.3f} -> metrics/evaluate.json")
    click.echo(time_line("evaluate", started, time_parts(started, marks, ev), marks[-1]))
