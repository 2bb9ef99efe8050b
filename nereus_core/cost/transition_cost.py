"""What a transition and a weight sync cost: the controller's prediction of moving state between plans.

Boundary: pure arithmetic over layouts, model configs and a ``HardwareProfile`` (or the transfer
list of a reshard plan), scaled by factors calibrated on the job's own measured transitions
(``TransitionScales``). The per-operation and fixed costs of a transition are the hardware
profile's own (``HardwareProfile.transitions``, a ``TransitionCosts``), read by the executed
schedule's price (``controller.transition_schedule``) and by the durable price from layouts alone.
Per-stage step latency and memory
are ``stage_cost.py``'s.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

import numpy as np
from pydantic import Field

from nereus_core.config import ModelConfig, RecoveryMode, recovery_write
from nereus_core.cost.geometry import value_bytes
from nereus_core.cost.hardware import HardwareProfile, TransitionCosts
from nereus_core.cost.stage_cost import stage_kind
from nereus_core.cost.terms import Num, model_stats
from nereus_core.frozen import Frozen
from nereus_core.layout import Layout
from nereus_core.plan import ModelStage

# The terms of a transition's price, each calibrated on its own scale (``TransitionScales``).
TRANSITION_TERMS = ("wire", "ops", "durable", "engine", "recovery", "verify")


class TransferLike(Protocol):
    """One copy of a slice between device slots (``emu.Transfer`` has these fields)."""

    src: int
    dst: int
    nbytes: int


class TransitionScales(Frozen):
    """Calibrated multipliers of the transition cost."""

    wire: float = Field(default=1.0, gt=0, description="Scale of the bytes-over-links time.")
    ops: float = Field(default=1.0, gt=0, description="Scale of the per-operation overhead.")
    durable: float = Field(default=1.0, gt=0, description="Scale of a durable switch's fixed cost.")
    engine: float = Field(default=1.0, gt=0, description="Scale of the rollout engines' rebuild.")
    recovery: float = Field(default=1.0, gt=0, description="Scale of the switch's recovery point.")
    verify: float = Field(default=1.0, gt=0, description="Scale of the live-state verification.")

    def as_array(self) -> np.ndarray:
        return np.array([getattr(self, k) for k in TRANSITION_TERMS], dtype=float)

    @classmethod
    def from_array(cls, values: Sequence[float]) -> TransitionScales:
        return cls(**{k: float(v) for k, v in zip(TRANSITION_TERMS, values, strict=True)})


class TransitionEstimate(Frozen):
    """Predicted cost of moving state from one plan to another."""

    seconds: float
    wire_s: float = Field(description="Unscaled time of the busiest port (send or receive).")
    ops_s: float = Field(description="Unscaled per-operation overhead on the busiest device.")
    durable_s: float = Field(
        default=0.0,
        description="Unscaled fixed cost of a durable switch (0 for a live one): ``durable_seconds``.",
    )
    engine_s: float = Field(
        default=0.0,
        description="Unscaled rebuild of the rollout engines (0 unless generation runs on vLLM engines "
        "and its layout changes): ``engine_rebuild_seconds``.",
    )
    recovery_s: float = Field(
        default=0.0, description="Unscaled recovery point on the critical path: ``recovery_seconds``."
    )
    verify_s: float = Field(
        default=0.0, description="Unscaled live-state verification (0 when off): ``verify_seconds``."
    )
    critical_bytes: int = Field(description="Bytes through the busiest port.")
    transfers: int = Field(description="Operations counted (transfers, or changed layouts when analytic).")
    analytic: bool = Field(description="True when estimated from layouts (no transfer list was given).")

    @property
    def terms(self) -> tuple[float, ...]:
        """The unscaled terms, in ``TRANSITION_TERMS`` order (what calibration fits)."""
        return tuple(getattr(self, f"{k}_s") for k in TRANSITION_TERMS)

    @classmethod
    def of(
        cls,
        wire_s: float,
        ops_s: float,
        scales: TransitionScales | None,
        durable_s: float = 0.0,
        engine_s: float = 0.0,
        recovery_s: float = 0.0,
        verify_s: float = 0.0,
        **rest: int | bool,
    ) -> TransitionEstimate:
        terms = (wire_s, ops_s, durable_s, engine_s, recovery_s, verify_s)
        seconds = float(np.dot((scales or TransitionScales()).as_array(), terms))
        named = {f"{k}_s": v for k, v in zip(TRANSITION_TERMS, terms, strict=True)}
        return cls(seconds=seconds, **named, **rest)

    def with_recovery(
        self, recovery_s: float, verify_s: float, scales: TransitionScales | None
    ) -> TransitionEstimate:
        """This estimate with the recovery point's and the verification's terms set (and priced)."""
        terms = (*self.terms[:4], recovery_s, verify_s)
        seconds = float(np.dot((scales or TransitionScales()).as_array(), terms))
        return self.model_copy(update={"seconds": seconds, "recovery_s": recovery_s, "verify_s": verify_s})


def transition_cost(
    transfers: Iterable[TransferLike | tuple[int, int, int]],
    profile: HardwareProfile,
    scales: TransitionScales | None = None,
) -> TransitionEstimate:
    """Cost of a list of transfers: the busiest port's bytes / its link bandwidth + per-op overhead.

    Every device sends and receives at once; transfers through the same port queue
    behind each other, so the critical path is the busiest port (a lower bound of
    any schedule, reached when the GTG keeps every port busy). Same-device copies
    run at memory bandwidth.
    """
    send: dict[int, float] = {}
    recv: dict[int, float] = {}
    ops: dict[int, int] = {}
    sent_bytes: dict[int, int] = {}
    count = 0
    for item in transfers:
        src, dst, nbytes = item if isinstance(item, tuple) else (item.src, item.dst, item.nbytes)
        count += 1
        ops[src] = ops.get(src, 0) + 1
        ops[dst] = ops.get(dst, 0) + 1 if dst != src else ops.get(dst, 0)
        if src == dst:
            send[src] = send.get(src, 0.0) + nbytes / profile.hbm
            continue
        bw = profile.inter_bw if profile.node_of(src) != profile.node_of(dst) else profile.intra_bw
        send[src] = send.get(src, 0.0) + nbytes / bw + profile.collective_latency_s
        recv[dst] = recv.get(dst, 0.0) + nbytes / bw + profile.collective_latency_s
        sent_bytes[src] = sent_bytes.get(src, 0) + nbytes
        sent_bytes[dst] = sent_bytes.get(dst, 0) + nbytes
    wire = max([*send.values(), *recv.values(), 0.0])
    ops_s = max(ops.values(), default=0) * profile.transitions.transition_op_overhead_s
    return TransitionEstimate.of(
        wire,
        ops_s,
        scales,
        critical_bytes=max(sent_bytes.values(), default=0),
        transfers=count,
        analytic=False,
    )


def held_fraction(
    new_tp: Num, new_pp: Num, old_tp: Num, old_pp: Num, new_dp: Num = 1, old_dp: Num = 1
) -> Num:
    """Share of a device's new shard it already holds under the old layout, shards nested axis by
    axis: min(1, t_new/t_old) * min(1, p_new/p_old) (* min(1, d_new/d_old) for dp-sharded state).

    With generation coarser than training on every axis this is HybridFlow's (Sheng et al.
    2025, Table 2) (tg*pg)/(t*p), i.e. a transfer of M/(tg*pg) - M/(t*p) per device.
    """
    return (
        np.minimum(1.0, new_tp / old_tp) * np.minimum(1.0, new_pp / old_pp) * np.minimum(1.0, new_dp / old_dp)
    )


def reshard_bytes(
    stage: str, old: Layout | None, new: Layout, model: ModelConfig, profile: HardwareProfile
) -> int:
    """Bytes the busiest device of ``new`` receives when ``stage`` moves from ``old`` to ``new``:
    the part of its new shard it does not hold (``held_fraction``; all of it on a device new to
    the model-stage). Optimizer state (train stages) is sharded over dp as well."""
    if old == new:
        return 0
    stats = model_stats(model)
    per = value_bytes(stats, profile)
    weights = stats.total_params * per.weight / (new.tp * new.pp)
    state = stats.total_params * per.optimizer / new.world_size if stage_kind(stage) == "train" else 0
    if old is None or set(new.devices) - set(old.devices):
        return math.ceil(weights + state)
    held_w = held_fraction(new.tp, new.pp, old.tp, old.pp)
    held_s = held_fraction(new.tp, new.pp, old.tp, old.pp, new.dp, old.dp)
    return math.ceil(weights * (1.0 - held_w) + state * (1.0 - held_s))


def durable_seconds(
    new: dict[str, Layout], models: dict[str, ModelConfig], profile: HardwareProfile, costs: TransitionCosts
) -> float:
    """Unscaled fixed cost of a durable switch onto ``new``: one world rebuilt, one engine per train
    stage, and every stage's state read from the checkpoint, its busiest device reading its whole
    shard (``reshard_bytes`` of a device new to the stage; weights, and optimizer state for train
    stages) at the store's bandwidth per device, stage after stage as ``rehydrate_all`` runs them;
    the inference copies are relinked to their train stages, not read."""
    engines, read = 0, 0
    for stage, layout in new.items():
        if not ModelStage(stage).owns_state:
            continue
        engines += stage_kind(stage) == "train"
        read += reshard_bytes(stage, None, layout, models[stage.partition("/")[0]], profile)
    return costs.world_rebuild_s + engines * costs.engine_s + read / costs.store_read_bandwidth


def _state_bytes(stage: str, model: ModelConfig, profile: HardwareProfile) -> float:
    """Bytes of a model-stage's whole state: weights, and the optimizer's for a train stage."""
    stats = model_stats(model)
    per = value_bytes(stats, profile)
    optimizer = per.optimizer if stage_kind(stage) == "train" else 0
    return stats.total_params * (per.weight + optimizer)


def _owners(layouts: Mapping[str, Layout]) -> list[str]:
    return [s for s in layouts if ModelStage(s).owns_state]


def recovery_seconds(
    mode: RecoveryMode,
    old: Mapping[str, Layout],
    models: Mapping[str, ModelConfig],
    profile: HardwareProfile,
    costs: TransitionCosts | None = None,
    *,
    in_place: frozenset[str] = frozenset(),
) -> float:
    """Unscaled seconds a switch's recovery point (``recovery_write``'s mode) holds the job up,
    written from plan A (``old``): every model's distinct pieces, spread over its stage's devices,
    one stage after another as the checkpoint runs them, each one device call; ``sync`` at the
    store's write bandwidth per device, ``async`` at the host staging bandwidth (the write itself runs
    in the background), ``none`` nothing. ``in_place``: ``async`` model-stages written from their
    kept old shards (``transition_schedule.staged_in_place``): no copy where the devices' memory is
    the host's (``TransitionCosts.host_memory``), only the call."""
    if mode == "none":
        return 0.0
    costs = costs or profile.transitions
    bandwidth = costs.store_write_bandwidth if mode == "sync" else costs.staging_bandwidth
    seconds = 0.0
    for stage in _owners(old):
        per_device = _state_bytes(stage, models[stage.partition("/")[0]], profile) / len(old[stage].devices)
        copied = not (mode == "async" and costs.host_memory and stage in in_place)
        seconds += costs.call_s + (per_device / bandwidth if copied else 0.0)
    return seconds


