"""``transfusion check``: validate params (and overrides) without running anything, and say what the head needs."""

from __future__ import annotations

import click

from pipeline.config.base import flatten
from pipeline.config.params import Params, load_params
from pipeline.core.plan import budget_bytes, largest_batch, plan_head
from stages._common import params_options

REFERENCE_GPU_GB = 80  # the device assumed for a GPU run when no GPU is visible here


def _device(params: Params) -> tuple[int, str]:
    """Bytes of memory of the device a worker trains on, and its name: the visible GPU for a GPU run, else this
    machine's available RAM; a GPU run on a machine without one assumes a ``REFERENCE_GPU_GB`` GPU."""
    gpu = params.ray.use_gpu or params.train.device == "cuda"
    if gpu:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return int(props.total_memory), props.name
        return REFERENCE_GPU_GB * 10**9, f"an {REFERENCE_GPU_GB} GB GPU (none visible here)"
    import psutil

    return int(psutil.virtual_memory().available), "this machine's available RAM"


def head_lines(params: Params) -> list[str]:
    """The head's memory per worker at ``train.batch_size`` and the largest global batch whose head fits."""
    m = params.model
    if m.method == "abc":
        return [f"head: ABC's, not planned: every worker runs it dense on all {2 * params.train.batch_size:,} rows of "
                "the global batch (pipeline.training.step; the additive similarity in row tiles, pipeline.core.abc)"]
    width = m.head_width()  # the projector's output, if any
    if width is None:
        return ["head: n/a here (the pixels backbone's width is the input's size: see `transfusion pretrain`)"]
    memory, device = _device(params)
    budget = budget_bytes(params.train.head_budget_mb, memory)
    itemsize = 2 if (params.ray.use_gpu or params.train.device == "cuda") and params.train.precision != "fp32" else 4
    depth = m.depth - int(m.head == "truncated")
    pairwise = params.loss.name != "barlow_twins"
    world = params.ray.num_workers
    plan = plan_head(2 * params.train.batch_size, world, depth, width, budget, itemsize, pairwise)
    biggest = largest_batch(world, depth, width, budget, itemsize, pairwise)
    return [f"{plan.describe()}",
            f"largest global batch whose head fits {device} (budget {budget / 2**20:,.0f} MiB a worker, "
            f"{world} worker{'s' if world > 1 else ''}): {biggest:,} images"]


@click.command("check")
@params_options(load_params)
def check(params: Params) -> None:
    """Validate params.yaml (exit 2 naming every bad key) and print the resolved values and the head's memory."""
    for key, value in flatten(params).items():
        click.echo(f"{key} = {value!r}")
    for line in head_lines(params):
        click.echo(line)
    click.echo("params OK")
