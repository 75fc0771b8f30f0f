"""TransFusion blocks, head and the full model (paper eq. 2-3 and Appendix E.1); ``build_model`` also builds the other
method, ABC (:class:`ABCModel`: the same backbone with :class:`pipeline.core.abc.ABCHead` on top).

Block ℓ, on a batch X ∈ R^{n×m} whose *samples* attend to each other:

    X̂ = norm(X)                                  # LayerNorm (default), L2, or none (Appendix E)
    Q = normalize(X̂ W_Q),  K = normalize(X̂ W_K),  V = X̂ W_V
    A = act(Q Kᵀ)                                 # act = ReLU (eq. 3); softmax etc. as ablations
    A ← A − diag(A);  A ← (A + 1e-10) / Σ_j (A + 1e-10)     # Appendix E's row normalisation
    X' = A V + X̂                                  # eq. 3 residual on the normalised input

Head of depth d: d such blocks. As in Appendix E, the training affinity is then the loss's parameter-free
cosine affinity of the fused output (``HeadOutput.q == HeadOutput.k == embedding``). With
``truncate_last=True`` the last block is cut after its affinity, as section 2.1 describes: blocks 1..d-1
fuse, and block d only supplies its normalised queries and keys (``q``, ``k``), whose product ``A^d`` the
loss compares with the target. Depth 0 is the backbone alone (and the projector, if any).

A projector (``model.projector``: none, linear, or SimCLR's MLP; :func:`build_projector`) may sit between the backbone
and the head, for any method and loss: ``forward = head(projector(backbone(x)))``. The probes read the backbone's
output, before the projector, as SimCLR does.

Two choices that keep blocks alive (``pipeline.evaluation.health``), both off in the paper's literal setting:

- ``fusion_scope``: ``joint`` (Appendix E: all 2B rows of a two-view batch attend to each other) or
  ``per_view`` (the authors' later code: each view's B rows are fused separately). Jointly, a row can find
  its own other view in the batch, a shortcut that a test batch, where every image appears once, never has.
- ``qk_init`` (ours): ``default`` (PyTorch's ``nn.Linear`` initialisation, the paper's), ``tied`` (W_K starts
  equal to W_Q, Theorem 1's construction: QKᵀ = X̂ W Wᵀ X̂ᵀ starts symmetric with a positive diagonal) or
  ``identity`` (W_Q = W_K = I, zero bias: the first affinity is ReLU of the inputs' cosine, as live and as
  class-aligned as the backbone's embedding).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline.config.model import ACTIVATIONS, AFFINITY_EPS, BLOCK_NORMS, FUSION_SCOPES, PROJECTORS, QK_INITS
from pipeline.core.abc import ABCHead, ABCOutput
from pipeline.core.attention import activate, fuse_rows
from pipeline.core.backbones import build_backbone

if TYPE_CHECKING:
    from pipeline.config.model import ModelConfig

EPS = AFFINITY_EPS  # Appendix E's additive constant in the row normalisation


def _affinity(q: Tensor, k: Tensor, activation: str) -> Tensor:
    """``act(Q Kᵀ)`` with a zero diagonal, allocating one (n, n) matrix where autograd allows."""
    a = q @ k.transpose(-2, -1)  # (n, n)
    if activation == "relu":
        raw = a.clamp_min(0.0)  # its backward needs a, not raw, so raw may be edited in place
    else:
        raw = activate(a, activation).clone()
    raw.diagonal(dim1=-2, dim2=-1).zero_()
    return raw


def fuse_weights(q: Tensor, k: Tensor, activation: str = "relu") -> tuple[Tensor, Tensor]:
    """Attention weights of one block from unit queries and keys.

    Returns ``(raw, weights)``: ``raw = act(Q Kᵀ)`` with its diagonal set to 0 (the affinity whose
    sharpness the theory speaks of) and ``weights = (raw + 1e-10) / Σ_j (raw + 1e-10)`` (Appendix E).
    q, k: (n, h) unit rows -> (n, n), (n, n).
    """
    raw = _affinity(q, k, activation)
    weights = (raw + EPS) / (raw + EPS).sum(dim=-1, keepdim=True)
    return raw, weights


def fuse(q: Tensor, k: Tensor, v: Tensor, activation: str = "relu") -> tuple[Tensor, Tensor]:
    """``weights @ V`` of :func:`fuse_weights` without materialising the normalised weights.

    ``(raw + ε) V / (Σ_j raw_ij + nε) = (raw V + ε Σ_j v_j) / (Σ_j raw_ij + nε)`` row by row: the same
    numbers, two fewer (n, n) passes forward and backward. q, k: (..., n, h), v: (..., n, m) -> (..., n, m),
    raw (..., n, n): :func:`pipeline.core.attention.fuse_rows`'s dense path with all n rows (half scores: the
    sums and the division in fp32, ``raw`` fp32).
    """
    return fuse_rows(q, k, v, 0, activation, return_raw=True)


class TransFusionBlock(nn.Module):
    """One TransFusion block, eq. 2-3 with Appendix E.1 semantics. x: (n, m) -> (n, m)."""

    def __init__(self, dim: int, activation: str = "relu", norm: str = "layernorm", qk_init: str = "default") -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; allowed: {', '.join(ACTIVATIONS)}")
        if norm not in BLOCK_NORMS:
            raise ValueError(f"unknown block norm {norm!r}; allowed: {', '.join(BLOCK_NORMS)}")
        if qk_init not in QK_INITS:
            raise ValueError(f"unknown qk_init {qk_init!r}; allowed: {', '.join(QK_INITS)}")
        self.activation = activation
        self.norm_kind = norm
        self.norm = nn.LayerNorm(dim) if norm == "layernorm" else nn.Identity()
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        with torch.no_grad():
            if qk_init == "tied":  # W_K = W_Q, b_K = b_Q at the start; trained apart afterwards
                self.key.weight.copy_(self.query.weight)
                self.key.bias.copy_(self.query.bias)
            elif qk_init == "identity":  # Q = K = the normalised input: the first affinity is ReLU(cos)
                for lin in (self.query, self.key):
                    lin.weight.copy_(torch.eye(dim))
                    lin.bias.zero_()

    def normalize_input(self, x: Tensor) -> Tensor:
        x = self.norm(x)
        return F.normalize(x, dim=-1) if self.norm_kind == "l2" else x

    def qk(self, x_hat: Tensor) -> tuple[Tensor, Tensor]:
        """Unit queries and keys of the normalised input. (n, m) -> (n, m), (n, m)."""
        return F.normalize(self.query(x_hat), dim=-1), F.normalize(self.key(x_hat), dim=-1)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Returns ``(x_next, raw_affinity)``: (..., n, m) and (..., n, n); leading dims are separate batches."""
        x_hat = self.normalize_input(x)  # (n, m)
        q, k = self.qk(x_hat)
        fused, raw = fuse(q, k, self.value(x_hat), self.activation)  # (n, m), (n, n)
        return fused + x_hat, raw


