"""The ``sets`` section: the set-clustering study (ABC's protocol, Coward et al. section 6): set models trained on
sets drawn by Algorithm 1, tested on sets of classes never seen in training, with the number of clusters known or
estimated by the eigengap.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from pipeline.config.base import MAX_SEED, Section

# the tasks of pipeline.data.set_tasks and the methods of pipeline.evaluation.set_study (tests/config checks both)
SET_DATASETS = ("circles", "subspaces", "digits", "omniglot")
SET_METHODS = ("abc_multiplicative", "abc_additive", "transfusion", "pairwise", "rbf")
TRAINED_METHODS = ("abc_multiplicative", "abc_additive", "transfusion", "pairwise")

SetDataset = Literal[SET_DATASETS]  # type: ignore[valid-type]
SetMethod = Literal[SET_METHODS]  # type: ignore[valid-type]
KRange = Annotated[list[Annotated[int, Field(ge=1)]], Field(min_length=2, max_length=2)]  # [k_lo, k_hi] inclusive


class SetsConfig(Section):
    """Every method is trained per data set and seed on ``steps`` steps of ``batch_sets`` sets each (Adam, ``lr``),
    then clusters ``test_sets`` fresh sets of unseen classes (circles: fresh circles; subspaces: fresh subspaces;
    digits: classes 6-9 after training on 0-5; omniglot: the evaluation alphabets after the background ones)."""

    datasets: list[SetDataset] = Field(default_factory=lambda: ["circles", "subspaces", "digits"], min_length=1)
    methods: list[SetMethod] = Field(default_factory=lambda: list(SET_METHODS), min_length=1)
    seeds: list[Annotated[int, Field(ge=0, le=MAX_SEED)]] = Field(default_factory=lambda: [0, 1, 2, 3, 4], min_length=1)
    # training: the same for every trained method
    steps: int = Field(200, ge=1, le=10_000_000)
    batch_sets: int = Field(8, ge=1, le=4096)  # sets per step
    lr: float = Field(1e-3, gt=0.0, le=10.0)
    # the set models: `blocks` SAB (ABC) or TransFusion blocks (transfusion) of `width`, after the same
    # Linear-tanh-Linear pre-embedding; ABC's attention has `heads` heads (the paper's Omniglot model: 2, 4, 128)
    blocks: int = Field(2, ge=0, le=64)
    heads: int = Field(4, ge=1, le=1024)  # ABC's SAB heads, except on the circles (``circles_heads``)
    width: int = Field(64, ge=2, le=65_536)
    # the SABs as ABC's code builds them: each variant attends as its similarity is computed ("matched": the additive
    # model's SABs softmax(uᵀtanh(q_i + k_j)), unscaled, the multiplicative model's softmax(q·k/√width)), or every
    # SAB softmax(q·k/√width) ("multiplicative"); the heads' output projection W_O (the code's circles: none)
    abc_attention: Literal["matched", "multiplicative"] = "matched"
    abc_projection: bool = False
    kernel: Literal["logits", "paper"] = "logits"  # ABC's kernel form (pipeline.core.abc)
    pos_weight: float | Literal["balanced"] = 1.0  # ABC's BCE weight on same-class pairs
    # testing
    test_sets: int = Field(30, ge=1, le=1_000_000)
    k_max: int = Field(10, ge=2, le=10_000)  # the eigengap's largest k (and never more than n - 1)
    rbf_gammas: list[Annotated[float, Field(gt=0.0)]] = Field(
        default_factory=lambda: [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0], min_length=1)  # × 1 / median d²
    rbf_select_sets: int = Field(30, ge=1, le=100_000)  # training sets that choose the RBF's γ
    # the data sets: set sizes and the number of clusters per set
    circles_points: int = Field(20, ge=4, le=100_000)  # 4 circles per set, as in the paper
    circles_heads: int = Field(1, ge=1, le=1024)  # ABC's SAB heads on the circles (the code's circles models: 1)
    circles_angles: Literal["stratified", "iid"] = "stratified"  # the code's m equal arcs | section 6.1's i.i.d.
    subspaces_size: int = Field(32, ge=4, le=100_000)
    subspaces_k: KRange = Field(default_factory=lambda: [2, 5])
    subspaces_dim: int = Field(16, ge=2, le=100_000)
    subspaces_rank: int = Field(2, ge=1, le=100_000)
    subspaces_noise: float = Field(0.1, ge=0.0, le=1.0)
    digits_size: int = Field(30, ge=4, le=1000)
    digits_k: KRange = Field(default_factory=lambda: [2, 4])  # classes 6-9 are the test classes: k <= 4
    omniglot_root: str = "data/raw"  # where omniglot-py/ is, when the user has it
    omniglot_size: int = Field(100, ge=4, le=100_000)
    omniglot_k: KRange = Field(default_factory=lambda: [5, 20])
    omniglot_image_size: int = Field(28, ge=8, le=105)

    @model_validator(mode="after")
    def _consistent(self) -> SetsConfig:
        problems = []
        for key in ("heads", "circles_heads"):
            if self.width % getattr(self, key):
                problems.append(f"sets.width ({self.width}) must be a multiple of sets.{key} ({getattr(self, key)})")
        for key in ("datasets", "methods", "seeds", "rbf_gammas"):
            values = getattr(self, key)
            if len(set(values)) != len(values):
                problems.append(f"sets.{key}: duplicate values in {values}")
        if isinstance(self.pos_weight, float) and not self.pos_weight > 0:
            problems.append(f"sets.pos_weight must be > 0 or 'balanced', got {self.pos_weight}")
        for name, size in (("subspaces", self.subspaces_size), ("digits", self.digits_size),
                           ("omniglot", self.omniglot_size)):
            lo, hi = getattr(self, f"{name}_k")
            if not 2 <= lo <= hi <= size:
                problems.append(f"sets.{name}_k must satisfy 2 <= k_lo <= k_hi <= sets.{name}_size ({size}), "
                                f"got [{lo}, {hi}]")
        if self.digits_k[1] > 4:
            problems.append(f"sets.digits_k: the test classes are 6-9, so k_hi must be <= 4, got {self.digits_k[1]}")
        if (self.subspaces_k[1] - 1) * self.subspaces_rank >= self.subspaces_dim:
            problems.append(f"sets.subspaces_dim: (k_hi - 1) * rank = {(self.subspaces_k[1] - 1) * self.subspaces_rank}"
                            f" must be < dim = {self.subspaces_dim} (independent subspaces, paper section 3)")
        if problems:
            raise ValueError("; ".join(problems))
        return self


__all__ = ["SET_DATASETS", "SET_METHODS", "SetsConfig", "TRAINED_METHODS"]
