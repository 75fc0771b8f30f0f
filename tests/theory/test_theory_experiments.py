"""The theory stage's engine (pipeline/theory/experiments.py) against slow references and small runs."""

from __future__ import annotations

import collections
import csv
import itertools
import json
import math

import numpy as np
import pytest
import torch

from pipeline.config.theory import TheoryConfig
from pipeline.data import synthetic
from pipeline.theory import bound
from pipeline.theory import experiments as TE
from pipeline.theory import report as TR
from pipeline.theory.measures import affinity_contrast  # against a loop in test_theory.py

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------------------- references
def gamma_reference(rho: float, eps: float, n: float) -> tuple[float, float, float, bool]:
    """Theorem 2 by hand in float64: (δ, Δ, γ, meaningful). γ = inf where Δ == 0 < δ (as theory.theorem2)."""
    keep = 1.0 - eps
    delta = math.sqrt(1.0 - keep * keep)
    big = keep * rho - math.sqrt((1.0 - keep * keep) * (1.0 - rho * rho))
    dd = delta + delta * delta
    meaningful = big > 0 and big**3 > n * n * dd
    if big == 0:
        return delta, big, (math.inf if delta > 0 else math.nan), meaningful
    inner = big * big + 1.0 + delta
    gamma = (big**3 - n * n * dd) ** 2 * (2.0 + delta) / (big * big * n**3 * inner * (1.0 + delta * inner))
    return delta, big, gamma, meaningful


TINY = dict(n=[8, 16], eps=[0.1], depth=[1, 2], steps=20, n_clusters=2, rank=1, dim=6, seeds=[0])


def empirical_grid(**theory: object) -> TE.EmpiricalGrid:
    """The grid of a validated ``theory`` section (its formula keys at their defaults)."""
    return TE.EmpiricalGrid.from_config(TheoryConfig(**theory))


@pytest.fixture(scope="module")
def tiny_rows():
    return TE.run_empirical(empirical_grid(**TINY), progress=None, workers=1)


@pytest.fixture(scope="module")
def tiny_formula():
    return TE.formula_table(TE.TheoryGrid.uniform(9, [2, 8], log_points=3, eps_min=1e-6))


# ------------------------------------------------------------------------------------------ part (a)
POINTS = [(0.9, 0.0, 2), (0.5, 0.0, 8), (0.9, 0.001, 2), (0.6, 0.2, 8), (0.3, 0.6, 32), (1.0, 0.5, 128),
          (0.2, 0.0, 1), (0.0, 0.3, 4)]


@pytest.mark.parametrize("rho,eps,n", POINTS)
def test_formula_at_matches_hand_formula_and_theorem2(rho, eps, n):
    got = TE.formula_at(rho, eps, n)
    delta, big, gamma, meaningful = gamma_reference(rho, eps, n)
    t = bound.theorem2(rho, eps, n)
    assert got["delta"] == pytest.approx(delta, rel=1e-12, abs=1e-15)
    assert got["Delta"] == pytest.approx(big, rel=1e-12, abs=1e-15)
    assert got["gamma"] == pytest.approx(gamma, rel=1e-10)
    assert got["gamma"] == pytest.approx(float(t.gamma), rel=1e-12)
    assert got["meaningful"] is meaningful is bool(t.meaningful)
    assert got["gamma_gt1"] is (gamma > 1)
    assert got["learnable"] is (meaningful and gamma > 1)
    if rho == 1.0:  # an estimate of ρ above 1 (round-off) is clipped
        assert TE.formula_at(1.0 + 1e-9, eps, n) == got


@pytest.mark.parametrize("points,log_points", [(5, 0), (9, 3), (21, 6)])
def test_formula_table_rows_match_theorem2_cell_by_cell(points, log_points):
    grid = TE.TheoryGrid.uniform(points, [1, 3, 16], log_points=log_points, eps_min=1e-7)
    rows = TE.formula_table(grid)
    assert len(rows) == len(grid.n) * len(grid.rho) * len(grid.eps)
    assert all(tuple(r) == TE.FORMULA_COLUMNS for r in rows)
    for r, (n, rho, eps) in zip(rows, itertools.product(grid.n, grid.rho, grid.eps), strict=True):
        assert (r["n"], r["rho"], r["eps"]) == (n, rho, eps)
        delta, big, gamma, meaningful = gamma_reference(rho, eps, n)
        assert r["meaningful"] is meaningful
        assert r["Delta"] == pytest.approx(big, abs=1e-12)
        if math.isnan(gamma):
            assert math.isnan(r["gamma"])
        elif math.isinf(gamma) or gamma > 1e12:
            assert r["gamma"] > 1e12 or math.isinf(r["gamma"])
        else:
            assert r["gamma"] == pytest.approx(gamma, rel=1e-8)
        assert r["learnable"] is False  # theory.learnable_region: empty for every n >= 1
    assert any(r["gamma_gt1"] for r in rows) and any(r["meaningful"] for r in rows)


