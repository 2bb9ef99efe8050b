"""Latency and memory of one model-stage under one layout: the analytic prior the controller ranks plans by.

Boundary: pure arithmetic over a ``ModelConfig``, a ``Layout`` (or arrays of
candidate degrees), a ``Workload`` and a ``HardwareProfile``; nothing runs.
Calibration (``calibration.py``) multiplies each latency term by a scale fitted
to the running job; memory is not scaled (it gates feasibility, so it stays a
conservative bound).

Latency terms (seconds, summed; no overlap assumed, calibration absorbs any):
- ``compute``: FLOPs / effective throughput; 2*params per token forward and 6*params
  train, plus attention 4*L*h*s forward / 12*L*h*s train (hardware.md, "Training FLOPs").
- ``decode``: memory-bound decode, per token step (weights/tp + KV read) / HBM
  bandwidth (hardware.md, "Decode is memory-bound").
- ``tp_comm``: per layer 2 all-reduces forward (+2 backward) of b*s*h values, plus
  Megatron's vocab-parallel embedding/head collectives; a ring all-reduce moves
  2(t-1)/t of the buffer and pays 2(t-1) hops of latency (hardware.md, "TP
  traffic"; alpha-beta model of Thakur et al. 2005).
- ``pp_comm``: the pipeline bubble (p-1)/(m+p-1) of the pipelined time
  (Narayanan et al. 2021) plus the point-to-point sends between stages.
- ``dp_comm``: ZeRO-1 gradient reduce-scatter + parameter all-gather = one ring
  all-reduce of the device's gradients over dp (Rajbhandari et al. 2020).
- ``optimizer``: the Adam step, memory-bound over the device's state shard.
- ``overhead``: a fixed cost per decoder-layer pass (kernel launches; Python on CPU).
- ``dispatch``: a fixed cost per stage call plus one per device reached.

Memory (bytes on the busiest device): weights, gradients, ZeRO-1 optimizer state
sharded over dp, activations (Korthikanti et al. 2022: s*b*h*(34 + 5*a*s/h) bytes per
layer in 16-bit, divided by t under TP+SP), KV cache for generation (2*L*kv*d*bytes
per token). Time uses the mean response length, memory the high quantile.

The formulas themselves, vectorized over candidate layouts, are in ``cost_terms``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from nereus_core.config import ModelConfig, NereusConfig
from nereus_core.cost_terms import (
    MEMORY_PARTS,
    TERMS,
    Geometry,
    Num,
    StageKind,
    bubble_fraction,
    is_contiguous,
    korthikanti_bytes,
    layout_geometry,
    model_stats,
    ring_bytes,
    stage_tables,
)
from nereus_core.hardware import HardwareProfile
from nereus_core.layout import Layout
from nereus_core.plan import ModelStage


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def stage_kind(stage: str) -> StageKind:
    """``'actor/generate'`` -> ``'generate'``."""
    kind = stage.partition("/")[2]
    if kind not in ("generate", "infer", "train"):
        raise ValueError(f"{stage!r} is not a model-stage; expected model/generate|infer|train")
    return kind  # type: ignore[return-value]


class Workload(_Frozen):
    """What one PPO step asks of every model-stage."""

    batch: int = Field(ge=1, description="Sequences per step (global).")
    prompt_len: int = Field(ge=1, description="Prompt tokens per sequence.")
    response_mean: float = Field(gt=0, description="Mean response tokens; latency uses it.")
    response_high: int = Field(ge=1, description="High quantile (or max) of response tokens; memory uses it.")
    ppo_epochs: int = Field(default=1, ge=1, description="Passes of the train stages over the batch.")
    mini_batches: int = Field(
        default=1,
        ge=1,
        description="Optimizer steps per epoch of a train stage (batch split this many ways).",
    )

    @model_validator(mode="after")
    def _check(self) -> Workload:
        if self.response_high < self.response_mean:
            raise ValueError(
                f"response_high={self.response_high} is below response_mean={self.response_mean}; "
                "the high quantile must be at least the mean"
            )
        return self

    @classmethod
    def from_config(
        cls, config: NereusConfig, lengths: Sequence[int] = (), quantile: float = 0.9
    ) -> Workload:
        """The job's workload: its batch, prompt length, PPO epochs and mini-batches, and the response
        lengths generated (mean and ``quantile``; the config's response length until there are any)."""
        job, ppo = config.job, config.ppo
        mean, high = (
            _mean_and_high(lengths, quantile) if len(lengths) else (job.response_len, job.response_len)
        )
        return cls(
            batch=job.batch_size,
            prompt_len=job.prompt_len,
            response_mean=mean,
            response_high=high,
            ppo_epochs=ppo.ppo_epochs,
            mini_batches=ppo.mini_batches,
        )

    @classmethod
    def from_lengths(
        cls, *, batch: int, prompt_len: int, lengths: Sequence[int], quantile: float = 0.9
    ) -> Workload:
        """Mean and ``quantile`` of observed response lengths (memory then uses the quantile)."""
        if not lengths:
            raise ValueError("lengths is empty; give the observed response lengths")
        mean, high = _mean_and_high(lengths, quantile)
        return cls(batch=batch, prompt_len=prompt_len, response_mean=mean, response_high=high)


def _mean_and_high(lengths: Sequence[int], quantile: float) -> tuple[float, int]:
    values = np.asarray(lengths, dtype=float)
    mean = max(float(values.mean()), 1.0)
    return mean, max(math.ceil(float(np.quantile(values, quantile))), math.ceil(mean))


class Scales(_Frozen):
    """Per-term multipliers fitted by calibration (1 = the analytic prior)."""

    compute: float = Field(default=1.0, gt=0, description="Scale of the compute term.")
    decode: float = Field(default=1.0, gt=0, description="Scale of the memory-bound decode term.")
    tp_comm: float = Field(default=1.0, gt=0, description="Scale of tensor-parallel collectives.")
    pp_comm: float = Field(default=1.0, gt=0, description="Scale of the pipeline bubble and sends.")
    dp_comm: float = Field(default=1.0, gt=0, description="Scale of the gradient all-reduce.")
    optimizer: float = Field(default=1.0, gt=0, description="Scale of the optimizer step.")
    overhead: float = Field(default=1.0, gt=0, description="Scale of the per-layer fixed cost.")
    dispatch: float = Field(default=1.0, gt=0, description="Scale of the per-call dispatch cost.")

    def as_array(self) -> np.ndarray:
        return np.array([getattr(self, t) for t in TERMS], dtype=float)

    @classmethod
    def from_array(cls, values: Sequence[float]) -> Scales:
        return cls(**{t: float(v) for t, v in zip(TERMS, values, strict=True)})


class MemoryEstimate(_Frozen):
    """Bytes on the busiest device of a layout."""

    weights: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    kv_cache: int = 0

    @property
    def persistent(self) -> int:
        """Held between steps: weights and (ZeRO-sharded) optimizer state."""
        return self.weights + self.optimizer

    @property
    def transient(self) -> int:
        """Held only while the stage runs: gradients (DeepSpeed ZeRO-1 frees them after the step,
        as measured by benchmarks/bench_calibration.py), activations, KV cache."""
        return self.gradients + self.activations + self.kv_cache

    @property
    def total(self) -> int:
        return self.persistent + self.transient


class Estimate(_Frozen):
    """Predicted latency (per term and total) and per-device memory of one model-stage."""

    stage: str
    layout: str = Field(description="Layout key.")
    raw: dict[str, float] = Field(description="Unscaled term seconds (what calibration fits against).")
    terms: dict[str, float] = Field(description="Scaled term seconds.")
    seconds: float
    memory: MemoryEstimate


def estimate(
    stage: str,
    layout: Layout,
    workload: Workload,
    model: ModelConfig,
    profile: HardwareProfile,
    scales: Scales | None = None,
) -> Estimate:
    """Latency and memory of ``stage`` on ``layout`` (see the module docstring for the terms)."""
    return estimate_many(stage, [layout], workload, model, profile, scales)[0]


def estimate_many(
    stage: str,
    layouts: Sequence[Layout],
    workload: Workload,
    model: ModelConfig,
    profile: HardwareProfile,
    scales: Scales | None = None,
) -> list[Estimate]:
    """``estimate`` of several layouts of one stage in one vectorized pass."""
    stats = model_stats(model)
    geos = [layout_geometry(stats, profile, layout) for layout in layouts]
    geo = Geometry(*(np.concatenate(field) for field in zip(*geos, strict=True)))
    raw, mem = stage_tables(stage_kind(stage), geo, workload, stats, profile)
    scaled = raw * (scales or Scales()).as_array()[:, None]
    return [
        Estimate(
            stage=stage,
            layout=layout_label(layout),
            raw=dict(zip(TERMS, raw[:, i].tolist(), strict=True)),
            terms=dict(zip(TERMS, scaled[:, i].tolist(), strict=True)),
            seconds=float(scaled[:, i].sum()),
            memory=MemoryEstimate(
                **{k: math.ceil(v) for k, v in zip(MEMORY_PARTS, mem[:, i].tolist(), strict=True)}
            ),
        )
        for i, layout in enumerate(layouts)
    ]


def layout_label(layout: Layout) -> str:
    """``tp2.pp1.dp4@0..7`` for consecutive slots, else the layout's full key."""
    if is_contiguous(layout):
        first, last = layout.devices[0], layout.devices[-1]
        return f"tp{layout.tp}.pp{layout.pp}.dp{layout.dp}@{first}..{last}"
    return layout.key


# ---------------------------------------------------------------- transitions and weight sync


class TransferLike(Protocol):
    """One copy of a slice between device slots (``emu.Transfer`` has these fields)."""

    src: int
    dst: int
    nbytes: int


class TransitionScales(_Frozen):
    """Calibrated multipliers of the transition cost."""

    wire: float = Field(default=1.0, gt=0, description="Scale of the bytes-over-links time.")
    ops: float = Field(default=1.0, gt=0, description="Scale of the per-operation overhead.")
    durable: float = Field(default=1.0, gt=0, description="Scale of a durable switch's fixed cost.")

    def as_array(self) -> np.ndarray:
        return np.array([self.wire, self.ops, self.durable], dtype=float)

    @classmethod
    def from_array(cls, values: Sequence[float]) -> TransitionScales:
        wire, ops, durable = (float(v) for v in values)
        return cls(wire=wire, ops=ops, durable=durable)


class DurableCosts(_Frozen):
    """The fixed costs of a durable switch before calibration (issue 16): the pool forms a new
    world, and every model-stage is rehydrated from the checkpoint, train stages with a new
    DeepSpeed engine. The job's measured durable switches scale their sum (``TransitionScales``)."""

    world_rebuild_s: float = Field(
        default=0.5, ge=0, description="Every rank leaves the world and joins a new one, s."
    )
    engine_build_s: float = Field(
        default=0.1, ge=0, description="A train stage's DeepSpeed engine built again on its devices, s."
    )
    store_read_bandwidth: float = Field(
        default=200e6, gt=0, description="Bytes/s rehydration reads from the checkpoint store (all stages)."
    )


class TransitionEstimate(_Frozen):
    """Predicted cost of moving state from one plan to another."""

    seconds: float
    wire_s: float = Field(description="Unscaled time of the busiest port (send or receive).")
    ops_s: float = Field(description="Unscaled per-operation overhead on the busiest device.")
    durable_s: float = Field(
        default=0.0,
        description="Unscaled fixed cost of a durable switch (0 for a live one): ``DurableCosts``.",
    )
    critical_bytes: int = Field(description="Bytes through the busiest port.")
    transfers: int = Field(description="Operations counted (transfers, or changed layouts when analytic).")
    analytic: bool = Field(description="True when estimated from layouts (no transfer list was given).")

    @property
    def terms(self) -> tuple[float, float, float]:
        """The unscaled terms, in the order of ``TransitionScales.as_array`` (what calibration fits)."""
        return (self.wire_s, self.ops_s, self.durable_s)

    @classmethod
    def of(
        cls,
        wire_s: float,
        ops_s: float,
        scales: TransitionScales | None,
        durable_s: float = 0.0,
        **rest: int | bool,
    ) -> TransitionEstimate:
        s = scales or TransitionScales()
        seconds = s.wire * wire_s + s.ops * ops_s + s.durable * durable_s
        return cls(seconds=seconds, wire_s=wire_s, ops_s=ops_s, durable_s=durable_s, **rest)


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
    ops_s = max(ops.values(), default=0) * profile.transition_op_overhead_s
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
    weights = stats.total_params * profile.weight_bytes / (new.tp * new.pp)
    state = (
        stats.total_params * profile.optimizer_bytes / new.world_size if stage_kind(stage) == "train" else 0
    )
    if old is None or set(new.devices) - set(old.devices):
        return math.ceil(weights + state)
    held_w = held_fraction(new.tp, new.pp, old.tp, old.pp)
    held_s = held_fraction(new.tp, new.pp, old.tp, old.pp, new.dp, old.dp)
    return math.ceil(weights * (1.0 - held_w) + state * (1.0 - held_s))


def durable_seconds(
    new: dict[str, Layout], models: dict[str, ModelConfig], profile: HardwareProfile, costs: DurableCosts
) -> float:
    """Unscaled fixed cost of a durable switch onto ``new``: one world rebuilt, one engine per train
    stage, and every stage's state (weights, and optimizer state for train stages) read from the
    checkpoint; the inference copies are relinked to their train stages, not read."""
    engines, read = 0, 0.0
    for stage in new:
        if not ModelStage(stage).owns_state:
            continue
        params = model_stats(models[stage.partition("/")[0]]).total_params
        trains = stage_kind(stage) == "train"
        engines += trains
        read += params * (profile.weight_bytes + (profile.optimizer_bytes if trains else 0))
    return costs.world_rebuild_s + engines * costs.engine_build_s + read / costs.store_read_bandwidth


def analytic_transition_cost(
    old: dict[str, Layout],
    new: dict[str, Layout],
    models: dict[str, ModelConfig],
    profile: HardwareProfile,
    scales: TransitionScales | None = None,
    *,
    durable: DurableCosts | None = None,
) -> TransitionEstimate:
    """Transition cost from layouts alone (no transfer list): the sum over model-stages of the
    busiest device's receive bytes (an upper bound of one device's total) over the slowest link.

    ``durable`` (the device set changes, so the world is rebuilt): nothing moves device to device;
    every model-stage is rehydrated or relinked (one operation each) at ``durable_seconds``."""
    if durable is not None:
        ops_s = len(new) * profile.transition_op_overhead_s
        fixed = durable_seconds(new, models, profile, durable)
        return TransitionEstimate.of(
            0.0, ops_s, scales, fixed, critical_bytes=0, transfers=len(new), analytic=True
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
    ops_s = changed * profile.transition_op_overhead_s
    return TransitionEstimate.of(wire, ops_s, scales, critical_bytes=total, transfers=changed, analytic=True)


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
    shard_g = model_stats(model).total_params * profile.weight_bytes / (gen_tp * gen_pp)
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


__all__ = [
    "MEMORY_PARTS",
    "TERMS",
    "DurableCosts",
    "Estimate",
    "MemoryEstimate",
    "Scales",
    "TransitionEstimate",
    "TransitionScales",
    "Workload",
    "analytic_transition_cost",
    "bubble_fraction",
    "durable_seconds",
    "estimate",
    "estimate_many",
    "held_fraction",
    "korthikanti_bytes",
    "layout_label",
    "model_stats",
    "reshard_bytes",
    "ring_bytes",
    "stage_kind",
    "sync_seconds",
    "transition_cost",
    "weight_sync_s",
]
