"""A transition as the executor runs it, and what that costs: the prediction the controller trusts.

    move_basis(observation, settings) -> MoveBasis: the pool a switch is priced on (slots, memory
        per slot, the KV cache plan A's vLLM engines hold through the moves: ``moves.move_capacities``)
    plan_moves(old, new, models, capacities, live) -> Planned: the GTG and the schedule of units
    schedule_moves(old, new, models, basis) -> MoveSchedule: plan_moves on that basis, memoised
    priced_moves(old, new, ...) -> (TransitionEstimate, MoveSchedule): the price and the schedule
        it priced; the controller's switch carries that schedule and the transition flow runs it
        after re-checking its basis against the live pool (flows/job/transition.py), never
        planning it again
    executed_cost(old, new, ...) -> TransitionEstimate of that schedule, in unscaled terms
        that the job's measured transitions calibrate (``TransitionScales``, controller.observe):
          wire     per byte: each wave's busiest port (the GTG's transfer list) over the link,
                   checkpoint reads over the store's bandwidth, copy syncs over the link
          ops      per operation: device calls, layouts' process groups built, DeepSpeed
                   engines built, point-to-point messages; and the switch's own fixed cost
                   (``switch_s``: the subflow's flow run, journal and records)
          durable  fixed costs of a new world: its rebuild, and workers started and warmed up
                   (only the workers not prepared ahead: ``DevicePool.prepare``)
          engine   actor/generate's vLLM engines rebuilt on its new layout (rollout.engine: vllm)
          recovery what the switch writes first (``recovery_write``: the job's switch_recovery,
                   sync whenever a unit rehydrates): ``transition_cost.recovery_seconds``
          verify   the live state gathered and hashed before and after (job.verify_transitions)

The controller priced a transition by its bytes alone and was off by 2-20x; on a small
model nearly all of a switch is per-operation cost (a train stage's engine, a relink's groups).
Each hardware profile holds those constants (``HardwareProfile.transitions``, a ``TransitionCosts``;
the durable price from layouts alone reads the same ones); the job's own transitions scale them.

Boundary: pure planning over layouts and model configs; ``analytic_transition_cost`` in
``transition_cost`` remains the estimate from layouts alone (the simulator's).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from functools import lru_cache

from nereus_core.config import ModelConfig, RecoveryMode, recovery_write
from nereus_core.controller.moves import MoveBasis, MoveSchedule, Planned
from nereus_core.controller.state import ControllerSettings, Observation
from nereus_core.cost.calibration import CalibrationSettings
from nereus_core.cost.hardware import HardwareProfile
from nereus_core.cost.transition_cost import (
    TransitionCosts,
    TransitionEstimate,
    TransitionScales,
    engine_rebuild_seconds,
    recovery_seconds,
    verify_seconds,
)
from nereus_core.emu import bytes_per_device, plan_reshard, shard_map
from nereus_core.gtg import TransitionInfeasible, build_gtg
from nereus_core.gtg.execution import NoStageSchedule, stage_schedule
from nereus_core.layout import Layout
from nereus_core.plan import GlobalPlan, ModelStage, StageLayouts, copies, own_state

# The controller of a job on a device pool: moves priced as the transition flow runs them, and each
# measured transition moving the transition scales halfway (in log) at first: a job makes few
# switches and one may run on a busier machine (the demo's on a shared 2-core machine: 0.3-3x).
JOB_CONTROLLER = ControllerSettings(
    transition_pricing="schedule", transition_calibration=CalibrationSettings(prior=1.0)
)


def plan_moves(
    old: StageLayouts,
    new: StageLayouts,
    models: Mapping[str, ModelConfig],
    capacities: dict[int, int],
    *,
    live: bool,
) -> Planned:
    """The GTG over the model-stages that own state, and the schedule of whole units; a GTG order
    that units cannot follow safely sends every changed stage durable (always safe: plan B alone
    fits, which the GTG checks; ``TransitionInfeasible`` otherwise). ``models``: config by model."""
    stateful = own_state(new)  # the job's model-stages that own state
    stages = {s: (models[ModelStage(s).model], ModelStage(s).trains) for s in stateful}
    a, b = {s: old[s] for s in stateful}, {s: new[s] for s in stateful}
    graph = build_gtg(a, b, stages, capacities, allow_live=live)
    try:
        return Planned(graph, stage_schedule(graph, capacities), graph.reason)
    except NoStageSchedule as err:
        graph = build_gtg(a, b, stages, capacities, allow_live=False)
        return Planned(graph, stage_schedule(graph, capacities), f"durable: {err}")


def move_basis(observation: Observation, settings: ControllerSettings) -> MoveBasis:
    """The pool the controller prices a switch on: the observation's slots and memory, and the
    engines' KV cache when generation runs on vLLM."""
    kv = observation.workload.engine_kv_bytes if settings.rollout_engine == "vllm" else 0
    return MoveBasis(
        slots=observation.devices, memory_per_device=observation.memory_per_device, engine_kv_bytes=kv
    )


