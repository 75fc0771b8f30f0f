"""Figures: valid PNG + CSV pairs, t-SNE subset / colour consistency, inf-safe sharpness, phase-diagram layout,
and atomic writes (a failure mid-way leaves nothing behind)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
from matplotlib.figure import Figure

from pipeline import plots as P
from pipeline.evaluation import figures as F

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TSNE_ITERS = 250  # sklearn's minimum; plenty for 60 points and keeps the file fast


# ------------------------------------------------------------------------------------------ helpers
def assert_valid_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[2] in (3, 4)
    assert img.shape[0] >= 150 and img.shape[1] >= 200
    pixels = np.round(img.reshape(-1, img.shape[2]) * 255).astype(np.int64)  # (h * w, c) of the PNG's 8-bit values
    colours = np.unique(pixels @ 256 ** np.arange(img.shape[2]))  # one integer a colour
    assert len(colours) > 10, "image is (nearly) a single colour"


def read_csv(path: Path) -> tuple[list[str], list[list[str]]]:
    with open(path, newline="") as f:
        table = list(csv.reader(f))
    return table[0], table[1:]


def only_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.fixture
def captured(monkeypatch):
    """Record every Figure that gets saved, so tests can inspect what was drawn."""
    figs: list[Figure] = []
    original = Figure.savefig

    def spy(self, *args, **kwargs):
        figs.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    return figs


def blobs(n_per_class: list[int], d: int = 8, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = np.concatenate([np.full(c, k) for k, c in enumerate(n_per_class)])
    x = rng.normal(size=(len(y), d)) + 3.0 * np.eye(len(n_per_class), d)[y]  # (n, d)
    return x, y


def test_class_colors():
    tab10 = np.asarray(matplotlib.colormaps["tab10"].colors)
    assert np.allclose(F.class_colors(4)[:, :3], tab10[:4])
    for k in (10, 15, 37):
        c = F.class_colors(k)
        assert c.shape == (k, 4)
        assert len({tuple(np.round(row, 6)) for row in c}) == k, "one distinct colour per class"


@pytest.mark.parametrize("n,perplexity,expected", [(12, 30.0, 11 / 3), (60, 30.0, 59 / 3), (2000, 30.0, 30.0)])
def test_tsne_perplexity_clip(n, perplexity, expected):
    p = F.tsne_perplexity(perplexity, n)
    assert p == pytest.approx(expected)
    assert p < n / 3


# ------------------------------------------------------------------------------------------- t-SNE
def test_tsne_layers_subset_colours_and_determinism(tmp_path, captured):
    x, y = blobs([30, 15, 10, 5])
    reps = [x, np.tanh(x @ np.random.default_rng(2).normal(size=(8, 5))), np.maximum(x, 0)]
    titles = ["input", "backbone", "block 1"]
    kw = dict(seed=7, max_points=40, max_iter=TSNE_ITERS, class_names=["a", "b", "c", "d"])
    F.tsne_layers(reps, y, titles, tmp_path / "t.png", tmp_path / "t.csv", **kw)
    assert_valid_png(tmp_path / "t.png")
    header, rows = read_csv(tmp_path / "t.csv")
    assert header == ["layer", "index", "x", "y", "label"]
    assert len(rows) == 40 * len(titles)

    per_layer = {t: [r for r in rows if r[0] == t] for t in titles}
    indices = [[int(r[1]) for r in per_layer[t]] for t in titles]
    assert all(ix == indices[0] for ix in indices), "the same subset in every panel"
    assert len(set(indices[0])) == 40
    assert set(y[indices[0]]) == {0, 1, 2, 3}, "stratified: every class present"
    for r in rows:
        assert int(r[4]) == y[int(r[1])], "label column matches the input label of that index"
        assert math.isfinite(float(r[2])) and math.isfinite(float(r[3]))

    # colours drawn: the same class has the same colour in every panel, distinct classes distinct colours
    fig = captured[-1]
    expected = F.class_colors(4)
    scatter_axes = [ax for ax in fig.axes if ax.collections]
    assert [ax.get_title() for ax in scatter_axes] == titles
    for ax, t in zip(scatter_axes, titles, strict=True):
        face = ax.collections[0].get_facecolors()  # (m, 4)
        assert face.shape[0] == 40
        assert np.allclose(face, expected[y[indices[0]]])
        offsets = np.asarray(ax.collections[0].get_offsets())
        csv_xy = np.array([[float(r[2]), float(r[3])] for r in per_layer[t]])
        assert np.allclose(offsets, csv_xy, atol=1e-6), "CSV holds the plotted coordinates"
    legends = fig.legends
    assert len(legends) == 1 and [t.get_text() for t in legends[0].get_texts()] == ["a", "b", "c", "d"]

    # deterministic for a seed; another seed changes the subset
    first = (tmp_path / "t.csv").read_text()
    F.tsne_layers(reps, y, titles, tmp_path / "t2.png", tmp_path / "t2.csv", **kw)
    assert (tmp_path / "t2.csv").read_text() == first
    F.tsne_layers(reps, y, titles, tmp_path / "t3.png", tmp_path / "t3.csv", **{**kw, "seed": 8})
    assert (tmp_path / "t3.csv").read_text() != first


def test_tsne_panels_side_by_side_equal_one_at_a_time(tmp_path):
    """The panels run on a thread each: every panel equals scikit-learn's t-SNE run alone on one thread."""
    from sklearn.manifold import TSNE
    from threadpoolctl import threadpool_limits

    x, y = blobs([50, 50, 50], d=32, seed=3)
    reps = [x, np.tanh(x[:, :16]), np.maximum(x, 0) ** 2]
    titles = ["input", "backbone", "block 1"]
    F.tsne_layers(reps, y, titles, tmp_path / "t.png", tmp_path / "t.csv", seed=1, max_iter=TSNE_ITERS)
    _, rows = read_csv(tmp_path / "t.csv")
    for a, title in zip(reps, titles, strict=True):
        with threadpool_limits(limits=1):
            alone = TSNE(n_components=2, perplexity=30.0, init="pca", learning_rate="auto", max_iter=TSNE_ITERS,
                         random_state=1).fit_transform(a)  # every point is in the subset (150 <= max_points)
        got = {int(r[1]): (float(r[2]), float(r[3])) for r in rows if r[0] == title}
        assert got == {i: (float(e0), float(e1)) for i, (e0, e1) in enumerate(alone)}, title


