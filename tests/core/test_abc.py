"""ABC (pipeline.core.abc) against slow references written here: the SAB against a per-head loop, the compatibilities
and kernels against a double loop over (i, j), the BCE against torch's, kernel_stats against a loop; permutation
equivariance, row slices adding up, the additive tiles against the untiled product (values, gradients, peak memory),
gradcheck, no host sync."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import pipeline.core.abc as abc
from pipeline.core.abc import (
    ATTENTION_SCALES,
    COMPATIBILITIES,
    KERNELS,
    SAB,
    ABCHead,
    AdditiveCompat,
    additive_compat,
    additive_energies,
    bce,
    kernel_stats,
)
from pipeline.training.measure import count, peak_bytes

KINDS = [(c, k) for c in COMPATIBILITIES for k in KERNELS]


pytestmark = pytest.mark.usefixtures("one_thread")  # small matrices: one thread beats two contending ones


def head(compatibility="multiplicative", kernel="logits", dim=6, width=8, depth=2, heads=2, seed=0, **kwargs):
    torch.manual_seed(seed)
    return ABCHead(dim, depth=depth, heads=heads, width=width, compatibility=compatibility, kernel=kernel,
                   **kwargs).double()


def layer_norm(v, ln):
    """(v − mean) / √(var + ε) · γ + β of one vector, the biased variance."""
    mean = v.mean()
    var = ((v - mean) ** 2).mean()
    return (v - mean) / torch.sqrt(var + ln.eps) * ln.weight + ln.bias


def sab_reference(block, x):
    """One SAB by hand: per head h, row i, a softmax over j of s · q_i^h · k_j^h (multiplicative) or s · uᵀtanh(q_i^h
    + k_j^h) (additive, one u for all heads); concat, W_O (if any), residual, LN, FF, residual, LN."""
    n, dim = x.shape
    d = dim // block.heads
    q, k, v = block.query(x), block.key(x), block.value(x)  # (n, dim)
    out = []
    for i in range(n):
        parts = []
        for h in range(block.heads):
            cols = slice(h * d, (h + 1) * d)
            if block.attention == "additive":
                scores = [block.scale * (block.u @ torch.tanh(q[i, cols] + k[j, cols])) for j in range(n)]
            else:
                scores = [block.scale * (q[i, cols] @ k[j, cols]) for j in range(n)]
            z = sum(torch.exp(s) for s in scores)
            parts.append(sum(torch.exp(scores[j]) / z * v[j, cols] for j in range(n)))
        mixed = torch.cat(parts)
        hidden = layer_norm(x[i] + (block.out(mixed) if block.out is not None else mixed), block.norm1)
        out.append(layer_norm(hidden + block.ff(hidden), block.norm2))
    return torch.stack(out)


def compat_reference(h, a, b):
    """E_ij = compat(a_i, b_j), one pair at a time (Table 1)."""

    def compat(x, y):
        if h.compatibility == "additive":
            return h.w @ torch.tanh(x + y)
        return (x @ y) / (math.sqrt(a.shape[1]) if h.scale_compat else 1.0)

    return torch.stack([torch.stack([compat(a[i], b[j]) for j in range(b.shape[0])]) for i in range(a.shape[0])])


def sigmoid(t):
    return 1.0 / (1.0 + math.exp(-t))


@pytest.mark.parametrize("n", [1, 5])
@pytest.mark.parametrize("scale", ATTENTION_SCALES)
@pytest.mark.parametrize("attention", COMPATIBILITIES)
@pytest.mark.parametrize("project", [True, False])
@pytest.mark.parametrize("heads", [1, 2])
def test_sab_matches_a_per_head_loop(n, scale, attention, project, heads):
    torch.manual_seed(n)
    block = SAB(8, heads=heads, scale=scale, attention=attention, project=project).double()
    expected = {"width": 1 / math.sqrt(8), "head": 1 / math.sqrt(8 // heads), "none": 1.0}[scale]
    assert block.scale == pytest.approx(expected)
    assert (block.out is None) == (not project)
    x = torch.randn(n, 8, dtype=torch.float64)
    torch.testing.assert_close(block(x), sab_reference(block, x), rtol=0, atol=1e-12)


def test_additive_energies_at_once_and_through_the_tiles_agree():
    torch.manual_seed(0)
    a, b = torch.randn(2, 3, 5, 4, dtype=torch.float64), torch.randn(2, 3, 6, 4, dtype=torch.float64)
    w = torch.randn(4, dtype=torch.float64)
    loop = torch.zeros(2, 3, 5, 6, dtype=torch.float64)
    for s, h, i, j in itertools.product(range(2), range(3), range(5), range(6)):
        loop[s, h, i, j] = w @ torch.tanh(a[s, h, i] + b[s, h, j])
    torch.testing.assert_close(additive_energies(a, b, w), loop, rtol=0, atol=1e-12)
    torch.testing.assert_close(additive_energies(a, b, w, tile=2), loop, rtol=0, atol=1e-12)


@pytest.mark.parametrize("compatibility", COMPATIBILITIES)
def test_the_codes_circles_model(compatibility):
    """``circles.py``'s AffinityAdd / AffinityMul: 1 head, no W_O; additive SABs with plain softmax, or q·k/√width."""
    h = ABCHead.as_code_circles(2, compatibility, width=16)
    for block in h.blocks:
        assert (block.heads, block.out, block.attention) == (1, None, compatibility)
        assert block.scale == (1.0 if compatibility == "additive" else pytest.approx(1 / 4))
    assert len(h.blocks) == 2 and h.compatibility == compatibility
    out = h(torch.randn(3, 20, 2))
    assert out.kernel.shape == (3, 20, 20)


