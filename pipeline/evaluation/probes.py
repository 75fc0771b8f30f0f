"""Probes on frozen embeddings: the evaluation protocol of the paper's section 5.2, with scikit-learn.

The backbone is frozen; its embeddings ``z`` (n, d) of the train split fit a small classifier that is scored on the
embeddings of the test split::

    acc = (1 / n_test) * sum_i [probe(z_i^test) == y_i^test]

Probes (section 5.2: "a 3-layer feed-forward network, having layer widths of 256, 128, and 64", an SVM and K-NN
with k = 50 and k = 200; logistic regression is the usual linear probe, added for reference):

- ``ffn``:    StandardScaler -> MLPClassifier(hidden_layer_sizes=(256, 128, 64))
- ``svm``:    StandardScaler -> SVC(kernel="rbf", C=1) (n_train <= 20000) or LinearSVC (larger)
- ``knn50``:  KNeighborsClassifier(k=50, cosine distance, brute force) on the raw embeddings
- ``knn200``: KNeighborsClassifier(k=200, cosine distance, brute force) on the raw embeddings
  (a kNN with k >= the labelled samples is not run: its accuracy is None, "n/a", not the majority class)
- ``logreg``: StandardScaler -> LogisticRegression

Label fractions (semi-supervised evaluation): the probe sees a stratified subset of the train labels, see
``split.stratified_subset(train_y, fraction=f, min_per_class=MIN_LABELS_PER_CLASS, seed=seed)`` (every
class's rounded share, but at least 2 of it); it is always scored on the full test split.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pipeline.data.split import stratified_subset

if TYPE_CHECKING:
    from sklearn.pipeline import Pipeline

__all__ = [
    "FFN_EARLY_STOP_PER_CLASS",
    "MIN_LABELS_PER_CLASS",
    "PROBES",
    "SVC_MAX_TRAIN",
    "ProbeResult",
    "make_probe",
    "run_probes",
]

PROBES: tuple[str, ...] = ("ffn", "svm", "knn50", "knn200", "logreg")
SVC_MAX_TRAIN = 20_000  # above this many training samples the SVM probe is a LinearSVC
MIN_LABELS_PER_CLASS = 2  # a label fraction keeps at least this many of every class (all of a smaller one)
FFN_EARLY_STOP_PER_CLASS = 50  # the MLP early-stops on a 10% validation split once it has this many samples/class
_KNN_K = {"knn50": 50, "knn200": 200}


@dataclass(frozen=True)
class ProbeResult:
    """One fitted probe: its name, the label fraction, test accuracy, fit+predict seconds, train-subset size.

    ``accuracy`` is None ("n/a") when the probe cannot run: a kNN whose k is not below the labelled samples
    would let every sample vote and report the majority class."""

    probe: str
    fraction: float
    accuracy: float | None
    seconds: float
    n_train: int


def _to_numpy(x, name: str) -> np.ndarray:
    """A numpy view of a numpy array / torch tensor (detached, on CPU) / array-like."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch.Tensor, without importing torch
        x = x.detach().cpu().numpy()
    try:
        return np.asarray(x)
    except Exception as exc:  # pragma: no cover - exotic inputs
        raise TypeError(f"{name}: cannot convert {type(x).__name__} to a numpy array") from exc


def _as_z(x, name: str) -> np.ndarray:
    """(n, d) floating embeddings; float32 / float64 are kept, anything else becomes float64."""
    z = _to_numpy(x, name)
    if z.ndim != 2:
        raise ValueError(f"{name} must be 2-d (n, d), got shape {z.shape}")
    if z.dtype not in (np.float32, np.float64):
        z = z.astype(np.float64)
    if not np.isfinite(z).all():
        raise ValueError(f"{name} contains NaN or inf")
    return z