def schedule_moves(
    old: GlobalPlan, new: GlobalPlan, models: Mapping[str, ModelConfig], basis: MoveBasis
) -> MoveSchedule:
    """The live move schedule from ``old`` to ``new`` on ``basis`` (memoised: the controller prices
    the same pairs step after step)."""
    return _schedule(_key(old.layouts), _key(new.layouts), tuple(sorted(models.items())), basis)


@lru_cache(maxsize=1024)
def _schedule(
    old_key: tuple[tuple[str, Layout], ...],
    new_key: tuple[tuple[str, Layout], ...],
    models_key: tuple[tuple[str, ModelConfig], ...],
    basis: MoveBasis,
) -> MoveSchedule:
    old = GlobalPlan.of({ModelStage(k): v for k, v in old_key})
    new = GlobalPlan.of({ModelStage(k): v for k, v in new_key})
    models = dict(models_key)
    caps = basis.capacities(old.layouts, models)
    try:
        planned = plan_moves(old.layouts, new.layouts, models, caps, live=True)
    except (TransitionInfeasible, NoStageSchedule) as err:
        return MoveSchedule(old=old, new=new, basis=basis, capacities=caps, planned=None, refused=str(err))
    return MoveSchedule(old=old, new=new, basis=basis, capacities=caps, planned=planned)


class _Tally:
    """The unscaled terms as the schedule adds them up."""

    def __init__(self, bandwidth: float, costs: TransitionCosts, built: set[str]) -> None:
        self.bandwidth, self.costs, self.built = bandwidth, costs, built
        self.wire = self.ops = self.durable = 0.0
        self.link_bytes = 0
        self.calls = 0

    def call(self, n: int = 1) -> None:
        self.ops += n * self.costs.call_s
        self.calls += n

    def groups(self, layout: Layout) -> None:
        if layout.key not in self.built:
            self.built.add(layout.key)
            self.ops += self.costs.groups_s

    def engine(self, stage: str) -> None:
        if ModelStage(stage).trains:
            self.ops += self.costs.engine_s

    def ports(self, transfers: list[tuple[int, int, int]]) -> None:
        """Transfers that run at once: the busiest port's bytes over the link, one message per peer."""
        port: dict[tuple[str, int], int] = defaultdict(int)
        peers: dict[int, set[int]] = defaultdict(set)
        for src, dst, nbytes in transfers:
            port[("send", src)] += nbytes
            port[("recv", dst)] += nbytes
            peers[src].add(dst)
            peers[dst].add(src)
        busiest = max(port.values(), default=0)
        self.link_bytes += busiest
        self.wire += busiest / self.bandwidth
        self.ops += max((len(p) for p in peers.values()), default=0) * self.costs.message_s

    def read(self, config: ModelConfig, layout: Layout, train: bool) -> None:
        """A model-stage rehydrated on ``layout``: every device reads its state at once."""
        per = bytes_per_device(config, layout, train=train)
        most = max((k["params"] + k["optimizer"] for k in per.values()), default=0)
        self.wire += most / self.costs.store_read_bandwidth