@pytest.mark.parametrize("compatibility", COMPATIBILITIES)
@pytest.mark.parametrize("scale_compat", [False, True])
def test_compatibility_matches_a_double_loop(compatibility, scale_compat):
    h = head(compatibility, scale_compat=scale_compat)
    a, b = torch.randn(4, 8, dtype=torch.float64), torch.randn(6, 8, dtype=torch.float64)
    torch.testing.assert_close(h.compat(a, b), compat_reference(h, a, b), rtol=0, atol=1e-12)


@pytest.mark.parametrize(("compatibility", "kernel"), KINDS)
def test_head_kernel_matches_the_definitions(compatibility, kernel):
    """Pre-embedding Linear–tanh–Linear, the SABs, q/k, then κ_ij = σ(½(E_ij + E_ji)) or ½(σ(E_ij) + σ(E_ji))."""
    h = head(compatibility, kernel).requires_grad_(False)
    x = torch.randn(6, 6, dtype=torch.float64)
    out = h(x)
    z = h.pre[2](torch.tanh(h.pre[0](x)))
    for i, block in enumerate(h.blocks):
        z = block(z)
        assert out.hidden[i] is not None and torch.equal(out.hidden[i], z)
    assert len(out.hidden) == 2 and torch.equal(out.embedding, z)
    torch.testing.assert_close(out.q, h.query(z), rtol=0, atol=0)
    e = compat_reference(h, h.query(z), h.key(z))
    torch.testing.assert_close(out.energies, e, rtol=0, atol=1e-12)
    n = x.shape[0]
    for i in range(n):
        for j in range(n):
            eij, eji = float(e[i, j]), float(e[j, i])
            want = sigmoid(0.5 * (eij + eji)) if kernel == "logits" else 0.5 * (sigmoid(eij) + sigmoid(eji))
            assert float(out.kernel[i, j]) == pytest.approx(want, abs=1e-12)
            assert float(out.logits[i, j]) == pytest.approx(0.5 * (eij + eji) if kernel == "logits" else eij, abs=1e-12)
    torch.manual_seed(1)  # fp32: exactly symmetric, in (0, 1)
    kappa = ABCHead(16, width=32, compatibility=compatibility, kernel=kernel)(torch.randn(40, 16)).kernel
    assert kappa.dtype == torch.float32 and torch.equal(kappa, kappa.T) and bool(((kappa > 0) & (kappa < 1)).all())


@pytest.mark.parametrize("n", [7, 100])
@pytest.mark.parametrize(("compatibility", "kernel"), KINDS)
@pytest.mark.parametrize("set_norm", [False, True])
def test_permutation_equivariance(n, compatibility, kernel, set_norm):
    """ABC(PX) = P ABC(X) Pᵀ with the same weights, set_norm or not; the embedding permutes with the rows."""
    h = head(compatibility, kernel, dim=5, width=16, heads=4, tile=13, set_norm=set_norm)
    x = torch.randn(n, 5, dtype=torch.float64)
    perm = torch.randperm(n)
    out, out_p = h(x), h(x[perm])
    torch.testing.assert_close(out_p.kernel, out.kernel[perm][:, perm], rtol=0, atol=1e-12)
    torch.testing.assert_close(out_p.logits, out.logits[perm][:, perm], rtol=0, atol=1e-11)
    torch.testing.assert_close(out_p.embedding, out.embedding[perm], rtol=0, atol=1e-12)
    assert not torch.allclose(out.kernel, out.kernel[perm][:, perm])  # the permutation did move something


