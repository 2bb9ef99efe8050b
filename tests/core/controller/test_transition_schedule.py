"""nereus_core/controller/transition_schedule.py: a transition priced as the transition flow runs it (issue
16)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from nereus_core import job
from nereus_core.config import parse_config
from nereus_core.controller.decide import TransitionTiming, calibrated_on
from nereus_core.controller.moves import move_capacities
from nereus_core.controller.transition_schedule import executed_cost, plan_moves
from nereus_core.cost.hardware import CPU_WORKERS
from nereus_core.cost.transition_cost import TransitionCosts
from nereus_core.emu import bytes_per_device, plan_reshard, shard_map
from nereus_core.gtg import TransitionInfeasible
from nereus_core.layout import Layout
from nereus_core.plan import MODEL_STAGES, ModelStage, models_for

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny_ppo.yaml"
CFG = parse_config({**yaml.safe_load(EXAMPLE.read_text()), "job": {"scenario": []}})
MODELS = models_for(CFG.model)
MIB = 1024**2
COSTS = TransitionCosts(
    call_s=0.01, groups_s=0.002, engine_s=0.1, message_s=0.001, world_rebuild_s=0.5, worker_start_s=3.0
)
PP2 = Layout.contiguous(pp=2)
DP2 = Layout.contiguous(dp=2)


def plan(**changes: Layout) -> dict[str, Layout]:
    """The demo's plan A (every model-stage pp=2 on slots 0 and 1), with ``changes`` by stage."""
    return {s: changes.get(s.replace("/", "_"), PP2) for s in MODEL_STAGES}


def cost(old: dict, new: dict, **kw: object) -> object:
    return executed_cost(old, new, MODELS, CPU_WORKERS, capacity=64 * MIB, devices=2, costs=COSTS, **kw)


def test_nothing_to_move_costs_nothing() -> None:
    est = cost(plan(), plan())
    assert est.seconds == 0 and est.terms == (0.0,) * 6


def test_a_live_move_costs_its_calls_groups_engine_and_the_busiest_port_of_its_transfers() -> None:
    old, new = plan(), plan(actor_train=DP2)
    est = cost(old, new)
    # One wave (one call) moving actor/train onto a new layout (its groups, a new engine, one message
    # per peer), then actor/generate (a copy of it) unloaded and relinked: two calls; the copy stays
    # on pp=2, synced from dp=2 replicas that hold every parameter on its devices (nothing on the link).
    sync = plan_reshard(
        shard_map(MODELS["actor"], DP2, train=False), shard_map(MODELS["actor"], PP2, train=False)
    )
    move = plan_moves(old, new, MODELS, {0: 64 * MIB, 1: 64 * MIB}, live=True)
    transfers = [op for op in move.graph.ops if op.kind == "transfer"]

    def busiest(items: list[tuple[int, int, int]]) -> int:
        ports: dict[tuple[str, int], int] = {}
        for src, dst, n in items:
            ports[("s", src)] = ports.get(("s", src), 0) + n
            ports[("r", dst)] = ports.get(("r", dst), 0) + n
        return max(ports.values(), default=0)

    wire = busiest([(t.src, t.dst, t.nbytes) for t in transfers]) + busiest(
        [(t.src, t.dst, t.nbytes) for t in sync.transfers]
    )
    assert est.wire_s == pytest.approx(wire / CPU_WORKERS.intra_bw)
    assert transfers and not sync.transfers and sync.local
    assert est.ops_s == pytest.approx(3 * COSTS.call_s + COSTS.groups_s + COSTS.engine_s + COSTS.message_s)

    assert est.durable_s == 0 and est.transfers == 3 and not est.analytic
    # An inference stage moved the same way needs no engine: it costs less.
    assert cost(old, plan(reward_infer=DP2)).ops_s < est.ops_s


def test_a_new_world_costs_its_rebuild_and_workers_started_only_when_not_prepared() -> None:
    old = plan()
    prepared = executed_cost(
        old, old, MODELS, CPU_WORKERS, capacity=64 * MIB, devices=4, costs=COSTS, resize=True
    )
    cold = executed_cost(
        old, old, MODELS, CPU_WORKERS, capacity=64 * MIB, devices=4, costs=COSTS, resize=True, cold=2
    )
    assert prepared.durable_s == pytest.approx(COSTS.world_rebuild_s)
    assert cold.durable_s == pytest.approx(COSTS.world_rebuild_s + COSTS.worker_start_s + COSTS.warm_up_s)
    # Every stage that owns state is rehydrated (a call, groups once per layout, an engine per train
    # stage) and every copy relinked; the checkpoint's bytes are read at the store's bandwidth.
    owners = [s for s in map(ModelStage, MODEL_STAGES) if s.owns_state]
    trains = sum(s.trains for s in owners)
    calls = 1 + len(owners) + (len(MODEL_STAGES) - len(owners))
    assert prepared.ops_s == pytest.approx(calls * COSTS.call_s + COSTS.groups_s + trains * COSTS.engine_s)
    assert prepared.wire_s > 0 and prepared.transfers == calls


