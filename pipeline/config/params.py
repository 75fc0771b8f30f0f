"""All of ``params.yaml`` (:class:`Params`), its cross-section checks, and reading and validating a file.

Every section is required; every field inside has a default. Unknown keys, wrong types, out-of-range
values, unknown names and conflicting settings raise :class:`ParamsError`, whose message names each bad
key and what is allowed. Nothing is run or written before validation passes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, model_validator

from pipeline.config.augment import AugmentConfig
from pipeline.config.base import ParamsError, Section, apply_overrides, format_error, read_params_file
from pipeline.config.data import DataConfig
from pipeline.config.loss import ABC_LOSSES, SELF_SUPERVISED_ONLY, LossConfig
from pipeline.config.model import ModelConfig, batchnorm_backbone, image_backbone
from pipeline.config.probe import ProbeConfig
from pipeline.config.ray import RayConfig
from pipeline.config.sets import SetsConfig
from pipeline.config.sweep import SweepConfig
from pipeline.config.tables import TablesConfig
from pipeline.config.theory import TheoryConfig
from pipeline.config.train import TrainConfig


class Params(Section):
    """All of ``params.yaml``. Each DVC stage depends only on the sections it reads."""

    data: DataConfig
    model: ModelConfig
    loss: LossConfig
    augment: AugmentConfig
    train: TrainConfig
    ray: RayConfig
    probe: ProbeConfig
    sweep: SweepConfig
    theory: TheoryConfig
    # optional (the paper's rows by default); read only by `transfusion tables`, so left out of the params every
    # other stage records (model_dump, MLflow, REPORT.md)
    tables: TablesConfig = Field(default_factory=TablesConfig, exclude=True)
    # optional too (the default study); read only by `transfusion sets`
    sets: SetsConfig = Field(default_factory=SetsConfig, exclude=True)

    @model_validator(mode="after")
    def _cross_section(self) -> Params:
        problems = []
        if self.train.mode == "supervised" and self.loss.name in SELF_SUPERVISED_ONLY:
            problems.append(
                f"loss.name: {self.loss.name} needs train.mode: self_supervised (one positive per row); "
                "for supervised training use jsd, jsd_appendix_e, kl_softmax, kl_relu, kl_squared, supcon or dcl"
            )
        abc, bce = self.model.method == "abc", self.loss.name in ABC_LOSSES
        if bce and not abc:
            problems.append(f"loss.name: {self.loss.name} is ABC's loss (its kernel against the targets); it needs "
                            "model.method: abc")
        elif abc and not bce:
            problems.append(f"model.method: abc trains its kernel with loss.name: {' or '.join(ABC_LOSSES)}, "
                            f"not {self.loss.name}")
        if not bce and self.loss.pos_weight != LossConfig.model_fields["pos_weight"].default:
            problems.append(f"loss.pos_weight: read only by loss.name: bce, not {self.loss.name}; remove it")
        if self.loss.name != "jsd" and self.loss.power != LossConfig.model_fields["power"].default:
            problems.append(f"loss.power: read only by loss.name: jsd, not {self.loss.name}; remove it")
        if self.data.dataset == "synthetic" and image_backbone(self.model.backbone):
            problems.append(
                f"model.backbone: {self.model.backbone} needs images, but data.dataset: synthetic gives "
                "vectors; use pixels or mlp"
            )
        if self.train.batch_size % self.ray.num_workers:
            problems.append(
                f"train.batch_size ({self.train.batch_size}) must be a multiple of ray.num_workers "
                f"({self.ray.num_workers}): it is the global batch, split evenly over the workers"
            )
        if self.ray.use_gpu and self.train.device == "cpu":
            problems.append("ray.use_gpu: true conflicts with train.device: cpu")
        if self.train.grad_cache_chunk is not None and batchnorm_backbone(self.model.backbone):
            problems.append(
                f"train.grad_cache_chunk: gradient caching is not exact with the BatchNorm backbone "
                f"{self.model.backbone}: its chunks would put the two views of an image in different BatchNorm "
                "batches and update the running statistics in both passes; set train.grad_cache_chunk: null "
                "or use a backbone without BatchNorm (pixels, mlp, cnn_small, or a torchvision model without it, "
                "e.g. torchvision:convnext_tiny)"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return self


SECTIONS = tuple(Params.model_fields)


def validate_params(raw: Mapping[str, Any], source: str = "params") -> Params:
    if not isinstance(raw, Mapping):
        raise ParamsError(f"{source}: expected a mapping of sections ({', '.join(SECTIONS)}), "
                          f"got {type(raw).__name__}")
    try:
        return Params.model_validate(dict(raw))
    except ValidationError as err:
        raise ParamsError(format_error(err, source, Params)) from None


def load_params(path: str | Path = "params.yaml", overrides: Iterable[str] = ()) -> Params:
    """Read, override and validate ``path``. Raises :class:`ParamsError` with every problem listed."""
    raw = apply_overrides(read_params_file(path, SECTIONS), overrides)
    return validate_params(raw, source=str(path))


__all__ = ['Params', 'SECTIONS', 'load_params', 'validate_params']
