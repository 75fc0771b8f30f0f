"""Contrastive losses on the batch affinity, all behind one registry by name.

Every loss has the uniform signature::

    loss(q, k, ids, *, rows=None, layout=None, tile=None, **hyper) -> scalar Tensor

- ``q``, ``k``: (n, d). The affinity is the cosine matrix ``A = normalize(q) @ normalize(k).T`` (n, n); the
  normalisation happens inside the loss (idempotent on unit rows). With the default head q = k = the fused
  embeddings; a truncated head passes the last block's separate query / key projections.
- ``ids``: (n,) int64. Target affinity, eq. (1): ``Y[i, j] = 1`` iff ``ids[i] == ids[j]`` and ``i != j``.
  Supervised: class labels. Self-supervised: source image index, two views laid out as
  ``[view1 of images 0..B-1; view2 of images 0..B-1]`` (see :func:`self_supervised_ids`).
- ``rows``: a contiguous slice of the rows of A. Only ``A[rows]`` (r, n) is computed and the loss returned
  is ``sum over those rows of the per-row loss / n`` with n the *total* number of rows. Hence ``rows=None``
  is the mean over all rows and losses (and their gradients) over disjoint row slices add up to the full
  loss, which is what a distributed trainer that owns a slice of a global batch needs.
- ``layout``: None, ``"two_view"`` or ``"labels"``, how the positives of eq. (1) are found from ``ids``; see
  *Layouts and host syncs* below. None (the default) reads them from ``ids`` and validates the batch.
- ``tile``: None (the default) or T >= 1 columns. The pairwise losses have one implementation, over column tiles
  (:mod:`pipeline.core.tiled_losses`). None or T >= n is one tile, the dense path: two (r, n) buffers (the
  affinity, kept for backward, and its gradient). T < n: the same value and gradients up to rounding, in
  O((r + n) d + r T) memory, for about 1-2x the time (that module's docstring has the numbers); the positives are
  then found per tile with no host sync in any layout (None keeps only the infonce / dcl checks).
  ``barlow_twins`` takes and ignores it (its (d, d) matrix is not pairwise).

Conventions shared by all row-wise losses:

- The diagonal (i == j) is excluded everywhere: it is never a positive, never a negative, and it is left
  out of every normalisation / softmax. For a row slice, the diagonal of local row i is column
  ``rows.start + i``.
- A row with no positive (a singleton class in a supervised batch) has an empty target; it contributes 0 to
  ``jsd``, ``kl_*``, ``supcon`` and ``dcl`` (``jsd_appendix_e`` gives 0 for it by construction). ``infonce``
  and ``barlow_twins`` instead refuse batches that are not one-positive-per-row / two-view.
- ``Normalize(S)`` (eq. 5 and Appendix B) is the row normalisation of Appendix E with its epsilon, diagonal
  excluded: ``Normalize(S)[i, j] = (S_ij + 1e-10) / sum_{l != i} (S_il + 1e-10)`` for ``j != i`` and 0 on the
  diagonal. The 1e-10 keeps every off-diagonal probability > 0 (so every log is finite) and keeps a row whose
  affinities are all 0 well defined (it becomes uniform); otherwise it changes values by ~1e-10.

Layouts and host syncs. On CUDA an op whose output shape depends on tensor values (``unique``, ``nonzero``,
boolean-mask indexing, ``repeat_interleave`` without ``output_size``) or that reads a value on the host
(``bool(t)``, ``t.item()``, ``torch.equal``) waits for the device. ``layout`` chooses how the positives
P(i) = {j != i : ids[j] == ids[i]} of the r rows ``rows`` are represented:

- None: read from the values of ``ids`` as P index pairs (sparse, O(n + P) memory); ``infonce``, ``dcl`` and
  ``barlow_twins`` validate the batch. Host syncs: one for the number of pairs P, plus the validation.
- ``"two_view"``: the caller guarantees the self-supervised two-view layout (:func:`check_layout`): n = 2B,
  ``ids[:B] == ids[B:]`` and ``ids[:B]`` distinct, so row i's only positive is ``(i + B) mod 2B``. These pairs
  depend on (n, rows) alone and are cached; ``ids`` is not read and nothing is validated. Values and
  gradients equal the default's bit for bit. No host sync.
- ``"labels"``: any labels (supervised). P(i) is the bool mask ``Y[rows] > 0``, built a tile at a time ((r, n)
  when dense) in forward and again in backward, and a sum over the positives is a masked row sum
  ``sum_j Y_ij x_ij`` (the JSD / KL losses evaluate their per-positive terms on every entry). Nothing is
  validated: ``infonce`` and ``barlow_twins`` refuse this layout, ``dcl`` on a batch with a single id gives NaN
  instead of a ValueError. Values and gradients equal the default's up to rounding (summation order). No host
  sync.

A trainer checks its ids against the layout once (:func:`check_layout`, one host sync), not at every step;
``pipeline.training.step.GlobalBatchStep(..., layout=...)`` does so on its first step of each batch size.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
from torch import Tensor

from pipeline.config.loss import SELF_SUPERVISED_ONLY
from pipeline.core.targets import check_layout_name, check_power, check_temperature, is_two_view, row_range
from pipeline.core.tiled_losses import EPS, pairwise_loss

BN_EPS = 1e-5  # Barlow Twins standardisation epsilon (as in BatchNorm1d)

__all__ = [
    "EPS",
    "LOSSES",
    "LOSS_NAMES",
    "SELF_SUPERVISED_ONLY",
    "barlow_twins",
    "dcl",
    "infonce",
    "jsd",
    "jsd_appendix_e",
    "kl_relu",
    "kl_softmax",
    "kl_squared",
    "make_loss",
    "supcon",
]


# --------------------------------------------------------------------------------------------------
# JSD and KL losses on a normalised affinity
# --------------------------------------------------------------------------------------------------


def jsd(
    q: Tensor,
    k: Tensor,
    ids: Tensor,
    *,
    rows: slice | None = None,
    layout: str | None = None,
    tile: int | None = None,
    power: float = 2.0,
) -> Tensor:
    """TransFusion loss, eqs. (4)-(5) with their logs (Appendix B's JSD-Squared): a scalar.

    With A (r, n) the cosine affinity and Y (r, n) the target of eq. (1)::

        P = g(A) = Normalize(|A|^p)          (eq. 5 at p = 2; P_ij = |A_ij|^p / sum_{l != i} |A_il|^p, P_ii = 0)
        Ŷ = Y / sum_j Y_ij                   (row-normalised target)
        M = (P + Ŷ) / 2
        L_i = sum_j Ŷ_ij log(Ŷ_ij / M_ij) + P_ij log(P_ij / M_ij)     (0 log 0 = 0)

    i.e. ``D(Ŷ_i || M_i) + D(P_i || M_i)`` (twice the Jensen-Shannon divergence), so 0 <= L_i <= 2 log 2.
    ``power`` p >= 1 is ours: the paper squares (p = 2); a larger p sharpens P as a smaller temperature sharpens a
    softmax (|a|^p = exp(p log |a|), and p log a ≈ p (a - 1) near a = 1: p plays 1/τ), which JSD otherwise lacks.
    Normalize uses the 1e-10 of Appendix E (see module docstring), the only epsilon. Rows without a positive
    contribute 0. Returns ``sum_{i in rows} L_i / n``.

    Computed by :class:`~pipeline.core.tiled_losses.NormalizedAffinityLoss` (analytic gradient): a negative j
    contributes P_ij log 2, so ``L_i = sum_pos [...] + log 2 · (1 - sum_pos P_ij)``. ``layout``: None (ids read,
    one host sync), ``"two_view"`` or ``"labels"`` (no host sync); ``tile``: None (dense) or T columns at a
    time; see the module docstring.
    """
    check_power(power)
    return pairwise_loss("jsd", q, k, ids, rows, layout, tile, power=power)


def jsd_appendix_e(
    q: Tensor, k: Tensor, ids: Tensor, *, rows: slice | None = None, layout: str | None = None, tile: int | None = None
) -> Tensor:
    """The loss exactly as Appendix E.2's ``Loss.forward`` computes it: a scalar.

    With A (r, n) the cosine affinity and Y (r, n) the 0/1 target of eq. (1) (NOT row-normalised)::

        S = A ∘ A with its diagonal set to 0
        S'_ij = (S_ij + 1e-10) / sum_j (S_ij + 1e-10)      (all j, so S'_ii = 1e-10 / row-sum, not 0)
        L = kl_div(log(S' + Y), Y, 'batchmean') + kl_div(log(S' + Y), S', 'batchmean')

    where ``kl_div(log x, t) = sum t (log t - log x)`` with 0 log 0 = 0. Note that ``S' + Y`` is not the
    mixture (S' + Y)/2 of a JSD; this reproduces the code, not the equation (see :func:`jsd`). 'batchmean'
    divides by the total number of rows n, also when only ``rows`` are computed. A row without a positive
    gives 0. Unlike :func:`jsd` the value can be negative: a row with m positives holding all of S' (1/m
    each) gives ``-m log(1 + 1/m) - log(1 + m)`` (-2 log 2 for m = 1).

    Computed by :class:`~pipeline.core.tiled_losses.NormalizedAffinityLoss`: where Y = 0 both terms vanish, so
    only the positives and the row sums of S enter. ``layout``, ``tile``: as :func:`jsd`.
    """
    return pairwise_loss("jsd_appendix_e", q, k, ids, rows, layout, tile)


# --------------------------------------------------------------------------------------------------
# KL losses of Appendices A/B
# --------------------------------------------------------------------------------------------------


def kl_relu(
    q: Tensor, k: Tensor, ids: Tensor, *, rows: slice | None = None, layout: str | None = None, tile: int | None = None
) -> Tensor:
    """KL-ReLU of Appendix B: ``L_i = D(Ŷ_i || Normalize(A_+)_i)``, a scalar.

    A_+ = max(A, 0); Normalize excludes the diagonal and uses the 1e-10 of Appendix E (so a positive with
    A_ij <= 0 costs about log(1e10) instead of infinity). Rows without a positive contribute 0.
    Returns ``sum_{i in rows} L_i / n``. By
    :class:`~pipeline.core.tiled_losses.NormalizedAffinityLoss`. ``layout``, ``tile``: as :func:`jsd`.
    """
    return pairwise_loss("kl_relu", q, k, ids, rows, layout, tile)


def kl_squared(
    q: Tensor, k: Tensor, ids: Tensor, *, rows: slice | None = None, layout: str | None = None, tile: int | None = None
) -> Tensor:
    """KL-Squared of Appendix B: ``L_i = D(Ŷ_i || Normalize(A ∘ A)_i)``, a scalar.

    Same conventions as :func:`kl_relu`. Rows without a positive contribute 0.
    Returns ``sum_{i in rows} L_i / n``. By
    :class:`~pipeline.core.tiled_losses.NormalizedAffinityLoss`. ``layout``, ``tile``: as :func:`jsd`.
    """
    return pairwise_loss("kl_squared", q, k, ids, rows, layout, tile)


# --------------------------------------------------------------------------------------------------
# softmax losses (KL-Softmax, InfoNCE, SupCon, DCL): tiled_losses.SoftmaxAffinityLoss
# --------------------------------------------------------------------------------------------------


def kl_softmax(
    q: Tensor,
    k: Tensor,
    ids: Tensor,
    *,
    rows: slice | None = None,
    layout: str | None = None,
    temperature: float = 0.1,
    tile: int | None = None,
) -> Tensor:
    """KL-Softmax of Appendices A/B: ``L_i = D(Ŷ_i || σ(A_i / τ))``, a scalar.

    σ is the softmax over j != i (diagonal excluded), Ŷ the row-normalised target. Equals SupCon (eq. 10)
    minus the entropy constant ``log |P(i)|`` per row (Appendix A). Rows without a positive contribute 0.
    Returns ``sum_{i in rows} L_i / n``. By
    :class:`~pipeline.core.tiled_losses.SoftmaxAffinityLoss`. ``layout``, ``tile``: as :func:`jsd`.
    """
    check_temperature(temperature)
    return pairwise_loss("kl_softmax", q, k, ids, rows, layout, tile, temperature)


# --------------------------------------------------------------------------------------------------
# baselines
# --------------------------------------------------------------------------------------------------


def infonce(
    q: Tensor,
    k: Tensor,
    ids: Tensor,
    *,
    rows: slice | None = None,
    layout: str | None = None,
    temperature: float = 0.1,
    tile: int | None = None,
) -> Tensor:
    """NT-Xent / InfoNCE, eq. (9): ``L_i = -log( exp(A_ip/τ) / sum_{a != i} exp(A_ia/τ) )``, a scalar.

    p = the unique positive of row i. Requires exactly one positive per row (the self-supervised two-view
    layout), checked on the whole batch; raises ValueError otherwise. Returns ``sum_{i in rows} L_i / n``.
    Computed by :class:`~pipeline.core.tiled_losses.SoftmaxAffinityLoss`; ``tile``: as :func:`jsd`.

    ``layout``: None checks the batch (host syncs); ``"two_view"`` guarantees one positive per row and skips
    the check (no host sync); ``"labels"`` does not, so it raises ValueError.
    """
    check_temperature(temperature)
    if layout == "labels":
        raise ValueError(
            "infonce needs exactly one positive per row (self-supervised two-view ids), which layout='labels' "
            "does not guarantee — use layout='two_view', or supcon for supervised batches"
        )
    if layout is None and ids.dim() == 1:
        _, inverse, size = torch.unique(ids, return_inverse=True, return_counts=True)
        counts = size[inverse] - 1  # (n,) positives per row
        if not bool((counts == 1).all()):
            raise ValueError(
                "infonce needs exactly one positive per row (self-supervised two-view ids); got rows with "
                f"{sorted(set(counts.tolist()))} positives — use supcon for supervised batches"
            )
    return pairwise_loss("infonce", q, k, ids, rows, layout, tile, temperature)


def supcon(
    q: Tensor,
    k: Tensor,
    ids: Tensor,
    *,
    rows: slice | None = None,
    layout: str | None = None,
    temperature: float = 0.1,
    tile: int | None = None,
) -> Tensor:
    """SupCon L_out (Khosla et al.), eq. (10), a scalar::

        L_i = -1/|P(i)| sum_{p in P(i)} log( exp(A_ip/τ) / sum_{a != i} exp(A_ia/τ) )

    P(i) = {j != i : ids[j] == ids[i]}. Rows with empty P(i) contribute 0.
    Returns ``sum_{i in rows} L_i / n``. By
    :class:`~pipeline.core.tiled_losses.SoftmaxAffinityLoss`. ``layout``, ``tile``: as :func:`jsd`.
    """
    check_temperature(temperature)
    return pairwise_loss("supcon", q, k, ids, rows, layout, tile, temperature)


def dcl(
    q: Tensor,
    k: Tensor,
    ids: Tensor,
    *,
    rows: slice | None = None,
    layout: str | None = None,
    temperature: float = 0.1,
    tile: int | None = None,
) -> Tensor:
    """Decoupled contrastive loss (Yeh et al.), a scalar::

        L_i = -1/|P(i)| sum_{p in P(i)} A_ip/τ + log sum_{a not in P(i) ∪ {i}} exp(A_ia/τ)

    (the positives are removed from the denominator). Rows with empty P(i) contribute 0. Every row needs at
    least one negative, i.e. the batch must hold at least two distinct ids (ValueError otherwise).
    Returns ``sum_{i in rows} L_i / n``. :class:`~pipeline.core.tiled_losses.SoftmaxAffinityLoss`; ``tile``: as
    :func:`jsd`.

    ``layout``: None checks the batch (host syncs); ``"two_view"`` has a negative in every row (n >= 4) and
    ``"labels"`` skips the check (no host sync): a batch with a single id then gives NaN, not a ValueError.
    """
    check_temperature(temperature)
    if layout is None and ids.dim() == 1 and ids.numel() > 0 and ids.unique().numel() < 2:
        raise ValueError("dcl needs at least one negative per row: the batch holds a single id")
    return pairwise_loss("dcl", q, k, ids, rows, layout, tile, temperature)


def barlow_twins(
    q: Tensor,
    k: Tensor,
    ids: Tensor,
    *,
    rows: slice | None = None,
    layout: str | None = None,
    barlow_lambda: float = 5e-3,
    tile: int | None = None,
) -> Tensor:
    """Barlow Twins (Zbontar et al.) on the two views of q (k is ignored; q is used raw, not normalised).

    With z1, z2 = q[:B], q[B:] (B, d), each standardised per dimension over the batch as BatchNorm1d without
    affine does: ``(z - mean) / sqrt(var + 1e-5)`` with the biased (population, 1/B) variance::

        C = z1^T z2 / B                                        (d, d)
        L = sum_i (1 - C_ii)^2 + λ sum_{i != j} C_ij^2

    Needs the self-supervised two-view layout (ids[:B] == ids[B:] and ids[:B] distinct), else ValueError.
    Not row-separable: with ``rows`` of r rows it returns ``L * r / n`` so that row slices still add up to L.

    ``layout``: None checks the ids (host syncs); ``"two_view"`` guarantees the layout and skips reading them
    (no host sync; n must still be even); ``"labels"`` does not, so it raises ValueError. ``tile`` is accepted
    for the uniform signature and ignored: C is (d, d), there is no (n, n) matrix across samples to tile.
    """
    del tile  # see above
    if q.dim() != 2:
        raise ValueError(f"q must be (n, d), got {tuple(q.shape)}")
    n = q.shape[0]
    if ids.shape != (n,):
        raise ValueError(f"ids must have shape ({n},) to match q, got {tuple(ids.shape)}")
    check_layout_name(layout)
    half = n // 2
    if layout == "two_view":
        two_view = n >= 2 and n % 2 == 0  # the caller's guarantee: only the shape is checked
    else:
        two_view = layout is None and is_two_view(ids)  # "labels" guarantees nothing
    if not two_view:
        why = "; layout='labels' does not say so" if layout == "labels" else ""
        raise ValueError(
            "Barlow Twins needs the self-supervised two-view layout: ids = [0..B-1, 0..B-1] "
            f"(both halves equal, each half distinct){why}"
        )
    start, stop = row_range(rows, n)

    def standardise(z: Tensor) -> Tensor:  # (B, d) -> (B, d)
        return (z - z.mean(dim=0)) / torch.sqrt(z.var(dim=0, unbiased=False) + BN_EPS)

    z1, z2 = standardise(q[:half]), standardise(q[half:])  # (B, d) each
    c = z1.T @ z2 / half  # (d, d)
    on_diag = (1.0 - torch.diagonal(c)).square().sum()
    off_diag = c.square().sum() - torch.diagonal(c).square().sum()
    loss = on_diag + barlow_lambda * off_diag
    return loss * ((stop - start) / n)


# --------------------------------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------------------------------

LOSSES: dict[str, Callable[..., Tensor]] = {
    "jsd": jsd,
    "jsd_appendix_e": jsd_appendix_e,
    "kl_softmax": kl_softmax,
    "kl_relu": kl_relu,
    "kl_squared": kl_squared,
    "infonce": infonce,
    "supcon": supcon,
    "dcl": dcl,
    "barlow_twins": barlow_twins,
}
LOSS_NAMES: tuple[str, ...] = tuple(LOSSES)


def make_loss(
    name: str, *, temperature: float = 0.1, barlow_lambda: float = 5e-3, power: float = 2.0
) -> Callable[..., Tensor]:
    """The loss ``name`` with its hyper-parameters bound: ``f(q, k, ids, *, rows=None, layout=None, tile=None)``.

    Only the hyper-parameters the loss takes are bound (``temperature`` for kl_softmax / infonce / supcon /
    dcl, ``barlow_lambda`` for barlow_twins, ``power`` for jsd). Unknown names raise ValueError listing the allowed
    ones.
    """
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; allowed: {', '.join(LOSS_NAMES)}")
    fn = LOSSES[name]
    params = inspect.signature(fn).parameters
    hyper = {"temperature": temperature, "barlow_lambda": barlow_lambda, "power": power}
    bound = {key: value for key, value in hyper.items() if key in params}
    if "temperature" in bound:
        check_temperature(temperature)
    if "power" in bound:
        check_power(power)
    return functools.partial(fn, **bound)