@dataclass(frozen=True)
class Rows:
    """The rows of a global batch of ``n`` rows that this process computes, and how it sees all of them.

    index: (r,) the global row of each local row. The rows of one fusion group (a view, with ``per_view``) are
    contiguous locally and in the global batch, groups in the same order in both.
    gather: local (r, c) -> global (n, c) in the global order; differentiable, and its backward sums each global
    row's gradient into the process that holds the row (``pipeline.training.step``'s all-gather on several
    workers; the identity when one process holds every row, :meth:`whole`).
    """

    index: Tensor
    n: int
    gather: Callable[[Tensor], Tensor]

    @staticmethod
    def whole(n: int, device: torch.device | str | None = None) -> Rows:
        """All n rows on this process: the head computes the whole batch (in tiles if asked)."""
        return Rows(torch.arange(n, device=device), n, lambda t: t)


@dataclass
class HeadOutput:
    """What a head returns for one batch of n samples.

    q, k: (n, h) — what the loss turns into the training affinity (cosine of q and k).
    embedding: (n, m) — the fused embedding for downstream use (output of the last full block).
    hidden: depth_full + 1 tensors (n, m) — the head's input and every full block's output.
    affinities: one (n, n) raw affinity act(QKᵀ) per block (zero diagonal), for sharpness.
    """

    q: Tensor
    k: Tensor
    embedding: Tensor
    hidden: list[Tensor] = field(default_factory=list)
    affinities: list[Tensor] = field(default_factory=list)


