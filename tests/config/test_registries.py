"""Each section's allowed names (plain literals in pipeline/config/, so a stage depends only on the sections it reads)
match the registries of what implements them; each name works, and one outside the list is refused there too."""

from __future__ import annotations

import os

import pytest
import torch

from pipeline.config import augment as C_augment
from pipeline.config import data as C_data
from pipeline.config import loss as C_loss
from pipeline.config import model as C_model
from pipeline.config import probe as C_probe
from pipeline.core import abc, backbones, losses, model
from pipeline.core.targets import self_supervised_ids
from pipeline.data import augment, sources
from pipeline.evaluation import probes
from pipeline.host import usable_cpus


def test_dataset_preset_and_probe_names_are_the_readers_presets_and_probes():
    assert tuple(sources.DATASET_NAMES) == C_data.DATASET_NAMES
    assert tuple(augment.PRESETS) == C_augment.PRESET_NAMES
    assert tuple(probes.PROBES) == C_probe.PROBES
    for name in C_probe.PROBES:
        assert hasattr(probes.make_probe(name, n_train=400, n_classes=4), "fit")
    with pytest.raises(ValueError):
        probes.make_probe("nope", n_train=400)


def test_backbone_names_and_fixed_widths_are_the_backbones():
    assert tuple(backbones.BACKBONE_NAMES) == C_model.BACKBONE_NAMES
    assert backbones.FIXED_DIMS == C_model.FIXED_DIMS
    assert set(C_model.BATCHNORM_BACKBONES) | set(C_model.IMAGE_BACKBONES) <= set(C_model.BACKBONE_NAMES)
    with pytest.raises(ValueError, match="unknown backbone"):
        backbones.build_backbone("nope", (3, 32, 32), None)
    # torchvision:<name>: the same prefix; a name outside torchvision's list refused by the builder too (the widths
    # and BatchNorm flags: tests/core/test_torchvision_backbones.py)
    assert backbones.TORCHVISION == C_model.TORCHVISION
    with pytest.raises(ValueError, match="unknown backbone torchvision:nope"):
        backbones.build_backbone("torchvision:nope", (3, 32, 32), None)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet18_cifar", "resnet18"])
def test_the_fixed_widths_are_what_the_backbones_output(name):
    net, width = backbones.build_backbone(name, (3, 32, 32), None)
    with torch.no_grad():
        assert net.eval()(torch.zeros(2, 3, 32, 32)).shape == (2, C_model.FIXED_DIMS[name]) and width == 512
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in net.modules()) == (name in C_model.BATCHNORM_BACKBONES)


def test_block_options_are_the_ones_the_block_takes():
    for activation in C_model.ACTIVATIONS:
        model.TransFusionBlock(8, activation=activation)
    for kwargs in ({"activation": "gelu"}, {"norm": "batch"}, {"qk_init": "orthogonal"}):
        with pytest.raises(ValueError, match="allowed"):
            model.TransFusionBlock(8, **kwargs)
    assert model.EPS == C_model.AFFINITY_EPS == losses.EPS


def test_loss_names_are_the_losses_and_self_supervised_only_is_what_they_refuse():
    assert tuple(losses.LOSSES) == C_loss.TRANSFUSION_LOSSES == losses.LOSS_NAMES
    assert C_loss.LOSS_NAMES == C_loss.TRANSFUSION_LOSSES + C_loss.ABC_LOSSES
    q, k = torch.randn(8, 4), torch.randn(8, 4)
    two_view, classes = self_supervised_ids(4), torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    for name in C_loss.TRANSFUSION_LOSSES:
        fn = losses.make_loss(name)
        assert torch.isfinite(fn(q, k, two_view))
        if name in C_loss.SELF_SUPERVISED_ONLY:
            with pytest.raises(ValueError):
                fn(q, k, classes)
        else:
            assert torch.isfinite(fn(q, k, classes))
    with pytest.raises(ValueError, match="unknown loss"):
        losses.make_loss("nope")


def test_abc_names_are_what_abc_implements():
    """model.method, model.abc's compatibilities and kernels, and ABC's losses: the core's registries, each usable."""
    assert model.METHODS == C_model.METHODS
    assert abc.COMPATIBILITIES == C_model.ABC_COMPATIBILITIES and abc.KERNELS == C_model.ABC_KERNELS
    assert tuple(model.ABC_LOSSES) == C_loss.ABC_LOSSES
    assert set(C_model.TRANSFUSION_ONLY) < set(C_model.ModelConfig.model_fields)
    assert set(C_model.AbcConfig.model_fields) == {"blocks", "heads", "width", "compatibility", "kernel", "pre_embed",
                                                  "set_norm"}
    x, classes = torch.randn(8, 6), torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    for compatibility in C_model.ABC_COMPATIBILITIES:
        for kernel in C_model.ABC_KERNELS:
            out = abc.ABCHead(6, depth=1, heads=2, width=8, compatibility=compatibility, kernel=kernel)(x)
            for name in C_loss.ABC_LOSSES:
                for pos_weight in (1.0, "balanced"):
                    assert torch.isfinite(model.ABC_LOSSES[name](pos_weight)(out, classes))
    with pytest.raises(ValueError, match="allowed"):
        abc.ABCHead(6, compatibility="cosine")
    with pytest.raises(ValueError, match="allowed"):
        abc.ABCHead(6, kernel="softmax")


def test_usable_cpus_is_this_process_affinity():
    n = usable_cpus()
    assert 1 <= n <= (os.cpu_count() or n)
    if hasattr(os, "sched_getaffinity"):
        assert n == len(os.sched_getaffinity(0))


def test_set_study_names_are_the_tasks_and_methods():
    from pipeline.config.sets import SET_DATASETS, SET_METHODS, TRAINED_METHODS
    from pipeline.data.set_tasks import TASKS
    from pipeline.evaluation.set_report import LABELS

    assert tuple(TASKS) == SET_DATASETS
    assert set(LABELS) == set(SET_METHODS) and set(TRAINED_METHODS) == set(SET_METHODS) - {"rbf"}