def test_tsne_layers_tiny_input_degenerate_panel_images_and_shapes(tmp_path):
    """12 points with the default perplexity 30 (clipped), a panel where every point is identical, images
    flattened; mismatched titles or rows refused."""
    x, y = blobs([4, 4, 4], d=16)
    reps = [x.reshape(12, 1, 4, 4), np.zeros((12, 6))]  # a dead layer: t-SNE's PCA init would crash on it
    F.tsne_layers(reps, y, ["input", "block 1"], tmp_path / "a.png", tmp_path / "a.csv", max_iter=TSNE_ITERS)
    assert_valid_png(tmp_path / "a.png")
    header, rows = read_csv(tmp_path / "a.csv")
    assert header == ["layer", "index", "x", "y", "label"] and len(rows) == 24
    assert sorted(int(r[1]) for r in rows if r[0] == "input") == list(range(12))
    for bad_reps, titles in (([x, x], ["only one title"]), ([x[:5]], ["short"]), ([x, x], ["same", "same"])):
        with pytest.raises(ValueError):
            F.tsne_layers(bad_reps, y, titles, tmp_path / "e.png", tmp_path / "e.csv")
    assert not (tmp_path / "e.png").exists()


# ------------------------------------------------------------------------------------------ curves
def test_line_curves_skips_none(tmp_path, captured):
    rows = [{"epoch": e, "loss": 1.0 / (e + 1), "knn_acc": (e / 10 if e % 3 == 0 else None)} for e in range(10)]
    rows.append({"epoch": 10, "loss": float("nan")})  # NaN and a missing key: skipped too
    F.line_curves(rows, "epoch", ["loss", "knn_acc", "view_noise"], tmp_path / "c.png", title="run",
                  csv=tmp_path / "c.csv")
    assert_valid_png(tmp_path / "c.png")
    header, table = read_csv(tmp_path / "c.csv")
    assert header == ["epoch", "loss", "knn_acc", "view_noise"]
    assert len(table) == len(rows)
    for r, line in zip(rows, table, strict=True):
        assert line[2] == ("" if r.get("knn_acc") is None else repr(r["knn_acc"]))
        assert line[3] == ""

    fig = captured[-1]
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
    assert set(panels) == {"loss", "knn_acc", "view_noise"}
    loss_x = panels["loss"].lines[0].get_xdata()
    assert list(loss_x) == list(range(10))
    knn = panels["knn_acc"].lines[0]
    assert list(knn.get_xdata()) == [0, 3, 6, 9]
    assert np.allclose(knn.get_ydata(), [0.0, 0.3, 0.6, 0.9])
    assert not panels["view_noise"].lines, "a series with no values draws no line"
    F.line_curves(rows, "epoch", ["loss"], tmp_path / "alone" / "c.png")  # without a CSV
    assert only_files(tmp_path / "alone") == ["c.png"]


