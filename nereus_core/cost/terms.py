"""The analytic formulas of the cost model, vectorized over candidate layouts.

Boundary: numbers in, numbers out. ``stage_tables`` evaluates every latency term
and memory part of one model-stage for an array of candidate layouts at once
(one entry per candidate), so the controller can rank thousands of layouts in a
few numpy operations; ``stage_cost.estimate`` calls it with a single layout.
The formulas and their sources are listed in ``stage_cost``'s docstring.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from nereus_core.cost import activations
from nereus_core.cost.activations import layer_activation_bytes
from nereus_core.cost.geometry import (  # re-exported: callers read the geometry through this module
    Geometry,
    ModelStats,
    Num,
    contiguous_geometry,
    is_contiguous,
    layout_geometry,
    model_stats,
    pipeline_split,
    slots,
    split_arrays,
    value_bytes,
)
from nereus_core.cost.hardware import COST_TERMS, HardwareProfile
from nereus_core.plan import Phase

TERMS = COST_TERMS
MEMORY_PARTS: tuple[str, ...] = (
    "weights",
    "gradients",
    "optimizer",
    "activations",
    "kv_cache",
    "engine_cache",
)
# Held for the whole job: weights, optimizer state, and a rollout engine's preallocated KV cache;
# the rest only while the stage runs.
PERSISTENT_PARTS: tuple[str, ...] = ("weights", "optimizer", "engine_cache")
PERSISTENT = np.array([p in PERSISTENT_PARTS for p in MEMORY_PARTS])
__all__ = [
    "MEMORY_PARTS",
    "PERSISTENT",
    "PERSISTENT_PARTS",
    "TERMS",
    "Geometry",
    "ModelStats",
    "Num",
    "collectives_s",
    "contiguous_geometry",
    "generation_collectives_s",
    "is_contiguous",
    "layer_activation_bytes",
    "layout_geometry",
    "model_stats",
    "pass_collectives_s",
    "pass_rows",
    "pipeline_split",
    "slots",
    "split_arrays",
    "stage_tables",
    "value_bytes",
]


class WorkloadLike(Protocol):
    """What the formulas read of a step's workload; ``stage_cost.Workload`` is the one that validates it.

    A protocol, not an import: the cost model builds on these formulas, never the other way round.
    """

    @property
    def batch(self) -> int: ...
    @property
    def prompt_len(self) -> int: ...
    @property
    def prompt_longest(self) -> int: ...
    @property
    def response_mean(self) -> float: ...
    @property
    def response_high(self) -> int: ...
    @property
    def response_longest(self) -> int: ...
    @property
    def ppo_epochs(self) -> int: ...
    @property
    def engine_kv_bytes(self) -> int: ...
    @property
    def pack(self) -> bool: ...
    @property
    def max_tokens_per_device(self) -> int | None: ...


def ring_bytes(nbytes: Num, n: Num) -> Num:
    """Bytes each device sends in a ring all-reduce of ``nbytes`` over ``n`` devices: 2(n-1)/n."""
    return 2.0 * (n - 1) / n * nbytes


def bubble_fraction(p: Num, m: Num) -> Num:
    """Share of a pipelined pass spent idle: (p-1)/(m+p-1) (Narayanan et al. 2021)."""
    return (p - 1) / (m + p - 1)


def collectives_s(
    tp: Num, calls: Num, reduces: Num, values: Num, act: int, alpha: float, bw: Num
) -> tuple[Num, Num]:
    """TP collectives in two parts, two rows: a fixed cost per collective call (one ``alpha``, the
    first hop, whatever the degree: launch and synchronisation) and the ring's (its other 2(t-1) - 1
    hops, and ``reduces`` all-reduces of ``values`` values, 2(t-1)/t of them per device; the alpha-beta
    model of Thakur et al. 2005). Together the ring all-reduce of hardware.md ("TP traffic"); zero at
    tp 1. Probes at several degrees (``controller.probe``) tell the part that grows with the degree
    from the part that does not."""
    ring = calls * (2.0 * (tp - 1) - 1.0) * alpha + reduces * ring_bytes(values * act, tp) / bw
    return (tp > 1) * calls * alpha, (tp > 1) * ring


def generation_collectives_s(
    stats: ModelStats, tp: Num, passes: Num, tokens: Num, act: int, alpha: float, bw: Num
) -> tuple[Num, Num]:
    """Generation's TP collectives (``tp_calls_generate``, ``tp_comm_generate``): per pass (prefill or
    decode step) 2 all-reduces per layer, 1 for the vocab-parallel embedding and 2 gathers to sample;
    the layers' all-reduces move the hidden state of the ``tokens`` passed."""
    calls = passes * (2 * stats.layers + 3)
    return collectives_s(tp, calls, 2 * stats.layers, tokens * stats.hidden, act, alpha, bw)


