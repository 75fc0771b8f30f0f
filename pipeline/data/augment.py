"""Batched, on-device data augmentation with one strength knob ``s in [0, 1]``.

Everything is vectorized over the batch: per-sample random parameters are drawn as ``(B,)`` tensors and the
transforms are tensor arithmetic, so no per-sample Python loop runs on the hot path.

Images ``(B, C, H, W)`` with C in {1, 3}, float in [0, 1]; in this fixed order:

1. random resized crop + horizontal flip: ONE affine sampling grid + ``F.grid_sample`` (bilinear,
   ``align_corners=False``, border padding). The crop box follows torchvision's ``RandomResizedCrop``
   sampling (area fraction ~ U[scale_min, 1], log aspect ratio ~ U[log 3/4, log 4/3], 10 attempts, first that
   fits wins) but in continuous (sub-pixel) coordinates; if no attempt fits, the whole image is used
   (torchvision falls back to a centre crop with clamped ratio, which differs only for images whose own
   aspect ratio is outside [3/4, 4/3]). Near the box edge the sampler reads the real neighbouring pixels,
   where torchvision's crop-then-resize replicates the crop's border row/column.
2. colour jitter, applied to a sample with probability ``jitter_p``, in the FIXED order brightness ->
   contrast -> saturation -> hue (torchvision permutes the order at random; a fixed order keeps the batch
   vectorized). Each step follows torchvision's definitions and clamps to [0, 1]:
   brightness ``f * x``; contrast ``f * x + (1 - f) * mean(gray(x))``;
   saturation ``f * x + (1 - f) * gray(x)``; hue: rotate the HSV hue by ``f`` turns.
   Hue: an exact RGB -> HSV -> RGB round trip written as element-wise tensor ops (see ``adjust_hue``),
   not a YIQ rotation: it reproduces torchvision's ``adjust_hue`` (tested to 1e-5), keeps saturation and
   value, and stays in the RGB gamut, whereas a YIQ rotation is an approximation that does neither; it costs
   ~30 element-wise ops per pixel, a fraction of the resampling.
3. random grayscale with probability ``grayscale_p`` (gray replicated to 3 channels).
4. additive Gaussian pixel noise of std ``noise_std`` (0 in the built-in presets), then clamp to [0, 1].

For C = 1 only crop, flip, brightness, contrast and noise apply (saturation, hue and grayscale are no-ops).

Vectors ``(B, m)`` (e.g. the synthetic union-of-subspaces data): each vector is rotated towards a random
direction orthogonal to it so that its cosine with the original is exactly ``1 - e``, ``e ~ U[0, s *
vector_noise]``; the norm is kept. This is the noise model of the paper's eq. (8), ``x_i^T x~_i >= 1 - eps``.

Strength ``s`` scales everything: crop min scale ``1 - s (1 - preset_min)``, jitter magnitudes ``* s``,
probabilities ``* s``, noise ``* s``. At ``s = 0`` (and for preset ``none``) the output is bitwise equal to
the input. A transform whose effective parameter is zero is skipped entirely (and draws no random numbers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "PRESETS",
    "AugmentParams",
    "AugmentPreset",
    "BatchAugment",
    "adjust_brightness",
    "adjust_contrast",
    "adjust_hue",
    "adjust_saturation",
    "crop_flip",
    "rgb_to_grayscale",
    "rotate_vectors",
    "two_views",
    "view_noise",
]

_GRAY_WEIGHTS = (0.2989, 0.587, 0.114)  # torchvision's rgb_to_grayscale weights (ITU-R 601-2 luma)
_LOG_RATIO = (math.log(3.0 / 4.0), math.log(4.0 / 3.0))  # RandomResizedCrop default aspect ratio range
_CROP_ATTEMPTS = 10  # as torchvision's RandomResizedCrop


@dataclass(frozen=True)
class AugmentPreset:
    """One augmentation recipe at full strength (s = 1).

    ``jitter`` = (brightness, contrast, saturation, hue) magnitudes as in torchvision's ColorJitter: factors
    drawn from U[max(0, 1 - b), 1 + b] etc., hue shift from U[-h, h] (h <= 0.5).
    """

    crop_scale_min: float
    flip_p: float
    jitter: tuple[float, float, float, float]  # b, c, s, h
    jitter_p: float
    grayscale_p: float
    noise_std: float
    vector_noise: float

    def __post_init__(self) -> None:
        if not 0.0 < self.crop_scale_min <= 1.0:
            raise ValueError(f"crop_scale_min must be in (0, 1], got {self.crop_scale_min}")
        for name in ("flip_p", "jitter_p", "grayscale_p", "vector_noise"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if len(self.jitter) != 4 or any(not j >= 0.0 for j in self.jitter):
            raise ValueError(f"jitter must be 4 non-negative magnitudes (b, c, s, h), got {self.jitter}")
        if self.jitter[3] > 0.5:
            raise ValueError(f"hue jitter must be <= 0.5, got {self.jitter[3]}")
        if not self.noise_std >= 0.0:
            raise ValueError(f"noise_std must be >= 0, got {self.noise_std}")

    def scaled(self, strength: float) -> AugmentPreset:
        """The recipe at strength s: min scale ``1 - s (1 - min)``; magnitudes, probabilities, noise * s."""
        _check_strength(strength)
        s = float(strength)
        return replace(
            self,
            crop_scale_min=1.0 - s * (1.0 - self.crop_scale_min),
            flip_p=s * self.flip_p,
            jitter=tuple(s * j for j in self.jitter),  # type: ignore[arg-type]
            jitter_p=s * self.jitter_p,
            grayscale_p=s * self.grayscale_p,
            noise_std=s * self.noise_std,
            vector_noise=s * self.vector_noise,
        )


PRESETS: dict[str, AugmentPreset] = {
    # Paper section 5.2.1: random crop scale (0.8, 1); colour jitter 0.2/0.2/0.2/0.1 (always applied).
    "paper": AugmentPreset(
        crop_scale_min=0.8, flip_p=0.0, jitter=(0.2, 0.2, 0.2, 0.1), jitter_p=1.0,
        grayscale_p=0.0, noise_std=0.0, vector_noise=0.1,
    ),
    # SimCLR's strong recipe (no blur for small images).
    "simclr": AugmentPreset(
        crop_scale_min=0.08, flip_p=0.5, jitter=(0.4, 0.4, 0.4, 0.1), jitter_p=0.8,
        grayscale_p=0.2, noise_std=0.0, vector_noise=0.3,
    ),
    "none": AugmentPreset(
        crop_scale_min=1.0, flip_p=0.0, jitter=(0.0, 0.0, 0.0, 0.0), jitter_p=0.0,
        grayscale_p=0.0, noise_std=0.0, vector_noise=0.0,
    ),
}


def _check_strength(strength: float) -> None:
    if not 0.0 <= strength <= 1.0:  # also rejects NaN
        raise ValueError(f"strength must be in [0, 1], got {strength}")


def _resolve_preset(preset: str | AugmentPreset) -> AugmentPreset:
    if isinstance(preset, AugmentPreset):
        return preset
    if preset not in PRESETS:
        allowed = ", ".join(repr(k) for k in sorted(PRESETS))
        raise ValueError(f"unknown augmentation preset {preset!r}; allowed: {allowed}")
    return PRESETS[preset]


# ----------------------------------------------------------------------------------------------------------
# Pure per-batch transforms (per-sample factors as (B,) tensors)
# ----------------------------------------------------------------------------------------------------------


def _per_sample(f: Tensor, x: Tensor) -> Tensor:
    """(B,) -> (B, 1, 1, 1) in x's dtype/device, for broadcasting over (B, C, H, W)."""
    return f.to(device=x.device, dtype=x.dtype).view(-1, 1, 1, 1)


