"""A switch's move schedule as the controller priced it, and the pool it assumed.

Boundary: data only. ``transition_schedule`` builds and prices a ``MoveSchedule``; the
controller's decision and the job's switch carry it; the transition flow re-checks its
``MoveBasis`` against the live pool and runs its units, never planning them again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import ConfigDict, Field, InstanceOf

from nereus_core.config import ModelConfig
from nereus_core.emu import bytes_per_device
from nereus_core.frozen import Frozen
from nereus_core.gtg import TransitionGraph
from nereus_core.gtg.execution import StageSchedule
from nereus_core.plan import GENERATE, GlobalPlan, ModelStage, StageLayouts

GIB = 1 << 30


@dataclass(frozen=True)
class Planned:
    """The GTG of a transition on one device set, the schedule of units the executor runs, and why."""

    graph: TransitionGraph
    schedule: StageSchedule
    reason: str


def move_capacities(
    old: StageLayouts, models: Mapping[str, ModelConfig], *, capacity: int, devices: int, engine_kv_bytes: int
) -> dict[int, int]:
    """Bytes each of ``devices`` slots can give a switch's moves. With vLLM engines
    (``engine_kv_bytes`` > 0: each engine's KV cache per device, ``stage_cost.engine_kv_bytes``), plan
    A's engines keep their weights and KV cache on actor/generate's devices through the moves: the
    flow stops them after the commit, once their probe answer is taken (flows/job/engine_switch.py)."""
    caps = dict.fromkeys(range(devices), capacity)
    gen = old.get(GENERATE)
    if engine_kv_bytes and gen is not None:
        weights = bytes_per_device(models[ModelStage(GENERATE).model], gen, train=False)
        for d in gen.devices:
            if d in caps:
                caps[d] -= weights[d]["params"] + engine_kv_bytes
    return caps


class MoveBasis(Frozen):
    """What a move schedule assumed of the pool: the capacities ``move_capacities`` derives from it."""

    slots: int = Field(ge=1, description="Device slots the moves may use (slots 0..slots-1).")
    memory_per_device: int = Field(gt=0, description="Capacity of one slot, bytes.")
    engine_kv_bytes: int = Field(
        default=0, ge=0, description="KV cache plan A's vLLM engines hold per slot through the moves."
    )

    def describe(self) -> str:
        """``4 slots of 8.00 GiB`` (and the engines' KV cache when they hold one)."""
        kv = f" ({self.engine_kv_bytes / GIB:.2f} GiB of engine KV cache)" if self.engine_kv_bytes else ""
        return f"{self.slots} slots of {self.memory_per_device / GIB:.2f} GiB{kv}"

    def capacities(self, old: StageLayouts, models: Mapping[str, ModelConfig]) -> dict[int, int]:
        """Bytes each slot can give the moves from ``old`` (``move_capacities``)."""
        return move_capacities(
            old,
            models,
            capacity=self.memory_per_device,
            devices=self.slots,
            engine_kv_bytes=self.engine_kv_bytes,
        )


class MoveSchedule(Frozen):
    """A switch's moves as the controller priced them: the pool they assumed (``basis``, the
    ``capacities`` derived from it) and the GTG and schedule of units (``planned``), or why no
    memory-safe schedule exists (``refused``: the transition refuses it before any move). Its JSON
    (a flow run's parameters) leaves out the GTG: thousands of operations."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    old: GlobalPlan
    new: GlobalPlan
    basis: MoveBasis
    capacities: dict[int, int] = Field(description="Bytes each slot could give the moves, on ``basis``.")
    planned: InstanceOf[Planned] | None = Field(
        exclude=True, repr=False, description="The GTG and its units."
    )
    refused: str = Field(default="", description="Why no memory-safe schedule exists ('' when planned).")

    def changed(self, live: MoveBasis) -> str:
        """One line naming what changed between the pricing and ``live`` (empty: nothing did)."""
        if live == self.basis:
            return ""
        return f"the switch was priced for {self.basis.describe()}, the pool now has {live.describe()}"
