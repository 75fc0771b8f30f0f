"""The ``probe`` section: the evaluate stage's probes (pipeline.evaluation.probes), label fractions, figures.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from pipeline.config.base import MAX_SEED, Section

PROBES = ("ffn", "svm", "knn50", "knn200", "logreg")
ProbeName = Literal[PROBES]  # type: ignore[valid-type]


class ProbeConfig(Section):
    """The evaluate stage: probes on frozen embeddings, cluster quality, figures."""

    probes: list[ProbeName] = Field(default_factory=lambda: list(PROBES), min_length=1)
    label_fractions: list[Annotated[float, Field(gt=0.0, le=1.0)]] = Field(
        default_factory=lambda: [0.1, 1.0], min_length=1)
    max_train: int | None = Field(10_000, ge=10)
    seed: int = Field(0, ge=0, le=MAX_SEED)
    tsne_points: int = Field(1000, ge=0)  # 0 = no t-SNE figure
    affinity_points: int = Field(500, ge=10)  # test samples in the affinity batch (sharpness, spectral)
    device: Literal["auto", "cpu", "cuda"] = "auto"


__all__ = ['PROBES', 'ProbeConfig']
