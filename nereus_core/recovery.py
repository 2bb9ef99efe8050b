"""What a switch writes as its recovery point: the runtime's rule, which the cost model prices and the
simulated world charges (each by its own constants).

``job.switch_recovery`` names the mode: ``sync`` every model's state to the store, ``async`` staged in
host memory and written in the background (PyTorch DCP's ``async_save``), ``none`` nothing (the newest
complete checkpoint stays the recovery point).
"""

from __future__ import annotations

from typing import Literal

RecoveryMode = Literal["async", "sync", "none"]


def recovery_write(mode: RecoveryMode, *, durable: bool) -> RecoveryMode:
    """What a switch writes: a switch with durable units (or a new world) rehydrates them from a
    checkpoint of the step, so it writes one synchronously whatever the mode; any other writes what
    ``mode`` says."""
    return "sync" if durable else mode