def _relink(t: _Tally, models: Mapping[str, ModelConfig], new: StageLayouts, copy: ModelStage) -> None:
    """Follow the train stage again: share its shards on its layout, else build and sync (one call)."""
    source = new[copies(new)[copy]]
    t.groups(new[copy])
    t.call()
    if new[copy] != source:
        config = models[copy.model]
        plan = plan_reshard(shard_map(config, source, train=False), shard_map(config, new[copy], train=False))
        t.ports([(x.src, x.dst, x.nbytes) for x in plan.transfers])


def _same_world(
    t: _Tally, planned: Planned, old: StageLayouts, new: StageLayouts, models: Mapping[str, ModelConfig]
) -> None:
    """What flows/job/transition.py's ``_run_schedule`` runs: per wave, its live moves in one call, its
    other units one call each; then every changed copy unloaded and relinked."""
    g = planned.graph
    for wave in planned.schedule.waves:
        moves = [u.partition(":")[2] for u in wave if u.startswith("move:")]
        if moves:
            t.call()
            for stage in moves:
                t.groups(new[stage])
                t.engine(stage)
            t.ports(
                [(op.src, op.dst, op.nbytes) for op in g.ops if op.kind == "transfer" and op.stage in moves]
            )  # type: ignore[misc]
        for unit in wave:
            kind, _, stage = unit.partition(":")
            if kind == "unload":
                t.call()
            elif kind == "load":
                t.call()
                t.groups(new[stage])
                t.engine(stage)
                t.read(models[ModelStage(stage).model], new[stage], ModelStage(stage).trains)
    for copy, source in copies(new).items():
        if old[copy] != new[copy] or old[source] != new[source]:
            t.call()  # unload the old copy
            _relink(t, models, new, copy)


def _new_world(t: _Tally, new: StageLayouts, models: Mapping[str, ModelConfig], cold: int) -> None:
    """What ``rehydrate_all`` runs: drop every shard, a new world (workers not prepared start and
    warm up first), every model-stage rehydrated from the checkpoint, every copy relinked."""
    t.call()
    t.durable += t.costs.world_rebuild_s
    if cold > 0:  # new workers start and warm up together
        t.durable += t.costs.worker_start_s + t.costs.warm_up_s
    for stage in own_state(new):
        t.call()
        t.groups(new[stage])
        t.engine(stage)
        t.read(models[stage.model], new[stage], stage.trains)
    for copy in copies(new):
        _relink(t, models, new, copy)


def executed_cost(
    old: StageLayouts,
    new: StageLayouts,
    models: Mapping[str, ModelConfig],
    profile: HardwareProfile,
    *,
    capacity: int,
    devices: int,
    resize: bool = False,
    cold: int = 0,
    costs: TransitionCosts | None = None,
    scales: TransitionScales | None = None,
    engines: bool = False,
    engine_kv_bytes: int = 0,
) -> TransitionEstimate:
    """The cost of switching from ``old`` to ``new`` (every model-stage's layout) as the transition
    flow runs it. ``resize``: the device set changes (a new world of ``devices`` slots); ``cold``:
    how many of its workers were not started and warmed ahead. ``capacity``: bytes per slot.
    ``engines``: actor/generate runs on vLLM engines, rebuilt when its layout changes, each holding
    ``engine_kv_bytes`` of KV cache per device through the moves (``move_capacities``)."""
    basis = MoveBasis(
        slots=devices, memory_per_device=capacity, engine_kv_bytes=engine_kv_bytes if engines else 0
    )
    args = (GlobalPlan.of(old), GlobalPlan.of(new), models, profile)
    return priced_moves(
        *args, basis=basis, resize=resize, cold=cold, costs=costs, scales=scales, engines=engines
    )[0]