def rgb_to_grayscale(x: Tensor) -> Tensor:
    """Luma ``0.2989 R + 0.587 G + 0.114 B``: (B, 3, H, W) -> (B, 1, H, W); (B, 1, H, W) is returned as is."""
    if x.shape[-3] == 1:
        return x
    r, g, b = x.unbind(dim=-3)
    gray = torch.mul(r, _GRAY_WEIGHTS[0]).add_(g, alpha=_GRAY_WEIGHTS[1]).add_(b, alpha=_GRAY_WEIGHTS[2])
    return gray.unsqueeze(-3)


# The colour ops below return a new tensor, or with ``inplace=True`` overwrite x (fewer fresh allocations:
# on CPU, touching newly allocated memory costs as much as the arithmetic).


def adjust_brightness(x: Tensor, factor: Tensor, inplace: bool = False) -> Tensor:
    """``clamp(f_i * x_i, 0, 1)``; x (B, C, H, W), factor (B,)."""
    out = x if inplace else x.clone()
    return out.mul_(_per_sample(factor, x)).clamp_(0.0, 1.0)


def adjust_contrast(x: Tensor, factor: Tensor, inplace: bool = False) -> Tensor:
    """``clamp(f_i x_i + (1 - f_i) mean(gray(x_i)), 0, 1)``, mean over (1, H, W); x (B, C, H, W), f (B,)."""
    f = _per_sample(factor, x)  # (B, 1, 1, 1)
    mean = rgb_to_grayscale(x).mean(dim=(-3, -2, -1), keepdim=True)  # (B, 1, 1, 1)
    out = x if inplace else x.clone()
    return out.mul_(f).add_((1.0 - f) * mean).clamp_(0.0, 1.0)