# --------------------------------------------------------------------------------------- sharpness
@pytest.mark.parametrize("values", [[0.5, 0.0, -2.0, math.inf, 3.0, math.nan, -math.inf], [math.inf, math.inf],
                                    [0.0, 0.0, 0.0], [1e-6, 1e3, 5.0]])
def test_sharpness_per_layer_handles_inf_zero_negative(tmp_path, captured, values):
    F.sharpness_per_layer(values, tmp_path / "s.png", tmp_path / "s.csv")
    assert_valid_png(tmp_path / "s.png")
    header, rows = read_csv(tmp_path / "s.csv")
    assert header == ["layer", "sharpness"]
    assert [r[0] for r in rows] == [f"block {i + 1}" for i in range(len(values))]
    for v, (_, text) in zip(values, rows, strict=True):
        got = float(text)
        assert (math.isnan(v) and math.isnan(got)) or got == v
        if math.isinf(v):
            assert text == ("inf" if v > 0 else "-inf")
    ax = captured[-1].axes[0]
    assert ax.get_yscale() == "symlog"
    notes = [t.get_text() for t in ax.texts]
    assert notes.count("+inf") == sum(v == math.inf for v in values)
    assert notes.count("-inf") == sum(v == -math.inf for v in values)
    plotted = np.asarray(ax.lines[-1].get_ydata(), dtype=float)
    finite = [v for v in values if math.isfinite(v)]
    assert np.allclose(plotted[np.isfinite(plotted)], finite)


def test_sharpness_per_layer_labels(tmp_path):
    F.sharpness_per_layer([1.0, 2.0], tmp_path / "s.png", tmp_path / "s.csv", labels=["backbone", "block 1"])
    assert read_csv(tmp_path / "s.csv")[1] == [["backbone", "1.0"], ["block 1", "2.0"]]
    with pytest.raises(ValueError):
        F.sharpness_per_layer([1.0], tmp_path / "t.png", tmp_path / "t.csv", labels=["a", "b"])


# ----------------------------------------------------------------------------------- phase diagram
def sweep_rows() -> list[dict]:
    rows = []
    for depth in (5, 2):
        for bs in (256, 32, 64):
            for aug in (0.1, 0.9, 0.5):
                if (bs, aug) == (64, 0.5):
                    continue  # a missing cell in both panels
                acc = None if (depth, bs, aug) == (2, 256, 0.9) else bs / 256 * aug + depth / 10
                rows.append({"depth": depth, "batch_size": bs, "aug": aug, "acc": acc, "seed": 0})
    rows.append({"depth": 5, "batch_size": 32, "aug": 0.1, "acc": 0.0, "seed": 1})  # a repeat: averaged
    return rows


def reference_grid(rows, panel_value, xs, ys):
    g = np.full((len(ys), len(xs)), np.nan)
    for i, yv in enumerate(ys):
        for j, xv in enumerate(xs):
            vals = [float(r["acc"]) for r in rows
                    if r["depth"] == panel_value and r["batch_size"] == xv and r["aug"] == yv and r["acc"] is not None]
            if vals:
                g[i, j] = sum(vals) / len(vals)
    return g


