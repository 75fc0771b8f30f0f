"""Contrastive losses on the batch affinity, all behind one registry by name.

Every loss has the uniform signature::

    loss(q, k, ids, *, rows=None, **hyper) -> scalar Tensor

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
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

EPS = 1e-10  # the normalisation epsilon of Appendix E
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
    "pairwise_cosine",
    "self_supervised_ids",
    "supcon",
    "target_affinity",
]


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def _row_range(rows: slice | None, n: int) -> tuple[int, int]:
    """Resolve ``rows`` against n rows into ``(start, stop)``, ``stop >= start``; only step 1 is allowed."""
    if rows is None:
        return 0, n
    if not isinstance(rows, slice):
        raise TypeError(f"rows must be a slice or None, got {type(rows).__name__}")
    start, stop, step = rows.indices(n)
    if step != 1:
        raise ValueError(f"rows must be a contiguous slice (step 1), got step {step}")
    return start, max(start, stop)


def _diag_mask(n: int, start: int, stop: int, device: torch.device | None = None) -> Tensor:
    """(r, n) bool, True at the diagonal entries (i, start + i) of rows start..stop-1."""
    r_idx = torch.arange(start, stop, device=device)  # (r,)
    return r_idx[:, None] == torch.arange(n, device=device)[None, :]  # (r, n)


def self_supervised_ids(batch: int, device: torch.device | str | None = None) -> Tensor:
    """Ids of the self-supervised two-view layout: ``[0..B-1, 0..B-1]``, shape (2B,) int64.

    Row i and row i + B are the two views of image i, so each row has exactly one positive in eq. (1).
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    return torch.arange(batch, device=device).repeat(2)  # (2B,)


def target_affinity(ids: Tensor, rows: slice | None = None, dtype: torch.dtype | None = None) -> Tensor:
    """Target affinity of eq. (1), rows ``rows`` only: ``Y[i, j] = 1`` iff ids equal and i != j.

    ids: (n,) int. Returns (r, n) float (``dtype``, default torch's default dtype), 0/1, zero on the diagonal
    (local row i has its diagonal at column ``rows.start + i``).
    """
    if ids.dim() != 1:
        raise ValueError(f"ids must be 1-D (n,), got shape {tuple(ids.shape)}")
    n = ids.shape[0]
    start, stop = _row_range(rows, n)
    same = ids[start:stop, None] == ids[None, :]  # (r, n)
    same = same & ~_diag_mask(n, start, stop, ids.device)
    return same.to(dtype or torch.get_default_dtype())


def pairwise_cosine(q: Tensor, k: Tensor, rows: slice | None = None) -> Tensor:
    """Cosine affinity ``A[rows] = normalize(q)[rows] @ normalize(k).T``.

    q, k: (n, d). Returns (r, n). Rows are L2-normalised with ``F.normalize`` (eps 1e-12).
    """
    if q.dim() != 2 or k.dim() != 2 or q.shape != k.shape:
        raise ValueError(f"q and k must both be (n, d), got {tuple(q.shape)} and {tuple(k.shape)}")
    start, stop = _row_range(rows, q.shape[0])
    qn = F.normalize(q[start:stop], dim=1)  # (r, d)
    kn = F.normalize(k, dim=1)  # (n, d)
    return qn @ kn.T  # (r, n)


def _prepare(q: Tensor, k: Tensor, ids: Tensor, rows: slice | None) -> tuple[Tensor, Tensor, Tensor, int]:
    """Validate inputs; return A (r, n), Y (r, n) 0/1 in A's dtype, diagonal mask (r, n) bool, and n."""
    if q.dim() != 2 or k.dim() != 2 or q.shape != k.shape:
        raise ValueError(f"q and k must both be (n, d), got {tuple(q.shape)} and {tuple(k.shape)}")
    n = q.shape[0]
    if ids.shape != (n,):
        raise ValueError(f"ids must have shape ({n},) to match q, got {tuple(ids.shape)}")
    if n < 2:
        raise ValueError(f"a contrastive loss needs at least 2 samples, got {n}")
    start, stop = _row_range(rows, n)
    a = pairwise_cosine(q, k, rows)  # (r, n)
    y = target_affinity(ids, rows, dtype=a.dtype)  # (r, n)
    diag = _diag_mask(n, start, stop, q.device)  # (r, n)
    return a, y, diag, n


