"""A transition of the running job moves every model's state bit for bit, and the job goes on."""

from __future__ import annotations

import torch
from prefect.testing.utilities import prefect_test_harness

from flows.transition import transition_flow
from nereus_core import job as jb
from nereus_core.config import parse_config
from nereus_core.engine.train import lm_loss, score_mse_loss
from nereus_core.layout import Layout
from nereus_core.model.weights import init_full_state
from nereus_core.plan import PPO_STAGES, own_state
from storage.journal import Journal
from storage.run_dir import RunDir
from tasks import job_ops, model_ops
from tasks.device_pool import DevicePool
from tasks.reshard import gather_state

from .test_ppo_job import SMALL

PLAN_B = {
    "actor/generate": Layout(tp=1, pp=1, dp=1, devices=(0,)),
    "actor/train": Layout(tp=1, pp=2, dp=2, devices=(1, 0, 3, 2)),
    "critic/train": Layout(tp=2, pp=1, dp=1, devices=(2, 3)),
    "critic/infer": Layout(tp=2, pp=1, dp=1, devices=(2, 3)),
    "reference/infer": Layout(tp=2, pp=1, dp=1, devices=(0, 1)),
    "reward/infer": Layout(tp=1, pp=1, dp=1, devices=(3,)),
}


def _state(pool: DevicePool, cfg, plan: dict[str, Layout]) -> dict[str, dict[str, torch.Tensor]]:
    return {
        stage: gather_state(
            pool, plan[stage], name=stage, config=jb.model_config(cfg, stage), train=stage.trains
        )
        for stage in own_state(PPO_STAGES)
    }


def test_transition_moves_all_state_bitwise_and_training_goes_on(tmp_path) -> None:
    cfg = parse_config(SMALL)
    ids = torch.randint(1, 11, (8, 8), generator=torch.Generator().manual_seed(3))
    batch_critic = {"ids": ids, "score": torch.linspace(0, 1, 8)}
    with prefect_test_harness(server_startup_timeout=300), DevicePool(4) as pool:
        state = jb.start(cfg)
        reward = init_full_state(jb.model_config(cfg, "reward/infer"))
        job_ops.load_models(pool, cfg, state.layouts, state.aliased, reward)
        plan_a = dict(state.layouts)
        # One step each so the AdamW moments and step counts are not trivial.
        model_ops.train(pool, plan_a["actor/train"], {"ids": ids}, name="actor/train", loss_fn=lm_loss)
        model_ops.train(
            pool, plan_a["critic/train"], batch_critic, name="critic/train", loss_fn=score_mse_loss
        )
        before = _state(pool, cfg, plan_a)
        logp_before = model_ops.forward(pool, plan_a["actor/train"], ids, name="actor/train")
        stats = transition_flow(pool, cfg, str(tmp_path), "t-test", plan_a, PLAN_B, step=1, reason="test")
        after = _state(pool, cfg, PLAN_B)
        logp_after = model_ops.forward(pool, PLAN_B["actor/train"], ids, name="actor/train")
        # The generation copy follows the trained actor after the transition.
        logp_gen = model_ops.forward(pool, PLAN_B["actor/generate"], ids, name="actor/generate")
        loss_after = model_ops.train(
            pool, PLAN_B["actor/train"], {"ids": ids}, name="actor/train", loss_fn=lm_loss
        )
    assert Journal(tmp_path, "t-test").status() == "committed"
    assert stats["bytes_moved"] > 0
    for stage in own_state(PPO_STAGES):
        assert before[stage].keys() == after[stage].keys(), stage
        for name, tensor in before[stage].items():
            assert torch.equal(tensor, after[stage][name]), f"{stage} {name} changed in the transition"
    assert any(":exp_avg" in name for name in before["actor/train"])
    assert (logp_before - logp_after).abs().max().item() <= 1e-5
    assert (logp_gen - logp_after).abs().max().item() <= 1e-5
    assert torch.isfinite(torch.tensor(loss_after))


class _NoDevices:
    """Stands in for the pool: a refused transition must not touch a device."""

    size = 4

    def __getattr__(self, name: str):
        raise AssertionError(f"the refused transition used the pool ({name})")


def test_transition_that_cannot_fit_is_refused_before_any_move(tmp_path) -> None:
    data = dict(SMALL, cluster={"devices": 4, "memory_per_device": "64KiB"})
    cfg = parse_config(data)
    plan_a = {k: Layout.model_validate(v) for k, v in SMALL["plan"].items()}
    with prefect_test_harness(server_startup_timeout=300):
        stats = transition_flow(
            _NoDevices(), cfg, str(tmp_path), "t-tight", plan_a, PLAN_B, step=0, reason="test"
        )
    assert stats["status"] == "refused" and stats["bytes_moved"] == 0
    assert Journal(tmp_path, "t-tight").status() == "aborted"


def test_a_shrink_moves_every_state_bitwise_and_retires_the_workers_once_the_switch_committed(
    tmp_path,
) -> None:
    """Issue 16: the job runs on the old plan until the switch; the workers plan B no longer uses
    leave the world in it and retire only after its commit (``retire_s``, not in ``seconds``)."""
    cfg = parse_config(SMALL)
    plan_2 = {stage: Layout(tp=1, pp=2, dp=1, devices=(0, 1)) for stage in PLAN_B}
    ids = torch.randint(1, 11, (8, 8), generator=torch.Generator().manual_seed(3))
    with prefect_test_harness(server_startup_timeout=300), DevicePool(4) as pool:
        run = RunDir.create(str(tmp_path / "run"), cfg.model_dump(mode="json"))
        state = jb.start(cfg)
        reward = init_full_state(jb.model_config(cfg, "reward/infer"))
        job_ops.load_models(pool, cfg, state.layouts, state.aliased, reward)
        plan_a = dict(state.layouts)
        model_ops.train(pool, plan_a["actor/train"], {"ids": ids}, name="actor/train", loss_fn=lm_loss)
        job_ops.checkpoint(pool, str(run.root), state, 1, digests=True)
        before = _state(pool, cfg, plan_a)
        leaving = set(pool.workers[2:])
        stats = transition_flow(
            pool,
            cfg,
            str(run.root),
            "t-shrink",
            plan_a,
            plan_2,
            step=1,
            reason="shrink",
            checkpoint_step=1,
            devices=2,
        )
        after = _state(pool, cfg, plan_2)
        present = set(pool.workers)
    assert Journal(run.root, "t-shrink").status() == "committed" and stats["route"] == "durable"
    assert len(present) == 2 and not leaving & present and stats["retire_s"] > 0
    for stage in own_state(PPO_STAGES):
        assert before[stage].keys() == after[stage].keys(), stage
        for name, tensor in before[stage].items():
            assert torch.equal(tensor, after[stage][name]), f"{stage} {name} changed in the shrink"