def test_the_controller_prices_the_schedule_and_calibrates_on_what_switches_took() -> None:
    state = job.start(CFG)
    assert state.controller.settings.transition_pricing == "schedule"
    old, new = plan(), plan(actor_train=DP2)
    before = cost(old, new, scales=state.controller.transition_scales)
    ran = TransitionTiming(predicted=before, seconds=3.0 * before.seconds)
    after = calibrated_on(state.controller, [ran])
    again = cost(old, new, scales=after.transition_scales)
    # One switch that took 3x moves the prediction part of the way (a job makes few switches, and
    # one may have run on a busier machine); switches that agree bring it the rest.
    assert before.seconds < again.seconds < 3.0 * before.seconds
    assert len(after.transition_samples) == 1
    assert calibrated_on(after, []) == after
    settled = calibrated_on(after, [ran] * 7)
    assert (
        2.5 * before.seconds < cost(old, new, scales=settled.transition_scales).seconds < 3 * before.seconds
    )


def test_a_resumed_job_keeps_the_calibration_of_the_switches_it_made() -> None:
    """The calibration state lives in the controller; the job's transition records persist it."""
    old, new = plan(), plan(actor_train=DP2)
    first = cost(old, new)
    runs = [TransitionTiming(predicted=first, seconds=2.5 * first.seconds)] * 2
    point = job.ResumePoint(4, job.start(CFG).layouts, 2, 2, CFG.job.response_len, {})
    resumed = job.resumed(CFG, point, runs)
    assert (
        resumed.controller.transition_samples
        == calibrated_on(job.start(CFG).controller, runs).transition_samples
    )
    assert (
        resumed.controller.transition_scales
        == calibrated_on(job.start(CFG).controller, runs).transition_scales
    )
    assert cost(old, new, scales=resumed.controller.transition_scales).seconds > 1.5 * first.seconds
    assert job.resumed(CFG, point).controller.transition_samples == ()


def test_vllm_engines_are_priced_when_generations_layout_changes_and_calibrated_on_rebuilds() -> None:
    """rollout.engine: vllm: a switch that changes actor/generate's degrees or devices also rebuilds its
    engines (the engine term, ``vllm_engine_s``); a switch that leaves it alone, or a job on Nereus's
    sampler, pays none; measured rebuilds scale the engine term and leave the others alone."""
    old, new = plan(), plan(actor_generate=DP2)
    assert cost(old, new).engine_s == 0.0  # Nereus's sampler: no engine to rebuild
    vllm = cost(old, new, engines=True)
    assert vllm.engine_s == COSTS.vllm_engine_s and vllm.seconds == pytest.approx(cost(old, new).seconds + 30)
    assert cost(old, plan(actor_train=DP2), engines=True).engine_s == 0.0
    assert cost(old, old, engines=True, resize=True).engine_s == COSTS.vllm_engine_s  # a new world
    assert (
        cost(old, plan(actor_generate=PP2.model_copy(update={"micro_batches": 2})), engines=True).engine_s
        == 0
    )

    state = job.start(CFG)
    controller = state.controller.model_copy(
        update={"settings": state.controller.settings.model_copy(update={"rollout_engine": "vllm"})}
    )
    ran = TransitionTiming(predicted=vllm, seconds=0.4 * vllm.seconds)  # engines started faster
    settled = calibrated_on(controller, [ran] * 8).transition_scales
    assert (
        settled.engine < 0.6 and min(settled.wire, settled.ops, settled.durable) > 0.99
    )  # the engine term took it
    assert cost(old, new, engines=True, scales=settled).seconds < 0.6 * vllm.seconds


def test_plan_a_s_engines_hold_generations_devices_through_the_moves() -> None:
    """Plan A's vLLM engines stop only after the commit, so their weights and KV cache stay on
    actor/generate's devices while the states move (``move_capacities``); the GTG plans around them:
    a switch that moves live with that memory free goes partly durable, then is refused."""
    old, new = plan(), plan(actor_train=DP2, critic_train=DP2)
    cap = 8 * MIB
    assert move_capacities(old, MODELS, capacity=cap, devices=2, engine_kv_bytes=0) == {0: cap, 1: cap}
    weights = bytes_per_device(MODELS["actor"], old["actor/generate"], train=False)
    held = move_capacities(old, MODELS, capacity=cap, devices=2, engine_kv_bytes=MIB)
    assert held == {d: cap - weights[d]["params"] - MIB for d in (0, 1)}

    def route(kv: int) -> str:
        caps = move_capacities(old, MODELS, capacity=cap, devices=2, engine_kv_bytes=kv)
        return plan_moves(old, new, MODELS, caps, live=True).graph.route

    assert route(0) == "live" and route(3 * MIB) == "mixed"  # some stages wait for a checkpoint read
    with pytest.raises(TransitionInfeasible, match="cannot hold plan B"):
        route(4 * MIB)
    free = executed_cost(old, new, MODELS, CPU_WORKERS, capacity=cap, devices=2, costs=COSTS, engines=True)
    held_cost = executed_cost(
        old,
        new,
        MODELS,
        CPU_WORKERS,
        capacity=cap,
        devices=2,
        costs=COSTS,
        engines=True,
        engine_kv_bytes=3 * MIB,
    )
    assert held_cost.seconds > free.seconds  # the controller prices the route the flow will take