def _row_normalize(y: Tensor) -> Tensor:
    """Ŷ = Y / sum_j Y_ij, (r, n); rows with no positive stay all-zero."""
    return y / y.sum(dim=1, keepdim=True).clamp_min(1.0)


def _normalize_offdiag(s: Tensor, diag: Tensor, eps: float = EPS) -> Tensor:
    """``Normalize(S)``: (S_ij + eps) / sum_{l != i} (S_il + eps) off the diagonal, 0 on it. (r, n)."""
    s = (s + eps).masked_fill(diag, 0.0)  # (r, n)
    return s / s.sum(dim=1, keepdim=True)


def _safe_log(x: Tensor, where: Tensor) -> Tensor:
    """log(x) where ``where`` holds, 0 elsewhere, without NaN gradients from log(0)."""
    return torch.log(torch.where(where, x, torch.ones_like(x)))


def _kl_rows(p: Tensor, log_q: Tensor) -> Tensor:
    """Per-row KL ``sum_j p_ij (log p_ij - log q_ij)`` with 0 log 0 = 0. (r, n) -> (r,).

    ``log_q`` must be finite wherever p > 0. NaN in ``p`` propagates (a NaN loss must not read as 0).
    """
    pos = ~(p <= 0)  # True for p > 0 and for NaN
    terms = p * (_safe_log(p, pos) - torch.where(pos, log_q, torch.zeros_like(log_q)))
    return torch.where(pos, terms, torch.zeros_like(terms)).sum(dim=1)


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def _reduce(per_row: Tensor, n: int) -> Tensor:
    """Sum of the per-row losses of this slice divided by the total number of rows n -> scalar."""
    return per_row.sum() / n


# --------------------------------------------------------------------------------------------------
# JSD losses (TransFusion)
# --------------------------------------------------------------------------------------------------


def jsd(q: Tensor, k: Tensor, ids: Tensor, *, rows: slice | None = None) -> Tensor:
    """TransFusion loss, eqs. (4)-(5) with their logs (Appendix B's JSD-Squared): a scalar.

    With A (r, n) the cosine affinity and Y (r, n) the target of eq. (1)::

        P = g(A) = Normalize(A ∘ A)          (eq. 5; P_ij = A_ij^2 / sum_{l != i} A_il^2, P_ii = 0)
        Ŷ = Y / sum_j Y_ij                   (row-normalised target)
        M = (P + Ŷ) / 2
        L_i = sum_j Ŷ_ij log(Ŷ_ij / M_ij) + P_ij log(P_ij / M_ij)     (0 log 0 = 0)

    i.e. ``D(Ŷ_i || M_i) + D(P_i || M_i)`` (twice the Jensen-Shannon divergence), so 0 <= L_i <= 2 log 2.
    Normalize uses the 1e-10 of Appendix E (see module docstring), the only epsilon. Rows without a positive
    contribute 0. Returns ``sum_{i in rows} L_i / n``.
    """
    a, y, diag, n = _prepare(q, k, ids, rows)
    p = _normalize_offdiag(a.square(), diag)  # (r, n)
    y_hat = _row_normalize(y)  # (r, n)
    m = (p + y_hat) / 2  # (r, n)
    log_m = _safe_log(m, m > 0)  # (r, n)
    per_row = _kl_rows(y_hat, log_m) + _kl_rows(p, log_m)  # (r,)
    has_pos = y.sum(dim=1) > 0  # (r,)
    per_row = torch.where(has_pos, per_row, torch.zeros_like(per_row))
    return _reduce(per_row, n)


