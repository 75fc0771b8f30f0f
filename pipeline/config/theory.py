"""The ``theory`` section: Theorem 2's grid and the heads trained on union-of-subspaces data.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from pipeline.config.base import Section


class TheoryConfig(Section):
    """The theory stage (paper section 3): (a) Theorem 2's γ over a (ρ, ε) grid per batch size n, (b) a head
    trained on union-of-subspaces data over batch size n × noise ε × depth × seed, (c) the two side by side."""

    # (a) the formula: `formula_points` evenly spaced ρ and ε in [0, 1], plus `formula_log_points` geometric ε
    # in [formula_eps_min, 1 / (formula_points - 1)) where the bound is valid at all
    formula_points: int = Field(41, ge=2, le=2001)
    formula_log_points: int = Field(24, ge=0, le=2001)
    formula_eps_min: float = Field(1e-8, gt=0.0, lt=1.0)
    formula_n: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [8, 32, 128, 512], min_length=1)
    # (b) the measurement: supervised JSD training of a TransFusion head on K subspaces of rank r in R^dim
    n: list[Annotated[int, Field(ge=2)]] = Field(default_factory=lambda: [8, 32, 128], min_length=1)
    eps: list[Annotated[float, Field(ge=0.0, le=1.0)]] = Field(
        default_factory=lambda: [0.0, 0.05, 0.1, 0.2, 0.3, 0.45, 0.6], min_length=1)
    depth: list[Annotated[int, Field(ge=1, le=64)]] = Field(default_factory=lambda: [1, 3], min_length=1)
    steps: int = Field(100, ge=1, le=1_000_000)
    lr: float = Field(0.01, gt=0.0, le=10.0)
    n_clusters: int = Field(4, ge=2, le=10_000)
    rank: int = Field(2, ge=1)
    dim: int = Field(32, ge=2, le=100_000)
    seeds: list[Annotated[int, Field(ge=0)]] = Field(default_factory=lambda: [0, 1, 2], min_length=1)
    learned_nmi: float = Field(0.9, gt=0.0, le=1.0)

    @model_validator(mode="after")
    def _consistent(self) -> TheoryConfig:
        problems = []
        if self.formula_eps_min >= 1.0 / (self.formula_points - 1):
            problems.append(f"theory.formula_eps_min ({self.formula_eps_min:g}) must be < 1 / (formula_points - 1) "
                            f"= {1.0 / (self.formula_points - 1):g}")
        if (self.n_clusters - 1) * self.rank >= self.dim:
            problems.append(f"theory.dim: (n_clusters - 1) * rank = {(self.n_clusters - 1) * self.rank} must be < "
                            f"dim = {self.dim} (the paper's independence assumption)")
        if min(self.n) < 2 * self.n_clusters:
            problems.append(f"theory.n: every batch size must be >= 2 * n_clusters = {2 * self.n_clusters} (a "
                            f"same-cluster pair in every cluster of the test batch), got {min(self.n)}")
        for key in ("formula_n", "n", "eps", "depth", "seeds"):
            values = getattr(self, key)
            if len(set(values)) != len(values):
                problems.append(f"theory.{key}: duplicate values in {values}")
        if problems:
            raise ValueError("; ".join(problems))
        return self


__all__ = ['TheoryConfig']
