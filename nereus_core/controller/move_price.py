"""What the controller charges a move from the plan in force to a candidate: the transition's price,
and on the same devices the schedule it priced.

Boundary: pure pricing over the controller's state (``controller.transition_schedule`` for the
schedule, ``cost.transition_cost`` for the analytic price); ``controller.decide`` weighs it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from nereus_core.config import recovery_write
from nereus_core.controller.moves import MoveSchedule
from nereus_core.controller.state import ControllerState, Observation
from nereus_core.controller.transition_schedule import move_basis, priced_moves
from nereus_core.cost.transition_cost import (
    TransferLike,
    TransitionEstimate,
    analytic_transition_cost,
    recovery_seconds,
    transition_cost,
    verify_seconds,
)
from nereus_core.plan import GlobalPlan

TransferPlanner = Callable[[GlobalPlan, GlobalPlan], Sequence[TransferLike]]


def move_price(
    current: GlobalPlan | None,
    new: GlobalPlan,
    state: ControllerState,
    planner: TransferPlanner | None,
    durable: bool = False,
    observation: Observation | None = None,
) -> tuple[TransitionEstimate, MoveSchedule | None]:
    """The price of a move from ``current`` to ``new``, and the schedule it priced (schedule pricing
    on the same devices; None otherwise)."""
    if state.settings.transition_pricing == "schedule" and current is not None and observation is not None:
        ready = observation.ready_devices or state.devices or observation.devices
        return priced_moves(
            current,
            new,
            state.models,
            state.profile,
            basis=move_basis(observation, state.settings),
            resize=durable,
            cold=max(0, observation.devices - ready),
            scales=state.transition_scales,
            engines=state.settings.rollout_engine == "vllm",
            recovery=state.settings.switch_recovery,
            verify=state.settings.verify_transitions,
        )
    recovery = {"recovery": state.settings.switch_recovery, "verify": state.settings.verify_transitions}
    if durable:  # a new world: every stage rehydrates from the checkpoint, whether its layout changes or not
        old = dict(current.layouts) if current is not None else {}
        args = (old, dict(new.layouts), state.models, state.profile, state.transition_scales)
        return analytic_transition_cost(*args, durable=True, **recovery), None  # type: ignore[arg-type]
    if current is None or current == new:
        return TransitionEstimate.of(0.0, 0.0, None, critical_bytes=0, transfers=0, analytic=True), None
    if planner is not None:
        moved = transition_cost(planner(current, new), state.profile, state.transition_scales)
        mode = recovery_write(state.settings.switch_recovery, durable=False)
        recovery_s = recovery_seconds(mode, current.layouts, state.models, state.profile)
        verify_s = verify_seconds(new.layouts, state.models, state.profile) if recovery["verify"] else 0.0
        return moved.with_recovery(recovery_s, verify_s, state.transition_scales), None
    args = (dict(current.layouts), dict(new.layouts), state.models, state.profile, state.transition_scales)
    return analytic_transition_cost(*args, **recovery), None  # type: ignore[arg-type]