def pair_counts(ids):
    """(#pos, #neg) over all n² pairs, the diagonal a positive, by a double loop."""
    n = len(ids)
    pos = sum(int(ids[i] == ids[j]) for i in range(n) for j in range(n))
    return pos, n * n - pos


@pytest.mark.parametrize("pos_weight", [1.0, 3.5, "balanced"])
def test_bce_on_the_paper_kernel_is_binary_cross_entropy_with_the_diagonal(pos_weight):
    h = head("additive", "paper")
    ids = torch.tensor([0, 1, 0, 2, 1, 0, 3])
    kappa = h(torch.randn(7, 6, dtype=torch.float64)).kernel
    y = (ids[:, None] == ids[None, :]).double()
    assert float(y.diagonal().sum()) == 7  # the diagonal is a positive and is counted
    pos, neg = pair_counts(ids.tolist())
    p = neg / pos if pos_weight == "balanced" else pos_weight
    want = F.binary_cross_entropy(kappa, y, weight=y * p + (1 - y))  # mean over all n²
    torch.testing.assert_close(bce(kappa, ids, pos_weight=pos_weight, logits=False), want, rtol=0, atol=1e-14)


@pytest.mark.parametrize("pos_weight", [1.0, 0.25, "balanced"])
def test_bce_on_logits_is_bce_with_logits_and_its_pos_weight(pos_weight):
    h = head("multiplicative", "logits")
    ids = torch.tensor([4, 4, 1, 2, 1, 4, 0, 0])
    out = h(torch.randn(8, 6, dtype=torch.float64))
    y = (ids[:, None] == ids[None, :]).double()
    pos, neg = pair_counts(ids.tolist())
    p = torch.tensor(neg / pos if pos_weight == "balanced" else pos_weight, dtype=torch.float64)
    want = F.binary_cross_entropy_with_logits(out.logits, y, pos_weight=p)
    torch.testing.assert_close(bce(out.logits, ids, pos_weight=pos_weight), want, rtol=0, atol=1e-14)
    torch.testing.assert_close(out.loss(ids, pos_weight=pos_weight), want, rtol=0, atol=1e-14)


@pytest.mark.parametrize(("compatibility", "kernel"), KINDS)
def test_row_slices_add_up_to_the_full_loss_and_gradient(compatibility, kernel):
    h = head(compatibility, kernel, tile=2)
    ids = torch.tensor([0, 1, 0, 2, 1, 0, 3, 3, 1])
    x = torch.randn(9, 6, dtype=torch.float64)
    full = h(x).loss(ids, pos_weight="balanced")
    grads = torch.autograd.grad(full, list(h.parameters()))
    out = h(x)
    parts = [out.loss(ids, rows=slice(a, b), pos_weight="balanced") for a, b in [(0, 4), (4, 5), (5, 9)]]
    torch.testing.assert_close(sum(parts), full, rtol=0, atol=1e-14)
    for g, g_parts in zip(grads, torch.autograd.grad(sum(parts), list(h.parameters())), strict=True):
        torch.testing.assert_close(g_parts, g, rtol=0, atol=1e-13)
    rows = slice(2, 6)
    torch.testing.assert_close(out.scores(rows), out.logits[rows], rtol=0, atol=1e-14)
    torch.testing.assert_close(out.kernel_rows(rows), out.kernel[rows], rtol=0, atol=1e-15)
    # a full x with rows is sliced; an (r, n) x is taken as those rows
    logits = kernel == "logits"
    x_full = out.logits if logits else out.kernel
    assert torch.equal(bce(x_full, ids, rows=rows, logits=logits), bce(x_full[rows], ids, rows=rows, logits=logits))


