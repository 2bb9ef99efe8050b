"""A transition of the running job moves every model's state bit for bit, and the job goes on."""

from __future__ import annotations

import pytest
import torch

from flows.job.transition import transition_flow
from nereus_core.config import parse_config
from nereus_core.engine.train import lm_loss
from nereus_core.layout import Layout
from storage.journal import Journal
from storage.run_dir import RunDir
from tasks import job_ops, model_ops
from tasks.runtime.device_pool import DevicePool
from tests.support.transition_checks import (
    PLAN_B,
    assert_same_state,
    batch_ids,
    gathered,
    load_job,
    train_then_move_to_plan_b,
)

from .test_ppo_job import SMALL

pytestmark = pytest.mark.usefixtures("prefect_server")  # the flows run against the suite's one Prefect server


def test_transition_moves_all_state_bitwise_and_training_goes_on(tmp_path) -> None:
    moved = train_then_move_to_plan_b(parse_config(SMALL), tmp_path, "t-test")
    assert Journal(tmp_path, "t-test").status() == "committed"
    assert moved.stats["bytes_moved"] > 0
    assert_same_state(moved.before, moved.after, "the transition")
    assert any(":exp_avg" in name for name in moved.before["actor/train"])
    assert (moved.logp_before - moved.logp_after).abs().max().item() <= 1e-5
    assert (moved.logp_gen - moved.logp_after).abs().max().item() <= 1e-5
    assert torch.isfinite(torch.tensor(moved.loss_after))


class _NoDevices:
    """Stands in for the pool: a refused transition must not touch a device."""

    size = 4

    def __getattr__(self, name: str):
        if name.startswith("__"):  # a validator's probe of the object (pydantic's), not a device call
            raise AttributeError(name)
        raise AssertionError(f"the refused transition used the pool ({name})")


def test_transition_that_cannot_fit_is_refused_before_any_move(tmp_path) -> None:
    data = dict(SMALL, cluster={"devices": 4, "memory_per_device": "64KiB"})
    cfg = parse_config(data)
    plan_a = {k: Layout.model_validate(v) for k, v in SMALL["plan"].items()}
    stats = transition_flow(
        _NoDevices(), cfg, str(tmp_path), "t-tight", plan_a, PLAN_B, step=0, reason="test"
    )
    assert stats["status"] == "refused" and stats["bytes_moved"] == 0
    assert Journal(tmp_path, "t-tight").status() == "aborted"


def test_a_shrink_moves_every_state_bitwise_and_retires_the_workers_once_the_switch_committed(
    tmp_path,
) -> None:
    """The job runs on the old plan until the switch; the workers plan B no longer uses
    leave the world in it and retire only after its commit (``retire_s``, not in ``seconds``)."""
    cfg = parse_config(SMALL)
    plan_2 = {stage: Layout(tp=1, pp=2, dp=1, devices=(0, 1)) for stage in PLAN_B}
    with DevicePool(4) as pool:
        run = RunDir.create(str(tmp_path / "run"), cfg.model_dump(mode="json"))
        state = load_job(pool, cfg)
        plan_a = dict(state.layouts)
        model_ops.train(
            pool, plan_a["actor/train"], {"ids": batch_ids()}, name="actor/train", loss_fn=lm_loss
        )
        job_ops.checkpoint(pool, str(run.root), state, 1, digests=True)
        before = gathered(pool, cfg, plan_a)
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
        after = gathered(pool, cfg, plan_2)
        present = set(pool.workers)
    assert Journal(run.root, "t-shrink").status() == "committed" and stats["route"] == "durable"
    assert len(present) == 2 and not leaving & present and stats["retire_s"] > 0
    assert_same_state(before, after, "the shrink")
