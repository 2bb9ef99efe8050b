"""The controller tests' common set-up: the H100 profile without per-call fixed costs, and a fresh
controller state (of the mid-size model by default), workload and observation."""

from __future__ import annotations

from nereus_core.config import ModelConfig, Workload
from nereus_core.controller.decide import ControllerSettings, ControllerState, Observation
from nereus_core.cost.hardware import H100_SXM
from nereus_core.plan import PPO_STAGES, models_for
from tests.support.model_configs import MID

GB = 10**9


def work(batch: int = 16, prompt: int = 64, mean: float = 64, high: int | None = None) -> Workload:
    return Workload(batch=batch, prompt_len=prompt, response_mean=mean, response_high=high or int(mean))


def observe(devices: int, capacity: int, w: Workload, remaining: int = 100, **kw) -> Observation:
    return Observation(
        step=1, remaining_steps=remaining, devices=devices, memory_per_device=capacity, workload=w, **kw
    )


# The H100 profile without the software stack's fixed costs per stage call and per plan change
# (hardware.py: ~14 s a generation call, ~44 s an engine rebuild): these tests run small batches, whose
# steps those costs would dominate, so no switch would pay.
H100 = H100_SXM.model_copy(
    update={
        "generate_call_s": 0.0,
        "infer_call_s": 0.0,
        "train_call_s": 0.0,
        "decode_step_s": 0.0,
        "transitions": H100_SXM.transitions.model_copy(
            update={"group_setup_s": 0.0, "engine_rebuild_s": 0.0}
        ),
    }
)


def fresh(model: ModelConfig = MID, profile=H100, **settings_kw) -> ControllerState:
    return ControllerState.initial(
        models_for(model), profile, ControllerSettings(**settings_kw), stages=PPO_STAGES
    )