def pass_collectives_s(
    tp: Num, layers: Num, rows: Num, seq: Num, hidden: int, train: bool, act: int, alpha: float, bw: Num
) -> tuple[Num, Num]:
    """One micro-batch's TP collectives in an infer or train pass (``tp_calls``, ``tp_comm``; Megatron-LM,
    Shoeybi et al. 2019): 2 all-reduces per layer forward (+2 backward) of rows*seq*hidden values, plus
    the vocab-parallel embedding (1) and log-prob (3) all-reduces."""
    reduces = (4 if train else 2) * layers
    return collectives_s(tp, reduces + 4, reduces, rows * seq * hidden, act, alpha, bw)


def stage_tables(
    kind: Phase, geo: Geometry, work: WorkloadLike, stats: ModelStats, profile: HardwareProfile
) -> tuple[np.ndarray, np.ndarray]:
    """Unscaled term seconds ``[len(TERMS), n]`` and memory bytes ``[len(MEMORY_PARTS), n]``."""
    n = geo.tp.shape[0]
    raw = np.zeros((len(TERMS), n))
    mem = np.zeros((len(MEMORY_PARTS), n))
    if kind == "generate":
        _generate(raw, mem, geo, work, stats, profile)
    else:
        _forward_backward(raw, mem, kind == "train", geo, work, stats, profile)
    # One dispatch per stage call, plus one per device it reaches (tasks/runtime/device_pool.py), plus the
    # kind's fixed cost per call (hardware.py: the engine's for generation, a pass's for infer and train),
    # in the kind's own row: calibration fits each kind's fixed cost apart from the others and from compute.
    world = geo.tp * geo.pp * geo.dp
    call = {"generate": profile.generate_call_s, "infer": profile.infer_call_s, "train": profile.train_call_s}
    raw[TERMS.index(f"dispatch_{kind}")] = (
        profile.call_overhead_s + world * profile.dispatch_per_device_s + call[kind]
    )
    for term, scale in profile.term_scales.items():
        raw[TERMS.index(term)] *= scale
    weights = np.where(geo.z3, np.ceil(geo.device_params / geo.dp), geo.device_params)
    mem[MEMORY_PARTS.index("weights")] = weights * value_bytes(stats, profile).weight
    return raw, mem


def _slowdown(profile: HardwareProfile, busy: np.ndarray) -> np.ndarray:
    """``HardwareProfile.busy_slowdown`` over an array of busy slots per node."""
    if profile.cores_per_node is None:
        return np.ones_like(busy, dtype=float)
    ratio = np.maximum(busy / profile.cores_per_node, 1.0)
    return ratio ** np.log2(profile.oversubscribed_slowdown)


def _set(table: np.ndarray, names: tuple[str, ...], **values: np.ndarray | float) -> None:
    for name, value in values.items():
        table[names.index(name)] = value


