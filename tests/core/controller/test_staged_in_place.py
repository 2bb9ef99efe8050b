"""An ``async`` recovery point writes the shards a one-wave live switch keeps as they are; its price agrees.

A live switch whose schedule is one wave of moves keeps every old shard until it ends (its rollback
source); such a shard is never written again, so the recovery point needs no copy of it. The rule
(``staged_in_place``) is the schedule's ``kept_sources``, for ``async`` on the same devices only; the
price (``recovery_seconds``) drops the staging copy for those stages where the devices' memory is the
host's (the CPU profile) and keeps it on a GPU (a device-to-host copy frees the device's memory).
"""

from __future__ import annotations

import pytest

from nereus_core.controller.moves import MoveBasis
from nereus_core.controller.transition_schedule import priced_moves, schedule_moves, staged_in_place
from nereus_core.cost.hardware import CPU_WORKERS, H100_SXM
from nereus_core.cost.transition_cost import recovery_seconds
from nereus_core.gtg.execution import StageSchedule
from nereus_core.layout import Layout
from nereus_core.plan import GlobalPlan, models_for
from tests.support.model_configs import SHARDABLE

MODELS = models_for(SHARDABLE)
STAGES = ("actor/generate", "actor/train", "critic/train", "critic/infer", "reference/infer", "reward/infer")
ROOMY = MoveBasis(slots=2, memory_per_device=1 << 30)


def _plans() -> tuple[GlobalPlan, GlobalPlan]:
    dp2 = Layout(dp=2, devices=(0, 1))
    tp2 = Layout(tp=2, devices=(0, 1))
    old = GlobalPlan.of(dict.fromkeys(STAGES, dp2))
    new = GlobalPlan.of({s: tp2 if s.startswith("actor/") else dp2 for s in STAGES})
    return old, new


def test_the_stages_a_one_wave_live_switch_keeps_are_written_in_place() -> None:
    old, new = _plans()
    moves = schedule_moves(old, new, MODELS, ROOMY)
    assert moves.planned is not None and len(moves.planned.schedule.waves) == 1
    assert staged_in_place(moves, "async", resize=False) == {"actor/train"}
    # Nothing in place for another recovery mode, a new world or no live schedule.
    assert staged_in_place(moves, "sync", resize=False) == frozenset()
    assert staged_in_place(moves, "none", resize=False) == frozenset()
    assert staged_in_place(moves, "async", resize=True) == frozenset()
    assert staged_in_place(None, "async", resize=False) == frozenset()


def test_several_waves_or_a_durable_unit_keep_nothing() -> None:
    def schedule(*waves: tuple[str, ...]) -> StageSchedule:
        units = [u for wave in waves for u in wave]
        return StageSchedule(waves=waves, ops=dict.fromkeys(units, ()), peak_bytes={}, serial=False)

    assert schedule(("move:actor/train", "move:critic/train")).kept_sources == {"actor/train", "critic/train"}
    # Several waves free a wave's old shards before the next allocates: that order is what fits.
    assert schedule(("move:actor/train",), ("move:critic/train",)).kept_sources == frozenset()
    # A durable unit frees its source through the checkpoint.
    assert schedule(("move:actor/train", "unload:critic/train")).kept_sources == frozenset()


def test_the_price_drops_the_copy_on_host_memory_only() -> None:
    old, new = _plans()
    kept = frozenset({"actor/train"})
    for profile, copies in ((CPU_WORKERS, False), (H100_SXM, True)):
        costs = profile.transitions
        full = recovery_seconds("async", old.layouts, MODELS, profile)
        in_place = recovery_seconds("async", old.layouts, MODELS, profile, in_place=kept)
        if copies:
            assert in_place == full
        else:
            # The kept stage still costs its device call; its bytes no longer cross the staging copy.
            assert in_place < full
            others = recovery_seconds(
                "async", {s: old.layouts[s] for s in old.layouts if s != "actor/train"}, MODELS, profile
            )
            assert in_place == pytest.approx(others + costs.call_s)
        # sync writes the store whatever the switch keeps
        assert recovery_seconds("sync", old.layouts, MODELS, profile, in_place=kept) == recovery_seconds(
            "sync", old.layouts, MODELS, profile
        )
    # The controller's price uses the same rule.
    estimate, moves = priced_moves(old, new, MODELS, CPU_WORKERS, basis=ROOMY, recovery="async")
    expected = recovery_seconds(
        "async", old.layouts, MODELS, CPU_WORKERS, in_place=staged_in_place(moves, "async", resize=False)
    )
    assert estimate.recovery_s == pytest.approx(expected)
    assert expected < recovery_seconds("async", old.layouts, MODELS, CPU_WORKERS)