def test_phase_grids_matches_reference():
    rows = sweep_rows()
    panels, xs, ys, grids = P.phase_grids(rows, x="batch_size", y="aug", value="acc", panel="depth")
    assert panels == [2, 5] and xs == [32, 64, 256] and ys == [0.1, 0.5, 0.9]
    assert grids.shape == (2, 3, 3)
    for p, pv in enumerate(panels):
        assert np.allclose(grids[p], reference_grid(rows, pv, xs, ys), equal_nan=True)
    assert np.isnan(grids[0, 2, 2]) and np.isnan(grids[1, 1, 1])
    assert grids[1, 0, 0] == pytest.approx((32 / 256 * 0.1 + 0.5 + 0.0) / 2)
    g = np.array([[[np.nan, 0.2], [0.9, 0.4]], [[0.1, np.nan], [0.3, 0.95]]])
    assert P.color_limits(g) == (0.1, 0.95)
    assert P.color_limits(np.full((1, 2, 2), np.nan)) == (0.0, 1.0)
    assert P.color_limits(np.array([[[0.5, np.nan]]])) == (0.0, 1.0)


def test_phase_diagram_two_panels_missing_cells_and_region(tmp_path, captured):
    rows = sweep_rows()

    def region(bs, aug, depth):
        return bs * aug >= 25 and depth == 5

    P.phase_diagram(rows, x="batch_size", y="aug", value="acc", panel="depth", png=tmp_path / "p.png",
                    csv=tmp_path / "p.csv", region=region)
    assert_valid_png(tmp_path / "p.png")
    header, table = read_csv(tmp_path / "p.csv")
    assert header == ["batch_size", "aug", "depth", "acc"]
    assert len(table) == len(rows)
    assert sum(line[3] == "" for line in table) == 1

    panels, xs, ys, grids = P.phase_grids(rows, x="batch_size", y="aug", value="acc", panel="depth")
    vmin, vmax = P.color_limits(grids)
    assert (vmin, vmax) == (np.nanmin(grids), np.nanmax(grids))
    fig = captured[-1]
    heat_axes = [ax for ax in fig.axes if ax.images]
    assert [ax.get_title() for ax in heat_axes] == ["depth = 2", "depth = 5"]
    for p, ax in enumerate(heat_axes):
        img = ax.images[0]
        assert img.get_clim() == (vmin, vmax), "one colour scale shared by all panels"
        data = img.get_array()
        assert np.array_equal(np.ma.getmaskarray(data), np.isnan(grids[p])), "missing cells are masked (blank)"
        n_numbers = sum(1 for t in ax.texts if t.get_text())
        assert n_numbers == int(np.isfinite(grids[p]).sum()), "a number in every filled cell"
        marks = [q for q in ax.patches if q.get_gid() == P.REGION_GID]
        expected = [(j - 0.5, i - 0.5) for i, yv in enumerate(ys) for j, xv in enumerate(xs)
                    if region(xv, yv, panels[p])]
        assert sorted(q.get_xy() for q in marks) == sorted(expected)
    # depth 5 only: bs 256 x all 3 augs, 64 x {0.5 (a missing cell, still marked), 0.9}, 32 x 0.9
    assert sum(len(ax.patches) for ax in heat_axes) == 6


def test_phase_diagram_marks_cells_with_a_dead_block(tmp_path, captured):
    rows = [{"bs": b, "aug": a, "depth": 3, "acc": 0.5} for b in (16, 128) for a in (0.0, 1.0)]
    dead = {(16, 1.0, 3)}
    P.phase_diagram(rows, x="bs", y="aug", value="acc", panel="depth", png=tmp_path / "p.png", csv=tmp_path / "p.csv",
                    marked=lambda x, y, p: (x, y, p) in dead, marked_label="a dead block")
    fig = captured[-1]
    ax = [a for a in fig.axes if a.images][0]
    marks = [q for q in ax.patches if q.get_gid() == P.MARKED_GID]
    assert len(marks) == 1 and marks[0].get_xy() == pytest.approx((0 - 0.42, 1 - 0.42))  # x = 16, y = 1.0
    assert [t.get_text() for leg in fig.legends for t in leg.get_texts()] == ["a dead block"]