def test_theory_grid_uniform_and_validation():
    g = TE.TheoryGrid.uniform(5, [4, 2], log_points=4, eps_min=1e-8)
    assert g.rho == (0.0, 0.25, 0.5, 0.75, 1.0)
    assert list(g.eps) == sorted(g.eps) and len(set(g.eps)) == len(g.eps) == 9
    small = [e for e in g.eps if 0 < e < 0.25]
    assert len(small) == 4 and small[0] == pytest.approx(1e-8) and max(small) < 0.25
    assert g.n == (4, 2)
    with pytest.raises(ValueError, match="points"):
        TE.TheoryGrid.uniform(1, [2])
    with pytest.raises(ValueError, match="eps_min"):
        TE.TheoryGrid.uniform(5, [2], log_points=2, eps_min=0.3)
    with pytest.raises(ValueError, match="duplicates"):
        TE.TheoryGrid(rho=[0.1, 0.1], eps=[0.0], n=[2])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        TE.TheoryGrid(rho=[1.5], eps=[0.0], n=[2])


@pytest.mark.parametrize("kwargs,match", [
    (dict(n=[6]), "2 \\* n_clusters"), (dict(rank=3, dim=6), "n_clusters - 1"), (dict(eps=[1.2]), "eps"),
    (dict(depth=[0]), "depth"), (dict(steps=0), "steps"), (dict(learned_nmi=0.0), "learned_nmi"),
    (dict(seeds=[1, 1]), "duplicate"),
])
def test_empirical_grid_rules_live_in_the_config(kwargs, match):
    base = dict(n=[8], eps=[0.0], depth=[1], n_clusters=4, rank=1, dim=8)
    with pytest.raises(ValueError, match=match):
        empirical_grid(**{**base, **kwargs})
    grid = empirical_grid(**base)
    assert (grid.n, grid.eps, grid.depth, grid.dim, grid.seeds) == ((8,), (0.0,), (1,), 8, (0, 1, 2))


