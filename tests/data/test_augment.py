"""Tests for pipeline.data.augment: batched augmentation with one strength knob, two views, view noise."""

from __future__ import annotations

import colorsys
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
import torchvision.transforms.v2.functional as TF

from pipeline.data.augment import (
    PRESETS,
    AugmentParams,
    AugmentPreset,
    BatchAugment,
    adjust_brightness,
    adjust_contrast,
    adjust_hue,
    adjust_saturation,
    crop_flip,
    two_views,
    view_noise,
)

ALL_PRESETS = sorted(PRESETS)
SHAPES = [(6, 1, 8, 8), (5, 3, 32, 32), (7, 16)]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _data(shape: tuple[int, ...], seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Images in [0, 1] or standard-normal vectors."""
    return (torch.rand if len(shape) == 4 else torch.randn)(shape, generator=_gen(seed)).to(dtype)


def _smooth_images(n: int, c: int, size: int, seed: int) -> torch.Tensor:
    """Natural-ish images: random 4x4 colour fields upsampled bilinearly, (n, c, size, size) in [0, 1]."""
    low = torch.rand(n, c, 4, 4, generator=_gen(seed))
    return F.interpolate(low, size=(size, size), mode="bilinear", align_corners=False).clamp(0, 1)


def _custom(**kw) -> AugmentPreset:
    return AugmentPreset(**{"crop_scale_min": 1.0, "flip_p": 0.0, "jitter": (0.0, 0.0, 0.0, 0.0), "jitter_p": 0.0,
                            "grayscale_p": 0.0, "noise_std": 0.0, "vector_noise": 0.0, **kw})


# ---------------------------------------------------------------------------- API, validation, presets
def test_presets_match_recipes():
    p, s = PRESETS["paper"], PRESETS["simclr"]
    fields = ("crop_scale_min", "flip_p", "jitter", "jitter_p", "grayscale_p")
    assert tuple(getattr(p, f) for f in fields) == (0.8, 0.0, (0.2, 0.2, 0.2, 0.1), 1.0, 0.0)
    assert tuple(getattr(s, f) for f in fields) == (0.08, 0.5, (0.4, 0.4, 0.4, 0.1), 0.8, 0.2)
    assert p.vector_noise > 0 and s.vector_noise > p.vector_noise
    assert PRESETS["none"].scaled(1.0) == PRESETS["none"]


@pytest.mark.parametrize("s", [0.0, 0.3, 1.0])
def test_strength_scales_recipe(s):
    base = PRESETS["simclr"]
    r = base.scaled(s)
    assert r.crop_scale_min == pytest.approx(1.0 - s * (1.0 - base.crop_scale_min))
    assert r.jitter == pytest.approx(tuple(s * j for j in base.jitter))
    assert (r.flip_p, r.jitter_p, r.grayscale_p) == pytest.approx((s * 0.5, s * 0.8, s * 0.2))
    assert r.vector_noise == pytest.approx(s * base.vector_noise)


def test_bad_arguments_raise():
    for bad in (-0.01, 1.01, float("nan"), 2.0):
        with pytest.raises(ValueError, match=r"\[0, 1\]"):
            BatchAugment("paper", bad)
    with pytest.raises(ValueError) as info:
        BatchAugment("strong")
    for name in ("paper", "simclr", "none"):
        assert name in str(info.value)
    aug = BatchAugment("paper")
    for x in (torch.zeros(2, 3, 4, 4, dtype=torch.uint8), torch.zeros(2, 2, 4, 4), torch.zeros(2, 3, 4)):
        with pytest.raises(ValueError):  # uint8, 2 channels, 3-D
            aug(x)


# ------------------------------------------------------------------- shapes, identity, reproducibility
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("preset", ALL_PRESETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_shape_dtype_device_preserved(shape, preset, dtype):
    x = _data(shape, dtype=dtype)
    y = BatchAugment(preset, 1.0)(x, _gen(1))
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
    assert torch.isfinite(y).all()
    if len(shape) == 4:
        assert y.min() >= 0.0 and y.max() <= 1.0


@pytest.mark.parametrize("shape", [(4, 3, 8, 8), (4, 10)])
def test_low_precision_and_empty_batches(shape):
    x = _data(shape).to(torch.bfloat16)
    y = BatchAugment("simclr", 1.0)(x, _gen(0))
    assert y.dtype == torch.bfloat16 and y.shape == x.shape and torch.isfinite(y.float()).all()
    empty = torch.zeros((0, *shape[1:]))
    assert BatchAugment("simclr", 1.0)(empty, _gen(0)).shape == empty.shape


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("preset,strength", [*((p, 0.0) for p in ALL_PRESETS), ("none", 1.0)])
def test_strength_zero_and_preset_none_are_bitwise_identity(shape, preset, strength):
    x = _data(shape)
    y = BatchAugment(preset, strength)(x, _gen(3))
    assert torch.equal(y, x)
    assert y.data_ptr() != x.data_ptr()  # a new tensor: callers may modify it
    assert torch.equal(BatchAugment(preset).apply_params(x, AugmentParams()), x)  # default parameters: identity


# "flip": a flip without a crop; "colour": no resampling
INPLACE_RECIPES = ["paper", "simclr", _custom(flip_p=0.5),
                   _custom(jitter=(0.4, 0.4, 0.4, 0.1), jitter_p=0.5, grayscale_p=0.5, noise_std=0.1)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("recipe", INPLACE_RECIPES, ids=["paper", "simclr", "flip", "colour"])
def test_input_is_never_modified(shape, recipe):
    x = _data(shape)
    before = x.clone()
    y = BatchAugment(recipe, 1.0)(x, _gen(0))
    assert torch.equal(x, before)
    assert y.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("fn", [adjust_brightness, adjust_contrast, adjust_saturation, adjust_hue])
def test_inplace_colour_ops_match_pure(fn):
    x = _data((4, 3, 6, 6))
    f = torch.tensor([0.1, 0.3, 0.0, 0.45]) if fn is adjust_hue else torch.tensor([0.5, 1.0, 1.5, 0.0])
    before = x.clone()
    pure = fn(x, f)
    assert torch.equal(x, before)  # the default is pure
    inplace = fn(x, f, inplace=True)
    assert inplace.data_ptr() == x.data_ptr()
    assert torch.allclose(inplace, pure, atol=1e-7)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("preset", ["paper", "simclr"])
def test_reproducible_per_seed_and_different_across_seeds(shape, preset):
    x = _data(shape)
    aug = BatchAugment(preset, 1.0)
    a, b, c = aug(x, _gen(7)), aug(x, _gen(7)), aug(x, _gen(8))
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)
    torch.manual_seed(5)  # without a generator: the global one
    a = aug(x)
    torch.manual_seed(5)
    assert torch.equal(aug(x), a)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("preset", ["paper", "simclr"])
def test_per_sample_parameters_differ(shape, preset):
    one = _data((1, *shape[1:]))
    x = one.expand(8, *shape[1:]).contiguous()  # 8 identical samples
    y = BatchAugment(preset, 1.0)(x, _gen(11))
    for i, j in itertools.combinations(range(8), 2):
        assert not torch.allclose(y[i], y[j]), (i, j)


def test_two_views_layout():
    x = _data((5, 3, 8, 8))
    aug = BatchAugment("simclr", 1.0)
    v, g = two_views(aug, x, _gen(2)), _gen(2)
    assert torch.equal(v, torch.cat([aug(x, g), aug(x, g)])) and not torch.equal(v[:5], v[5:])


# -------------------------------------------------------------------------------- crop + flip geometry
@pytest.mark.parametrize("shape", [(4, 1, 8, 8), (3, 3, 32, 32), (2, 3, 12, 20)])
def test_full_box_is_identity_or_torch_flip(shape):
    x = _data(shape)
    box = torch.tensor([[0.0, 0.0, 1.0, 1.0]]).repeat(shape[0], 1)
    flip = torch.tensor([True, False] * shape[0])[: shape[0]]
    expected = torch.where(flip.view(-1, 1, 1, 1), x.flip(-1), x)
    assert (crop_flip(x, box, flip) - expected).abs().max() <= 1e-5
    assert (crop_flip(x, box, torch.zeros(shape[0], dtype=torch.bool)) - x).abs().max() <= 1e-5
    assert torch.equal(BatchAugment(_custom(flip_p=1.0), 1.0)(x, _gen(0)), x.flip(-1))  # a forced flip, no crop


def _ref_crop_flip(img: torch.Tensor, cx: float, cy: float, w: float, h: float, flip: bool) -> torch.Tensor:
    """Slow bilinear sampling of one image at output pixel centres mapped through the box, border-clamped."""
    chans, height, width = img.shape
    out = torch.empty_like(img)
    for i, j, c in itertools.product(range(height), range(width), range(chans)):
        u, v = (2 * j + 1) / width - 1, (2 * i + 1) / height - 1
        xn, yn = cx + (-w if flip else w) * u, cy + h * v
        px = min(max(((xn + 1) * width - 1) / 2, 0.0), width - 1.0)
        py = min(max(((yn + 1) * height - 1) / 2, 0.0), height - 1.0)
        x0, y0 = int(math.floor(px)), int(math.floor(py))
        x1, y1 = min(x0 + 1, width - 1), min(y0 + 1, height - 1)
        ax, ay = px - x0, py - y0
        top = (1 - ax) * float(img[c, y0, x0]) + ax * float(img[c, y0, x1])
        bot = (1 - ax) * float(img[c, y1, x0]) + ax * float(img[c, y1, x1])
        out[c, i, j] = (1 - ay) * top + ay * bot
    return out


@pytest.mark.parametrize("shape", [(4, 1, 8, 8), (3, 3, 6, 10)])
def test_random_crop_flip_matches_slow_bilinear_reference(shape):
    x = _data(shape, dtype=torch.float64)
    aug = BatchAugment(_custom(crop_scale_min=0.1, flip_p=0.5), 1.0)
    p = aug.sample_params(x, _gen(5))
    y = crop_flip(x, p.box, p.flip)
    for b in range(shape[0]):
        cx, cy, w, h = (float(t) for t in p.box[b])
        ref = _ref_crop_flip(x[b], cx, cy, w, h, bool(p.flip[b]))
        assert torch.allclose(y[b], ref, atol=1e-5), b


@pytest.mark.parametrize("scale_min", [0.08, 0.5, 0.8])
def test_sampled_boxes_follow_random_resized_crop(scale_min):
    x = torch.zeros(4000, 1, 8, 8)
    p = BatchAugment(_custom(crop_scale_min=scale_min), 1.0).sample_params(x, _gen(4))
    cx, cy, w, h = p.box.unbind(1)
    area = w * h
    assert (area >= scale_min - 1e-6).all() and (area <= 1 + 1e-6).all()
    assert ((cx.abs() + w) <= 1 + 1e-6).all() and ((cy.abs() + h) <= 1 + 1e-6).all()  # inside the image
    ratio = w / h  # square image: width/height in pixels
    fallback = (w == 1) & (h == 1)
    assert ((ratio[~fallback] >= 3 / 4 - 1e-5) & (ratio[~fallback] <= 4 / 3 + 1e-5)).all()
    assert area.std() > 0.01
    # mean area close to the mean of U[scale_min, 1] (fallback and rejections skew it a little)
    assert abs(area.mean().item() - (1 + scale_min) / 2) < 0.1


# ---------------- colour arithmetic vs slow per-sample references (torchvision's definitions), float64
def _ref_gray(img: torch.Tensor, i: int, j: int) -> float:
    if img.shape[0] == 1:
        return float(img[0, i, j])
    return 0.2989 * float(img[0, i, j]) + 0.587 * float(img[1, i, j]) + 0.114 * float(img[2, i, j])


def _clamp01(v: float) -> float:
    return min(1.0, max(0.0, v))


def _ref_pixels(img: torch.Tensor, pixel, rgb_only: bool = False) -> torch.Tensor:
    """``pixel(i, j) -> its channel values`` at every pixel of a (C, H, W) image; ``rgb_only``: grey ones unchanged."""
    if rgb_only and img.shape[0] == 1:
        return img.clone()
    out = torch.empty_like(img)
    for i, j in itertools.product(range(img.shape[1]), range(img.shape[2])):
        out[:, i, j] = torch.tensor(pixel(i, j), dtype=img.dtype)
    return out


def _ref_brightness(img: torch.Tensor, f: float) -> torch.Tensor:
    return _ref_pixels(img, lambda i, j: [_clamp01(f * float(v)) for v in img[:, i, j]])


def _ref_contrast(img: torch.Tensor, f: float) -> torch.Tensor:
    h, w = img.shape[1:]
    mean = sum(_ref_gray(img, i, j) for i in range(h) for j in range(w)) / (h * w)
    return _ref_pixels(img, lambda i, j: [_clamp01(f * float(v) + (1 - f) * mean) for v in img[:, i, j]])


def _ref_saturation(img: torch.Tensor, f: float) -> torch.Tensor:
    return _ref_pixels(img, lambda i, j: [_clamp01(f * float(v) + (1 - f) * _ref_gray(img, i, j))
                                          for v in img[:, i, j]], rgb_only=True)


def _ref_hue(img: torch.Tensor, shift: float) -> torch.Tensor:
    def pixel(i: int, j: int) -> tuple[float, float, float]:
        h, s, v = colorsys.rgb_to_hsv(*(float(img[c, i, j]) for c in range(3)))
        return colorsys.hsv_to_rgb((h + shift) % 1.0, s, v)

    return _ref_pixels(img, pixel, rgb_only=True)


COLOUR_SHAPES = [(3, 1, 5, 4), (4, 3, 6, 5), (2, 3, 3, 7)]


@pytest.mark.parametrize("shape", COLOUR_SHAPES)
@pytest.mark.parametrize("fn,ref,lo,hi", [(adjust_brightness, _ref_brightness, 0.0, 2.0),
                                         (adjust_contrast, _ref_contrast, 0.0, 2.0),
                                         (adjust_saturation, _ref_saturation, 0.0, 2.0),
                                         (adjust_hue, _ref_hue, -0.5, 0.5)], ids=["brightness", "contrast",
                                                                                  "saturation", "hue"])
def test_colour_ops_match_slow_reference(shape, fn, ref, lo, hi):
    x = _data(shape, seed=shape[0], dtype=torch.float64)
    x[0, :, 0, 0] = 0.5  # a gray pixel (zero chroma)
    x[-1, :, 0, 1] = 1.0  # saturated pixels
    f = lo + (hi - lo) * torch.rand(shape[0], generator=_gen(9), dtype=torch.float64)
    y = fn(x, f)
    for b in range(shape[0]):
        assert torch.allclose(y[b], ref(x[b], float(f[b])), atol=1e-9), b


def test_jitter_pipeline_matches_per_sample_chain():
    """Jitter only (p = 1, then p = 0.5): fixed order b -> c -> s -> h per sample, else left unchanged."""
    x = _data((12, 3, 8, 8), seed=4)
    for p in (1.0, 0.5):
        aug = BatchAugment(_custom(jitter=(0.4, 0.4, 0.4, 0.1), jitter_p=p), 1.0)
        params = aug.sample_params(x, _gen(6))
        y = aug.apply_params(x, params)
        assert params.jitter is not None and (params.jitter.all() if p == 1.0 else not params.jitter.all())
        for b in range(12):
            img = x[b]
            if params.jitter[b]:
                img = TF.adjust_brightness(img, float(params.brightness[b]))
                img = TF.adjust_contrast(img, float(params.contrast[b]))
                img = TF.adjust_saturation(img, float(params.saturation[b]))
                img = TF.adjust_hue(img, float(params.hue[b]))
                assert torch.allclose(y[b], img, atol=1e-5), b
            else:
                assert torch.equal(y[b], x[b]), b


def test_forced_grayscale_and_gray_inputs():
    x = _data((3, 3, 8, 8))
    y = BatchAugment(_custom(grayscale_p=1.0), 1.0)(x, _gen(0))
    gray = 0.2989 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]
    for c in range(3):
        assert torch.allclose(y[:, c], gray, atol=1e-6)
    # C = 1: saturation, hue, grayscale are no-ops and draw no parameters
    g1 = _data((3, 1, 8, 8))
    aug = BatchAugment(_custom(jitter=(0.0, 0.0, 0.4, 0.1), jitter_p=1.0, grayscale_p=1.0), 1.0)
    p = aug.sample_params(g1, _gen(0))
    assert p.saturation is None and p.hue is None and p.grayscale is None and p.jitter is None
    assert torch.equal(aug(g1, _gen(0)), g1)


def test_image_noise_scaled_by_strength():
    x = torch.full((64, 3, 16, 16), 0.5)
    std = [(BatchAugment(_custom(noise_std=0.1), s)(x, _gen(0)) - x).std().item() for s in (0.25, 1.0)]
    assert std[0] == pytest.approx(0.025, rel=0.05) and std[1] == pytest.approx(0.1, rel=0.05)


# ------------------------------------------------------------------------------ vector noise (eq. (8))
@pytest.mark.parametrize("preset", ["paper", "simclr"])
@pytest.mark.parametrize("s", [0.1, 0.5, 1.0])
@pytest.mark.parametrize("m", [2, 16, 64])
def test_vector_noise_obeys_eq8(preset, s, m):
    x = _data((200, m), seed=m)
    x[0] = 0.0  # zero vector stays zero
    aug = BatchAugment(preset, s)
    params = aug.sample_params(x, _gen(1))
    y = aug.apply_params(x, params)
    cos = F.cosine_similarity(x[1:].double(), y[1:].double(), dim=1)
    bound = 1 - s * PRESETS[preset].vector_noise
    assert (cos >= bound - 1e-6).all()
    assert torch.allclose(cos, 1 - params.vector_e[1:].double(), atol=1e-5)  # exactly 1 - e_i
    assert torch.allclose(y.norm(dim=1), x.norm(dim=1), atol=1e-5)  # norms kept
    assert torch.equal(y[0], x[0])
    assert cos.min() < bound + 0.05 * s  # e actually spans [0, s * vector_noise]


# ------------------------------------------------------------------------------------------ view noise
@pytest.mark.parametrize("shape", [(1, 5), (7, 3), (5, 2, 3, 3)])
def test_view_noise_matches_naive_loop(shape):
    v1, v2 = _data(shape, seed=1), _data(shape, seed=2)
    a, b = v1.reshape(shape[0], -1).double(), v2.reshape(shape[0], -1).double()
    total = 0.0
    for i in range(shape[0]):
        dot = sum(float(a[i, k]) * float(b[i, k]) for k in range(a.shape[1]))
        na = math.sqrt(sum(float(a[i, k]) ** 2 for k in range(a.shape[1])))
        nb = math.sqrt(sum(float(b[i, k]) ** 2 for k in range(b.shape[1])))
        total += dot / (na * nb)
    assert view_noise(v1, v2) == pytest.approx(1 - total / shape[0], abs=1e-10)
    with pytest.raises(ValueError):
        view_noise(v1, v2[:-1] if shape[0] > 1 else v2[..., :-1])


@pytest.mark.parametrize("preset", ["paper", "simclr"])
@pytest.mark.parametrize("kind", ["rgb", "gray", "vector"])
def test_view_noise_grows_with_strength(preset, kind):
    images = {"rgb": (3, 32), "gray": (1, 8)}  # channels, size
    x = _smooth_images(256, *images[kind], seed=0) if kind in images else _data((256, 32), seed=0)
    eps = [view_noise(*two_views(BatchAugment(preset, s), x, _gen(0)).chunk(2)) for s in (0.0, 0.25, 0.5, 1.0)]
    assert eps[0] == pytest.approx(0.0, abs=1e-12)
    assert all(b > a for a, b in zip(eps, eps[1:], strict=False)), eps
