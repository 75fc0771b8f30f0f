"""``model.backbone: torchvision:<name>``: any torchvision classification model, adapted as resnet18 is.

Each model here is built by ``build_backbone`` and compared with the same model built by torchvision alone (the
reference): the first convolution reads the input's channels with the reference stem's settings, the classifier
(the reference's last Linear, at its path) is Flatten + LayerNorm of its in_features, the output is (n, width), no
random layer is left (a training-mode forward is the same under any seed), BatchNorm is where the reference has it
and ``convert_batchnorm`` turns every one global. The widths and BatchNorm flags agree with what the params check
computes (``pipeline.config.model.torchvision_facts``). Sizes: 28x28x1 (Fashion-MNIST) and 32x32x3 (CIFAR-10).
"""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn
from torchvision.ops import StochasticDepth

from pipeline.config.model import NO_LINEAR_CLASSIFIER, TORCHVISION_KWARGS, torchvision_facts
from pipeline.core.backbones import build_backbone
from pipeline.core.batchnorm import GlobalBatchNorm, convert_batchnorm, has_batchnorm
from pipeline.core.model import TransFusion, TransFusionHead

SLOW = pytest.mark.slow  # 5-8 s each on 2 busy cores (the quick ones: 3-5 s)
# (model, input shape, the reference's stem path, its classifier path, width, BatchNorm)
MODELS = [
    ("resnet18", (1, 28, 28), "conv1", "fc", 512, True),
    ("mobilenet_v3_small", (3, 32, 32), "features.0.0", "classifier.3", 1024, True),
    pytest.param("mobilenet_v3_small", (1, 28, 28), "features.0.0", "classifier.3", 1024, True, marks=SLOW),
    pytest.param("efficientnet_b0", (1, 28, 28), "features.0.0", "classifier.1", 1280, True, marks=SLOW),
    pytest.param("convnext_tiny", (3, 32, 32), "features.0.0", "classifier.2", 768, False, marks=SLOW),
    # its builder cannot run on the meta device: torchvision_facts builds it on the CPU
    pytest.param("regnet_x_400mf", (1, 28, 28), "stem.0", "fc", 400, True, marks=SLOW),
]


def _id(case) -> str:
    model, shape = (case.values if hasattr(case, "values") else case)[:2]
    return f"{model}-{'x'.join(map(str, shape))}"


def _reference(model: str) -> nn.Module:
    return torchvision.models.get_model(model, weights=None, **TORCHVISION_KWARGS.get(model, {}))


@pytest.mark.parametrize("model,shape,stem,classifier,width,batchnorm", MODELS, ids=[_id(c) for c in MODELS])
def test_torchvision_backbone_is_adapted_as_resnet18(model, shape, stem, classifier, width, batchnorm, tmp_path,
                                                     monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))  # where torchvision would put downloaded weights
    torch.manual_seed(0)
    bb, dim = build_backbone(f"torchvision:{model}", shape)
    ref = _reference(model)
    assert dim == width == ref.get_submodule(classifier).in_features
    assert torchvision_facts(model) == (width, batchnorm)  # what the params check computes on the meta device
    # the stem reads the input's channels, with the reference's settings
    conv, ref_conv = bb.get_submodule(stem), ref.get_submodule(stem)
    assert isinstance(conv, nn.Conv2d) and conv.in_channels == shape[0]
    assert ([conv.out_channels, conv.kernel_size, conv.stride, conv.padding, conv.groups, conv.bias is None]
            == [ref_conv.out_channels, ref_conv.kernel_size, ref_conv.stride, ref_conv.padding, ref_conv.groups,
                ref_conv.bias is None])
    # the classifier is Flatten + LayerNorm(width), where the reference's last Linear was
    head = bb.get_submodule(classifier)
    assert isinstance(head, nn.Sequential) and [type(m) for m in head] == [nn.Flatten, nn.LayerNorm]
    assert head[1].normalized_shape == (width,)
    assert not any(isinstance(m, nn.Linear) and m.out_features == 1000 for m in bb.modules())
    # no random layer: a training-mode forward is a function of the input
    assert not any(isinstance(m, (nn.modules.dropout._DropoutNd, StochasticDepth)) for m in bb.modules())
    x = torch.rand(4, *shape)
    torch.manual_seed(1)
    y1 = bb.train()(x)
    torch.manual_seed(2)
    y2 = bb(x)
    assert y1.shape == (4, width) and torch.isfinite(y1).all()
    torch.testing.assert_close(y1, y2, rtol=0, atol=0)
    # LayerNorm last: each row has mean 0 and variance 1 (its affine is the identity at initialisation)
    torch.testing.assert_close(y1.mean(1), torch.zeros(4), atol=1e-5, rtol=0)
    if shape[0] != 3:
        with pytest.raises(RuntimeError):  # the channels really changed
            bb(torch.rand(4, 3, *shape[1:]))
    # BatchNorm where the reference has it; global after conversion, with the same state_dict
    n_bn = sum(isinstance(m, nn.BatchNorm2d) for m in bb.modules())
    assert has_batchnorm(bb) == batchnorm and n_bn == sum(isinstance(m, nn.BatchNorm2d) for m in ref.modules())
    keys = list(bb.state_dict())
    convert_batchnorm(bb)
    assert sum(isinstance(m, GlobalBatchNorm) for m in bb.modules()) == n_bn
    assert not any(type(m) is nn.BatchNorm2d for m in bb.modules()) and list(bb.state_dict()) == keys
    # with a head, as build_model puts it
    out = TransFusion(bb, dim, TransFusionHead(dim, depth=1)).eval()(x, collect=True)
    assert out.embedding.shape == (4, width)
    assert not any(tmp_path.iterdir())  # nothing downloaded


