"""The ``augment`` section: a preset of pipeline.data.augment by name and the one strength that scales it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipeline.config.base import Section

PRESET_NAMES = ("paper", "simclr", "none")
PresetName = Literal[PRESET_NAMES]  # type: ignore[valid-type]


class AugmentConfig(Section):
    preset: PresetName = "paper"
    strength: float = Field(1.0, ge=0.0, le=1.0)


__all__ = ['AugmentConfig', 'PRESET_NAMES']