def adjust_saturation(x: Tensor, factor: Tensor, inplace: bool = False) -> Tensor:
    """``clamp(f_i x_i + (1 - f_i) gray(x_i), 0, 1)``; x (B, 3, H, W), factor (B,). No-op for C = 1."""
    out = x if inplace else x.clone()
    if x.shape[-3] == 1:
        return out
    f = _per_sample(factor, x)  # (B, 1, 1, 1)
    gray = rgb_to_grayscale(x).mul_(1.0 - f)  # (B, 1, H, W)
    return out.mul_(f).add_(gray).clamp_(0.0, 1.0)


def adjust_hue(x: Tensor, shift: Tensor, inplace: bool = False) -> Tensor:
    """Rotate the HSV hue of sample i by ``shift_i`` turns, shift in [-0.5, 0.5]; x (B, 3, H, W), shift (B,).

    With v = max(R, G, B), m = min(R, G, B), chroma c = v - m and the hue in sextants
    ``h6 = (G - B)/c`` (v = R), ``(B - R)/c + 2`` (v = G), ``(R - G)/c + 4`` (v = B), the rotated hue
    ``h = (h6 + 6 shift) mod 6`` in [0, 6) maps back by the piecewise-linear pure-hue curves
    ``R = m + c clamp(|h - 3| - 1, 0, 1)``, ``G = m + c clamp(2 - |h - 2|, 0, 1)``,
    ``B = m + c clamp(2 - |h - 4|, 0, 1)``. Saturation c/v and value v are unchanged. No-op for C = 1.
    Element-wise on (B, H, W) planes with a handful of scratch buffers.
    """
    if x.shape[-3] == 1:
        return x if inplace else x.clone()
    r, g, b = x.unbind(dim=-3)  # each (B, H, W)
    v = torch.maximum(r, g)
    torch.maximum(v, b, out=v)
    m = torch.minimum(r, g)
    torch.minimum(m, b, out=m)
    c = v - m
    # which channel holds the max, as exact 0/1 float masks (priority R > G > B; hue is continuous at ties).
    # sign() of a non-positive difference, not torch.where: where() on a random per-pixel mask is slow on CPU.
    on_r = torch.sub(r, v).sign_().add_(1.0)  # 1 where v == r, else 0
    on_b = torch.neg(on_r).add_(1.0)  # not r
    on_g = torch.sub(g, v).sign_().add_(1.0).mul_(on_b)  # 1 where v == g != r
    on_b.sub_(on_g)  # 1 where v == b != r, g
    h = torch.sub(g, b).mul_(on_r)  # sextant numerator; 0 where c = 0
    tmp = torch.sub(b, r).add_(c, alpha=2.0)
    h.addcmul_(on_g, tmp)
    torch.sub(r, g, out=tmp).add_(c, alpha=4.0)
    h.addcmul_(on_b, tmp)
    shift6 = 6.0 * shift.to(device=x.device, dtype=x.dtype).view(-1, 1, 1)  # (B, 1, 1) in sextants
    h.div_(torch.clamp_min(c, torch.finfo(x.dtype).tiny, out=tmp)).add_(shift6)
    h.sub_(torch.mul(h, 1.0 / 6.0, out=tmp).floor_().mul_(6.0))  # rotated hue mod 6 (curves are 6-periodic)
    # pure-hue curves R = clamp(|h - 3| - 1), G = clamp(2 - |h - 2|), B = clamp(2 - |h - 4|); m + c * curve
    out = x if inplace else torch.empty_like(x)
    for ch, (centre, sign, bias) in enumerate(((3.0, 1.0, -1.0), (2.0, -1.0, 2.0), (4.0, -1.0, 2.0))):
        torch.sub(h, centre, out=tmp).abs_().mul_(sign).add_(bias).clamp_(0.0, 1.0)
        torch.addcmul(m, c, tmp, out=out[:, ch])
    return out.clamp_(0.0, 1.0)


