"""``rehearse`` command: a shipped params file's jobs, end to end on this machine, shrunk only in size
(``pipeline.config.rehearse``), before a cluster is rented for them.

Writes the shrunk params and every job's outputs under ``--dir`` (default ``.rehearsal/<file name>/``, git-ignored,
emptied first), with an MLflow store of its own there; the project's outputs and runs are not touched. ``--resume``
keeps the directory of an interrupted rehearsal (Ctrl-C, a failed job) and runs the jobs there again, each resuming
as its command does (a sweep from its unfinished trials, a pretraining from its last checkpoint); its params must be
the rehearsal's own (the same file, sizes and declared GPUs), or it exits 2 before any work.

Each job runs as its command would (``transfusion prepare``, ``pretrain``, ...), in this process and on one Ray: a
local Ray of this machine's CPUs and ``--gpus N`` declared GPUs (the workers are scheduled on GPUs and train on
gloo/CPU), or the cluster of ``RAY_ADDRESS``. A key that is not a size exits 2 naming it; a job that fails ends the
rehearsal with its message (exit 1, or 2 for a request the cluster can never hold) and, after exit 1, the command that
continues it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import time
from pathlib import Path

import click
import yaml

from pipeline.runs.tracking import project_root
from stages._common import STARTED_ENV, ParamsUsageError

DEFAULT_DIR = ".rehearsal"


@click.command("rehearse")
@click.option("--params", "params_path", default="params.yaml", show_default=True, type=click.Path(dir_okay=False),
              help="The params file to rehearse (params.yaml, presets/*.yaml).")
@click.option("-S", "--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Another size (repeatable); control keys are refused (pipeline/config/rehearse.py: SIZE_KEYS).")
@click.option("--gpus", type=click.IntRange(min=0), default=0, show_default=True,
              help="GPUs the local Ray declares (its workers train on gloo/CPU); 0 rehearses on CPUs.")
@click.option("--dir", "work_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where the rehearsal runs (default: .rehearsal/<file name>/, emptied first).")
@click.option("--jobs", default=None, help="Comma-separated subset of the file's jobs (default: all of them).")
@click.option("--resume", is_flag=True,
              help="Keep --dir (an interrupted rehearsal of the same file and sizes) and rerun the jobs there, each "
                   "resuming as its command does.")
def rehearse_cmd(params_path: str, overrides: tuple[str, ...], gpus: int, work_dir: Path | None,
                 jobs: str | None, resume: bool) -> None:
    """Rehearse a params file's jobs end to end on this machine, shrunk only in size (data, backbone, epochs, grid
    lengths, CPUs, storage, declared GPUs), every control key as shipped."""
    from pipeline.config.base import ParamsError
    from pipeline.config.rehearse import plan
    from pipeline.host import usable_cpus

    started = time.time()
    if gpus and os.environ.get("RAY_ADDRESS"):
        raise ParamsUsageError("--gpus declares GPUs on a local Ray; with RAY_ADDRESS set the cluster's own GPUs "
                               "count: unset one of them")
    try:
        p = plan(params_path, overrides, cpus=usable_cpus(), gpus=gpus)
    except ParamsError as exc:
        raise ParamsUsageError(str(exc)) from None
    chosen = p.jobs if jobs is None else tuple(j.strip() for j in jobs.split(",") if j.strip())
    unknown = [j for j in chosen if j not in p.jobs]
    if unknown:
        raise ParamsUsageError(f"--jobs: {', '.join(unknown)} is not a job of {params_path} ({', '.join(p.jobs)})")
    here = project_root()
    work = (work_dir or Path(DEFAULT_DIR) / Path(params_path).stem).resolve()
    shrunk = yaml.safe_dump(p.raw, sort_keys=False)
    if resume:
        _check_resumable(work, shrunk)
    else:
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        (work / "params.yaml").write_text(shrunk)
    sizes = ", ".join(f"{k}={v}" for k, v in p.changed.items() if k != "tables.rows")
    click.echo(f"[rehearse] {params_path} in {work}: jobs {', '.join(chosen)}; sizes {sizes}")
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}", "MLFLOW_SKIP_PIP_REQUIREMENTS_CHECK": "true"}
    saved = {k: os.environ.get(k) for k in (*env, STARTED_ENV)}
    os.environ.update(env)
    os.chdir(work)
    try:
        if gpus:
            from pipeline.runs.cluster import start_local_ray

            start_local_ray(num_gpus=gpus)
        for i, job in enumerate(chosen):
            again = ["transfusion", "rehearse", "--params", params_path, *(a for o in overrides for a in ("-S", o)),
                     *(["--gpus", str(gpus)] if gpus else []), "--dir", str(work), "--jobs", ",".join(chosen[i:]),
                     "--resume"]
            _run(job, shlex.join(again))
    finally:
        os.chdir(here)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    click.echo(f"[rehearse] {params_path}: {', '.join(chosen)} passed in {time.time() - started:.0f} s; outputs in "
               f"{work}")


def _check_resumable(work: Path, shrunk: str) -> None:
    """``--resume``: ``work`` holds a rehearsal whose params are ``shrunk`` (else exit 2, naming what differs)."""
    saved = work / "params.yaml"
    if not saved.is_file():
        raise ParamsUsageError(f"--resume: {work} holds no rehearsal ({saved} is missing); drop --resume to start one")
    if saved.read_text() != shrunk:
        raise ParamsUsageError(f"--resume: the rehearsal in {work} ran other params ({saved}: another file, sizes or "
                               "--gpus); resume with the same options, or drop --resume to start afresh")


def _run(job: str, resume: str) -> None:
    """One job as its command runs it, on the rehearsal's params; its failure ends the rehearsal, naming the job and
    the command (``resume``) that continues the rehearsal where it stopped."""
    from stages.cli import main

    command = main.get_command(click.Context(main), job)
    start = time.time()
    os.environ[STARTED_ENV] = str(start)
    click.echo(f"[rehearse] {job} ...")
    try:
        command.main(args=["--params", "params.yaml"], prog_name=f"transfusion {job}", standalone_mode=False)
    except click.ClickException as exc:
        kind = type(exc)
        wrapped = kind(f"rehearsal: `transfusion {job}` failed: {exc.format_message()}")
        if exc.exit_code == 1:  # a job that ran (2: a request or input refused before any work)
            wrapped = kind(f"{wrapped.format_message()}\nto continue the rehearsal from there: {resume}")
        wrapped.exit_code = exc.exit_code
        raise wrapped from None
    click.echo(f"[rehearse] {job} passed in {time.time() - start:.0f} s")
