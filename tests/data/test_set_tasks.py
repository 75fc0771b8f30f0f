"""The set-clustering tasks (pipeline.data.set_tasks): shapes, the number of clusters per set, unseen classes at test
time, fresh circles and subspaces, determinism."""

from __future__ import annotations

import pytest
import torch

from pipeline.config.sets import SetsConfig
from pipeline.data.set_tasks import DIGITS_TRAIN, TEST, TRAIN, make_task


@pytest.mark.parametrize("name", ["circles", "subspaces", "digits"])
def test_batches_have_the_declared_shape_and_cluster_counts(name):
    task = make_task(name, SetsConfig())
    for part in (TRAIN, TEST):
        b = task.draw(6, part, seed=3)
        assert b.x.shape == (6, task.size, task.dim) and b.x.dtype == torch.float32 and b.x.isfinite().all()
        assert b.labels.shape == (6, task.size) and b.labels.dtype == torch.int64
        lo, hi = task.k_range
        assert ((b.k() >= lo) & (b.k() <= hi)).all(), b.k()
        again = task.draw(6, part, seed=3)
        assert torch.equal(b.x, again.x) and torch.equal(b.labels, again.labels)  # deterministic
    assert not torch.equal(task.draw(6, TRAIN, 3).x, task.draw(6, TEST, 3).x)  # train and test never share a draw


def test_digits_test_sets_hold_only_unseen_classes():
    task = make_task("digits", SetsConfig())
    train, test = task.draw(50, TRAIN, 0), task.draw(50, TEST, 0)
    assert set(train.labels.unique().tolist()) <= set(DIGITS_TRAIN)
    assert set(test.labels.unique().tolist()) <= {6, 7, 8, 9}
    for x in test.x:  # no element twice in a set (Algorithm 1 draws without replacement)
        assert torch.unique(x, dim=0).shape[0] == x.shape[0]


def test_subspace_sets_use_fresh_subspaces_of_the_declared_rank():
    cfg = SetsConfig()
    b = make_task("subspaces", cfg).draw(4, TEST, 1)
    spans = []
    for x, y in zip(b.x, b.labels, strict=True):
        for c in y.unique():
            pts = x[y == c].double()  # noise 0.1: the points lie near a rank-2 subspace
            s = torch.linalg.svdvals(pts)
            assert s[cfg.subspaces_rank] < 0.35 * s[0]
        spans.append(torch.linalg.svd(x[y == y[0]].double()).Vh[:2])
    overlap = (spans[0] @ spans[1].T).abs().max()  # two sets' subspaces: unrelated
    assert overlap < 0.99


def test_unknown_task_is_refused():  # the registry against the config: tests/config/test_registries.py
    with pytest.raises(ValueError, match="unknown set task 'mnist'"):
        make_task("mnist", SetsConfig())
    with pytest.raises(ValueError, match="part must be"):
        make_task("circles", SetsConfig()).draw(2, 3, 0)


def test_omniglot_sets_train_on_background_characters_and_test_on_evaluation_ones(tmp_path):
    """On tiny files in the real layout (tests/data/test_omniglot.py): 5 background and 4 evaluation characters of
    3 drawings each; sets of 6 drawings from 2-3 characters, flattened 8×8 images in [0, 1]."""
    from tests.data.test_omniglot import write_omniglot

    write_omniglot(tmp_path)
    cfg = SetsConfig(omniglot_root=str(tmp_path), omniglot_size=6, omniglot_k=[2, 3], omniglot_image_size=8)
    task = make_task("omniglot", cfg)
    assert task.dim == 64 and task.size == 6
    train, test = task.draw(4, TRAIN, 0), task.draw(4, TEST, 0)
    assert train.x.shape == test.x.shape == (4, 6, 64) and 0 <= float(train.x.min()) <= float(train.x.max()) <= 1
    assert int(train.labels.max()) < 5 <= int(test.labels.min())  # the evaluation characters are numbered after
    assert ((test.k() >= 2) & (test.k() <= 3)).all()
