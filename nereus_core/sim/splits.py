"""How a strategy splits a step over a slot group: micro-batch counts, data-parallel degrees, and the
bytes a device may use under a headroom."""

from __future__ import annotations

import math

from nereus_core.layout import Layout
from nereus_core.plan import GENERATE


def micro_batch_options(stage: str, layout: Layout, batch: int, max_waves: int) -> list[int]:
    """Micro-batch counts (waves for generation) that split a replica's batch evenly: powers of two."""
    per_replica = batch // layout.dp
    cap = min(per_replica, max_waves) if stage == GENERATE else per_replica
    out, m = [], 1
    while m <= cap:
        if per_replica % m == 0:
            out.append(m)
        m *= 2
    return out or [1]


def largest_dp(batch: int, slots: int) -> int:
    """The largest data-parallel degree <= ``slots`` that divides ``batch``."""
    for d in range(max(1, slots), 0, -1):
        if batch % d == 0:
            return d
    return 1


def usable_bytes(capacity: float, headroom: float) -> float:
    return math.floor(capacity * (1.0 - headroom))
