"""The ``loss`` section: the loss by name and its hyper-parameters. TransFusion's losses (the first names) are
implemented in pipeline.core.losses; ``bce``, ABC's binary cross-entropy of its kernel against the same-class (or
same-image) targets, in pipeline.core.abc (pipeline.core.model.ABC_LOSSES).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from pipeline.config.base import Section

TRANSFUSION_LOSSES = ("jsd", "jsd_appendix_e", "kl_softmax", "kl_relu", "kl_squared", "infonce", "supcon", "dcl",
                      "barlow_twins")
ABC_LOSSES = ("bce",)  # model.method: abc trains with these, and only abc does
LOSS_NAMES = TRANSFUSION_LOSSES + ABC_LOSSES
MAX_POWER = 64.0  # loss.power's largest value (cosines of 0.9 and 0.5 then weigh 3e16 to 1)
SELF_SUPERVISED_ONLY = frozenset({"infonce", "barlow_twins"})  # one positive per row: two views, no labels
LossName = Literal[LOSS_NAMES]  # type: ignore[valid-type]


class LossConfig(Section):
    name: LossName = "jsd"
    temperature: float = Field(0.1, gt=0.0, le=100.0)
    barlow_lambda: float = Field(5e-3, ge=0.0)
    # jsd only, ours: P = Normalize(|A|^power); 2 is the paper's eq. 5 (A ∘ A). A larger power sharpens P as a
    # smaller temperature sharpens InfoNCE's softmax (power ≈ 1 / temperature near a cosine of 1)
    power: float = Field(2.0, ge=1.0, le=MAX_POWER)
    # bce only: the weight of the positive pairs, a number > 0 or "balanced" = #negative / #positive pairs of each
    # global batch (the diagonal included; ABC's code on Omniglot weighs by such a ratio)
    pos_weight: Annotated[float, Field(gt=0.0, le=1e9)] | Literal["balanced"] = "balanced"


__all__ = ['ABC_LOSSES', 'LOSS_NAMES', 'LossConfig', 'MAX_POWER', 'SELF_SUPERVISED_ONLY', 'TRANSFUSION_LOSSES']
