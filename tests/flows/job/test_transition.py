"""A transition of the running job moves every model's state bit for bit, and the job goes on."""

from __future__ import annotations

import pytest
import torch

from flows.job import transition as transition_module
from flows.job.transition import live_basis, transition_flow
from nereus_core.config import parse_config
from nereus_core.controller.moves import MoveBasis
from nereus_core.controller.transition_schedule import schedule_moves
from nereus_core.engine.train import lm_loss
from nereus_core.layout import Layout
from nereus_core.plan import GlobalPlan
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


def test_transition_moves_all_state_bitwise_and_training_goes_on(tmp_path, monkeypatch) -> None:
    def planned_again(*args, **kwargs):
        raise AssertionError("the transition planned the moves again instead of running the priced ones")

    monkeypatch.setattr(transition_module, "plan_moves", planned_again)
    moved = train_then_move_to_plan_b(parse_config(SMALL), tmp_path, "t-test")
    journal = Journal(tmp_path, "t-test")
    assert journal.status() == "committed"
    # The schedule the journal says ran is the one priced, unit for unit.
    assert moved.moves.planned is not None
    assert journal.header()["schedule"] == [list(w) for w in moved.moves.planned.schedule.waves]
    assert moved.stats["route"] == moved.moves.planned.graph.route
    assert moved.stats["bytes_moved"] > 0
    assert_same_state(moved.before, moved.after, "the transition")
    assert any(":exp_avg" in name for name in moved.before["actor/train"])
    assert (moved.logp_before - moved.logp_after).abs().max().item() <= 1e-5
    assert (moved.logp_gen - moved.logp_after).abs().max().item() <= 1e-5
    assert torch.isfinite(torch.tensor(moved.loss_after))


class _NoDevices:
    """Stands in for the pool: a refused transition must not touch a device."""

    def __init__(self, size: int = 4) -> None:
        self.size = size

    def __getattr__(self, name: str):
        if name.startswith("__"):  # a validator's probe of the object (pydantic's), not a device call
            raise AttributeError(name)
        raise AssertionError(f"the refused transition used the pool ({name})")


def test_transition_that_cannot_fit_is_refused_before_any_move(tmp_path) -> None:
    data = dict(SMALL, cluster={"devices": 4, "memory_per_device": "64KiB"})
    cfg = parse_config(data)
    plan_a = GlobalPlan.of({k: Layout.model_validate(v) for k, v in SMALL["plan"].items()})
    plan_b, pool = GlobalPlan.of(PLAN_B), _NoDevices()
    moves = schedule_moves(plan_a, plan_b, cfg.models, live_basis(pool, cfg))
    assert moves.planned is None and moves.refused  # the controller priced it as a new world
    stats = transition_flow(
        pool, cfg, str(tmp_path), "t-tight", plan_a, plan_b, step=0, reason="test", moves=moves
    )
    assert stats["status"] == "refused" and stats["bytes_moved"] == 0
    assert stats["error"] == moves.refused
    assert Journal(tmp_path, "t-tight").status() == "aborted"


@pytest.mark.parametrize(
    ("slots", "memory", "now"),
    [(3, "1GiB", "3 slots of 1.00 GiB"), (4, "512MiB", "4 slots of 0.50 GiB")],
    ids=["a-slot-lost", "less-memory"],
)
def test_a_switch_priced_on_another_pool_is_refused_in_one_line_and_never_planned_again(
    tmp_path, monkeypatch, slots: int, memory: str, now: str
) -> None:
    """The controller priced the moves on 4 slots of 1 GiB; by the time the transition runs, the pool
    lost a slot or the config's memory per slot shrank: the switch is refused in one line naming what
    changed, journaled as aborted, and no move is planned or run (plan A stays)."""
    priced_on = MoveBasis(slots=4, memory_per_device=1 << 30)
    cfg = parse_config(dict(SMALL, cluster={"devices": 4, "memory_per_device": memory}))
    plan_a = GlobalPlan.of({k: Layout.model_validate(v) for k, v in SMALL["plan"].items()})
    plan_b = GlobalPlan.of(PLAN_B)
    moves = schedule_moves(plan_a, plan_b, cfg.models, priced_on)
    assert moves.planned is not None  # it fitted the pool it was priced on

    def planned_again(*args, **kwargs):
        raise AssertionError("the transition planned the moves again")

    monkeypatch.setattr(transition_module, "plan_moves", planned_again)
    stats = transition_flow(
        _NoDevices(slots), cfg, str(tmp_path), "t-stale", plan_a, plan_b, step=5, reason="test", moves=moves
    )
    expected = (
        f"the switch was priced for 4 slots of 1.00 GiB, the pool now has {now}: "
        "the controller decides again after step 6"
    )
    assert stats["status"] == "refused" and stats["bytes_moved"] == 0 and stats["error"] == expected
    journal = Journal(tmp_path, "t-stale")
    assert journal.status() == "aborted" and journal.header() is None  # no start line: nothing moved
    assert [e["error"] for e in journal.entries()] == [expected]


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
        plan_a = state.layouts
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
            state.plan,
            GlobalPlan.of(plan_2),
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