def _generate(
    raw: np.ndarray,
    mem: np.ndarray,
    geo: Geometry,
    work: WorkloadLike,
    stats: ModelStats,
    profile: HardwareProfile,
) -> None:
    """Prefill, then decode iterations through every pipeline stage until the slowest sequence ends.

    A replica's batch runs in ``m`` waves of b/m sequences (m = 1 on the CPU runtime),
    each wave holding its own KV cache. Pipeline stages run one after another for
    every token, so compute and weight reads cover the whole model, split over tp only.
    Stragglers: a replica decodes until its longest sequence ends, and the
    stage ends with the slowest replica, the one holding the step's longest response.
    A wave is one round of the engine (its KV budget, not its sequences, sets m): the next
    starts when its longest sequence ends, and a wave of many sequences reaches the high
    quantile of the lengths, so a replica runs (m - 1) * high + longest iterations. Each
    iteration reads the weights and pays ``decode_step_s`` (scheduler, sampling, launches);
    the KV read and the FLOPs follow the tokens actually generated (b * mean), whatever the schedule.
    TP collectives go to ``tp_comm_generate`` (decode-sized and latency-bound, unlike the passes');
    the engine's fixed cost per call (``generate_call_s``) to ``dispatch_generate`` (``stage_tables``).
    """
    tp, pp = geo.tp, geo.pp
    slow = _slowdown(profile, geo.per_node / pp)  # one pipeline stage per replica works at a time
    waves = np.minimum(geo.m, profile.max_generate_waves)
    h, layers = stats.hidden, stats.layers
    b = np.ceil(work.batch / geo.dp)
    bw_ = np.ceil(b / waves)  # sequences per wave
    prompt, resp = work.prompt_len, work.response_mean
    ctx = prompt + resp / 2.0  # mean context a decode step attends to
    flops = profile.flops * tp / slow
    # Training FLOPs (Narayanan et al. 2021): forward ~ 2*params per token + attention 4*L*h*s.
    prefill = b * prompt * (2.0 * stats.flop_params + 4.0 * layers * h * prompt)
    decode_flops = resp * b * (2.0 * stats.flop_params + 4.0 * layers * h * ctx)
    sizes = value_bytes(stats, profile)
    kv_token = stats.kv_bytes_per_token(sizes.kv)
    tp_kv = np.minimum(tp, stats.kv_heads)
    # Decode is memory-bound: (weight bytes / tp + KV bytes read) / HBM bandwidth.
    weight_read, kv_read = stats.total_params * sizes.weight / tp, ctx * kv_token / tp_kv
    iters = (waves - 1.0) * work.response_high + work.response_longest  # the slowest replica's decode steps
    passes = waves + iters  # one prefill per wave and the decode iterations
    alpha, act = profile.collective_latency_s, sizes.activation  # alpha: not slowed by sharing cores
    # Per pass: 2 all-reduces per layer, 1 for the vocab-parallel embedding, 2 gathers to sample.
    tp_calls, tp_ring = generation_collectives_s(
        stats, tp, passes, b * (prompt + resp), act, alpha, geo.tp_bw
    )
    # Per pass: p-1 hidden-state sends forward and the sampled token back to the first stage.
    pp_comm = (pp > 1) * (passes * pp * alpha + (pp - 1) * b * h * act * (prompt + resp) / geo.pp_bw)
    _set(
        raw,
        TERMS,
        compute=(prefill + decode_flops) / flops,
        decode=(iters * weight_read + waves * bw_ * resp * kv_read) * slow / profile.hbm,
        tp_comm_generate=tp_ring,
        tp_calls_generate=tp_calls,
        pp_comm=pp_comm,
        overhead=passes * layers * profile.layer_overhead_s * slow + iters * profile.decode_step_s,
    )
    _generate_memory(mem, geo, work, stats, profile, wave_seqs=bw_)


def _generate_memory(
    mem: np.ndarray,
    geo: Geometry,
    work: WorkloadLike,
    stats: ModelStats,
    profile: HardwareProfile,
    *,
    wave_seqs: np.ndarray,
) -> None:
    """Generation's memory per device: one wave's prefill activations and last-position logits, and
    its KV cache (or a rollout engine's preallocated one, held between steps)."""
    tp, layers, prompt = geo.tp, stats.layers, work.prompt_longest  # the sampler pads prompts
    sizes = value_bytes(stats, profile)
    kv_token = stats.kv_bytes_per_token(sizes.kv)
    tp_kv = np.minimum(tp, stats.kv_heads)
    seq_high = prompt + work.response_high
    share = geo.stage_layers / layers
    logits = wave_seqs * stats.logit_width / tp * 4.0  # fp32 logits of the last position of each sequence
    prefill_act = layer_activation_bytes(stats, wave_seqs * prompt, sizes.activation, tp)
    _set(
        mem,
        MEMORY_PARTS,
        activations=prefill_act + logits,
        kv_cache=wave_seqs * seq_high * kv_token * share / tp_kv if not work.engine_kv_bytes else 0.0,
        engine_cache=float(work.engine_kv_bytes),  # vLLM's: fixed per device, held between steps
    )