def verify_seconds(
    layouts: Mapping[str, Layout],
    models: Mapping[str, ModelConfig],
    profile: HardwareProfile,
    costs: TransitionCosts | None = None,
) -> float:
    """Unscaled seconds of a switch's verification (``job.verify_transitions``): every model's whole
    state gathered to the driver and hashed before the moves and after (``digest_bandwidth``), and
    the probe batch's forward passes on plan A and plan B (one device call per stage each time)."""
    costs = costs or profile.transitions
    owners = _owners(layouts)
    total = sum(_state_bytes(s, models[s.partition("/")[0]], profile) for s in owners)
    return 2 * (total / costs.digest_bandwidth + 2 * len(owners) * costs.call_s)


def setup_seconds(old: dict[str, Layout], new: dict[str, Layout], profile: HardwareProfile) -> float:
    """Fixed cost of bringing up the layouts of ``new`` whose degrees or devices differ from ``old``:
    their process groups, created in parallel (one ``group_setup_s``), and the
    generation engine rebuilt when generation's layout changed (``engine_rebuild_s``)."""
    changed = [
        s
        for s, v in new.items()
        if s not in old
        or old[s].model_copy(update={"micro_batches": 1}) != v.model_copy(update={"micro_batches": 1})
    ]
    if not changed:
        return 0.0
    engine = (
        profile.transitions.engine_rebuild_s if any(stage_kind(s) == "generate" for s in changed) else 0.0
    )
    return profile.transitions.group_setup_s + engine