def crop_flip(x: Tensor, box: Tensor, flip: Tensor | None = None) -> Tensor:
    """Resample each image's crop box to the full size with one affine grid + ``F.grid_sample``.

    x (B, C, H, W); box (B, 4) = (cx, cy, w, h) in normalized coordinates (image spans [-1, 1], centre
    (cx, cy), half-extents = w, h as fractions of the image, so (0, 0, 1, 1) is the whole image);
    flip (B,) bool mirrors the sampled box horizontally. Output pixel centre (u, v) in [-1, 1]^2 reads input
    ``(cx + s_i w u, cy + h v)``, s_i = -1 if flipped else 1, i.e. ``F.affine_grid`` with
    ``theta_i = [[s_i w, 0, cx], [0, h, cy]]`` (built here by broadcasting: the map is axis-aligned, and
    affine_grid's (B, HW, 3) @ (B, 3, 2) bmm costs more than the resampling on CPU). Bilinear,
    align_corners=False, border padding: an identity box maps pixel centres onto pixel centres exactly.
    """
    bsz, _, height, width = x.shape
    box = box.to(device=x.device, dtype=x.dtype)
    cx, cy, w, h = box.unbind(dim=1)  # each (B,)
    if flip is not None:
        w = torch.where(flip.to(x.device), -w, w)
    u = torch.arange(width, device=x.device, dtype=x.dtype).mul_(2.0 / width).add_(1.0 / width - 1.0)  # (W,)
    v = torch.arange(height, device=x.device, dtype=x.dtype).mul_(2.0 / height).add_(1.0 / height - 1.0)
    base = torch.stack([u.expand(height, width), v[:, None].expand(height, width)], dim=-1)  # (H, W, 2)
    scale = torch.stack([w, h], dim=1).view(bsz, 1, 1, 2)
    offset = torch.stack([cx, cy], dim=1).view(bsz, 1, 1, 2)
    grid = torch.addcmul(offset, scale, base)  # (B, H, W, 2): (cx + s w u_j, cy + h v_i)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