@pytest.mark.parametrize(("m", "n"), [(1, 1), (7, 5), (12, 12)])
@pytest.mark.parametrize("tile", [1, 3, 100])
def test_additive_tiles_equal_the_untiled_product(m, n, tile):
    torch.manual_seed(m + n)
    a, b = (torch.randn(rows, 8, dtype=torch.float64, requires_grad=True) for rows in (m, n))
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    g = torch.randn(m, n, dtype=torch.float64)
    dense = (torch.tanh(a[:, None, :] + b[None]) * w).sum(-1)  # (m, n, H) at once: the reference
    tiled = additive_compat(a, b, w, tile)
    torch.testing.assert_close(tiled, dense, rtol=0, atol=1e-12)
    for got, want in zip(torch.autograd.grad(tiled, (a, b, w), g), torch.autograd.grad(dense, (a, b, w), g),
                         strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_additive_tiles_bound_the_peak_memory():
    """Forward + backward at n = 256, H = 32, fp32: an (n, n, H) tensor is 8 MiB. Measured: 16-row tiles peak at
    0.80 MB (one 0.52 MB tile + E, 0.26 MB), untiled 8.9 MB."""
    n, hdim, tile = 256, 32, 16
    a, b = torch.randn(n, hdim, requires_grad=True), torch.randn(n, hdim, requires_grad=True)
    w = torch.randn(hdim, requires_grad=True)

    def run(t):
        return lambda: additive_compat(a, b, w, t).sum().backward()

    cube = n * n * hdim * 4
    tiled, untiled = peak_bytes(run(tile)), peak_bytes(run(n))
    assert untiled >= cube
    assert tiled <= tile * n * hdim * 4 + 2 * n * n * 4 + 4 * n * hdim * 4  # one tile, E and its gradient, a/b grads
    assert tiled < cube / 4


def test_gradcheck_additive_compat():
    torch.manual_seed(0)
    a = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, w: AdditiveCompat.apply(a, b, w, 2), (a, b, w))


@pytest.mark.parametrize(("compatibility", "kernel", "set_norm"),
                         [*((c, k, False) for c, k in KINDS), ("multiplicative", "logits", True)])
def test_gradcheck_head_loss(compatibility, kernel, set_norm):
    h = head(compatibility, kernel, dim=3, width=4, depth=1, heads=2, tile=2, set_norm=set_norm)
    ids = torch.tensor([0, 1, 0, 1, 2])
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: h(x).loss(ids, pos_weight="balanced"), (x,))


def test_pairwise_ablation_has_no_blocks():
    h = ABCHead.pairwise(6, width=8)
    assert len(h.blocks) == 0 and h.compatibility == "additive"
    x = torch.randn(4, 6)
    out = h(x)
    assert out.hidden == [] and out.kernel.shape == (4, 4)
    torch.testing.assert_close(out.embedding, h.pre(x), rtol=0, atol=0)


@pytest.mark.parametrize("n", [2, 9])
def test_kernel_stats_match_a_loop(n):
    torch.manual_seed(n)
    kappa = torch.rand(n, n)
    labels = torch.randint(0, 3, (n,))
    stats = kernel_stats(kappa, labels)
    same = [float(kappa[i, j]) for i in range(n) for j in range(n) if i != j and labels[i] == labels[j]]
    other = [float(kappa[i, j]) for i in range(n) for j in range(n) if i != j and labels[i] != labels[j]]
    above = [float(kappa[i, j]) > 0.5 for i in range(n) for j in range(n) if i != j]
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in stats.values())
    for key, values in (("same_class", same), ("other", other)):
        if values:
            assert float(stats[key]) == pytest.approx(sum(values) / len(values), rel=1e-6)
        else:
            assert math.isnan(float(stats[key]))
    assert float(stats["above_half"]) == pytest.approx(sum(above) / len(above))


def test_no_host_sync_in_the_loss_and_the_stats():
    h = ABCHead(6, width=8, heads=2, compatibility="additive", tile=3)
    ids = torch.tensor([0, 1, 0, 2, 1, 0, 3])
    x = torch.randn(7, 6)
    assert count(lambda: h(x).loss(ids, rows=slice(2, 5), pos_weight="balanced").backward()).syncs == []
    assert count(lambda: kernel_stats(h(x).kernel, ids)).syncs == []


def test_bad_options_are_refused():
    kappa, ids = torch.full((3, 3), 0.5), torch.tensor([0, 0, 1])
    for bad, match in [(lambda: ABCHead(4, compatibility="cosine"), "compatibility"),
                       (lambda: ABCHead(4, kernel="rbf"), "kernel"), (lambda: SAB(8, scale="sqrt"), "attention scale"),
                       (lambda: SAB(8, attention="relu"), "SAB attention"),
                       (lambda: ABCHead(4, width=8, pre_embed=False), "must equal width"),
                       (lambda: bce(kappa, ids, pos_weight="auto"), "pos_weight"),
                       (lambda: bce(kappa, ids, pos_weight=0.0), "pos_weight"),
                       (lambda: bce(kappa[:2], ids, rows=slice(0, 1)), "rows")]:
        with pytest.raises(ValueError, match=match):
            bad()