class TransFusionHead(nn.Module):
    """A stack of ``depth`` TransFusion blocks. x: (n, m) -> :class:`HeadOutput`.

    ``fusion_scope="per_view"``: a batch of ``views`` equal parts (rows ``[view 1; view 2; ...]``) is fused
    part by part; ``views=1`` (evaluation, one view) and ``joint`` fuse all n rows together.
    """

    def __init__(
        self,
        dim: int,
        depth: int,
        activation: str = "relu",
        norm: str = "layernorm",
        truncate_last: bool = False,
        fusion_scope: str = "joint",
        qk_init: str = "default",
    ) -> None:
        super().__init__()
        if depth < 0:
            raise ValueError(f"depth must be >= 0, got {depth}")
        if truncate_last and depth == 0:
            raise ValueError("truncate_last needs depth >= 1 (the last block supplies the affinity)")
        if fusion_scope not in FUSION_SCOPES:
            raise ValueError(f"unknown fusion_scope {fusion_scope!r}; allowed: {', '.join(FUSION_SCOPES)}")
        self.depth = depth
        self.truncate_last = truncate_last
        self.fusion_scope = fusion_scope
        self.blocks = nn.ModuleList(TransFusionBlock(dim, activation, norm, qk_init) for _ in range(depth))

    def forward(self, x: Tensor, *, collect: bool = False, views: int = 1,
                on_affinity: Callable[[int, Tensor], None] | None = None) -> HeadOutput:
        """``collect`` keeps every block's output and raw affinity in the :class:`HeadOutput`; ``on_affinity(i, raw)``
        instead hands block i's raw affinity (detached, (n, n) or (g, n/g, n/g)) to the caller as soon as it exists,
        so that no more than one block's affinity need be alive at once (``pipeline.training.loop``'s health check)."""
        n, m = x.shape
        groups = views if self.fusion_scope == "per_view" else 1
        if n % groups:
            raise ValueError(f"{n} rows do not split into {views} views")
        full = self.blocks[:-1] if self.truncate_last else self.blocks
        hidden, affinities = [x], []
        x = x.reshape(groups, n // groups, m)  # (g, n/g, m): each group is fused on its own
        for i, block in enumerate(full):
            x, raw = block(x)  # (g, n/g, m), (g, n/g, n/g)
            if collect:
                hidden.append(x.reshape(n, m))
                affinities.append(raw.detach().squeeze(0))
            if on_affinity is not None:
                on_affinity(i, raw.detach().squeeze(0))
            del raw
        x = x.reshape(n, m)
        if self.truncate_last:
            last = self.blocks[-1]
            q, k = last.qk(last.normalize_input(x))  # row-wise: the trained affinity spans all n rows
            if collect or on_affinity is not None:
                raw = _affinity(q, k, last.activation).detach()
                if collect:
                    affinities.append(raw)
                if on_affinity is not None:
                    on_affinity(len(full), raw)
        else:
            q = k = x
        return HeadOutput(q=q, k=k, embedding=x, hidden=hidden if collect else [], affinities=affinities)


    def forward_rows(self, x: Tensor, rows: Rows, *, views: int = 1, tile: int | None = None, collect: bool = False,
                     on_block: Callable[[int, Tensor, Tensor], None] | None = None) -> HeadOutput:
        """The head on this process's rows of a global batch: x (r, m) -> :class:`HeadOutput` of these r rows.

        Row-sharded: LayerNorm, the projections and the residuals are row-wise and stay local; each block gathers the
        keys and values of all n rows (``rows.gather``, one collective a block) and computes its r rows of
        ``act(Q Kᵀ) V`` against them (:func:`pipeline.core.attention.fuse_rows`; over column tiles of ``tile``
        keys with ``tile``, never an (r, n) matrix). Compute per process falls as r/n; memory is the gathered
        (n, 2m) keys and values plus (r, n) dense or (r, tile) tiled per block. Equal to :meth:`forward` on the
        whole batch, restricted to these rows (``tests/training/test_sharded_head.py``). ``q``, ``k`` and
        ``embedding`` are the local rows; the loss gathers what it needs. ``collect`` keeps the input and every full
        block's output (r, m) in ``hidden`` (no affinities: they are what this path never holds); ``on_block(i, q, k)``
        hands block i's unit queries of these rows (r, m) and keys of every row (n, m), detached, so that a caller can
        compute the block's affinity ``act(q kᵀ)`` a row slice at a time (``pipeline.evaluation.health``).
        """
        r, m = x.shape
        groups = views if self.fusion_scope == "per_view" else 1
        if r % groups or rows.n % groups or rows.index.shape != (r,):
            raise ValueError(f"{r} local rows of {rows.n} do not split into {groups} fusion groups")
        rg, ng = r // groups, rows.n // groups
        full = self.blocks[:-1] if self.truncate_last else self.blocks
        hidden = [x] if collect else []
        for i, block in enumerate(full):
            x_hat = block.normalize_input(x)  # (r, m)
            q, k = block.qk(x_hat)  # (r, m) each, unit rows
            kv = rows.gather(torch.cat([k, block.value(x_hat)], dim=1))  # (n, 2m): every row's keys and values
            if on_block is not None:
                on_block(i, q.detach(), kv[:, :m].detach())
            parts = []
            for g in range(groups):
                mine, cols = slice(g * rg, (g + 1) * rg), slice(g * ng, (g + 1) * ng)
                parts.append(fuse_rows(q[mine], kv[cols, :m], kv[cols, m:], rows.index[mine] - g * ng,
                                       block.activation, tile))  # (r/g, m)
            x = (parts[0] if groups == 1 else torch.cat(parts)) + x_hat  # (r, m)
            if collect:
                hidden.append(x)
        if self.truncate_last:
            last = self.blocks[-1]
            q, k = last.qk(last.normalize_input(x))
            if on_block is not None:
                on_block(len(full), q.detach(), rows.gather(k).detach())
        else:
            q = k = x
        return HeadOutput(q=q, k=k, embedding=x, hidden=hidden)


def build_projector(kind: str, dim: int, out_dim: int | None = None) -> nn.Module:
    """The projector between the backbone and the head (``model.projector``, ours): (n, dim) -> (n, out_dim or dim).

    - ``none``: the identity (no parameters: a model without a projector has the state_dict it always had);
    - ``linear``: ``Linear(dim, out)``;
    - ``mlp``: ``Linear(dim, dim) -> ReLU -> Linear(dim, out)``, SimCLR's projection head g(·) (Chen et al., 2020,
      section 2.1: one hidden layer of the backbone's width, ReLU) without the BatchNorm after each Linear that
      SimCLR's code (v2) adds: BatchNorm there would need statistics over the global batch on several workers, and
      row-wise layers keep the sharded step, gradient caching and the tiled head equal to one process.

    Every method and loss may have one, so that a comparison can give every loss the same head. Its parameters train at
    ``train.lr`` (not ``train.lr * train.head_lr_scale``, which is the TransFusion head's: ``pipeline.core.optim``).
    """
    out = out_dim or dim
    if kind == "none":
        if out != dim:
            raise ValueError(f"projector none keeps the width {dim}; got out_dim={out_dim}")
        return nn.Identity()
    if kind == "linear":
        return nn.Linear(dim, out)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, out))
    raise ValueError(f"unknown projector {kind!r}; allowed: {', '.join(PROJECTORS)}")


