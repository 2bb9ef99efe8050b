"""What a pass holds at its peak, as the runtime's step holds it: the memory model's activations and
gradients of a forward or train pass (checked against the runtime's measured peaks by
``benchmarks/bench_stage_memory.py``). Numbers in, numbers out, vectorized over candidate layouts;
``cost.terms`` calls it for every candidate."""

from __future__ import annotations

import numpy as np

from nereus_core.cost.geometry import Geometry, ModelStats, Num, ValueBytes, end_stage_layers
from nereus_core.emu import REDUCE_BUCKET_ELEMENTS
from nereus_core.model.tensor_parallel import LOGPROB_CHUNK_ELEMENTS, LOGPROB_CHUNKS


def layer_activation_bytes(stats: ModelStats, tokens: Num, activation_bytes: int, tp: Num) -> Num:
    """What one decoder layer of the runtime's ``LlamaStage`` keeps for backward, for ``tokens`` tokens
    (``benchmarks/bench_stage_memory.py`` measures it): each RMSNorm's input upcast to fp32 and its
    normed values and output in the model's dtype (``norm_bytes``), replicated over tp; and in the
    model's dtype, split over tp: q, k and v after RoPE, SDPA's output and its contiguous copy for
    o_proj (SDPA's fused kernels keep no s*s scores), and the MLP's gate, SiLU, up and product. A
    no-grad pass's working set is taken as the same bytes, one layer at a time."""
    q, kv = stats.heads * stats.head_dim, stats.kv_heads * stats.head_dim
    split = activation_bytes * (3.0 * q + 2.0 * kv + 4.0 * stats.intermediate) / tp
    return tokens * (2.0 * norm_bytes(stats, activation_bytes) + split)


def norm_bytes(stats: ModelStats, activation_bytes: int) -> float:
    """What an RMSNorm keeps for backward per token: its fp32 input, its normed values and its output."""
    return (4.0 + 2.0 * activation_bytes) * stats.hidden


def logprob_chunk_bytes(logit_elements: Num, width: Num) -> Num:
    """The fp32 temporary of the log-prob and entropy passes (``model.tensor_parallel``): one chunk of
    logit rows at a time."""
    rows = logit_elements / width
    chunk_rows = np.maximum(np.ceil(rows / LOGPROB_CHUNKS), np.floor(LOGPROB_CHUNK_ELEMENTS / width))
    return np.minimum(rows, chunk_rows) * width * 4.0


def pass_peak(
    geo: Geometry,
    stats: ModelStats,
    sizes: ValueBytes,
    tokens: np.ndarray,
    m: np.ndarray,
    *,
    train: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """(activations, gradients): a pass's peak beyond the weights and optimizer state, on its busiest
    pipeline stage, for micro-batches of ``tokens`` tokens, ``m`` of them per replica.

    Forward (no grad): one layer's working set, or on the last stage the logits (in the model's dtype
    and their fp32 copy while the head upcasts, then fp32 and one log-prob chunk). Train: each micro-batch
    in flight keeps every layer's activations (only each layer's input with gradient checkpointing,
    one layer recomputed at a time in backward) and, on the last stage, the final norm's and the fp32
    logits its loss saved; backward adds the logits' fp32 gradient. In flight: one micro-batch without a
    pipeline (each backpropagates before the next), all of them on every stage under GPipe, pp - stage
    of them under 1F1B (``Layout.schedule``).
    Gradients (``gradients``): ZeRO's fp32 reduction bucket (``emu.reduce_bucket_elements``) and the
    gradients accumulated while a later micro-batch's activations are held; a single backward frees
    its activations as it makes the gradients, so there only what they exceed the activations by.
    Sharded ``full`` (ZeRO-3): two modules' gathered weights and one module's whole gradient; its
    gradient partition and bucket are held between steps (``zero3_buffers``)."""
    tp, pp = geo.tp, geo.pp
    act = sizes.activation
    layer = layer_activation_bytes(stats, tokens, act, tp)
    logits = tokens * stats.logit_width / tp  # elements on each tp rank
    upcast = act if act < 4 else 0  # the head's output in the model's dtype, beside its fp32 copy
    inner, last = end_stage_layers(stats, pp)
    if not train:
        head = logits * 4.0 + np.maximum(logits * upcast, logprob_chunk_bytes(logits, stats.logit_width / tp))
        return np.maximum(layer, head), np.zeros_like(layer)
    # In flight on the first stage and on the last: GPipe keeps every micro-batch on each; 1F1B keeps
    # pp - stage of them (PipeDream-Flush: the first stage pp, the last one).
    first_in_flight = np.where(pp > 1, np.where(geo.f1b, np.minimum(m, pp), m), 1)
    last_in_flight = np.where(pp > 1, np.where(geo.f1b, 1, m), 1)
    keep = np.where(geo.rc, tokens * stats.hidden * act, layer)
    recomputed = np.where(geo.rc, layer, 0.0)
    head_saved = tokens * norm_bytes(stats, act) + logits * 4.0
    last_stage = last_in_flight * (last * keep + head_saved) + np.maximum(logits * 4.0, recomputed)
    held = np.maximum(first_in_flight * inner * keep + recomputed, last_stage)
    # Sharded full (ZeRO-3, module by module): the module at work and the next one gathered, and the
    # module's whole gradient before its reduce-scatter; its buffers held between steps are
    # ``zero3_buffers``' (the optimizer part).
    module = zero3_module(geo, stats)
    held = held + np.where(geo.z3, 2.0 * module * sizes.weight, 0.0)
    grads = geo.device_params * sizes.grad
    zero1 = np.minimum(REDUCE_BUCKET_ELEMENTS, geo.device_params) * 4.0  # ZeRO-1/2's fp32 bucket
    accumulating = m > 1  # a later micro-batch's activations beside an earlier one's gradients
    zero1 += np.where(accumulating, grads, np.maximum(grads - held, 0.0))
    return held, np.where(geo.z3, module * sizes.grad, zero1)


def zero3_module(geo: Geometry, stats: ModelStats) -> np.ndarray:
    """Elements of a ZeRO-3 stage's largest module on a device (the embedding or an MLP matmul): what it
    gathers and reduces at once, and its gradient bucket's size (``engine.optimizer``)."""
    return np.maximum(stats.embed_params, stats.hidden * stats.intermediate) / geo.tp


def zero3_buffers(geo: Geometry, stats: ModelStats, sizes: ValueBytes) -> np.ndarray:
    """Bytes a ZeRO-3 stage allocates at the start and holds between steps beside its weights and
    AdamW state: its gradient partition (a dp-th of the gradients) and its gradient bucket, both in
    the gradients' dtype; 0 for other layouts."""
    partition = np.ceil(geo.device_params / geo.dp) * sizes.grad
    return np.where(geo.z3, partition + zero3_module(geo, stats) * sizes.grad, 0.0)