def priced_moves(
    old: GlobalPlan,
    new: GlobalPlan,
    models: Mapping[str, ModelConfig],
    profile: HardwareProfile,
    *,
    basis: MoveBasis,
    resize: bool = False,
    cold: int = 0,
    costs: TransitionCosts | None = None,
    scales: TransitionScales | None = None,
    engines: bool = False,
    recovery: RecoveryMode = "none",
    verify: bool = False,
) -> tuple[TransitionEstimate, MoveSchedule | None]:
    """``executed_cost`` with the schedule it priced (None for a new world: ``resize``, every stage
    rehydrated, or no memory-safe live schedule on the basis). ``recovery``: the job's
    ``switch_recovery``, written as ``recovery_write`` says (synchronously when a unit is durable);
    ``verify``: the switch's live state is verified (``verify_seconds``)."""
    costs = costs or profile.transitions
    keys = (_key(old.layouts), _key(new.layouts), tuple(sorted(models.items())))
    wire, ops, durable, link_bytes, calls, moves = _terms(*keys, profile.intra_bw, basis, resize, cold, costs)
    engine = engine_rebuild_seconds(old.layouts, new.layouts, costs, resize=resize) if engines else 0.0
    recovery_s = verify_s = 0.0
    if old != new or resize:
        mode = recovery_write(recovery, durable=has_durable_units(moves, resize=resize))
        in_place = staged_in_place(moves, mode, resize=resize)
        recovery_s = recovery_seconds(mode, old.layouts, models, profile, costs, in_place=in_place)
        verify_s = verify_seconds(new.layouts, models, profile, costs) if verify else 0.0
    estimate = TransitionEstimate.of(
        wire,
        ops,
        scales,
        durable,
        engine,
        recovery_s,
        verify_s,
        critical_bytes=link_bytes,
        transfers=calls,
        analytic=False,
    )
    return estimate, moves


def has_durable_units(moves: MoveSchedule | None, *, resize: bool) -> bool:
    """Whether a switch rehydrates anything from the checkpoint of its step: a new world (``resize``),
    no memory-safe live schedule (``moves`` None or refused: priced as a new world), or a schedule
    with durable units (``load:``)."""
    if resize or moves is None or moves.planned is None:
        return True
    return any(unit.startswith("load:") for unit in moves.planned.schedule.order)


def staged_in_place(moves: MoveSchedule | None, mode: RecoveryMode, *, resize: bool) -> frozenset[str]:
    """The model-stages whose ``async`` recovery point is written from their old shards themselves,
    with no staging copy: those a one-wave live schedule keeps until the switch ends
    (``StageSchedule.kept_sources``). They are never written again: a commit retires them, a
    rollback copies them into a rebuilt stage. Every other model-stage is copied first (the next
    step trains it in place)."""
    if mode != "async" or resize or moves is None or moves.planned is None:
        return frozenset()
    return moves.planned.schedule.kept_sources


def _key(plan: StageLayouts) -> tuple[tuple[str, Layout], ...]:
    return tuple(sorted((str(k), v) for k, v in plan.items()))


@lru_cache(maxsize=1024)  # the controller prices the same pairs step after step
def _terms(
    old_key: tuple[tuple[str, Layout], ...],
    new_key: tuple[tuple[str, Layout], ...],
    models_key: tuple[tuple[str, ModelConfig], ...],
    bandwidth: float,
    basis: MoveBasis,
    resize: bool,
    cold: int,
    costs: TransitionCosts,
) -> tuple[float, float, float, int, int, MoveSchedule | None]:
    if old_key == new_key and not resize:
        return (0.0, 0.0, 0.0, 0, 0, None)
    old = {ModelStage(k): v for k, v in old_key}
    new = {ModelStage(k): v for k, v in new_key}
    models = dict(models_key)
    tally = _Tally(bandwidth, costs, set() if resize else {v.key for v in old.values()})
    moves = None if resize else _schedule(old_key, new_key, models_key, basis)
    if moves is None or moves.planned is None:  # the flow refuses an unsafe one: priced as a new world
        _new_world(tally, new, models, cold if resize else 0)
    else:
        _same_world(tally, moves.planned, old, new, models)
    tally.ops += costs.switch_s  # the subflow itself, its journal and records
    return (tally.wire, tally.ops, tally.durable, tally.link_bytes, tally.calls, moves)