class TransFusion(nn.Module):
    """Backbone, projector (``model.projector``; the identity by default) and a TransFusion head.
    images (n, ...) -> :class:`HeadOutput`.

    ``embed_dim`` is the backbone's width (the representation the probes read), ``head_dim`` the head's (the
    projector's output; ``embed_dim`` without a projector).
    """

    method = "transfusion"

    def __init__(self, backbone: nn.Module, embed_dim: int, head: TransFusionHead,
                 projector: nn.Module | None = None, head_dim: int | None = None) -> None:
        super().__init__()
        self.backbone = backbone
        self.embed_dim = embed_dim
        self.projector = nn.Identity() if projector is None else projector
        self.head_dim = embed_dim if head_dim is None else head_dim
        self.head = head

    def encode(self, x: Tensor) -> Tensor:
        """The head's input: the projector of the backbone's output. (n, ...) -> (n, head_dim). Row-wise: what the
        training step embeds (in chunks with gradient caching) before the head sees the global batch."""
        return self.projector(self.backbone(x))

    def forward(self, x: Tensor, *, collect: bool = False, views: int = 1) -> HeadOutput:
        """The head on ``encode(x)``. With ``collect``, ``hidden[0]`` is the backbone's output (the representation
        probed, before the projector), then every full block's output, as :meth:`embed` lists them."""
        z = self.backbone(x)
        out = self.head(self.projector(z), collect=collect, views=views)
        if collect:
            out.hidden[0] = z
        return out

    @torch.no_grad()
    def embed(self, x: Tensor, tile: int | None = None) -> list[Tensor]:
        """Frozen representations for probes: [backbone output (n, m), block 1 output, ...] (blocks (n, head_dim)):
        the backbone's output before the projector, as SimCLR probes it. ``tile``: the blocks over column tiles
        (:meth:`TransFusionHead.forward_rows`), holding no (n, n) matrix; same numbers."""
        if tile is None:
            return [h.detach() for h in self.forward(x, collect=True).hidden]
        z = self.backbone(x)  # (n, m)
        p = self.projector(z)  # (n, head_dim)
        hidden = self.head.forward_rows(p, Rows.whole(len(p), p.device), tile=tile, collect=True).hidden
        return [z.detach(), *(h.detach() for h in hidden[1:])]


