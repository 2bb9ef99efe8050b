"""What a model-stage holds on one device in the simulated world: its state, and one step's activations,
logits and KV cache. The world's own accounting: it shares no formula or constant with the cost model
(``cost.terms``), so a plan the cost model thinks fits can run out of memory here.

Boundary: pure arithmetic over a model's size (``stage_world.ModelSize``), a layout's shape and one
step's response lengths. Fitted on published peak memory by ``python -m benchmarks.fit_world_memory``
(``ACTIVATION_BYTES`` is what it printed).

- State, per parameter (ZeRO's mixed-precision Adam accounting, Rajbhandari et al. 2020: 2 bytes of bf16
  weights, 2 of bf16 gradients, 12 of fp32 master weights and moments), over tp and on the busiest
  pipeline stage: a trained model under ZeRO-1 (Nereus's DeepSpeed, Megatron's distributed optimizer)
  holds its weights and gradients whole on each data-parallel replica and 1/dp of the 12; sharded
  (verl's FSDP, OpenRLHF's ZeRO-3) it holds 1/dp of all 16, plus two gathered layers in flight. The
  gradients live only while the train stage runs (freed after the optimizer step): transient. A
  frozen model (reference, forward-only, the rollout engine) holds bf16 weights. Checked: torchtitan's
  Llama-3.1-8B FSDP peaks at 8 and 128 GPUs differ by 15.4 GiB; 16 bytes x 8.03e9 x (1/8 - 1/128)
  = 14.0 GiB, the rest is the gather buffers.
- Activations kept for the backward pass: ``ACTIVATION_BYTES`` per token, layer and hidden unit (on a
  tp-th of the device's tokens), fitted on those two peaks (2 x 8,192 tokens per GPU, selective
  activation checkpointing, which keeps the matmul outputs; taken as a layer's whole activations, so a
  pass without checkpointing may need more than the world says). With full recomputation
  (gradient checkpointing) a layer keeps its bf16 input and one layer's activations live while it is
  recomputed. A pipeline stage holds the micro-batches its schedule keeps in flight: all of them under
  GPipe (Nereus's runtime), at most pp under 1F1B (Megatron, the peers). A forward-only pass holds one
  layer's.
- Logits on the last stage: ``LOGIT_BYTES_TRAIN`` per token and vocabulary entry in a train pass (bf16
  output, its fp32 copy for the loss and the fp32 gradient), ``LOGIT_BYTES_FORWARD`` in a forward pass.
  Every pass runs packed (Nereus's ``passes.pack``, verl's ``use_remove_padding``, OpenRLHF's packing):
  a micro-batch holds its real tokens, the replica's sequences dealt round-robin.
- Generation: the engine's bf16 weights; its KV cache takes what is free (vLLM preallocates its share)
  and needs at least one longest sequence's.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from nereus_core.sim.stage_world import ModelSize, Shape, balanced_replicas, pipeline_stages

STATE_BYTES = {"weights": 2.0, "gradients": 2.0, "optimizer": 12.0}  # per parameter, ZeRO's accounting
FROZEN_BYTES = 2.0  # bf16 weights
ACTIVATION_BYTES = 23.12  # per token, layer and hidden unit: benchmarks/fit_world_memory.py
INPUT_BYTES = 2.0  # a recomputed layer keeps its bf16 input
LOGIT_BYTES_TRAIN = 2.0 + 4.0 + 4.0
LOGIT_BYTES_FORWARD = 2.0 + 4.0
GATHERED_LAYERS = 2  # FSDP/ZeRO-3: the layer computing and the one prefetched


class Held(NamedTuple):
    """Bytes one device holds for a model-stage: for the whole job, and at its peak within the step."""

    persistent: float
    transient: float


def _stage_params(model: ModelSize, shape: Shape) -> tuple[float, int, bool]:
    """Parameters and layers of the busiest pipeline stage, and whether it holds the head."""
    stages = pipeline_stages(model, shape.pp)
    params, layers = max(stages, key=lambda s: s[0])
    return params, layers, shape.pp == 1 or (params, layers) == stages[-1]


def state_bytes(model: ModelSize, shape: Shape, *, trains: bool, sharded: bool) -> tuple[float, float]:
    """One device's bytes of a model's state, over tp on the busiest pipeline stage: the persistent
    ones (a trained model's weights and optimizer state, a frozen model's bf16 weights) and a trained
    model's gradients (0 for a frozen one); sharded ones over dp."""
    params = _stage_params(model, shape)[0] / shape.tp
    whole, split = (1.0 / shape.dp, 1.0 / shape.dp) if sharded else (1.0, 1.0 / shape.dp)
    if not trains:
        return params * FROZEN_BYTES * whole, 0.0
    held = params * (STATE_BYTES["weights"] * whole + STATE_BYTES["optimizer"] * split)
    return held, params * STATE_BYTES["gradients"] * whole


def micro_batch_tokens(lengths: np.ndarray, prompt: float, shape: Shape) -> float:
    """Real tokens of the largest micro-batch of any replica (sequences dealt round-robin)."""
    replicas = balanced_replicas(lengths, shape.dp).astype(float) + prompt
    dp, n = replicas.shape
    m = max(1, min(shape.micro_batches, n))
    dealt = np.zeros((dp, -(-n // m) * m))
    dealt[:, :n] = replicas  # sequence i of a replica goes to micro-batch i mod m
    return float(dealt.reshape(dp, -1, m).sum(axis=1).max())


def pass_bytes(
    lengths: np.ndarray,
    prompt: float,
    model: ModelSize,
    shape: Shape,
    *,
    train: bool,
    recompute: bool = False,
    sharded: bool = False,
    one_f_one_b: bool = False,
    activation_bytes: float = ACTIVATION_BYTES,
) -> Held:
    """A forward (infer) or train pass of one model on one layout (``activation_bytes``: the fit's
    free constant, ``benchmarks/fit_world_memory.py`` varies it)."""
    params, layers, head = _stage_params(model, shape)
    tokens = micro_batch_tokens(lengths, prompt, shape) / shape.tp  # a tp-th of them (sequence parallel)
    layer = tokens * model.hidden * activation_bytes
    if train:
        in_flight = min(shape.micro_batches, shape.pp) if one_f_one_b else shape.micro_batches
        in_flight = 1 if shape.pp == 1 else in_flight
        kept = tokens * model.hidden * INPUT_BYTES if recompute else layer
        activations = in_flight * layers * kept + (layer if recompute else 0.0)
    else:
        activations = layer
    vocab = model.head_params / model.hidden if model.hidden else 0.0
    per_logit = LOGIT_BYTES_TRAIN if train else LOGIT_BYTES_FORWARD
    logits = tokens * vocab * per_logit if head else 0.0  # vocabulary-parallel: a tp-th of all tokens'
    gathered = GATHERED_LAYERS * params / layers * FROZEN_BYTES / shape.tp if sharded else 0.0
    persistent, gradients = state_bytes(model, shape, trains=train, sharded=sharded)
    return Held(persistent, activations + logits + gathered + gradients)


def generation_bytes(lengths: np.ndarray, prompt: float, model: ModelSize, shape: Shape) -> Held:
    """The rollout engine: bf16 weights, and at least one longest sequence's KV cache."""
    shard = shape.tp * shape.pp
    weights = model.params * FROZEN_BYTES / shard
    return Held(weights, (prompt + float(lengths.max(initial=1))) * model.kv_bytes_per_token / shard)
