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
    Sharded ``full`` (ZeRO-3): a dp-th of the gradients, held throughout, and two modules' gathered
    weights, the bucket and one module's whole gradient beside them."""
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
    # Sharded full (ZeRO-3, module by module): the largest module (the embedding or an MLP matmul) sets its
    # gradient bucket, held from the start, and the weights gathered at once: the module at work and
    # the next one. Its gradient partition (a dp-th, in the gradients' dtype) is held from the start too.
    module = np.maximum(stats.embed_params, stats.hidden * stats.intermediate) / tp
    grads = np.where(geo.z3, np.ceil(geo.device_params / geo.dp) * sizes.grad, geo.device_params * sizes.grad)
    held = held + np.where(geo.z3, 2.0 * module * sizes.weight, 0.0)
    # ZeRO-1/2's fp32 bucket; ZeRO-3's, in the gradients' dtype, beside the module's own gradient.
    zero1_bucket = np.minimum(REDUCE_BUCKET_ELEMENTS, geo.device_params) * 4.0
    bucket = np.where(geo.z3, 2.0 * module * sizes.grad, zero1_bucket)
    accumulating = (m > 1) | geo.z3  # a later micro-batch's activations beside an earlier one's gradients
    return held, bucket + np.where(accumulating, grads, np.maximum(grads - held, 0.0))
