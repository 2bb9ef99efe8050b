"""nereus_core.sim.peers: verl and OpenRLHF as they run: a config chosen at launch, launch flags kept, a
relaunch (checkpoint, restart, reload) when their devices change, steps lost on an unplanned shrink,
a relaunch with recomputation when a step runs out of memory, checkpoints at their cadence."""

from __future__ import annotations

import pytest

from nereus_core.cost.hardware import H100_SXM
from nereus_core.cost.stage_cost import stage_kind
from nereus_core.sim import checkpoints
from nereus_core.sim.config import NoiseSettings
from nereus_core.sim.job import SimJob, make_strategy, run_job
from nereus_core.sim.trace import parse_trace
from nereus_core.sim.world import World
from tests.core.sim.test_sim import config, csv_text

QUIET = NoiseSettings(stage_sigma=0, transition_sigma=0).model_dump()


def grow_then_shrink(k: int) -> int:
    return 16 if k < 3 else (32 if k < 6 else 16)


def test_a_peer_relaunches_when_its_devices_change_paying_checkpoint_restart_and_reload() -> None:
    cfg = config(noise=QUIET)
    tr = parse_trace(csv_text(9, devices=grow_then_shrink), name="t")  # planned: a lease that ends
    strategy = make_strategy(cfg, "verl")
    world = World(tr, cfg.model, H100_SXM, cfg.noise, 0, stages=cfg.stages)
    strategy.begin(world)
    relaunched = []
    for k in range(tr.steps):
        world.begin_step(k)
        strategy.prepare(k, world)
        old = strategy.base
        move = strategy.after(k, world, None)  # type: ignore[arg-type]
        if move.kind == "relaunch":
            new = strategy.base
            assert max(max(v.devices) for v in new.layouts.values()) + 1 == tr.devices[k + 1]
            save = world.checkpoint_s(old)
            start = world.restart_s(new) + checkpoints.read_s(dict(new.layouts), world.params)
            assert save > 0 and move.transition_s == pytest.approx(save + start), k
            relaunched.append(k)
    assert relaunched == [2, 5]
    result = run_job(SimJob(cfg, tr, "verl", 0))
    assert [r["step"] for r in result.records if r["move"] == "relaunch"] == [2, 5]
    assert all(r["lost_s"] == 0.0 for r in result.records)  # planned: nothing lost
    assert result.summary["relaunches"] == 2 and result.summary["transitions_devices"] == 2
    moved = sum(r["transition_s"] for r in result.records if r["move"] == "relaunch")
    assert result.summary["relaunch_s_total"] == pytest.approx(moved)


def test_an_unplanned_shrink_loses_the_steps_since_the_last_checkpoint_for_every_strategy() -> None:
    cfg = config(noise=QUIET, snapshot_every=4)
    tr = parse_trace(csv_text(9, devices=grow_then_shrink), name="t", shrinks="unplanned")
    assert [k for k in range(tr.steps) if tr.unplanned_shrink(k)] == [5]
    for name in ("verl", "openrlhf", "nereus", "static"):
        result = run_job(SimJob(cfg, tr, name, 0))
        every = 20 if name in ("verl", "openrlhf") else 4  # the peers' default cadence (StrategySpec)
        last = max(k for k in range(6) if (k + 1) % every == 0) if every <= 6 else -1
        since = sum(r["stages_s"] for r in result.records if last < r["step"] <= 5)
        lost = {r["step"]: r["lost_s"] for r in result.records if r["lost_s"] > 0}
        assert lost == {5: pytest.approx(since)}, name
        shrink = result.records[5]
        assert shrink["transition_s"] > 0, name
        total = sum(r["step_s"] + r["transition_s"] + r["checkpoint_s"] + r["lost_s"] for r in result.records)
        assert result.summary["total_s"] == pytest.approx(total) and result.summary["lost_s_total"] == since
    # The growth at step 2 is still planned: the peer writes its checkpoint before it goes.
    verl = run_job(SimJob(cfg, tr, "verl", 0)).records
    assert verl[2]["transition_s"] > verl[5]["transition_s"]  # no save before the unplanned shrink