# ---------------------------------------------------------------------------------------- atomicity
def _call(kind: str, png: Path, csv_path: Path) -> None:
    if kind == "tsne":
        x, y = blobs([6, 6])
        F.tsne_layers([x], y, ["input"], png, csv_path, max_iter=TSNE_ITERS)
    elif kind == "curves":
        F.line_curves([{"epoch": 0, "loss": 1.0}], "epoch", ["loss"], png, csv=csv_path)
    elif kind == "sharpness":
        F.sharpness_per_layer([1.0, math.inf], png, csv_path)
    else:
        P.phase_diagram(sweep_rows(), x="batch_size", y="aug", value="acc", panel="depth", png=png, csv=csv_path)


@pytest.mark.parametrize("kind", ["tsne", "curves", "sharpness", "phase"])
def test_failure_mid_write_leaves_nothing_success_replaces(tmp_path, monkeypatch, kind):
    def broken_savefig(self, fname, *args, **kwargs):
        Path(fname).write_bytes(PNG_SIGNATURE + b"half a picture")  # partial output, then the crash
        raise OSError("disk full")

    monkeypatch.setattr(Figure, "savefig", broken_savefig)
    fresh = tmp_path / "fresh"
    with pytest.raises(OSError, match="disk full"):
        _call(kind, fresh / "f.png", fresh / "f.csv")
    assert only_files(fresh) == [], "no PNG, no CSV, no temporary file"

    old = tmp_path / "old"
    old.mkdir()
    (old / "f.png").write_bytes(b"old png")
    (old / "f.csv").write_text("old csv\n")
    with pytest.raises(OSError):
        _call(kind, old / "f.png", old / "f.csv")
    assert only_files(old) == ["f.csv", "f.png"]
    assert (old / "f.png").read_bytes() == b"old png" and (old / "f.csv").read_text() == "old csv\n"
    monkeypatch.undo()  # success replaces the old files
    _call(kind, old / "f.png", old / "f.csv")
    assert only_files(old) == ["f.csv", "f.png"]
    assert_valid_png(old / "f.png")
    assert (old / "f.csv").read_text() != "old csv\n"


@pytest.mark.slow
@pytest.mark.parametrize("seeds", [1, 3])
def test_lr_curves_a_line_per_varying_key_mean_and_sd_over_seeds(tmp_path, captured, seeds):
    """Figure 5's layout: accuracy against lr (log axis), a line per loss; depth, the same everywhere, names no line."""
    lrs, losses = (1e-4, 1e-3, 1e-1), ("jsd", "kl_relu")
    rows = [{"train.lr": lr, "loss.name": loss, "model.depth": 1, "acc": 0.1 * i + 0.05 * j + 0.01 * s}
            for i, lr in enumerate(lrs) for j, loss in enumerate(losses) for s in range(seeds)]
    rows.append({"train.lr": 1.0, "loss.name": "jsd", "model.depth": 1, "acc": math.nan})  # a failed trial
    P.lr_curves(rows, x="train.lr", value="acc", lines=("loss.name", "model.depth"), png=tmp_path / "lr.png",
                csv=tmp_path / "lr.csv", title="Figure 5")
    assert_valid_png(tmp_path / "lr.png")
    header, table = read_csv(tmp_path / "lr.csv")
    assert header == ["line", "train.lr", "acc_mean", "acc_sd", "n"]
    accs = [0.01 * s for s in range(seeds)]
    sd = float(np.std(accs, ddof=1)) if seeds > 1 else 0.0
    want = [[f"loss {loss}", repr(lr), repr(0.1 * i + 0.05 * j + float(np.mean(accs))), repr(sd), str(seeds)]
            for j, loss in enumerate(losses) for i, lr in enumerate(lrs)]
    want.insert(3, ["loss jsd", "1.0", "", "", "0"])
    assert [line[:2] + [line[4]] for line in table] == [w[:2] + [w[4]] for w in want]
    for got, w in zip(table, want, strict=True):
        assert (got[2] == w[2] == "") or (float(got[2]) == pytest.approx(float(w[2])) and
                                          float(got[3]) == pytest.approx(float(w[3])))
    ax = captured[-1].axes[0]
    assert ax.get_xscale() == "log" and [t.get_text() for t in ax.get_legend().get_texts()] == ["loss jsd",
                                                                                                 "loss kl_relu"]
