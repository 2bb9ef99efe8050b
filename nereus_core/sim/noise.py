"""How a simulated job's measured times differ from the world's true times."""

from __future__ import annotations

from pydantic import Field

from nereus_core.frozen import Frozen


class NoiseSettings(Frozen):
    """How the simulated "measured" times differ from the world's true times."""

    stage_sigma: float = Field(
        default=0.05, ge=0, le=2, description="Log-sd of the per-stage, per-step noise on measured times."
    )
    transition_sigma: float = Field(
        default=0.1, ge=0, le=2, description="Log-sd of the noise on each transition's measured time."
    )
