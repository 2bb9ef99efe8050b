"""Latency and memory of one model-stage under one layout: the analytic prior the controller ranks plans by.

Boundary: pure arithmetic over a ``ModelConfig``, a ``Layout`` (or arrays of
candidate degrees), a ``Workload`` and a ``HardwareProfile``; nothing runs.
Calibration (``calibration.py``) multiplies each latency term by a scale fitted
to the running job; memory is not scaled (it gates feasibility, so it stays a
conservative bound).

Latency terms (seconds, summed; no overlap assumed, calibration absorbs any):
- ``compute``: FLOPs / effective throughput; 2*params per token forward and 6*params
  train, plus attention 4*L*h*s forward / 12*L*h*s train (Narayanan et al. 2021).
- ``decode``: memory-bound decode, per decode iteration (weights/tp + KV read) / HBM
  bandwidth (decode is memory-bound); a replica iterates until its longest
  sequence ends and the stage waits for the slowest replica (``Workload.response_max``).
- ``tp_comm``, ``tp_calls`` (infer and train passes): per layer 2 all-reduces forward (+2
  backward) of b*s*h values, plus Megatron's vocab-parallel embedding/head collectives; a
  ring all-reduce moves 2(t-1)/t of the buffer and pays 2(t-1) hops of latency (hardware.md,
  "TP traffic"; alpha-beta model of Thakur et al. 2005). Two rows: the first hop of each call is its
  fixed cost (``tp_calls``, the same at every degree), the other hops and the bytes the ring's
  (``tp_comm``), so probes at several degrees (``controller.probe``) can tell them apart.
- ``pp_comm``: the pipeline bubble (p-1)/(m+p-1) of the pipelined time
  (Narayanan et al. 2021) plus the point-to-point sends between stages.
- ``dp_comm``: ZeRO-1 gradient reduce-scatter + parameter all-gather = one ring
  all-reduce of the device's gradients over dp (Rajbhandari et al. 2020); a layout sharded ``full``
  (ZeRO-3) reduce-scatters every micro-batch's gradients instead, (dp-1)/dp of them per device.
- ``dp_gather``: a ``full`` layout's weight all-gathers: every module's weights gathered for each
  micro-batch's forward and again for its backward (and for the recomputed forward), (dp-1)/dp of
  the weights per device each time, one collective per module (Rajbhandari et al. 2020, section 7:
  3x the data-parallel volume of ZeRO-1's 2x). A row of its own, so calibration scales the gathers
  apart from the gradient reduction.
- ``optimizer``: the Adam step, memory-bound over the device's state shard.
- ``tp_comm_generate``, ``tp_calls_generate``: the same two parts of generation's collectives,
  per prefill and decode pass. Rows of their own: generation runs on its own TP degree, with
  small decode-sized buffers, and its collectives are priced apart from the passes'.
- ``overhead``: a fixed cost per decoder-layer pass of each micro-batch (kernel launches;
  Python on CPU); for generation also one per decode iteration (``decode_step_s``:
  scheduler, sampling).
- ``dispatch_generate``, ``dispatch_infer``, ``dispatch_train``: a fixed cost per stage call plus
  one per device reached, plus the kind's fixed cost per call (``generate_call_s``: the engine's
  wake-up, weights into the engine, KV cache; ``infer_call_s``, ``train_call_s``: a pass's; fitted
  to verl's logs, see hardware.py). One row per kind, zero in the others' raw vectors, so
  calibration fits each kind's fixed cost apart from the others and from compute.

Memory (bytes on the busiest device at the stage's peak, checked against the runtime's measured
peaks by ``benchmarks/bench_stage_memory.py``): weights, ZeRO-1 optimizer state sharded over dp,
gradients and activations as the runtime's step holds them at its peak
(``activations.layer_activation_bytes`` per decoder layer: what the runtime's layer keeps for backward;
``activations.pass_peak``), KV cache for generation (2*L*kv*d*bytes per token; a vLLM engine's
instead is the fixed ``Workload.engine_kv_bytes`` it preallocates per device and holds between
steps, ``engine_cache``). Time uses the mean response length and the
longest one (generation's stragglers), memory the high quantile. Packed passes (``passes.pack``,
verl's use_remove_padding) hold a micro-batch's real tokens: rows x (prompt + mean response), or at
most ``max_tokens_per_device`` (verl's ppo_max_token_len_per_gpu), never less than one longest
sequence (``cost.terms.pass_tokens``). Bytes per value: the profile's
for an fp32 model, the model's own for ``model.dtype: bf16`` (``cost.geometry.value_bytes``).

The formulas themselves, vectorized over candidate layouts, are in ``cost.terms``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from pydantic import Field, model_validator

from nereus_core.config import ModelConfig, Workload
from nereus_core.cost.hardware import HardwareProfile, split_legacy_terms
from nereus_core.cost.terms import (
    MEMORY_PARTS,
    PERSISTENT_PARTS,
    TERMS,
    Geometry,
    bubble_fraction,
    is_contiguous,
    layer_activation_bytes,
    layout_geometry,
    model_stats,
    ring_bytes,
    stage_tables,
)
from nereus_core.frozen import Frozen
from nereus_core.layout import Layout
from nereus_core.plan import Phase


def stage_kind(stage: str) -> Phase:
    """The phase of a model-stage: ``'actor/generate'`` -> ``'generate'``."""
    kind = stage.partition("/")[2]
    if kind not in ("generate", "infer", "train"):
        raise ValueError(f"{stage!r} is not a model-stage; expected model/generate|infer|train")
    return kind  # type: ignore[return-value]


class Scales(Frozen):
    """Per-term multipliers fitted by calibration (1 = the analytic prior), one per ``TERMS`` row.

    Backwards-readable: a record written before generation's TP collectives and each kind's fixed
    cost had scales of their own (its one ``dispatch`` field) reads with its ``tp_comm`` and
    ``dispatch`` given to every row they covered (``hardware.split_legacy_terms``)."""

    compute: float = Field(default=1.0, gt=0, description="Scale of the compute term.")
    decode: float = Field(default=1.0, gt=0, description="Scale of the memory-bound decode term.")
    tp_comm_generate: float = Field(
        default=1.0, gt=0, description="Scale of generation's TP collectives' ring hops and bytes."
    )
    tp_calls_generate: float = Field(
        default=1.0, gt=0, description="Scale of generation's fixed cost per TP collective call."
    )
    tp_comm: float = Field(
        default=1.0, gt=0, description="Scale of the passes' TP collectives' ring hops and bytes."
    )
    tp_calls: float = Field(
        default=1.0, gt=0, description="Scale of the passes' fixed cost per TP collective call."
    )
    pp_comm: float = Field(default=1.0, gt=0, description="Scale of the pipeline bubble and sends.")
    dp_comm: float = Field(default=1.0, gt=0, description="Scale of the gradient all-reduce.")
    dp_gather: float = Field(
        default=1.0, gt=0, description="Scale of a sharded layout's weight all-gathers (ZeRO-3)."
    )
    optimizer: float = Field(default=1.0, gt=0, description="Scale of the optimizer step.")
    overhead: float = Field(
        default=1.0, gt=0, description="Scale of the per-layer and per-decode-iteration fixed costs."
    )
    dispatch_generate: float = Field(
        default=1.0, gt=0, description="Scale of a generation call's fixed cost (dispatch, engine)."
    )
    dispatch_infer: float = Field(default=1.0, gt=0, description="Scale of an infer call's fixed cost.")
    dispatch_train: float = Field(default=1.0, gt=0, description="Scale of a train call's fixed cost.")

    @model_validator(mode="before")
    @classmethod
    def _legacy(cls, data: object) -> object:
        return split_legacy_terms(data) if isinstance(data, dict) else data

    def as_array(self) -> np.ndarray:
        return np.array([getattr(self, t) for t in TERMS], dtype=float)

    @classmethod
    def from_array(cls, values: Sequence[float]) -> Scales:
        return cls(**{t: float(v) for t, v in zip(TERMS, values, strict=True)})


class MemoryEstimate(Frozen):
    """Bytes on the busiest device of a layout."""

    weights: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    kv_cache: int = 0
    engine_cache: int = 0

    @property
    def persistent(self) -> int:
        """Held between steps (``terms.PERSISTENT_PARTS``): weights, (ZeRO-sharded) optimizer state,
        a rollout engine's KV cache."""
        return sum(getattr(self, p) for p in PERSISTENT_PARTS)

    @property
    def transient(self) -> int:
        """Held only while the stage runs: gradients (DeepSpeed ZeRO-1 frees them after the step,
        as measured by benchmarks/bench_calibration.py), activations, the sampler's KV cache."""
        return sum(getattr(self, p) for p in MEMORY_PARTS if p not in PERSISTENT_PARTS)

    @property
    def total(self) -> int:
        return self.persistent + self.transient


class Estimate(Frozen):
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


__all__ = [
    "MEMORY_PARTS",
    "TERMS",
    "Estimate",
    "MemoryEstimate",
    "Scales",
    "Workload",
    "bubble_fraction",
    "estimate",
    "estimate_many",
    "layer_activation_bytes",
    "layout_label",
    "model_stats",
    "ring_bytes",
    "stage_kind",
]