@pytest.mark.parametrize("name,shape,needles", [
    ("torchvision:resnet5", (3, 32, 32), ["unknown backbone torchvision:resnet5", "list_models"]),
    ("torchvision:squeezenet1_0", (3, 32, 32), ["squeezenet1_0", "no Linear classifier"]),
    pytest.param("torchvision:convnext_tiny", (1, 28, 28),
                 ["convnext_tiny", "(1, 28, 28)", "does not run on this size", "choose a model for images this small"],
                 marks=SLOW),  # torch's own words for the size differ between versions (2.11, 2.14)
    ("torchvision:vit_b_16", (3, 28, 28), ["vit_b_16", "(3, 28, 28)", "indivisible by patch size"]),
    ("torchvision:resnet18", (784,), ["needs image inputs"]),
])
def test_torchvision_backbones_that_cannot_be_built_say_why(name, shape, needles):
    with pytest.raises(ValueError) as info:
        build_backbone(name, shape)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


@pytest.mark.slow
def test_vit_takes_the_inputs_side_as_its_image_size():
    bb, dim = build_backbone("torchvision:vit_b_32", (1, 32, 32))
    assert dim == 768 and bb.image_size == 32 and bb.conv_proj.in_channels == 1
    assert bb.encoder.pos_embedding.shape == (1, 1 + 1, 768)  # one 32x32 patch and the class token
    assert bb.eval()(torch.rand(2, 1, 32, 32)).shape == (2, 768)


@pytest.mark.slow  # ~10 s: every classification model of torchvision, on the meta device
def test_every_torchvision_model_has_a_linear_classifier_but_the_refused_ones():
    """NO_LINEAR_CLASSIFIER is exactly the models without a Linear; the rest have their last Linear as the
    classifier (the one that outputs the 1000 classes), so the backbone's width is its in_features."""
    without, not_on_meta = [], []
    for name in torchvision.models.list_models(module=torchvision.models):
        try:
            with torch.device("meta"):
                net = torchvision.models.get_model(name, weights=None, **TORCHVISION_KWARGS.get(name, {}))
        except NotImplementedError:  # the builder reads tensor values: torchvision_facts builds it on the CPU
            not_on_meta.append(name)
            continue
        linears = [m for m in net.modules() if isinstance(m, nn.Linear)]
        if not linears:
            without.append(name)
        else:
            assert linears[-1].out_features == 1000, name
    assert tuple(without) == NO_LINEAR_CLASSIFIER
    assert not_on_meta and all(name.startswith("regnet_") for name in not_on_meta)  # regnet_x_400mf is in MODELS