def _as_y(x, name: str, n: int | None = None) -> np.ndarray:
    """(n,) int64 labels; integral-valued floats are accepted."""
    y = _to_numpy(x, name)
    if y.ndim != 1:
        raise ValueError(f"{name} must be 1-d (n,), got shape {y.shape}")
    if n is not None and y.shape[0] != n:
        raise ValueError(f"{name} has {y.shape[0]} labels but the embeddings have {n} rows")
    if y.dtype.kind not in "iu" and not (y.dtype.kind == "f" and np.all(y == np.round(y))):
        raise ValueError(f"{name} must hold integer labels, got dtype {y.dtype}")
    return y.astype(np.int64, copy=False)


def _check_fraction(fraction: float) -> float:
    f = float(fraction)
    if not (0.0 < f <= 1.0):  # also rejects NaN
        raise ValueError(f"label fraction must be in (0, 1], got {fraction!r}")
    return f


def make_probe(name: str, *, n_train: int, seed: int = 0, n_classes: int | None = None) -> Pipeline:
    """An unfitted scikit-learn Pipeline for probe ``name`` (one of :data:`PROBES`), sized for ``n_train`` samples.

    - ``ffn``: StandardScaler -> MLPClassifier((256, 128, 64), max_iter=200, random_state=seed). Early stopping
      (10% stratified validation split, patience 10) is on when ``n_train >= 50 * n_classes`` (so the split holds
      >= 5 samples per class) and off below. ``n_classes`` defaults to 10 (CIFAR-10).
    - ``svm``: StandardScaler -> SVC(kernel="rbf", C=1.0) when ``n_train <= 20000``, else
      StandardScaler -> LinearSVC(C=1.0). Kernel SVC costs O(n^2) memory/time (and more) in the number of
      training samples: on CIFAR-10's 50k embeddings it would take hours, the linear SVM takes minutes.
    - ``knn50`` / ``knn200``: KNeighborsClassifier(n_neighbors=min(k, n_train), metric="cosine",
      algorithm="brute"), uniform majority vote, on the raw (unscaled) embeddings, since cosine distance is
      what the contrastive losses shape.
    - ``logreg``: StandardScaler -> LogisticRegression(max_iter=2000) (lbfgs, multinomial).

    Args:
        name: probe name.
        n_train: number of training samples the probe will be fit on (>= 1).
        seed: random_state of the stochastic probes (ffn; LinearSVC's coordinate order).
        n_classes: number of classes, used only by the ffn early-stopping rule.

    Returns:
        sklearn.pipeline.Pipeline whose last step is named ``"clf"``.
    """
    # scikit-learn loads in ~2 s; imported here, so that what only validates params (every stage, every Ray
    # worker through pipeline.config.params) does not pay for it
    from sklearn.linear_model import LogisticRegression
    from sklearn.neighbors import KNeighborsClassifier
    from sklearn.neural_network import MLPClassifier
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import StandardScaler
    from sklearn.svm import SVC, LinearSVC

    if name not in PROBES:
        raise ValueError(f"unknown probe {name!r}; expected one of {PROBES}")
    if n_train < 1:
        raise ValueError(f"n_train must be >= 1, got {n_train}")
    if name == "ffn":
        per_class = FFN_EARLY_STOP_PER_CLASS * (10 if n_classes is None else max(1, n_classes))
        clf = MLPClassifier(
            hidden_layer_sizes=(256, 128, 64),
            max_iter=200,
            early_stopping=n_train >= per_class,
            random_state=seed,
        )
        return Pipeline([("scale", StandardScaler()), ("clf", clf)])
    if name == "svm":
        if n_train <= SVC_MAX_TRAIN:
            svm = SVC(kernel="rbf", C=1.0)
        else:
            svm = LinearSVC(C=1.0, random_state=seed)
        return Pipeline([("scale", StandardScaler()), ("clf", svm)])
    if name in _KNN_K:
        knn = KNeighborsClassifier(n_neighbors=min(_KNN_K[name], n_train), metric="cosine", algorithm="brute")
        return Pipeline([("clf", knn)])
    return Pipeline([("scale", StandardScaler()), ("clf", LogisticRegression(max_iter=2000))])


