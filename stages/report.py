"""``report`` stage: ``reports/REPORT.md`` from the metrics and figures of the other stages.

Reads params: every section (the report prints them); inputs ``metrics/*.json``, ``plots/evaluate/``, and the
set-clustering study's ``metrics/sets.json`` (its table beside ABC's published numbers) when it is there; the
recorded tables jobs on the same data set (``studies/*/tables/``).
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from pipeline.config.params import Params, load_params
from pipeline.evaluation import set_report, tables_report
from pipeline.evaluation.report import render
from pipeline.io import write_text
from stages._common import params_options, runtime_errors

OUT = Path("reports/REPORT.md")
FIGURES = {
    "t-SNE of the input and of every layer (paper Fig. 4)": "plots/evaluate/tsne.png",
    "Sharpness of every layer's affinity (def. 2, worst pair)": "plots/evaluate/sharpness.png",
    "Contrast of every layer's affinity (mean same-class / mean other-class)": "plots/evaluate/contrast.png",
    "Pretraining curves": "plots/evaluate/curves.png",
}


@click.command("report")
@params_options(load_params)
@runtime_errors(FileNotFoundError)
def report_cmd(params: Params) -> None:
    """Write reports/REPORT.md: our tables beside the paper's, the figures, the params."""
    pre, ev = Path("metrics/pretrain.json"), Path("metrics/evaluate.json")
    for f in (pre, ev):
        if not f.is_file():
            raise FileNotFoundError(f"{f} is missing: run `dvc repro` (the pretrain and evaluate stages) first")
    config = json.loads(Path("models/pretrain/config.json").read_text())
    figures = {c: f"../{p}" for c, p in FIGURES.items() if Path(p).is_file()}
    text = render(config["params"] | {"probe": params.probe.model_dump()}, json.loads(pre.read_text()),
                  json.loads(ev.read_text()), figures)
    sets = Path("metrics/sets.json")  # the set-clustering study (`transfusion sets`), when it has run
    if sets.is_file():
        study = json.loads(sets.read_text())
        figure = "../plots/sets/ari.png" if Path("plots/sets/ari.png").is_file() else None
        text = text.rstrip("\n") + "\n\n" + set_report.render(study["summary"], study["setup"], figure=figure)
        if study.get("circles"):  # the recorded full-length circles study the sets stage read
            circles = "../plots/sets/circles.png" if Path("plots/sets/circles.png").is_file() else None
            text = text.rstrip("\n") + "\n\n" + set_report.circles_section(study["circles"], figure=circles)
    studies = tables_report.studies_section(config["params"]["data"]["dataset"])  # recorded on the same data
    if studies:
        text = text.rstrip("\n") + "\n\n" + studies
    write_text(OUT, text)
    click.echo(f"report -> {OUT}")
