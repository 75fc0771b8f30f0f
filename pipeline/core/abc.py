"""ABC, Attention-Based Clustering (Coward et al., ICLR 2021 submission): a head that turns a set's embeddings into a
learned, context-dependent kernel, beside TransFusion's head (:mod:`pipeline.core.model`).

On a set of n elements X ∈ R^{n×dim} (the rows of a batch, after a backbone), sections 3-4 of the paper and the
authors' code (DramaCow/ABC) define:

    Z₀ = W₂ tanh(W₁ X + b₁) + b₂                        # pre-embedding, Linear–tanh–Linear, (n, width)
    H = LN(Z + MHA(Z, Z, Z)),  SAB(Z) = LN(H + FF(H))   # eq. (1)-(2): post-norm Set Transformer block
    Z = (SAB_depth ∘ ... ∘ SAB_1)(Z₀)                   # embedding T(X), (n, width)
    q_i = W_q z_i + b_q,  k_j = W_k z_j + b_k            # (n, width) each
    E_ij = compat(q_i, k_j)                             # Table 1, (n, n)

with Table 1's compatibilities

    multiplicative:  E_ij = q_i · k_j          (or q_i · k_j / √width with ``scale_compat=True``)
    additive:        E_ij = wᵀ tanh(q_i + k_j),  w ∈ R^width

and the kernel, symmetric and in (0, 1), in one of two forms (``kernel``):

    "logits" (the code's, default):  S = ½(E + Eᵀ),  κ = σ(S), trained as logits (BCE with logits on S)
    "paper" (section 4.2):           κ = ½(σ(E) + σ(Eᵀ)), trained on the probabilities κ

The pairwise ablation of section 6.1 is depth 0 with additive compatibility (:meth:`ABCHead.pairwise`).

Choices, each an option:

- ``attention`` inside the SABs (the code's ``compatibility`` of its ``Attention``): "multiplicative", softmax of
  s·q_i·k_j per head (through ``F.scaled_dot_product_attention``), or "additive", softmax of s·uᵀtanh(q_i + k_j) per
  head with one u ∈ R^{width/heads} shared by the heads (the code's ``AddComp(head_size)``). The code builds each
  model's SABs with its final similarity's kind: its additive circles and Omniglot models attend additively.
- ``scale`` s of the SAB attention: "width" (the code's ``scaled_softmax``: 1/√width, with per-head q, k of
  width/heads), "head" (Vaswani et al.: 1/√(width/heads)) or "none" (the code's plain ``softmax``, s = 1: its
  additive circles model). Default "width".
- ``project``: the heads' concatenation goes through an output projection W_O (the code's ``reduce: True``, its
  Omniglot models) or straight into the residual (``reduce: False``, its circles models). Default True.
- FF is one Linear layer, no activation (the code's ``rFF``), so a SAB is LN(H + W_F H + b_F).
- The multiplicative similarity is unscaled by default, as in the code (Table 1 divides by √d).

The code's circles models (``circles.py``), as :meth:`ABCHead.as_code_circles` builds them: 1 head, no output
projection; the additive model's SABs attend additively with plain softmax, the multiplicative model's with softmax
of q·k/√width.

The additive compatibility needs tanh(q_i + k_j) ∈ R^width for every pair, n²·width numbers (n = 8192,
width = 128: 8.6e9, 34 GB in fp32). :class:`AdditiveCompat` computes it in row tiles of ``tile`` rows forward and
recomputes each tile in backward, so no (n, n, width) tensor exists beyond one (tile, n, width) tile.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

COMPATIBILITIES = ("multiplicative", "additive")
KERNELS = ("logits", "paper")
ATTENTION_SCALES = ("width", "head", "none")
SET_NORM_EPS = 1e-5  # ABCHead's set_norm: added to each feature's variance over the set (as BatchNorm's eps)
TILE_ELEMENTS = 1 << 24  # default additive tile: rows such that tile * n * width <= 16M numbers (64 MiB in fp32)


def _check(value: str, allowed: tuple[str, ...], what: str) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; allowed: {', '.join(allowed)}")


class SAB(nn.Module):
    """Set Attention Block, eq. (1)-(2), post-norm. x: (..., n, dim) -> (..., n, dim); the n rows attend to each other.

        MHA(X) = concat_h(softmax(s E_h) V_h) W_O + b_O,   Q_h = X W_Q^h + b, K_h, V_h likewise, (n, dim/heads)
        E_h[i, j] = q_i^h · k_j^h  ("multiplicative")  or  uᵀ tanh(q_i^h + k_j^h)  ("additive", u shared by the heads)
        H = LN(X + MHA(X)),   SAB(X) = LN(H + FF(H)),   FF(H) = H W_F + b_F

    Softmax over all n keys, the diagonal included; s = 1/√dim (``scale="width"``), 1/√(dim/heads) ("head") or 1
    ("none"). Without ``project`` there is no W_O, b_O: the concatenation of the heads is MHA(X).
    """

    def __init__(self, dim: int, heads: int = 4, scale: str = "width", attention: str = "multiplicative",
                 project: bool = True) -> None:
        super().__init__()
        _check(scale, ATTENTION_SCALES, "attention scale")
        _check(attention, COMPATIBILITIES, "SAB attention")
        if dim % heads:
            raise ValueError(f"dim {dim} is not a multiple of heads {heads}")
        self.heads, self.attention = heads, attention
        self.scale = {"width": 1.0 / math.sqrt(dim), "head": 1.0 / math.sqrt(dim // heads), "none": 1.0}[scale]
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim) if project else None
        if attention == "additive":  # u ~ U(±1/√(dim/heads)), as the code initialises its AddComp(head_size)
            bound = 1.0 / math.sqrt(dim // heads)
            self.u = nn.Parameter(torch.empty(dim // heads).uniform_(-bound, bound))
        self.ff = nn.Linear(dim, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)

    def split(self, t: Tensor) -> Tensor:
        """(..., n, dim) -> (..., heads, n, dim/heads)."""
        return t.unflatten(-1, (self.heads, -1)).transpose(-3, -2)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.split(self.query(x)), self.split(self.key(x)), self.split(self.value(x))  # (..., h, n, d/h)
        if self.attention == "multiplicative":
            o = F.scaled_dot_product_attention(q, k, v, scale=self.scale)  # (..., h, n, d/h)
        else:
            e = additive_energies(q, k, self.u)  # (..., h, n, n)
            o = torch.softmax(e * self.scale if self.scale != 1.0 else e, dim=-1) @ v  # (..., h, n, d/h)
        o = o.transpose(-3, -2).flatten(-2)  # (..., n, d): the heads concatenated
        h = self.norm1(x + (self.out(o) if self.out is not None else o))  # (..., n, d)
        return self.norm2(h + self.ff(h))


def additive_tile(n: int, width: int, tile: int | None = None) -> int:
    """Rows per tile of :class:`AdditiveCompat`: ``tile`` if given, else the most with tile·n·width <= TILE_ELEMENTS."""
    if tile is not None:
        if tile < 1:
            raise ValueError(f"tile must be >= 1, got {tile}")
        return tile
    return max(1, TILE_ELEMENTS // max(1, n * width))


class AdditiveCompat(torch.autograd.Function):
    """``E_ij = wᵀ tanh(a_i + b_j)``, a: (m, H), b: (n, H), w: (H,) -> E (m, n), in row tiles of ``tile`` rows.

    Forward keeps only a, b, w; backward recomputes each tile's T = tanh(a_i + b_j) (tile, n, H) and with
    G_ij = dE_ij · w ⊙ (1 − T_ij²):  dw = Σ_ij dE_ij T_ij,  da_i = Σ_j G_ij,  db_j = Σ_i G_ij.
    Peak extra memory: one (tile, n, H) buffer, forward or backward (the tanh and G are computed in place;
    tests/core/test_abc.py measures it).
    Not twice differentiable.
    """

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor, w: Tensor, tile: int) -> Tensor:  # noqa: D102
        ctx.save_for_backward(a, b, w)
        ctx.tile = tile
        out = a.new_empty(a.shape[0], b.shape[0])  # (m, n)
        for s in range(0, a.shape[0], tile):
            out[s : s + tile] = (a[s : s + tile, None, :] + b[None]).tanh_() @ w  # (t, n, H) @ (H,) -> (t, n)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):  # noqa: D102
        a, b, w = ctx.saved_tensors
        ga, gb, gw = torch.zeros_like(a), torch.zeros_like(b), torch.zeros_like(w)
        for s in range(0, a.shape[0], ctx.tile):
            t = (a[s : s + ctx.tile, None, :] + b[None]).tanh_()  # T (t, n, H), the tile's one buffer
            g = grad[s : s + ctx.tile]  # (t, n)
            gw += t.flatten(0, 1).T @ g.flatten()  # Σ_ij dE_ij T_ij, a matrix-vector product (no copy of T)
            t = t.square_().neg_().add_(1.0).mul_(g[..., None]).mul_(w)  # G = dE w (1 - T²), in place
            ga[s : s + ctx.tile] = t.sum(1)
            gb += t.sum(0)
            del t  # freed before the next tile is allocated
        return ga, gb, gw, None


def additive_compat(a: Tensor, b: Tensor, w: Tensor, tile: int | None = None) -> Tensor:
    """``E_ij = wᵀ tanh(a_i + b_j)`` (m, n) over row tiles (:class:`AdditiveCompat`); a (m, H), b (n, H), w (H,)."""
    return AdditiveCompat.apply(a, b, w, additive_tile(b.shape[0], b.shape[1], tile))


def additive_energies(a: Tensor, b: Tensor, w: Tensor, tile: int | None = None) -> Tensor:
    """``E_ij = wᵀ tanh(a_i + b_j)`` for a (..., m, H), b (..., n, H) with the same leading dims (sets, heads), w (H,)
    -> (..., m, n). One set: :func:`additive_compat`'s row tiles. Several: all at once while the (..., m, n, H) tanh
    holds at most TILE_ELEMENTS numbers and no ``tile`` is asked for, else set by set through the tiles."""
    if a.dim() == 2:
        return additive_compat(a, b, w, tile)
    if tile is None and a[..., None, :].numel() * b.shape[-2] <= TILE_ELEMENTS:
        return torch.tanh(a[..., :, None, :] + b[..., None, :, :]) @ w  # (..., m, n)
    return torch.stack([additive_compat(x, y, w, tile) for x, y in zip(a.flatten(0, -3), b.flatten(0, -3),
                                                                        strict=True)]).unflatten(0, a.shape[:-2])


@dataclass
class ABCOutput:
    """What :class:`ABCHead` returns for a set of n elements; the (n, n) matrices are computed on first access.

    q, k: (n, width) — the similarity's queries and keys.
    embedding: (n, width) — T(X), the last block's output (the pre-embedding at depth 0).
    hidden: the output of each SAB, ``depth`` tensors (n, width), for probes.
    logits: (n, n) — S = ½(E + Eᵀ) for the "logits" kernel, E itself for "paper".
    kernel: (n, n) — κ, symmetric, in (0, 1).
    """

    q: Tensor
    k: Tensor
    embedding: Tensor
    hidden: list[Tensor]
    compat: Callable[[Tensor, Tensor], Tensor] = field(repr=False)
    kind: str = "logits"

    def scores(self, rows: slice | None = None) -> Tensor:
        """``logits[rows]`` (r, n) from the r rows' queries and keys only: S[rows] = ½(E[rows] + (Eᵀ)[rows]) or E[rows].

        Both compatibilities are symmetric in their two arguments' roles, so (Eᵀ)[rows] = compat(k[rows], q).
        """
        if rows is None:
            return self.logits
        e = self.compat(self.q[rows], self.k)  # (r, n)
        return 0.5 * (e + self.compat(self.k[rows], self.q)) if self.kind == "logits" else e

    def kernel_rows(self, rows: slice | None = None) -> Tensor:
        """``kernel[rows]`` (r, n), computed from the r rows alone."""
        if rows is None:
            return self.kernel
        if self.kind == "logits":
            return torch.sigmoid(self.scores(rows))
        e, e_t = self.compat(self.q[rows], self.k), self.compat(self.k[rows], self.q)  # E[rows], (Eᵀ)[rows]: (r, n)
        return 0.5 * (torch.sigmoid(e) + torch.sigmoid(e_t))

    @functools.cached_property
    def energies(self) -> Tensor:
        """E (n, n), unsymmetrised."""
        return self.compat(self.q, self.k)

    @functools.cached_property
    def logits(self) -> Tensor:  # noqa: D102 - see the class docstring
        e = self.energies
        return 0.5 * (e + e.mT) if self.kind == "logits" else e

    @functools.cached_property
    def kernel(self) -> Tensor:  # noqa: D102 - see the class docstring
        s = torch.sigmoid(self.logits)
        return s if self.kind == "logits" else 0.5 * (s + s.mT)

    def loss(self, ids: Tensor, *, rows: slice | None = None, pos_weight: float | str = 1.0) -> Tensor:
        """:func:`bce` on this output: on the logits S for the "logits" kernel, on κ for "paper"."""
        if self.kind == "logits":
            return bce(self.scores(rows), ids, rows=rows, pos_weight=pos_weight, logits=True)
        return bce(self.kernel_rows(rows), ids, rows=rows, pos_weight=pos_weight, logits=False)


class ABCHead(nn.Module):
    """ABC on the rows of a batch: x (n, dim) -> :class:`ABCOutput` (module docstring for the equations).

    x (B, n, dim), a batch of B sets of n elements each, gives B independent sets: every (n, n) matrix of the
    output is then (B, n, n) (``scores(rows)``/``kernel_rows(rows)``/``loss`` take one set, 2-d).

    dim: the backbone's feature size. With ``pre_embed=False`` there is no Linear–tanh–Linear and dim must equal width.
    depth, heads, width: SAB blocks, their heads and width (Omniglot in the paper: 2, 4, 128).
    compatibility: "multiplicative" | "additive" (Table 1); kernel: "logits" | "paper"; attention: the SABs' energies
    ("multiplicative" | "additive", :class:`SAB`); scale: the SAB attention scale ("width" | "head" | "none");
    project: the SABs' output projection W_O; scale_compat: divide the multiplicative similarity by √width; tile: rows
    per additive tile (None: :func:`additive_tile`'s default).
    set_norm: standardise each feature over the set's rows before the pre-embedding (before the SABs without it):

        μ = (1/n) Σ_i x_i,   σ² = (1/n) Σ_i (x_i − μ)²   (per feature, (dim,) each; per set for x (B, n, dim))
        x̂_i = (x_i − μ) / √(σ² + ε),   ε = SET_NORM_EPS,   x̂ (n, dim) replaces x

    μ and σ² are symmetric functions of the rows, so the head stays permutation-equivariant (κ of permuted rows is κ
    permuted), and κ no longer depends on a part c common to every row (x_i + c gives the same x̂): the tanh of the
    pre-embedding sees the rows' differences at unit scale instead of saturating on their shared part. A set function
    of all n rows, like the SABs: the set must be whole (training runs the head on the gathered global batch). No
    parameters. Default False (the paper's and the code's maths); ``model.abc.set_norm`` turns it on for ``pretrain``.
    """

    def __init__(
        self,
        dim: int,
        depth: int = 2,
        heads: int = 4,
        width: int = 128,
        compatibility: str = "multiplicative",
        kernel: str = "logits",
        pre_embed: bool = True,
        scale: str = "width",
        scale_compat: bool = False,
        tile: int | None = None,
        attention: str = "multiplicative",
        project: bool = True,
        set_norm: bool = False,
    ) -> None:
        super().__init__()
        _check(compatibility, COMPATIBILITIES, "compatibility")
        _check(kernel, KERNELS, "kernel")
        if depth < 0:
            raise ValueError(f"depth must be >= 0, got {depth}")
        if not pre_embed and dim != width:
            raise ValueError(f"without the pre-embedding dim ({dim}) must equal width ({width})")
        self.compatibility, self.kernel, self.scale_compat = compatibility, kernel, scale_compat
        self.set_norm = set_norm
        self.tile = None if tile is None else additive_tile(1, 1, tile)
        self.pre = nn.Sequential(nn.Linear(dim, width), nn.Tanh(), nn.Linear(width, width)) if pre_embed else None
        self.blocks = nn.ModuleList(SAB(width, heads, scale, attention, project) for _ in range(depth))
        self.query = nn.Linear(width, width)
        self.key = nn.Linear(width, width)
        if compatibility == "additive":  # w ~ U(±1/√width), as the code initialises it
            bound = 1.0 / math.sqrt(width)
            self.w = nn.Parameter(torch.empty(width).uniform_(-bound, bound))

    @classmethod
    def pairwise(cls, dim: int, width: int = 128, **kwargs: object) -> ABCHead:
        """Section 6.1's pairwise ablation: no embedding blocks, additive compatibility."""
        return cls(dim, depth=0, width=width, compatibility="additive", **kwargs)

    @classmethod
    def as_code_circles(cls, dim: int, compatibility: str, depth: int = 2, width: int = 128,
                        **kwargs: object) -> ABCHead:
        """The code's circles model (``circles.py``: ``AffinityAdd``/``AffinityMul``): 1-head SABs without an output
        projection, attending as the similarity is computed: additive with plain softmax, or softmax of q·k/√width."""
        additive = compatibility == "additive"
        return cls(dim, depth=depth, heads=1, width=width, compatibility=compatibility, attention=compatibility,
                   scale="none" if additive else "width", project=False, **kwargs)

    def compat(self, a: Tensor, b: Tensor) -> Tensor:
        """E_ij = compat(a_i, b_j), a (..., m, width), b (..., n, width) -> (..., m, n) (leading dims: sets)."""
        if self.compatibility == "additive":
            return additive_energies(a, b, self.w, self.tile)
        e = a @ b.mT  # (..., m, n)
        return e / math.sqrt(a.shape[-1]) if self.scale_compat else e

    def forward(self, x: Tensor) -> ABCOutput:
        if self.set_norm:  # per feature over the set's n rows (per set for (B, n, dim)): (x − μ) / √(σ² + ε)
            xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x  # the statistics in fp32 at least
            var, mean = torch.var_mean(xf, dim=-2, correction=0, keepdim=True)  # (..., 1, dim) each
            x = ((xf - mean) * torch.rsqrt(var + SET_NORM_EPS)).to(x.dtype)  # (..., n, dim)
        z = self.pre(x) if self.pre is not None else x  # (n, width)
        hidden = []
        for block in self.blocks:
            z = block(z)  # (n, width)
            hidden.append(z)
        return ABCOutput(self.query(z), self.key(z), z, hidden, self.compat, self.kernel)


def _positive_count(ids: Tensor) -> Tensor:
    """#{(i, j) : ids_i = ids_j}, the diagonal included, as a 0-d tensor: Σ_i |class of i|, O(n log n), no host sync."""
    ordered = ids.sort().values
    size = torch.searchsorted(ordered, ids, right=True) - torch.searchsorted(ordered, ids)  # (n,)
    return size.sum()


def bce(
    x: Tensor,
    ids: Tensor,
    *,
    rows: slice | None = None,
    pos_weight: float | str = 1.0,
    logits: bool = True,
) -> Tensor:
    """Weighted binary cross-entropy between ABC's kernel and Y_ij = 1[ids_i = ids_j], the diagonal INCLUDED.

        loss = (1/n²) Σ_{i, j} −[p Y_ij log κ_ij + (1 − Y_ij) log(1 − κ_ij)],   κ = σ(x) if ``logits`` else x

    x: (n, n), or (r, n) the rows ``rows`` of it (a full (n, n) x with ``rows`` is sliced here); ids: (n,).
    x (B, n, n) with ids (B, n): B sets, the mean of their losses (no ``rows``, a numeric ``pos_weight``).
    With ``rows`` the loss is the sum over those rows / n², so losses over disjoint row slices add up to the full
    loss. ``logits=True`` goes through ``binary_cross_entropy_with_logits`` (stable for any x); ``False`` through
    ``binary_cross_entropy`` (its logs clamped at −100). p = ``pos_weight``: a number, or "balanced" = #neg / #pos
    over all n² pairs of the batch (the whole batch's, whatever ``rows``; on Omniglot the code weighs positives
    by the ratio of its training distribution). No host sync.
    """
    if x.dim() == 3:  # (B, n, n) with ids (B, n): B sets at once, the mean of their losses
        if rows is not None or pos_weight == "balanced" or ids.shape != x.shape[:2] or x.shape[1] != x.shape[2]:
            raise ValueError(f"a batch of sets needs x (B, n, n) and ids (B, n), no rows and a numeric pos_weight; "
                             f"got x {tuple(x.shape)}, ids {tuple(ids.shape)}, rows {rows}, pos_weight {pos_weight!r}")
        target = (ids[:, :, None] == ids[:, None, :]).to(x.dtype)  # (B, n, n)
        p = torch.tensor(float(pos_weight), dtype=x.dtype, device=x.device)
        if logits:
            return F.binary_cross_entropy_with_logits(x, target, pos_weight=p)
        return F.binary_cross_entropy(x, target, weight=1.0 + (p - 1.0) * target)
    n = ids.shape[0]
    rows = slice(0, n) if rows is None else rows
    if x.shape[-1] != n:
        raise ValueError(f"x has {x.shape[-1]} columns, ids {n} entries")
    if x.shape[0] == n:
        x = x[rows]
    elif x.shape[0] != len(range(*rows.indices(n))):
        raise ValueError(f"x has {x.shape[0]} rows, neither n = {n} nor the {len(range(*rows.indices(n)))} of {rows}")
    target = (ids[rows, None] == ids[None, :]).to(x.dtype)  # (r, n)
    if pos_weight == "balanced":
        pos = _positive_count(ids).double()
        p = ((n * n - pos) / pos).to(x.dtype)  # n² in fp64: exact, and no fp16 overflow
    elif isinstance(pos_weight, str):
        raise ValueError(f"pos_weight must be a number or 'balanced', got {pos_weight!r}")
    else:
        if not pos_weight > 0:
            raise ValueError(f"pos_weight must be > 0, got {pos_weight}")
        p = torch.tensor(float(pos_weight), dtype=x.dtype, device=x.device)
    if logits:
        total = F.binary_cross_entropy_with_logits(x, target, pos_weight=p, reduction="sum")
    else:
        weight = 1.0 + (p - 1.0) * target  # p on positives, 1 on negatives
        total = F.binary_cross_entropy(x, target, weight=weight, reduction="sum")
    return total / (n * n)


def kernel_stats(kappa: Tensor, labels: Tensor) -> dict[str, Tensor]:
    """Health of a kernel κ (n, n) on labels (n,), over the off-diagonal pairs i ≠ j, as 0-d tensors (no host sync).

    same_class: mean κ_ij over same-class pairs; other: over the other pairs (NaN where there are none);
    above_half: the share of pairs with κ_ij > 0.5.
    """
    n = labels.shape[0]
    off = ~torch.eye(n, dtype=torch.bool, device=kappa.device)  # (n, n)
    same = (labels[:, None] == labels[None, :]) & off  # (n, n)
    other = off & ~same
    k = kappa.detach()
    return {
        "same_class": (k * same).sum() / same.sum(),
        "other": (k * other).sum() / other.sum(),
        "above_half": ((k > 0.5) & off).sum() / max(1, n * (n - 1)),
    }
