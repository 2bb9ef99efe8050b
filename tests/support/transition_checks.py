"""The transition tests' common run: every model of the small PPO job loaded on a pool of 4, one train
step each for the actor and the critic (so that the AdamW moments and step counts are not trivial),
then plan A -> plan B; and the check that a move kept every model's state bit for bit."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flows.job.transition import live_basis, transition_flow
from nereus_core import job
from nereus_core.config import NereusConfig
from nereus_core.controller.moves import MoveSchedule
from nereus_core.controller.transition_schedule import schedule_moves
from nereus_core.engine.train import lm_loss, score_mse_loss
from nereus_core.layout import Layout
from nereus_core.model.weights import init_full_state
from nereus_core.plan import PPO_STAGES, GlobalPlan, own_state
from tasks import job_ops, model_ops
from tasks.reshard import gather_state
from tasks.runtime.device_pool import DevicePool

PLAN_B = {
    "actor/generate": Layout(tp=1, pp=1, dp=1, devices=(0,)),
    "actor/train": Layout(tp=1, pp=2, dp=2, devices=(1, 0, 3, 2)),
    "critic/train": Layout(tp=2, pp=1, dp=1, devices=(2, 3)),
    "critic/infer": Layout(tp=2, pp=1, dp=1, devices=(2, 3)),
    "reference/infer": Layout(tp=2, pp=1, dp=1, devices=(0, 1)),
    "reward/infer": Layout(tp=1, pp=1, dp=1, devices=(3,)),
}
StageStates = dict[str, dict[str, torch.Tensor]]


def batch_ids() -> torch.Tensor:
    """The token ids every step and forward of these tests runs on."""
    return torch.randint(1, 11, (8, 8), generator=torch.Generator().manual_seed(3))


def load_job(pool: DevicePool, cfg: NereusConfig) -> job.JobState:
    """The job's start state, with every model loaded on ``pool`` (a fresh reward model among them)."""
    state = job.start(cfg)
    reward = init_full_state(job.model_config(cfg, "reward/infer"))
    job_ops.load_models(pool, cfg, state.layouts, state.aliased, reward)
    return state


def gathered(pool: DevicePool, cfg: NereusConfig, plan: dict[str, Layout]) -> StageStates:
    """The full state (weights and optimizer) of each model-stage that owns state, gathered from ``plan``."""
    return {
        stage: gather_state(
            pool, plan[stage], name=stage, config=job.model_config(cfg, stage), train=stage.trains
        )
        for stage in own_state(PPO_STAGES)
    }


@dataclass(frozen=True)
class Moved:
    """What a transition to plan B left: the state before and after, the actor's log-probs before and
    after (and the generation copy's after), the loss of a train step after, the flow's statistics and
    the move schedule it was given (priced as the controller prices a switch)."""

    before: StageStates
    after: StageStates
    logp_before: torch.Tensor
    logp_after: torch.Tensor
    logp_gen: torch.Tensor
    loss_after: float
    stats: dict[str, Any]
    moves: MoveSchedule


def train_then_move_to_plan_b(cfg: NereusConfig, run_dir: Path, transition_id: str) -> Moved:
    """Load the job, train the actor and the critic one step, move plan A -> ``PLAN_B``, then train the
    actor once more on plan B."""
    ids = batch_ids()
    batch_critic = {"ids": ids, "score": torch.linspace(0, 1, 8)}
    with DevicePool(4) as pool:
        plan_a = dict(load_job(pool, cfg).layouts)
        model_ops.train(pool, plan_a["actor/train"], {"ids": ids}, name="actor/train", loss_fn=lm_loss)
        model_ops.train(
            pool, plan_a["critic/train"], batch_critic, name="critic/train", loss_fn=score_mse_loss
        )
        before = gathered(pool, cfg, plan_a)
        logp_before = model_ops.forward(pool, plan_a["actor/train"], ids, name="actor/train")
        a, b = GlobalPlan.of(plan_a), GlobalPlan.of(PLAN_B)
        moves = schedule_moves(a, b, cfg.models, live_basis(pool, cfg))
        stats = transition_flow(
            pool, cfg, str(run_dir), transition_id, a, b, step=1, reason="test", moves=moves
        )
        after = gathered(pool, cfg, PLAN_B)
        logp_after = model_ops.forward(pool, PLAN_B["actor/train"], ids, name="actor/train")
        # The generation copy follows the trained actor after the transition.
        logp_gen = model_ops.forward(pool, PLAN_B["actor/generate"], ids, name="actor/generate")
        loss_after = model_ops.train(
            pool, PLAN_B["actor/train"], {"ids": ids}, name="actor/train", loss_fn=lm_loss
        )
    return Moved(before, after, logp_before, logp_after, logp_gen, loss_after, stats, moves)


def assert_same_state(before: StageStates, after: StageStates, what: str) -> None:
    """Every model-stage holds the same tensors after ``what`` as before: same names, dtypes, bits."""
    for stage in own_state(PPO_STAGES):
        assert before[stage].keys() == after[stage].keys(), stage
        for name, tensor in before[stage].items():
            same = tensor.dtype == after[stage][name].dtype and torch.equal(tensor, after[stage][name])
            assert same, f"{stage} {name} changed in {what}"