class ABCModel(nn.Module):
    """Backbone followed by ABC's head (:class:`pipeline.core.abc.ABCHead`). images (n, ...) -> ABCOutput.

    The n images are one set: ABC's SABs attend across all of them (in training the 2B rows ``[view 1; view 2]`` of
    the global batch, jointly), and its kernel κ (n, n) is trained by :data:`ABC_LOSSES` against same-class targets
    (``train.mode: supervised``) or same-image targets (``self_supervised``: a row's positives are itself and its
    other view).
    """

    method = "abc"

    def __init__(self, backbone: nn.Module, embed_dim: int, head: ABCHead) -> None:
        super().__init__()
        self.backbone = backbone
        self.embed_dim = self.head_dim = embed_dim  # no projector (model.projector: none): ABC has its pre-embedding
        self.head = head

    def encode(self, x: Tensor) -> Tensor:
        """The head's input: the backbone's output (ABC has no projector). (n, ...) -> (n, m)."""
        return self.backbone(x)

    def forward(self, x: Tensor) -> ABCOutput:
        return self.head(self.encode(x))

    @torch.no_grad()
    def embed(self, x: Tensor, tile: int | None = None) -> list[Tensor]:
        """Frozen representations for probes: [backbone output (n, m), the head's embedding T(X) (n, width)], T(X) of
        the n rows as one set. ``tile`` is TransFusion's and is ignored (ABC's additive similarity tiles itself)."""
        z = self.backbone(x)  # (n, m)
        return [z.detach(), self.head(z).embedding.detach()]


def bce_loss(pos_weight: float | str = "balanced") -> Callable[..., Tensor]:
    """ABC's loss, ``f(out, ids, *, rows=None)``: :meth:`pipeline.core.abc.ABCOutput.loss` with ``pos_weight`` bound,
    mean BCE of κ against Y_ij = 1[ids_i = ids_j] over all n² pairs (diagonal included), restricted to ``rows``
    (summed / n²: disjoint row slices add up to the full loss)."""
    def loss(out: ABCOutput, ids: Tensor, *, rows: slice | None = None) -> Tensor:
        return out.loss(ids, rows=rows, pos_weight=pos_weight)
    return loss


ABC_LOSSES: dict[str, Callable[..., Callable[..., Tensor]]] = {"bce": bce_loss}  # = pipeline.config.loss.ABC_LOSSES
METHODS = ("transfusion", "abc")  # what build_model builds (= pipeline.config.model.METHODS)


def memory_format(setting: str, input_shape: tuple[int, ...]) -> torch.memory_format:
    """The layout ``train.memory_format`` gives images (C, H, W) and the model's weights: ``channels_last`` (NHWC;
    on 2 CPU cores a ``cnn_small`` step takes 0.76x, ``benchmarks/bench_backbone.py``) or ``contiguous``; inputs that
    are not images are always contiguous. Training and the probes of a trained model use the same."""
    image = len(input_shape) == 3
    return torch.channels_last if image and setting == "channels_last" else torch.contiguous_format


def build_model(m: ModelConfig, input_shape: tuple[int, ...]) -> TransFusion | ABCModel:
    """Backbone + the head of ``model.method`` as ``model.*`` (a :class:`pipeline.config.model.ModelConfig`)
    describes: a TransFusion head (``transfusion``) after the projector of ``model.projector``
    (:func:`build_projector`, to ``model.projector_dim``), or ABC's (``abc``, from ``model.abc``; no projector)."""
    backbone, dim = build_backbone(m.backbone, tuple(input_shape), m.embed_dim, m.hidden_dim, m.weights)
    if m.method == "abc":
        if m.projector != "none":
            raise ValueError(f"model.projector: {m.projector}: method abc takes none (it has model.abc.pre_embed)")
        a = m.abc
        return ABCModel(backbone, dim, ABCHead(dim, depth=a.blocks, heads=a.heads, width=a.width,
                                               compatibility=a.compatibility, kernel=a.kernel, pre_embed=a.pre_embed,
                                               set_norm=a.set_norm))
    if m.method != "transfusion":
        raise ValueError(f"unknown model.method {m.method!r}; allowed: {', '.join(METHODS)}")
    width = dim if m.projector == "none" else (m.projector_dim or dim)
    head = TransFusionHead(width, m.depth, m.activation, m.block_norm, truncate_last=m.head == "truncated",
                           fusion_scope=m.fusion_scope, qk_init=m.qk_init)
    return TransFusion(backbone, dim, head, build_projector(m.projector, dim, width), width)