def _forward_backward(
    raw: np.ndarray,
    mem: np.ndarray,
    train: bool,
    geo: Geometry,
    work: WorkloadLike,
    stats: ModelStats,
    profile: HardwareProfile,
) -> None:
    """A pipelined pass over prompt + response (infer), plus backward and the Adam step (train)."""
    tp, pp, dp, m = geo.tp, geo.pp, geo.dp, geo.m
    h, layers = stats.hidden, geo.stage_layers
    b = np.ceil(work.batch / dp)
    if work.pack and work.max_tokens_per_device is not None:  # the budget's whole micro-batches, not m
        m = np.ceil(pass_rows(work, b, m)[1] - 1e-9)
        bm = b / m
    else:
        bm = np.ceil(b / m)
    slow = _slowdown(profile, geo.per_node * np.minimum(pp, m) / pp)  # stages of a replica work together
    seq = work.prompt_len + work.response_mean
    epochs = work.ppo_epochs if train else 1
    sizes = value_bytes(stats, profile)
    alpha = profile.collective_latency_s  # waiting on a peer: not slowed by sharing cores
    act = sizes.activation
    # Training FLOPs (Narayanan et al. 2021): 2*params + 4*L*h*s per token forward, 6*params + 12*L*h*s train.
    mult, attn = (6.0, 12.0) if train else (2.0, 4.0)
    if train:  # recomputation: one more forward per micro-batch
        mult, attn = np.where(geo.rc, 8.0, mult), np.where(geo.rc, 16.0, attn)
    compute_mb = (
        bm * seq * (mult * geo.stage_flop_params + attn * layers * h * seq) * slow / (profile.flops * tp)
    )
    calls_mb, tp_mb = pass_collectives_s(tp, layers, bm, seq, h, train, act, alpha, geo.tp_bw)
    overhead_mb = (3.0 if train else 1.0) * layers * profile.layer_overhead_s * slow
    # Narayanan et al. 2021: with m micro-batches a pass takes (m+p-1) stage slots, m of them busy;
    # the idle (p-1) slots are the bubble, (p-1)/(m+p-1) of the pass.
    bubble = (pp - 1) * (compute_mb + calls_mb + tp_mb + overhead_mb)
    sends = (2.0 if train else 1.0) * (m + pp - 2) * (alpha + bm * seq * h * act / geo.pp_bw)
    _set(
        raw,
        TERMS,
        compute=epochs * m * compute_mb,
        tp_comm=epochs * m * tp_mb,
        tp_calls=epochs * m * calls_mb,
        pp_comm=epochs * (bubble + (pp > 1) * sends),
        overhead=epochs * m * overhead_mb,
    )
    _pass_memory(mem, train, geo, work, stats, profile)
    if train:
        _optimizer_step(raw, mem, geo, stats, profile, epochs=epochs, slow=slow)
        _sharded_traffic(raw, geo, stats, profile, epochs * m)


def _pass_memory(
    mem: np.ndarray,
    train: bool,
    geo: Geometry,
    work: WorkloadLike,
    stats: ModelStats,
    profile: HardwareProfile,
) -> None:
    """A pass's activations (and, training, its gradients at the step's peak) on the busiest pipeline
    stage (``activations.pass_peak``), for a micro-batch of the pass's rows (``pass_rows``)."""
    sizes = value_bytes(stats, profile)
    bm, m = pass_rows(work, np.ceil(work.batch / geo.dp), geo.m)
    tokens = bm * (work.prompt_longest + work.response_high)
    acts, grads = activations.pass_peak(geo, stats, sizes, tokens, m, train=train)
    _set(mem, MEMORY_PARTS, activations=acts, gradients=grads)


