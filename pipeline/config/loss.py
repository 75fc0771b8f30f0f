"""The ``loss`` section: the loss by name (pipeline.core.losses implements each) and its hyper-parameters.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipeline.config.base import Section

LOSS_NAMES = ("jsd", "jsd_appendix_e", "kl_softmax", "kl_relu", "kl_squared", "infonce", "supcon", "dcl",
              "barlow_twins")
SELF_SUPERVISED_ONLY = frozenset({"infonce", "barlow_twins"})  # one positive per row: two views, no labels
LossName = Literal[LOSS_NAMES]  # type: ignore[valid-type]


class LossConfig(Section):
    name: LossName = "jsd"
    temperature: float = Field(0.1, gt=0.0, le=100.0)
    barlow_lambda: float = Field(5e-3, ge=0.0)


__all__ = ['LOSS_NAMES', 'LossConfig', 'SELF_SUPERVISED_ONLY']