# ------------------------------------------------------------------------------------------ part (b)
@pytest.mark.parametrize("total,n,k,seed", [(40, 8, 2, 0), (57, 12, 3, 1), (100, 17, 4, 2), (30, 6, 6, 3)])
def test_split_test_is_stratified_disjoint_and_takes_the_last_members(total, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    labels = (torch.arange(total) % k)[torch.randperm(total, generator=g)]
    test, train = TE.split_test(labels, n, k)
    lab = labels.tolist()
    expected = []
    for c in range(k):
        need = n // k + (1 if c < n % k else 0)
        members = [i for i in range(total) if lab[i] == c]
        expected.extend(members[len(members) - need:])
    assert sorted(test.tolist()) == sorted(expected) and len(test) == n
    assert train.tolist() == [i for i in range(total) if i not in set(expected)]
    counts = [sum(lab[i] == c for i in test.tolist()) for c in range(k)]
    assert max(counts) - min(counts) <= 1 and min(counts) >= 1
    with pytest.raises(ValueError, match="cluster 1"):
        TE.split_test(torch.tensor([0, 0, 0, 0, 1]), 4, 2)


@pytest.mark.parametrize("n,h", [(3, 2), (6, 5), (9, 3)])
def test_squared_cosine_matches_loops(n, h):
    g = torch.Generator().manual_seed(n)
    q, k = torch.randn(n, h, generator=g), torch.randn(n, h, generator=g)
    got = TE.squared_cosine(q, k)
    qd, kd = q.double().tolist(), k.double().tolist()
    for i, j in itertools.product(range(n), repeat=2):
        dot = sum(a * b for a, b in zip(qd[i], kd[j], strict=True))
        nq = math.sqrt(sum(a * a for a in qd[i]))
        nk = math.sqrt(sum(b * b for b in kd[j]))
        want = 0.0 if i == j else (dot / (nq * nk)) ** 2
        assert got[i, j] == pytest.approx(want, abs=1e-12)


def test_measure_fields_match_references():
    train = synthetic.union_of_subspaces(36, 3, 1, 6, 0.2, seed=4)
    head, _ = TE.train_head(train.x, train.labels, n=12, depth=2, steps=3, lr=1e-2, seed=0)
    data = synthetic.union_of_subspaces(12, 3, 1, 6, 0.2, seed=5)
    m = TE.measure(head, data.x, data.labels, learned_nmi=0.5)
    y = data.labels.tolist()
    x = data.x.double()
    xn = x / x.norm(dim=1, keepdim=True)
    relu_cos = [[0.0 if i == j else max(float(xn[i] @ xn[j]), 0.0) for j in range(12)] for i in range(12)]
    contrasts = [float(c) for c in m["contrast_layers"].split(";")]
    assert len(contrasts) == 3 and len(m["gain_layers"].split(";")) == 2
    assert contrasts[0] == pytest.approx(affinity_contrast(np.array(relu_cos), y), rel=1e-3)
    with torch.no_grad():
        out = head(data.x, collect=True)
    for c, a in zip(contrasts[1:], out.affinities, strict=True):
        assert c == pytest.approx(affinity_contrast(a.double().numpy(), y), rel=1e-3)
    assert m["contrast_gain"] == pytest.approx((contrasts[2] / contrasts[0]) ** 0.5, rel=1e-3)
    sq_in = [[0.0 if i == j else float(xn[i] @ xn[j]) ** 2 for j in range(12)] for i in range(12)]
    assert m["contrast_in"] == pytest.approx(affinity_contrast(np.array(sq_in), y), rel=1e-9)
    assert m["learned"] is (m["nmi"] >= 0.5)
    assert 0.0 <= m["nmi_in"] <= 1.0 and 0.0 <= m["nmi"] <= 1.0


def test_train_head_keeps_global_rng_and_is_seeded():
    data = synthetic.union_of_subspaces(40, 2, 1, 4, 0.1, seed=0)
    state = torch.random.get_rng_state()
    h1, l1 = TE.train_head(data.x, data.labels, n=8, depth=1, steps=5, lr=1e-2, seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)
    h2, l2 = TE.train_head(data.x, data.labels, n=8, depth=1, steps=5, lr=1e-2, seed=3)
    assert l1 == l2 and len(l1) == 5
    assert all(torch.equal(a, b) for a, b in zip(h1.state_dict().values(), h2.state_dict().values(), strict=True))
    with pytest.raises(ValueError, match="training rows"):
        TE.train_head(data.x, data.labels, n=8, depth=1, steps=6, lr=1e-2, seed=3)


@pytest.mark.slow  # a spawned process pool
def test_run_empirical_rows_complete_and_deterministic(tiny_rows):
    """Also across processes: two workers (spawned, the slowest cells first) give the serial rows, in grid order."""
    threads = torch.get_num_threads()
    again = TE.run_empirical(empirical_grid(**TINY), progress=None, workers=2)
    assert torch.get_num_threads() == threads
    assert len(tiny_rows) == 2 * 1 * 2 * 1
    assert [(r["n"], r["depth"]) for r in tiny_rows] == [(8, 1), (8, 2), (16, 1), (16, 2)]
    for r, s in zip(tiny_rows, again, strict=True):
        assert tuple(r) == TE.EMPIRICAL_COLUMNS
        for c in TE.EMPIRICAL_COLUMNS:
            if isinstance(r[c], float) and math.isnan(r[c]):
                assert math.isnan(s[c])
            else:
                assert r[c] == s[c], c
        f = TE.formula_at(r["rho"], r["eps"], r["n"])
        assert all(r[k] == f[k] for k in f)
        assert 0 < r["rho"] <= 1 and r["train_loss"] >= 0
        assert len(r["gain_layers"].split(";")) == r["depth"]
    # rho is a property of the clean test batch: the same for both depths of one (n, eps, seed)
    assert tiny_rows[0]["rho"] == tiny_rows[1]["rho"]


def test_progress_lines(capsys):
    lines = []
    TE.run_empirical(empirical_grid(**{**TINY, "n": [8], "depth": [1], "steps": 2}), progress=lines.append)
    assert len(lines) == 1 and "n=8" in lines[0] and "NMI" in lines[0]


def test_easy_data_beats_very_noisy_data():
    grid = empirical_grid(n=[16], eps=[0.0, 0.9], depth=[1], steps=20, n_clusters=3, rank=1, dim=8, seeds=[0])
    easy, noisy = TE.run_empirical(grid, progress=None, workers=1)
    assert (easy["eps"], noisy["eps"]) == (0.0, 0.9)
    assert easy["nmi"] >= noisy["nmi"] + 0.3
    assert easy["contrast_out"] > 2.0 * noisy["contrast_out"]
    assert easy["learned"] and not noisy["learned"]
    assert easy["meaningful"] and not noisy["meaningful"]


# ------------------------------------------------------------------------------------- aggregation
def _row(**kw):
    base = dict(n=8, eps=0.0, depth=1, seed=0, rho=0.5, delta=0.0, Delta=0.5, gamma=0.5, meaningful=False,
                gamma_gt1=False, learnable=False, train_loss=0.1, test_loss=0.1, contrast_layers="2;1",
                sharpness_layers="0;0", gain_layers="0.5", contrast_gain=0.5, sharpness=0.0, contrast_in=2.0,
                contrast_out=3.0, nmi_in=0.5, nmi=0.9, learned=True)
    return {**base, **kw}


def test_aggregate_means_over_seeds():
    rows = [_row(seed=0, nmi=0.8, learned=False, gamma=2.0), _row(seed=1, nmi=1.0, learned=True, gamma=4.0),
            _row(n=16, nmi=0.3)]
    table = TR.aggregate(rows)
    assert [(t["n"], t["runs"]) for t in table] == [(8, 2), (16, 1)]
    assert table[0]["nmi"] == pytest.approx(0.9) and table[0]["learned"] == 0.5 and table[0]["gamma"] == 3.0
    assert tuple(table[0]) == TR.TABLE_COLUMNS


def test_summarize_counts_match_a_loop(tiny_formula):
    rng = np.random.default_rng(0)
    rows = []
    for i in range(40):
        g = float(rng.choice([0.01, 0.5, 3.0, math.inf]))
        m = bool(rng.random() < 0.3) and g < 1
        rows.append(_row(seed=i, eps=float(rng.choice([0.0, 0.5])), n=int(rng.choice([8, 16])), gamma=g,
                         gamma_gt1=g > 1, meaningful=m, learned=bool(rng.random() < 0.5),
                         contrast_gain=float(rng.choice([0.5, 2.0, 0.001])), nmi=float(rng.random())))
    e = TR.summarize(tiny_formula, rows)["empirical"]
    cells = collections.Counter((r["gamma_gt1"], r["learned"]) for r in rows)  # (formula says γ > 1, learned)
    assert (e["both"], e["formula_only"], e["measured_only"], e["neither"]) == (
        cells[True, True], cells[True, False], cells[False, True], cells[False, False])
    assert e["runs"] == 40 and e["learned"] == sum(r["learned"] for r in rows)
    assert e["gain_gt1"] == sum(r["contrast_gain"] > 1 for r in rows)
    assert e["meaningful_gain_ge_gamma"] == sum(r["contrast_gain"] >= r["gamma"] for r in rows if r["meaningful"])
    assert e["by_eps"]["0.5"]["runs"] == sum(r["eps"] == 0.5 for r in rows)
    f = TR.summarize(tiny_formula, rows)["formula"]
    for n in (2, 8):
        cells = [r for r in tiny_formula if r["n"] == n]
        assert f[str(n)]["cells"] == len(cells)
        assert f[str(n)]["gamma_gt1_fraction"] == pytest.approx(sum(r["gamma_gt1"] for r in cells) / len(cells))
        assert f[str(n)]["overlap"] == 0


def test_verdict_states_the_numbers(tiny_formula, tiny_rows):
    s = TR.summarize(tiny_formula, tiny_rows)
    text = TR.verdict(s, 0.9)
    e = s["empirical"]
    assert f"learned (spectral NMI of the trained affinity ≥ 0.9) in {e['learned']} of {e['runs']} runs" in text
    assert f"both {e['both']}, γ > 1 but not learned {e['formula_only']}" in text
    assert "share no cell" in text and "Caveat" in text
    fake = {**s, "formula": {"2": {**s["formula"]["2"], "overlap": 3}}}
    assert "share 3 cells" in TR.verdict(fake)


# ------------------------------------------------------------------------------------------- part (c)
def test_write_outputs_files_headers_and_metrics(tmp_path, tiny_formula, tiny_rows):
    report = tmp_path / "reports" / "theory.md"
    metrics = TR.write_outputs(tiny_formula, tiny_rows, tmp_path / "out", setup={"steps": 20}, report=report)
    out = tmp_path / "out"
    names = sorted(p.name for p in out.iterdir())
    assert names == ["empirical.csv", "formula.csv", "measured_gain.csv", "measured_gain.png", "measured_nmi.csv",
                     "measured_nmi.png", "table.csv", "theory.png"]  # the Markdown goes to `report`, not here
    assert metrics["files"] == names
    for png in ("theory.png", "measured_nmi.png", "measured_gain.png"):
        assert (out / png).read_bytes()[:8] == PNG_SIGNATURE
    for name, cols, count in (("formula.csv", TE.FORMULA_COLUMNS, len(tiny_formula)),
                              ("empirical.csv", TE.EMPIRICAL_COLUMNS, len(tiny_rows)),
                              ("table.csv", TR.TABLE_COLUMNS, len(TR.aggregate(tiny_rows)))):
        with open(out / name) as f:
            rows = list(csv.reader(f))
        assert tuple(rows[0]) == cols and len(rows) == count + 1
    with open(out / "measured_nmi.csv") as f:
        assert next(csv.reader(f)) == ["eps", "n", "depth", "nmi"]
    md = report.read_text()
    assert "## Verdict" in md and "| n | ε | depth | ρ |" in md and "- steps: 20" in md
    assert md.count("\n| 8 | 0.1 |") == 2  # one table line per depth at n = 8
    assert metrics["empirical"]["runs"] == len(tiny_rows)
    assert not [p for p in out.iterdir() if p.name.startswith(".")]
    json.dumps(metrics, allow_nan=False)  # JSON-safe: no float is non-finite
    with pytest.raises(ValueError, match="empirical rows"):
        TR.write_outputs(tiny_formula, [], tmp_path)


def test_theory_figure_draws_each_formula_category_it_is_given(tmp_path, tiny_formula, tiny_rows):
    """The figure alone (``pipeline.theory.figure``): the cells where only the printed γ > 1 holds take their colour
    (beyond the legend's swatch, there in every figure), and without such cells only the swatch has it."""
    import matplotlib.image

    from pipeline.theory import figure as TF

    def pixels(path, colour):
        rgb = (matplotlib.image.imread(path)[..., :3] * 255).round().astype(int)
        return int((rgb == colour).all(axis=-1).sum())

    gamma_only = (0xF4, 0xA5, 0x82)
    assert any(r["gamma_gt1"] and not r["meaningful"] for r in tiny_formula)
    TF.theory_figure(tiny_formula, TR.aggregate(tiny_rows), tiny_rows, tmp_path / "theory.png")
    assert (tmp_path / "theory.png").read_bytes()[:8] == PNG_SIGNATURE
    none_gamma = [{**r, "gamma_gt1": False} for r in tiny_formula]
    TF.theory_figure(none_gamma, TR.aggregate(tiny_rows), tiny_rows, tmp_path / "none.png")
    swatch = pixels(tmp_path / "none.png", gamma_only)
    assert 0 < swatch < pixels(tmp_path / "theory.png", gamma_only)


def test_a_small_grid_runs_in_this_process_a_large_one_on_the_pool(monkeypatch):
    """Spawning the pool costs more than a grid of fewer than POOL_MIN_STEPS steps; an explicit ``workers`` wins."""
    import concurrent.futures
    import contextlib
    import dataclasses

    pools = []

    class Pool(contextlib.nullcontext):  # runs each cell at once, in this process; records the pool's size
        def __init__(self, workers, mp_context=None):
            super().__init__(self)  # `with` gives the pool itself
            pools.append(workers)

        def submit(self, fn, *args):
            future = concurrent.futures.Future()
            future.set_result(fn(*args))
            return future

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", Pool)  # what pipeline.host.spawned_map starts
    monkeypatch.setattr(TE, "run_cell", lambda grid, seed, n, eps: [({"seed": seed, "n": n, "eps": eps}, "")])
    small = empirical_grid(**TINY)  # 2 cells x 2 depths x 20 steps
    assert 2 * 2 * small.steps < TE.POOL_MIN_STEPS
    rows = TE.run_empirical(small, progress=None)
    assert pools == [] and [r["n"] for r in rows] == [8, 16]
    large = dataclasses.replace(small, steps=TE.POOL_MIN_STEPS)
    assert TE.run_empirical(large, progress=None, workers=2) == rows and pools == [2]
    monkeypatch.setattr(TE, "usable_cpus", lambda: 2)
    assert TE.run_empirical(large, progress=None) == rows and pools == [2, 2]
    assert TE.run_empirical(small, progress=None, workers=2) == rows and pools == [2, 2, 2]