def test_the_launch_config_knows_step_zero_only_and_hindsight_is_a_what_if() -> None:
    cfg = config(strategies={"verl": {"kind": "verl"}, "seer": {"kind": "verl", "config": "hindsight"}})
    short = parse_trace(csv_text(6, mean=lambda k: 600.0), name="t")
    grows = parse_trace(csv_text(6, mean=lambda k: 600.0 if k == 0 else 12000.0), name="t")
    plans = {}
    for tr in (short, grows):
        for name in ("verl", "seer"):
            world = World(tr, cfg.model, H100_SXM, cfg.noise, 0, stages=cfg.stages)
            plans[(tr is grows, name)] = make_strategy(cfg, name).begin(world).plan.plan_id
    assert plans[(False, "verl")] == plans[(True, "verl")]  # later steps do not change a launch
    assert plans[(True, "seer")] != plans[(True, "verl")]  # hindsight sees the long responses coming


def test_launch_flags_stay_until_a_step_runs_out_of_memory_then_it_relaunches_recomputing() -> None:
    cfg = config(noise=QUIET, strategies={"openrlhf": {"kind": "openrlhf", "placements": ["colocated"]}})
    tr = parse_trace(csv_text(8, mean=lambda k: 500.0 if k < 4 else 5000.0), name="t")
    strategy = make_strategy(cfg, "openrlhf")
    world = World(tr, cfg.model, H100_SXM, cfg.noise, 0, stages=cfg.stages)
    launched = strategy.begin(world).plan
    train = [s for s in launched.layouts if stage_kind(s) == "train"]
    assert not any(strategy.recompute[s] for s in train)  # step 0 fits without recomputation
    result = run_job(SimJob(cfg, tr, "openrlhf", 0))
    failed = [r["step"] for r in result.records if not r["fits"]]
    assert failed == [4]  # the first long step, on the launch micro-batches; then it is relaunched
    assert result.records[4]["restart_s"] > result.records[4]["stages_s"]
    ran = {r["step"]: r["plan_id"] for r in result.records}
    assert (
        len({ran[k] for k in range(4)}) == 1
    )  # micro-batches fixed while it fits (--micro_train_batch_size)
    assert ran[5] != ran[3]


def test_peers_checkpoint_at_their_cadence() -> None:
    cfg = config(
        noise=QUIET,
        strategies={
            "verl": {"kind": "verl"},
            "openrlhf": {"kind": "openrlhf"},
            "often": {"kind": "verl", "checkpoint_every": 10},
        },
    )
    tr = parse_trace(csv_text(45), name="t")
    for name in ("verl", "openrlhf"):
        records = run_job(SimJob(cfg, tr, name, 0)).records
        assert [r["step"] for r in records if r["checkpoint_s"] > 0] == [19, 39, 44], name
    often = run_job(SimJob(cfg, tr, "often", 0)).records
    assert [r["step"] for r in often if r["checkpoint_s"] > 0] == [9, 19, 29, 39, 44]


def test_the_recompute_example_is_the_churn_example_with_gradient_checkpointing() -> None:
    import yaml

    from nereus_core.config import LLAMA_3_8B
    from nereus_core.sim.config import parse_sim_config
    from tests.core.sim.test_sim import ROOT

    read = lambda name: parse_sim_config(yaml.safe_load((ROOT / "examples" / name).read_text()))  # noqa: E731
    churn, again = read("paper_sim_churn.yaml"), read("paper_sim_churn_recompute.yaml")
    assert again.model == LLAMA_3_8B.model_copy(update={"gradient_checkpointing": True})
    assert again.traces == churn.traces and {s.kind for s in again.strategies.values()} == {
        "nereus",
        "static",
    }


@pytest.mark.parametrize(
    ("strategy", "trace", "needle"),
    [
        ({"kind": "verl", "config": "oracle"}, {}, "strategies.v.config: 'oracle' is now 'hindsight'"),
        ({"kind": "verl"}, {"shrinks": "sometimes"}, "traces[0].shrinks: must be 'planned' or 'unplanned'"),
    ],
)
def test_an_old_or_unknown_peer_setting_is_refused_in_one_line(
    strategy: dict, trace: dict, needle: str
) -> None:
    from nereus_core.config import ConfigError
    from nereus_core.sim.config import parse_sim_config

    with pytest.raises(ConfigError) as err:
        parse_sim_config({"traces": [{"name": "t", "file": "t.csv", **trace}], "strategies": {"v": strategy}})
    assert str(err.value).startswith(needle) and "\n" not in str(err.value)