def jsd_appendix_e(q: Tensor, k: Tensor, ids: Tensor, *, rows: slice | None = None) -> Tensor:
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
    """
    a, y, diag, n = _prepare(q, k, ids, rows)
    aff = a.square().masked_fill(diag, 0.0)  # (r, n)
    aff = (aff + EPS) / (aff + EPS).sum(dim=1, keepdim=True)  # (r, n), diagonal = EPS / row-sum
    log_mix = (aff + y).log()  # (r, n), > 0 everywhere thanks to EPS
    loss = F.kl_div(log_mix, y, reduction="sum") + F.kl_div(log_mix, aff, reduction="sum")
    return loss / n


# --------------------------------------------------------------------------------------------------
# KL losses of Appendices A/B
# --------------------------------------------------------------------------------------------------


def kl_softmax(
    q: Tensor, k: Tensor, ids: Tensor, *, rows: slice | None = None, temperature: float = 0.1
) -> Tensor:
    """KL-Softmax of Appendices A/B: ``L_i = D(Ŷ_i || σ(A_i / τ))``, a scalar.

    σ is the softmax over j != i (diagonal excluded), Ŷ the row-normalised target. Equals SupCon (eq. 10)
    minus the entropy constant ``log |P(i)|`` per row (Appendix A). Rows without a positive contribute 0.
    Returns ``sum_{i in rows} L_i / n``.
    """
    _check_temperature(temperature)
    a, y, diag, n = _prepare(q, k, ids, rows)
    logits = (a / temperature).masked_fill(diag, float("-inf"))  # (r, n)
    log_sigma = F.log_softmax(logits, dim=1).masked_fill(diag, 0.0)  # (r, n), finite
    per_row = _kl_rows(_row_normalize(y), log_sigma)  # (r,), 0 for rows without a positive
    return _reduce(per_row, n)


def kl_relu(q: Tensor, k: Tensor, ids: Tensor, *, rows: slice | None = None) -> Tensor:
    """KL-ReLU of Appendix B: ``L_i = D(Ŷ_i || Normalize(A_+)_i)``, a scalar.

    A_+ = max(A, 0); Normalize excludes the diagonal and uses the 1e-10 of Appendix E (so a positive with
    A_ij <= 0 costs about log(1e10) instead of infinity). Rows without a positive contribute 0.
    Returns ``sum_{i in rows} L_i / n``.
    """
    a, y, diag, n = _prepare(q, k, ids, rows)
    p = _normalize_offdiag(a.clamp_min(0.0), diag)  # (r, n)
    per_row = _kl_rows(_row_normalize(y), _safe_log(p, ~diag))  # (r,)
    return _reduce(per_row, n)


def kl_squared(q: Tensor, k: Tensor, ids: Tensor, *, rows: slice | None = None) -> Tensor:
    """KL-Squared of Appendix B: ``L_i = D(Ŷ_i || Normalize(A ∘ A)_i)``, a scalar.

    Same conventions as :func:`kl_relu`. Rows without a positive contribute 0.
    Returns ``sum_{i in rows} L_i / n``.
    """
    a, y, diag, n = _prepare(q, k, ids, rows)
    p = _normalize_offdiag(a.square(), diag)  # (r, n)
    per_row = _kl_rows(_row_normalize(y), _safe_log(p, ~diag))  # (r,)
    return _reduce(per_row, n)


# --------------------------------------------------------------------------------------------------
# baselines
# --------------------------------------------------------------------------------------------------


def _supcon_rows(a: Tensor, y: Tensor, diag: Tensor, temperature: float) -> Tensor:
    """Per-row eq. (10), (r,): ``-1/|P(i)| sum_p A_ip/τ + log sum_{a != i} exp(A_ia/τ)``, 0 if P(i) = {}."""
    logits = a / temperature  # (r, n)
    lse = logits.masked_fill(diag, float("-inf")).logsumexp(dim=1)  # (r,)
    pos_mean = (_row_normalize(y) * logits).sum(dim=1)  # (r,)
    has_pos = y.sum(dim=1) > 0  # (r,)
    per_row = lse - pos_mean
    return torch.where(has_pos, per_row, torch.zeros_like(per_row))


def infonce(
    q: Tensor, k: Tensor, ids: Tensor, *, rows: slice | None = None, temperature: float = 0.1
) -> Tensor:
    """NT-Xent / InfoNCE, eq. (9): ``L_i = -log( exp(A_ip/τ) / sum_{a != i} exp(A_ia/τ) )``, a scalar.

    p = the unique positive of row i. Requires exactly one positive per row (the self-supervised two-view
    layout), checked on the whole batch; raises ValueError otherwise. Returns ``sum_{i in rows} L_i / n``.
    """
    _check_temperature(temperature)
    if ids.dim() == 1:
        counts = (ids[:, None] == ids[None, :]).sum(dim=1) - 1  # (n,) positives per row
        if not bool((counts == 1).all()):
            raise ValueError(
                "infonce needs exactly one positive per row (self-supervised two-view ids); got rows with "
                f"{sorted(set(counts.tolist()))} positives — use supcon for supervised batches"
            )
    a, y, diag, n = _prepare(q, k, ids, rows)
    return _reduce(_supcon_rows(a, y, diag, temperature), n)


def supcon(
    q: Tensor, k: Tensor, ids: Tensor, *, rows: slice | None = None, temperature: float = 0.1
) -> Tensor:
    """SupCon L_out (Khosla et al.), eq. (10), a scalar::

        L_i = -1/|P(i)| sum_{p in P(i)} log( exp(A_ip/τ) / sum_{a != i} exp(A_ia/τ) )

    P(i) = {j != i : ids[j] == ids[i]}. Rows with empty P(i) contribute 0.
    Returns ``sum_{i in rows} L_i / n``.
    """
    _check_temperature(temperature)
    a, y, diag, n = _prepare(q, k, ids, rows)
    return _reduce(_supcon_rows(a, y, diag, temperature), n)


def dcl(q: Tensor, k: Tensor, ids: Tensor, *, rows: slice | None = None, temperature: float = 0.1) -> Tensor:
    """Decoupled contrastive loss (Yeh et al.), a scalar::

        L_i = -1/|P(i)| sum_{p in P(i)} A_ip/τ + log sum_{a not in P(i) ∪ {i}} exp(A_ia/τ)

    (the positives are removed from the denominator). Rows with empty P(i) contribute 0. Every row needs at
    least one negative, i.e. the batch must hold at least two distinct ids (ValueError otherwise).
    Returns ``sum_{i in rows} L_i / n``.
    """
    _check_temperature(temperature)
    if ids.dim() == 1 and ids.numel() > 0 and ids.unique().numel() < 2:
        raise ValueError("dcl needs at least one negative per row: the batch holds a single id")
    a, y, diag, n = _prepare(q, k, ids, rows)
    logits = a / temperature  # (r, n)
    not_neg = (y > 0) | diag  # (r, n)
    lse_neg = logits.masked_fill(not_neg, float("-inf")).logsumexp(dim=1)  # (r,)
    pos_mean = (_row_normalize(y) * logits).sum(dim=1)  # (r,)
    has_pos = y.sum(dim=1) > 0  # (r,)
    per_row = lse_neg - pos_mean
    per_row = torch.where(has_pos, per_row, torch.zeros_like(per_row))
    return _reduce(per_row, n)


def barlow_twins(
    q: Tensor, k: Tensor, ids: Tensor, *, rows: slice | None = None, barlow_lambda: float = 5e-3
) -> Tensor:
    """Barlow Twins (Zbontar et al.) on the two views of q (k is ignored; q is used raw, not normalised).

    With z1, z2 = q[:B], q[B:] (B, d), each standardised per dimension over the batch as BatchNorm1d without
    affine does: ``(z - mean) / sqrt(var + 1e-5)`` with the biased (population, 1/B) variance::

        C = z1^T z2 / B                                        (d, d)
        L = sum_i (1 - C_ii)^2 + λ sum_{i != j} C_ij^2

    Needs the self-supervised two-view layout (ids[:B] == ids[B:] and ids[:B] distinct), else ValueError.
    Not row-separable: with ``rows`` of r rows it returns ``L * r / n`` so that row slices still add up to L.
    """
    if q.dim() != 2:
        raise ValueError(f"q must be (n, d), got {tuple(q.shape)}")
    n = q.shape[0]
    if ids.shape != (n,):
        raise ValueError(f"ids must have shape ({n},) to match q, got {tuple(ids.shape)}")
    half = n // 2
    if n < 2 or n % 2 or not bool((ids[:half] == ids[half:]).all()) or ids[:half].unique().numel() != half:
        raise ValueError(
            "Barlow Twins needs the self-supervised two-view layout: ids = [0..B-1, 0..B-1] "
            "(both halves equal, each half distinct)"
        )
    start, stop = _row_range(rows, n)

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
SELF_SUPERVISED_ONLY: frozenset[str] = frozenset({"infonce", "barlow_twins"})


def make_loss(name: str, *, temperature: float = 0.1, barlow_lambda: float = 5e-3) -> Callable[..., Tensor]:
    """The loss ``name`` with its hyper-parameters bound: ``f(q, k, ids, *, rows=None) -> scalar``.

    Only the hyper-parameters the loss takes are bound (``temperature`` for kl_softmax / infonce / supcon /
    dcl, ``barlow_lambda`` for barlow_twins). Unknown names raise ValueError listing the allowed ones.
    """
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; allowed: {', '.join(LOSS_NAMES)}")
    fn = LOSSES[name]
    params = inspect.signature(fn).parameters
    hyper = {"temperature": temperature, "barlow_lambda": barlow_lambda}
    bound = {key: value for key, value in hyper.items() if key in params}
    if "temperature" in bound:
        _check_temperature(temperature)
    return functools.partial(fn, **bound)