def engines_rebuilt(old: Mapping[str, Layout], new: Mapping[str, Layout], *, resize: bool = False) -> bool:
    """Whether a switch from ``old`` to ``new`` rebuilds actor/generate's vLLM engines: its degrees
    or devices change (its micro-batches do not matter to an engine), or the device set does
    (``resize``: a new world)."""
    stage = "actor/generate"
    before, after = old.get(stage), new.get(stage)
    if before is None or after is None:
        return False
    bare = [v.model_copy(update={"micro_batches": 1}) for v in (before, after)]
    return resize or bare[0] != bare[1]


def engine_rebuild_seconds(
    old: Mapping[str, Layout], new: Mapping[str, Layout], costs: TransitionCosts, *, resize: bool = False
) -> float:
    """Unscaled rebuild of actor/generate's vLLM engines (``rollout.engine: vllm``) when the switch
    rebuilds them (``engines_rebuilt``): the new engines start at once (``vllm_engine_s``); otherwise
    0 (the engines keep running, their weights synced in place as after every step)."""
    return costs.vllm_engine_s if engines_rebuilt(old, new, resize=resize) else 0.0


def analytic_transition_cost(
    old: dict[str, Layout],
    new: dict[str, Layout],
    models: dict[str, ModelConfig],
    profile: HardwareProfile,
    scales: TransitionScales | None = None,
    *,
    durable: bool = False,
    costs: TransitionCosts | None = None,
    recovery: RecoveryMode = "none",
    verify: bool = False,
) -> TransitionEstimate:
    """Transition cost from layouts alone (no transfer list): the sum over model-stages of the
    busiest device's receive bytes (an upper bound of one device's total) over the slowest link.

    ``durable`` (the device set changes, so the world is rebuilt): nothing moves device to device;
    every model-stage is rehydrated or relinked (one operation each) at ``durable_seconds`` of
    ``costs`` (the profile's, ``profile.transitions``, unless given). ``recovery``: the job's
    ``switch_recovery`` (what the switch writes first: ``recovery_write``); ``verify``: the job
    verifies the switch's live state (``verify_seconds``)."""
    costs = costs or profile.transitions
    mode = recovery_write(recovery, durable=durable)
    recovery_s = recovery_seconds(mode, old or new, models, profile, costs) if old != new or durable else 0.0
    verify_s = verify_seconds(new, models, profile, costs) if verify and (old != new or durable) else 0.0
    if durable:
        ops_s = len(new) * profile.transitions.transition_op_overhead_s
        fixed = durable_seconds(new, models, profile, costs)
        return TransitionEstimate.of(
            0.0,
            ops_s,
            scales,
            fixed,
            0.0,
            recovery_s,
            verify_s,
            critical_bytes=0,
            transfers=len(new),
            analytic=True,
        )
    total, changed, inter = 0, 0, False
    for stage, layout in new.items():
        before = old.get(stage)
        if before == layout:
            continue
        changed += 1
        total += reshard_bytes(stage, before, layout, models[stage.partition("/")[0]], profile)
        inter = inter or profile.spans_nodes((*layout.devices, *(before.devices if before else ())))
    bw = profile.inter_bw if inter else profile.intra_bw
    wire = total / bw + (profile.collective_latency_s if changed else 0.0)
    ops_s = changed * profile.transitions.transition_op_overhead_s + setup_seconds(old, new, profile)
    return TransitionEstimate.of(
        wire,
        ops_s,
        scales,
        recovery_s=recovery_s,
        verify_s=verify_s,
        critical_bytes=total,
        transfers=changed,
        analytic=True,
    )


