"""The set-clustering tasks of ABC's protocol (Coward et al., section 6): batches of sets to train a set model on, and
sets of *unseen* classes to test it on, each set with its own number of clusters.

=============  ==========================================================  ============================================
task           a training set                                              a test set
=============  ==========================================================  ============================================
``circles``    ``circles_points`` points on 4 random intersecting circles  the same, fresh circles (section 6.1)
               (:func:`pipeline.data.synthetic.four_circles`), (x, y)
``subspaces``  ``subspaces_size`` unit vectors from k ~ U{k_lo..k_hi}      the same, fresh subspaces: no subspace is
               fresh random rank-r subspaces of R^dim, noise ε (eq. 8)     ever seen twice
``digits``     ``digits_size`` of scikit-learn's 8×8 digits 0-5 (pixels     digits 6-9 only, k ≤ 4
               / 16), k ~ U{k_lo..k_hi} classes by Algorithm 1
``omniglot``   ``omniglot_size`` characters of the background alphabets     the evaluation alphabets (unseen
               (flattened, resized images), Algorithm 1                     characters), when the files are there
=============  ==========================================================  ============================================

Every set of a task has the same number of elements n (so a batch is one (S, n, d) tensor); the labels of a set are
its clusters (any integers: only equality counts). Draws are deterministic given the seed; a task's training and
test draws of one seed never share a seed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pipeline.config.base import ParamsError
from pipeline.data.sets import k_bounds, sample_sets
from pipeline.data.synthetic import four_circles, union_of_subspaces

__all__ = ["SetBatch", "SetTask", "check_inputs", "make_task", "TASKS"]

TRAIN, TEST = 1, 2  # the stream offsets of a seed: seed * 16 + TRAIN, seed * 16 + TEST


@dataclass(frozen=True)
class SetBatch:
    """S sets of n elements: x (S, n, d) float32, labels (S, n) int64 (a set's clusters)."""

    x: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return self.x.shape[0]

    def k(self) -> np.ndarray:
        """(S,) the number of clusters of each set."""
        return np.array([np.unique(y).size for y in self.labels.numpy()])


@dataclass(frozen=True)
class SetTask:
    """A set-clustering task: ``draw(n_sets, part, seed)`` gives a :class:`SetBatch` of ``part`` TRAIN or TEST sets.

    name, dim (features per element), size (n, elements per set), k_range (the clusters per set, inclusive).
    """

    name: str
    dim: int
    size: int
    k_range: tuple[int, int]
    sample: Callable[[int, int, int], SetBatch]

    def draw(self, n_sets: int, part: int, seed: int) -> SetBatch:
        if part not in (TRAIN, TEST):
            raise ValueError(f"part must be TRAIN ({TRAIN}) or TEST ({TEST}), got {part}")
        return self.sample(n_sets, part, seed * 16 + part)


def _circles(cfg) -> SetTask:
    def sample(n_sets: int, part: int, seed: int) -> SetBatch:
        c = four_circles(n_sets, points=cfg.circles_points, circles=4, seed=seed, angles=cfg.circles_angles)
        return SetBatch(c.points, c.labels)

    return SetTask("circles", 2, cfg.circles_points, (4, 4), sample)


def _subspaces(cfg) -> SetTask:
    lo, hi = cfg.subspaces_k

    def sample(n_sets: int, part: int, seed: int) -> SetBatch:
        rng = np.random.default_rng(seed)
        ks = rng.integers(lo, hi + 1, size=n_sets)  # (S,)
        seeds = rng.integers(0, 2**62, size=n_sets)  # (S,) fresh subspaces per set
        sets = [union_of_subspaces(cfg.subspaces_size, int(k), cfg.subspaces_rank, cfg.subspaces_dim,
                                   cfg.subspaces_noise, seed=int(s)) for k, s in zip(ks, seeds, strict=True)]
        return SetBatch(torch.stack([s.x for s in sets]), torch.stack([s.labels for s in sets]))

    return SetTask("subspaces", cfg.subspaces_dim, cfg.subspaces_size, (lo, hi), sample)


def _labelled(name: str, x_train: torch.Tensor, y_train: torch.Tensor, x_test: torch.Tensor, y_test: torch.Tensor,
              size: int, k_range: tuple[int, int]) -> SetTask:
    """Sets drawn by Algorithm 1 (:func:`pipeline.data.sets.sample_sets`) from the train or the test classes."""
    parts = {TRAIN: (x_train, y_train), TEST: (x_test, y_test)}

    def sample(n_sets: int, part: int, seed: int) -> SetBatch:
        x, y = parts[part]
        index = sample_sets(y, n_sets, size, k_range=k_range, seed=seed)  # (S, n)
        return SetBatch(x[index], y[index])

    return SetTask(name, x_train.shape[1], size, k_range, sample)


DIGITS_TRAIN = (0, 1, 2, 3, 4, 5)  # the classes the set models see; 6-9 are for testing only


def _digits(cfg) -> SetTask:
    from sklearn.datasets import load_digits  # shipped with scikit-learn: no download

    x, y = load_digits(return_X_y=True)
    x = torch.from_numpy(x / 16.0).float()  # (1797, 64) in [0, 1]
    y = torch.from_numpy(y).long()
    seen = torch.isin(y, torch.tensor(DIGITS_TRAIN))
    return _labelled("digits", x[seen], y[seen], x[~seen], y[~seen], cfg.digits_size, tuple(cfg.digits_k))


def _digits_counts(cfg) -> tuple[str, tuple[np.ndarray, np.ndarray]]:
    from sklearn.datasets import load_digits

    counts = np.bincount(load_digits().target, minlength=10)  # (10,) drawings per digit
    test = [c for c in range(10) if c not in DIGITS_TRAIN]
    return "scikit-learn's digits", (counts[list(DIGITS_TRAIN)], counts[test])


def _omniglot_root(cfg) -> Path:
    return Path(cfg.omniglot_root).expanduser()


def _omniglot_counts(cfg) -> tuple[str, tuple[np.ndarray, np.ndarray]]:
    from pipeline.data.omniglot import OMNIGLOT_FOLDER, OMNIGLOT_PARTS, omniglot_counts

    root = _omniglot_root(cfg)
    fix = (f"the set study reads the training classes from {root / OMNIGLOT_FOLDER / OMNIGLOT_PARTS[True]}/<Alphabet>/"
           f"<characterNN>/*.png and the test classes from {OMNIGLOT_PARTS[False]}/<Alphabet>/<characterNN>/*.png "
           f"beside it: place the extracted folders there, point sets.omniglot_root at the folder holding "
           f"{OMNIGLOT_FOLDER}, or drop omniglot from sets.datasets")
    counts = omniglot_counts(root, "sets.omniglot_root", fix)
    return f"Omniglot under {root}", (counts[True], counts[False])


_CLASS_COUNTS = {"digits": _digits_counts, "omniglot": _omniglot_counts}  # the tasks that read labelled data


def check_inputs(cfg) -> None:
    """Check every input the tasks of ``cfg.datasets`` read, before any work: the files are there (Omniglot's
    folders under ``sets.omniglot_root``, listed, not decoded) and hold enough classes and elements per class for
    the training and the test sets of ``sets.<task>_size`` elements and ``sets.<task>_k`` clusters.

    Raises :class:`~pipeline.data.types.DatasetError` for missing or malformed files (naming the key, the folder and
    the layout expected) and :class:`~pipeline.config.base.ParamsError` for a set size or k range the data cannot
    fill (naming the keys and what the data holds).
    """
    for name in cfg.datasets:
        if name not in TASKS:
            raise ParamsError(f"sets.datasets: unknown set task {name!r}; allowed: {', '.join(TASKS)}")
        if name not in _CLASS_COUNTS:
            continue
        source, parts = _CLASS_COUNTS[name](cfg)
        size, k_range = getattr(cfg, f"{name}_size"), tuple(getattr(cfg, f"{name}_k"))
        for part, counts in zip(("training", "test"), parts, strict=True):
            try:
                k_bounds(counts, size, k_range)
            except ValueError as e:
                fix = "" if "smaller sets" in str(e) else f"; lower sets.{name}_size or change sets.{name}_k"
                raise ParamsError(
                    f"sets.{name}_size ({size}) and sets.{name}_k ({list(k_range)}) do not fit {source}: no {part} "
                    f"set can be drawn from its {len(counts)} {part} classes of {counts.min()} to {counts.max()} "
                    f"elements: {e}{fix}") from None


def _omniglot(cfg) -> SetTask:
    from pipeline.data.sources import omniglot_sets_split

    x_train, y_train, x_test, y_test = omniglot_sets_split(_omniglot_root(cfg), cfg.omniglot_image_size)
    flat = [t.reshape(t.shape[0], -1).float() / (255.0 if t.dtype == torch.uint8 else 1.0) for t in (x_train, x_test)]
    return _labelled("omniglot", flat[0], y_train, flat[1], y_test, cfg.omniglot_size, tuple(cfg.omniglot_k))


TASKS: dict[str, Callable[..., SetTask]] = {
    "circles": _circles, "subspaces": _subspaces, "digits": _digits, "omniglot": _omniglot}


def make_task(name: str, cfg) -> SetTask:
    """The task ``name`` with the sizes of ``cfg`` (a :class:`pipeline.config.sets.SetsConfig`)."""
    if name not in TASKS:
        raise ValueError(f"unknown set task {name!r}; allowed: {', '.join(TASKS)}")
    return TASKS[name](cfg)