def rotate_vectors(x: Tensor, e: Tensor, direction: Tensor) -> Tensor:
    """Rotate x_i towards the part of ``direction_i`` orthogonal to it so that ``cos(x_i, x~_i) = 1 - e_i``.

    ``x~_i = |x_i| ((1 - e_i) u_i + sqrt(1 - (1 - e_i)^2) p_i)``, u_i = x_i/|x_i|, p_i the unit component of
    direction_i orthogonal to u_i (eq. (8) of the paper with equality). Norms are kept; zero vectors stay 0.
    x, direction (B, m); e (B,) in [0, 1].
    """
    norm = x.norm(dim=1, keepdim=True)  # (B, 1)
    u = x / norm.clamp_min(torch.finfo(x.dtype).tiny)  # (B, m)
    d = direction.to(device=x.device, dtype=x.dtype)
    p = d - (d * u).sum(dim=1, keepdim=True) * u  # (B, m), orthogonal to u
    p = p - (p * u).sum(dim=1, keepdim=True) * u  # second Gram-Schmidt pass: exact even when d ~ +-u
    p = p / p.norm(dim=1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)
    cos = (1.0 - e.to(device=x.device, dtype=x.dtype)).unsqueeze(1)  # (B, 1)
    sin = (1.0 - cos * cos).clamp_min(0.0).sqrt()
    return norm * (cos * u + sin * p)


# ----------------------------------------------------------------------------------------------------------
# Random parameters
# ----------------------------------------------------------------------------------------------------------


@dataclass
class AugmentParams:
    """Per-sample random parameters of one call; ``None`` = that transform is skipped.

    box (B, 4) crop boxes for ``crop_flip``; flip (B,) bool; jitter (B,) bool = jitter applied;
    brightness/contrast/saturation (B,) factors; hue (B,) shift in turns; grayscale (B,) bool;
    noise same shape as x (already scaled); vector_e (B,) and vector_dir (B, m) for ``rotate_vectors``.
    """

    box: Tensor | None = None
    flip: Tensor | None = None
    jitter: Tensor | None = None
    brightness: Tensor | None = None
    contrast: Tensor | None = None
    saturation: Tensor | None = None
    hue: Tensor | None = None
    grayscale: Tensor | None = None
    noise: Tensor | None = None
    vector_e: Tensor | None = None
    vector_dir: Tensor | None = None


def _sample_boxes(
    bsz: int, height: int, width: int, scale_min: float, gen: torch.Generator | None, dev: torch.device
) -> Tensor:
    """RandomResizedCrop boxes, all attempts at once: (B, 4) = (cx, cy, w, h), normalized as in crop_flip."""
    u = torch.rand(bsz, _CROP_ATTEMPTS, 2, generator=gen, device=dev, dtype=torch.float32)
    area = scale_min + (1.0 - scale_min) * u[..., 0]  # (B, K) fraction of the image area
    ratio = torch.exp(_LOG_RATIO[0] + (_LOG_RATIO[1] - _LOG_RATIO[0]) * u[..., 1])  # (B, K) w/h in pixels
    w = torch.sqrt(area * (height * width) * ratio) / width  # (B, K) fraction of the width
    h = torch.sqrt(area * (height * width) / ratio) / height
    fits = (w <= 1.0) & (h <= 1.0)  # (B, K)
    first = fits.to(torch.int8).argmax(dim=1, keepdim=True)  # (B, 1) first fitting attempt (0 if none)
    any_fit = fits.any(dim=1)
    one = torch.ones(bsz, device=dev, dtype=torch.float32)
    w = torch.where(any_fit, w.gather(1, first).squeeze(1), one)  # (B,)
    h = torch.where(any_fit, h.gather(1, first).squeeze(1), one)
    pos = torch.rand(bsz, 2, generator=gen, device=dev, dtype=torch.float32) * 2.0 - 1.0  # (B, 2)
    cx = pos[:, 0] * (1.0 - w)  # box stays inside the image
    cy = pos[:, 1] * (1.0 - h)
    return torch.stack([cx, cy, w, h], dim=1)


