"""Tests for pipeline.data.synthetic's circles problem (ABC, section 6.1): shapes, every point on its circle, the
radii and centres within their ranges, every circle used, determinism by seed."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from pipeline.data.synthetic import four_circles


@pytest.mark.parametrize(("n_sets", "points", "circles"), [(1, 4, 4), (7, 20, 4), (50, 33, 3), (3, 10, 1)])
def test_shapes_and_dtypes(n_sets: int, points: int, circles: int) -> None:
    d = four_circles(n_sets, points=points, circles=circles, seed=n_sets)
    assert d.points.shape == (n_sets, points, 2) and d.points.dtype == torch.float32
    assert d.labels.shape == (n_sets, points) and d.labels.dtype == torch.int64
    assert d.centres.shape == (n_sets, circles, 2) and d.centres.dtype == torch.float32
    assert d.radii.shape == (n_sets, circles) and d.radii.dtype == torch.float32
    for s in range(n_sets):  # every circle has a point
        assert sorted(set(d.labels[s].tolist())) == list(range(circles))


@pytest.mark.parametrize("seed", [0, 3])
def test_every_point_lies_on_its_circle(seed: int) -> None:
    d = four_circles(40, seed=seed)
    for s, p in itertools.product(range(40), range(20)):
        c = int(d.labels[s, p])
        x, y = (float(v) for v in d.points[s, p])
        cx, cy = (float(v) for v in d.centres[s, c])
        assert abs(math.hypot(x - cx, y - cy) - float(d.radii[s, c])) <= 1e-6, (s, p)


def test_radii_and_centres_within_their_ranges() -> None:
    d = four_circles(2000, seed=1)
    assert float(d.radii.min()) >= 0.2 - 1e-7 and float(d.radii.max()) <= 0.4 + 1e-7  # float32(0.4) > 0.4
    assert float(d.centres.norm(dim=-1).max()) <= 0.5 + 1e-7
    # clip(N(0.3, 0.1), 0.2, 0.4): P(r = 0.2) = P(r = 0.4) = Phi(-1) = 0.159, the rest spread between
    at_low = float((d.radii == 0.2).float().mean())
    at_high = float((d.radii == 0.4).float().mean())
    assert abs(at_low - 0.159) < 0.02 and abs(at_high - 0.159) < 0.02
    # uniform in the disk: |centre| <= 0.25 with probability (0.25 / 0.5)^2 = 1/4 (8000 centres: sd 0.005)
    assert abs(float((d.centres.norm(dim=-1) <= 0.25).float().mean()) - 0.25) < 0.025
    # each point picks one of the 4 circles uniformly beyond the first: E[count] = 1 + 16 / 4 = 5 per circle
    counts = torch.stack([(d.labels == c).sum(1) for c in range(4)], dim=1).float()  # (S, 4)
    assert abs(float(counts.mean()) - 5.0) < 1e-6 and abs(float(counts[:, 0].mean()) - 5.0) < 0.2


def largest_gaps(d) -> list[tuple[float, int]]:
    """(the largest angular gap between neighbouring points of a circle, its m points) for every circle of every set,
    by a loop over sets and circles."""
    out = []
    for s, c in itertools.product(range(d.points.shape[0]), range(d.centres.shape[1])):
        on = d.points[s][d.labels[s] == c].double() - d.centres[s, c].double()  # (m, 2)
        theta = sorted(math.atan2(float(y), float(x)) % (2 * math.pi) for x, y in on)
        gaps = [b - a for a, b in zip(theta, theta[1:], strict=False)] + [theta[0] + 2 * math.pi - theta[-1]]
        out.append((max(gaps), len(theta)))
    return out


@pytest.mark.parametrize("points", [20, 50])
def test_stratified_neighbours_are_never_more_than_two_arcs_apart(points: int) -> None:
    """The code's sampling (the default): a circle's m points, one in each of m equal arcs, so two neighbours are at
    most 2 · 2π/m apart. i.i.d. angles (section 6.1) break it on most circles of 20-point sets."""
    stratified = largest_gaps(four_circles(400, points=points, seed=3))
    assert all(gap <= 2 * (2 * math.pi / m) + 1e-5 for gap, m in stratified)
    iid = largest_gaps(four_circles(400, points=points, seed=3, angles="iid"))
    broken = sum(gap > 2 * (2 * math.pi / m) + 1e-5 for gap, m in iid)
    assert broken > len(iid) / 4, (broken, len(iid))


def test_deterministic_by_seed_and_iid_angles_share_the_circles_and_memberships() -> None:
    a, b, c, iid = (four_circles(30, seed=5), four_circles(30, seed=5), four_circles(30, seed=6),
                    four_circles(30, seed=5, angles="iid"))
    for field in ("points", "labels", "centres", "radii"):
        assert torch.equal(getattr(a, field), getattr(b, field))
        assert torch.equal(getattr(a, field), getattr(iid, field)) == (field != "points")
    assert not torch.equal(a.points, c.points)


def test_stratified_angles_are_uniform_on_the_circle() -> None:
    """Each point's angle (from its circle's centre) is still uniform on [0, 2π): the arcs are equal, each uniform."""
    d = four_circles(2000, seed=7)
    rel = d.points.double() - d.centres.double().gather(1, d.labels[..., None].expand(-1, -1, 2))
    theta = torch.atan2(rel[..., 1], rel[..., 0]) % (2 * math.pi)  # (S, P)
    hist = torch.histc(theta.flatten(), bins=8, min=0, max=2 * math.pi) / theta.numel()
    assert float((hist - 1 / 8).abs().max()) < 0.01  # 40,000 angles: sd of a bin's share 0.0017


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="angles"):
        four_circles(2, angles="grid")
    for kwargs in ({"n_sets": 0}, {"n_sets": 2, "circles": 0}, {"n_sets": 2, "points": 3}, {"n_sets": 1.5}):
        with pytest.raises(ValueError, match="must be an integer"):
            four_circles(**kwargs)