@pytest.mark.parametrize(("compatibility", "kernel"), KINDS)
@pytest.mark.parametrize("big", [False, True])
def test_a_batch_of_sets_equals_each_set_alone(compatibility, kernel, big, monkeypatch):
    """x (B, n, dim): every (n, n) matrix and the batched BCE equal the B sets' own, set by set (the additive
    compatibility at once, and per set in tiles past TILE_ELEMENTS)."""
    if big:
        monkeypatch.setattr(abc, "TILE_ELEMENTS", 16)
    h = head(compatibility, kernel)
    x = torch.randn(3, 7, 6, dtype=torch.float64)
    ids = torch.randint(0, 3, (3, 7))
    out = h(x)
    for b in range(3):
        alone = h(x[b])
        for name in ("energies", "logits", "kernel"):
            torch.testing.assert_close(getattr(out, name)[b], getattr(alone, name), rtol=1e-12, atol=1e-12)
    logits = kernel == "logits"
    batched = bce(out.logits if logits else out.kernel, ids, pos_weight=2.5, logits=logits)
    each = torch.stack([h(x[b]).loss(ids[b], pos_weight=2.5) for b in range(3)]).mean()
    torch.testing.assert_close(batched, each, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="numeric pos_weight"):
        bce(out.logits, ids, pos_weight="balanced")


def set_norm_reference(x, eps):
    """x (n, dim) standardised per feature over the n rows, by loops: (x_id − μ_d) / √(σ²_d + ε), σ² biased."""
    n, dim = x.shape
    out = torch.empty_like(x)
    for d in range(dim):
        mean = sum(float(x[i, d]) for i in range(n)) / n
        var = sum((float(x[i, d]) - mean) ** 2 for i in range(n)) / n
        for i in range(n):
            out[i, d] = (float(x[i, d]) - mean) / math.sqrt(var + eps)
    return out


@pytest.mark.parametrize(("compatibility", "kernel"), KINDS)
@pytest.mark.parametrize("pre_embed", [True, False])
def test_set_norm_is_the_plain_head_on_the_standardised_set(compatibility, kernel, pre_embed):
    """set_norm: the same weights without it on x̂ = (x − μ) / √(σ² + ε), μ, σ² per feature over the set (a loop);
    a batch of sets (B, n, dim) standardises each set alone. Off by default."""
    dim = 6 if pre_embed else 8
    h = head(compatibility, kernel, dim=dim, pre_embed=pre_embed, set_norm=True)
    plain = head(compatibility, kernel, dim=dim, pre_embed=pre_embed)
    assert h.set_norm and not plain.set_norm and not ABCHead(dim, width=8, heads=2, pre_embed=pre_embed).set_norm
    x = 3.0 + 2.0 * torch.randn(9, dim, dtype=torch.float64)
    want = plain(set_norm_reference(x, abc.SET_NORM_EPS))
    out = h(x)
    for name in ("embedding", "energies", "logits", "kernel"):
        torch.testing.assert_close(getattr(out, name), getattr(want, name), rtol=0, atol=1e-10)
    sets = torch.randn(3, 5, dim, dtype=torch.float64) * torch.tensor([[[1.0]], [[10.0]], [[0.1]]]) + 4.0
    batched = h(sets)
    for b in range(3):
        torch.testing.assert_close(batched.kernel[b], plain(set_norm_reference(sets[b], abc.SET_NORM_EPS)).kernel,
                                   rtol=0, atol=1e-10)


@pytest.mark.parametrize(("compatibility", "kernel"), KINDS)
def test_set_norm_makes_the_kernel_blind_to_an_offset_common_to_every_row(compatibility, kernel):
    """x_i + c for every row i gives the same κ with set_norm (and not without: the offset saturates the tanh)."""
    torch.manual_seed(3)
    x, c = torch.randn(12, 6, dtype=torch.float64), 30.0 * torch.randn(6, dtype=torch.float64)
    normed = head(compatibility, kernel, set_norm=True)
    torch.testing.assert_close(normed(x + c).kernel, normed(x).kernel, rtol=0, atol=1e-9)
    plain = head(compatibility, kernel)
    assert not torch.allclose(plain(x + c).kernel, plain(x).kernel, atol=1e-3)
