"""The one frozen-model base: every config section, plan record and manifest entry is a frozen
pydantic model that refuses unknown fields (``extra="forbid"``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Frozen(BaseModel):
    """An immutable pydantic model that refuses unknown fields."""

    model_config = ConfigDict(frozen=True, extra="forbid")