def pass_rows(work: WorkloadLike, rows: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The activation rows of one micro-batch of a forward or train pass, in sequences of the high
    quantile's length (prompt + ``response_high``, what the padded pass holds per row), and the
    micro-batches a replica's ``rows`` make, as the pipeline schedule counts those in flight.

    Padded: ``ceil(rows / m)`` rows of the layout's ``m`` micro-batches. Packed (``pack``, verl's
    use_remove_padding): the micro-batch's real tokens, rows/m x (prompt + mean response); with a
    budget (``max_tokens_per_device``, verl's ppo_max_token_len_per_gpu with use_dynamic_bsz) at
    most the budget, and the micro-batches the replica's real tokens over that (not whole: GPipe
    then holds the replica's real tokens, not a whole number of full budgets). Never less than one
    longest sequence: it lies whole in one micro-batch."""
    bm = np.ceil(rows / m)
    if not work.pack:
        return bm, m
    seq_high = work.prompt_longest + work.response_high
    real = work.prompt_len + work.response_mean
    budget = work.max_tokens_per_device
    if budget is None:
        return np.maximum(bm * real, seq_high) / seq_high, m
    replica = np.maximum(rows * real, seq_high)
    tokens = np.maximum(np.minimum(replica, budget), seq_high)
    return tokens / seq_high, replica / tokens


def _optimizer_step(
    raw: np.ndarray,
    mem: np.ndarray,
    geo: Geometry,
    stats: ModelStats,
    profile: HardwareProfile,
    *,
    epochs: float,
    slow: np.ndarray,
) -> None:
    """A train stage's gradient all-reduce over dp and Adam step, and the optimizer state it holds (its
    gradients at the step's peak: ``_pass_memory``)."""
    dp, alpha = geo.dp, profile.collective_latency_s
    sizes = value_bytes(stats, profile)
    grads = geo.device_params * sizes.grad
    buckets = np.ceil(grads / profile.gradient_bucket_bytes)
    # ZeRO-1 (Rajbhandari et al. 2020): reduce-scatter + all-gather = one ring all-reduce volume.
    # (ZeRO-3 reduce-scatters every micro-batch instead: ``_sharded_traffic``.)
    dp_comm = (dp > 1) * ~geo.z3 * (ring_bytes(grads, dp) / geo.dp_bw + buckets * 2.0 * (dp - 1) * alpha)
    # Adam reads and writes its state shard, reads the gradient shard, writes weights (all-gathered
    # under ZeRO-1; ZeRO-3 writes its own partition and gathers in the next pass).
    gathered = np.where(geo.z3, 0.0, sizes.weight)
    opt_bytes = geo.device_params * ((2.0 * sizes.optimizer + sizes.grad + sizes.weight) / dp + gathered)
    _set(raw, TERMS, dp_comm=epochs * dp_comm, optimizer=epochs * opt_bytes * slow / profile.hbm)
    state = np.ceil(geo.device_params / dp) * sizes.optimizer
    _set(mem, MEMORY_PARTS, optimizer=state + activations.zero3_buffers(geo, stats, sizes))


def _sharded_traffic(
    raw: np.ndarray, geo: Geometry, stats: ModelStats, profile: HardwareProfile, micro_batches: np.ndarray
) -> None:
    """A ``full`` layout's (ZeRO-3) data-parallel traffic per micro-batch: each module's weights gathered
    for the forward, again for the backward and for a recomputed forward (``dp_gather``), and the
    gradients reduce-scattered (``dp_comm``): (dp-1)/dp of the bytes each device sends per collective,
    ring latency (dp-1) hops per module (the decoder layers, the embedding and the head)."""
    dp, alpha = geo.dp, profile.collective_latency_s
    sizes = value_bytes(stats, profile)
    share = (dp - 1) / dp
    modules = geo.stage_layers + 2.0
    gathers = 2.0 + geo.rc
    on = geo.z3 & (dp > 1)
    gather = gathers * (share * geo.device_params * sizes.weight / geo.dp_bw + modules * (dp - 1) * alpha)
    scatter = share * geo.device_params * sizes.grad / geo.dp_bw + modules * (dp - 1) * alpha
    raw[TERMS.index("dp_gather")] = on * micro_batches * gather
    raw[TERMS.index("dp_comm")] += on * micro_batches * scatter