def sync_seconds(
    model: ModelConfig,
    profile: HardwareProfile,
    gen_tp: Num,
    gen_pp: Num,
    *,
    link: Iterable[int],
    train: tuple[Num, Num] | None = None,
) -> Num:
    """Unscaled time to refresh the generation copy of the actor after its update, each step,
    for generation degrees ``gen_tp`` x ``gen_pp`` (scalars or one per candidate layout).

    Colocated (``train`` = actor/train's ``(tp, pp)``), the 3D-HybridEngine reshard of HybridFlow
    (Table 2): each generation device receives the part of its shard M/(tg*pg) it does not hold
    (``held_fraction``) over ``link``, the slots of a training replica. Disaggregated (``train``
    None), each generation device receives its whole shard over ``link``, a generation slot and a
    training slot (receivers bound the time: the training pool has at least as many senders).
    """
    stats = model_stats(model)
    shard_g = stats.total_params * value_bytes(stats, profile).weight / (gen_tp * gen_pp)
    nbytes = shard_g if train is None else shard_g * (1.0 - held_fraction(gen_tp, gen_pp, *train))
    latency = np.where(nbytes > 0, profile.collective_latency_s, 0.0)  # nothing to move, no round
    return nbytes / profile.link_bandwidth(link) + latency


def weight_sync_s(
    train: Layout, generate: Layout, model: ModelConfig, profile: HardwareProfile, *, colocated: bool
) -> float:
    """``sync_seconds`` of two layouts of the actor (train and generate)."""
    if colocated:
        degrees = (train.tp, train.pp)
        return float(
            sync_seconds(
                model, profile, generate.tp, generate.pp, link=train.replica_groups()[0], train=degrees
            )
        )
    link = (generate.devices[0], train.devices[0])
    return float(sync_seconds(model, profile, generate.tp, generate.pp, link=link))