def _uniform(bsz: int, lo: float, hi: float, gen: torch.Generator | None, dev: torch.device) -> Tensor:
    return lo + (hi - lo) * torch.rand(bsz, generator=gen, device=dev)


def _bernoulli(bsz: int, p: float, gen: torch.Generator | None, dev: torch.device) -> Tensor:
    return torch.rand(bsz, generator=gen, device=dev) < p


class BatchAugment(torch.nn.Module):
    """Batched augmentation ``x -> x~`` at strength s of a preset (the module docstring gives the recipe)."""

    def __init__(self, preset: str | AugmentPreset = "paper", strength: float = 1.0):
        super().__init__()
        _check_strength(strength)
        self.preset_name = preset if isinstance(preset, str) else "custom"
        self.base = _resolve_preset(preset)
        self.strength = float(strength)
        self.recipe = self.base.scaled(self.strength)  # effective parameters at strength s

    def extra_repr(self) -> str:
        return f"preset={self.preset_name!r}, strength={self.strength}"

    # -- which transforms are active at this strength -------------------------------------------------------
    def _image_ops(self, channels: int) -> dict[str, bool]:
        r = self.recipe
        color = channels == 3
        b, c, s, h = r.jitter
        jit = r.jitter_p > 0 and (b > 0 or c > 0 or (color and (s > 0 or h > 0)))
        return {
            "crop": r.crop_scale_min < 1.0,
            "flip": r.flip_p > 0,
            "jitter": jit,
            "grayscale": color and r.grayscale_p > 0,
            "noise": r.noise_std > 0,
        }

    def sample_params(self, x: Tensor, generator: torch.Generator | None = None) -> AugmentParams:
        """Draw every per-sample parameter for x, (B, C, H, W) or (B, m), from ``generator`` (or global RNG).

        Draws happen on the generator's device (x's device without a generator), in a fixed order, so a
        seed fixes the result.
        """
        _check_input(x)
        dev = generator.device if generator is not None else x.device
        bsz, r, p = x.shape[0], self.recipe, AugmentParams()
        if x.dim() == 2:
            if r.vector_noise > 0:
                p.vector_e = _uniform(bsz, 0.0, r.vector_noise, generator, dev)
                p.vector_dir = torch.randn(x.shape, generator=generator, device=dev, dtype=torch.float32)
            return p
        channels, height, width = x.shape[1:]
        ops = self._image_ops(channels)
        if ops["crop"]:
            p.box = _sample_boxes(bsz, height, width, r.crop_scale_min, generator, dev)
        if ops["flip"]:
            p.flip = _bernoulli(bsz, r.flip_p, generator, dev)
        if ops["jitter"]:
            b, c, s, h = r.jitter
            p.jitter = _bernoulli(bsz, r.jitter_p, generator, dev)
            if b > 0:
                p.brightness = _uniform(bsz, max(0.0, 1.0 - b), 1.0 + b, generator, dev)
            if c > 0:
                p.contrast = _uniform(bsz, max(0.0, 1.0 - c), 1.0 + c, generator, dev)
            if channels == 3 and s > 0:
                p.saturation = _uniform(bsz, max(0.0, 1.0 - s), 1.0 + s, generator, dev)
            if channels == 3 and h > 0:
                p.hue = _uniform(bsz, -h, h, generator, dev)
        if ops["grayscale"]:
            p.grayscale = _bernoulli(bsz, r.grayscale_p, generator, dev)
        if ops["noise"]:
            p.noise = r.noise_std * torch.randn(x.shape, generator=generator, device=dev, dtype=torch.float32)
        return p

    def apply_params(self, x: Tensor, p: AugmentParams) -> Tensor:
        """Apply drawn parameters to x; deterministic. Returns a new tensor (same shape/dtype/device)."""
        _check_input(x)
        work = x if x.dtype in (torch.float32, torch.float64) else x.float()  # grid_sample/HSV in >= fp32
        if x.dim() == 2:
            if p.vector_e is None or p.vector_dir is None:
                return x.clone()
            return rotate_vectors(work, p.vector_e, p.vector_dir).to(x.dtype)
        if x.shape[0] == 0 or all(t is None for t in (p.box, p.flip, p.jitter, p.grayscale, p.noise)):
            return x.clone()  # exact identity (s = 0, preset "none")
        if p.box is not None:
            out = crop_flip(work, p.box, p.flip)  # crop + flip in one resampling; a new tensor
        elif p.flip is not None:
            out = torch.where(p.flip.to(x.device).view(-1, 1, 1, 1), work.flip(-1), work)  # exact; new
        else:
            out = work.clone()
        # from here on ``out`` is ours: ops run in place
        if p.jitter is not None:
            on = p.jitter.to(x.device)  # (B,) jitter applied
            neutral = torch.ones((), device=x.device)
            # brightness/contrast/saturation with factor 1 are exact identities on [0, 1]: no mask pass needed
            if p.brightness is not None:
                adjust_brightness(out, torch.where(on, p.brightness.to(x.device), neutral), inplace=True)
            if p.contrast is not None:
                adjust_contrast(out, torch.where(on, p.contrast.to(x.device), neutral), inplace=True)
            if p.saturation is not None:
                adjust_saturation(out, torch.where(on, p.saturation.to(x.device), neutral), inplace=True)
            if p.hue is not None:  # an HSV round trip is not bitwise exact: keep skipped samples as they are
                hued = adjust_hue(out, p.hue)
                out = torch.where(on.view(-1, 1, 1, 1), hued, out, out=hued)
        if p.grayscale is not None and out.shape[1] == 3:
            gray = rgb_to_grayscale(out).expand_as(out)
            torch.where(p.grayscale.to(x.device).view(-1, 1, 1, 1), gray, out, out=out)
        if p.noise is not None:
            out.add_(p.noise.to(device=out.device, dtype=out.dtype))
        return out.clamp_(0.0, 1.0).to(x.dtype)

    def forward(self, x: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """One random view of every sample: x (B, C, H, W) in [0, 1] or (B, m) -> same shape/dtype/device."""
        return self.apply_params(x, self.sample_params(x, generator))


def _check_input(x: Tensor) -> None:
    if not torch.is_floating_point(x):
        raise ValueError(f"augmentation expects a floating-point tensor, got {x.dtype}")
    if x.dim() == 4:
        if x.shape[1] not in (1, 3):
            raise ValueError(f"images must have 1 or 3 channels, got shape {tuple(x.shape)}")
    elif x.dim() != 2:
        raise ValueError(f"expected images (B, C, H, W) or vectors (B, m), got shape {tuple(x.shape)}")


def two_views(augment: torch.nn.Module, x: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Two independent views of the batch: (B, ...) -> (2B, ...) = [view 1 of all B; view 2 of all B]."""
    return torch.cat([augment(x, generator), augment(x, generator)], dim=0)


def view_noise(v1: Tensor, v2: Tensor) -> float:
    """Measured view noise ``eps = 1 - (1/B) sum_i cos(flatten(v1_i), flatten(v2_i))`` (cf. eq. (8)).

    v1, v2 (B, ...) of equal shape; computed in float64; a zero vector has cosine 0.
    """
    if v1.shape != v2.shape:
        raise ValueError(f"views must have equal shapes, got {tuple(v1.shape)} and {tuple(v2.shape)}")
    if v1.shape[0] == 0:
        raise ValueError("view_noise needs at least one sample")
    a = v1.reshape(v1.shape[0], -1).double()  # (B, D)
    b = v2.reshape(v2.shape[0], -1).double()
    cos = F.cosine_similarity(a, b, dim=1, eps=1e-12).clamp(-1.0, 1.0)  # (B,)
    return float(1.0 - cos.mean())