def _format_fraction(fraction: float) -> str:
    return f"{fraction * 100:g}%"


def run_probes(
    train_z,
    train_y,
    test_z,
    test_y,
    *,
    probes: Sequence[str] = PROBES,
    fractions: Sequence[float] = (1.0,),
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> list[ProbeResult]:
    """Fit every probe on a stratified label fraction of the train split, score it on the whole test split.

    For each ``fraction`` (outer loop) and each probe (inner loop)::

        S     = stratified_subset(train_y, fraction=fraction, min_per_class=MIN_LABELS_PER_CLASS, seed=seed)
        probe = make_probe(name, n_train=|S|, seed=seed).fit(train_z[S], train_y[S])
        acc   = mean_i [probe.predict(test_z)_i == test_y_i]

    ``seconds`` is the wall time of fit + predict. sklearn ConvergenceWarnings (MLP / LinearSVC / logistic
    regression hitting max_iter) are silenced; other warnings pass through.

    Args:
        train_z: (n_train, d) float embeddings, numpy array or torch tensor.
        train_y: (n_train,) integer labels.
        test_z: (n_test, d) float embeddings.
        test_y: (n_test,) integer labels.
        probes: probe names, a subset of :data:`PROBES`.
        fractions: label fractions in (0, 1].
        seed: seed of the label subsets and of the stochastic probes.
        progress: called with one line per fitted probe, e.g. ``"ffn @ 10%: 0.9633"``.

    Returns:
        ``len(fractions) * len(probes)`` :class:`ProbeResult`, fraction-major.
    """
    tr_z = _as_z(train_z, "train_z")  # (n_train, d)
    te_z = _as_z(test_z, "test_z")  # (n_test, d)
    tr_y = _as_y(train_y, "train_y", tr_z.shape[0])  # (n_train,)
    te_y = _as_y(test_y, "test_y", te_z.shape[0])  # (n_test,)
    if tr_z.shape[1] != te_z.shape[1]:
        raise ValueError(f"embedding dims differ: train {tr_z.shape[1]} vs test {te_z.shape[1]}")
    if te_z.shape[0] == 0:
        raise ValueError("run_probes: empty test set")
    if np.unique(tr_y).shape[0] < 2:
        raise ValueError("run_probes: the train split needs at least 2 classes")
    probes = tuple(probes)
    for name in probes:
        if name not in PROBES:
            raise ValueError(f"unknown probe {name!r}; expected one of {PROBES}")
    fractions = tuple(_check_fraction(f) for f in fractions)
    from sklearn.exceptions import ConvergenceWarning

    results: list[ProbeResult] = []
    for fraction in fractions:
        idx = stratified_subset(tr_y, fraction=fraction, min_per_class=MIN_LABELS_PER_CLASS, seed=seed)  # (m,)
        sub_z, sub_y = tr_z[idx], tr_y[idx]  # (m, d), (m,)
        n_classes = int(np.unique(sub_y).shape[0])
        for name in probes:
            k = _KNN_K.get(name)
            if k is not None and k >= idx.shape[0]:  # every sample would vote: the majority class, not a kNN
                results.append(ProbeResult(name, fraction, None, 0.0, int(idx.shape[0])))
                if progress is not None:
                    progress(f"{name} @ {_format_fraction(fraction)}: n/a (k = {k} needs more than {k} labelled "
                             f"samples; this fraction has {idx.shape[0]})")
                continue
            probe = make_probe(name, n_train=int(idx.shape[0]), seed=seed, n_classes=n_classes)
            start = time.perf_counter()
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", category=ConvergenceWarning)
                probe.fit(sub_z, sub_y)
                pred = probe.predict(te_z)  # (n_test,)
            seconds = time.perf_counter() - start
            accuracy = float(np.mean(pred == te_y))
            results.append(ProbeResult(name, fraction, accuracy, seconds, int(idx.shape[0])))
            if progress is not None:
                progress(f"{name} @ {_format_fraction(fraction)}: {accuracy:.4f}")
    return results
