"""Model-stage operations on the device pool: load, log-probs, generate, train, full state.

Each function is thin: split the global batch per device (``engine.dispatch``),
run one ``nereus_core.engine`` function on the layout's devices, stitch the
answer back. No policy here; the flow decides what runs where.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from nereus_core.config import ModelConfig, PassesConfig
from nereus_core.emu import shard_map
from nereus_core.engine import dispatch
from nereus_core.engine.device import DeviceContext
from nereus_core.engine.forward import forward_outputs, generate
from nereus_core.engine.hf_load import HFSource, load_from_hf
from nereus_core.engine.optimizer import OptimizerSettings
from nereus_core.engine.reshard import ReshardJob
from nereus_core.engine.shard import alias_shard, drop_shard, load_shard, set_weights, shard_state
from nereus_core.engine.train import LossFn, lm_loss, train_step
from nereus_core.layout import Layout
from tasks.reshard import gather_state
from tasks.runtime.device_pool import DevicePool


def load_model(
    pool: DevicePool,
    layout: Layout,
    *,
    name: str,
    config: ModelConfig,
    optimizer: OptimizerSettings | None = None,
    full_state: dict[str, torch.Tensor] | None = None,
) -> None:
    """Build ``name`` on ``layout`` (groups first, collectively), with an optimizer for training.

    Weights come from ``full_state`` when given (sent whole to each device, which keeps its
    slices: fine for small models; the EMU path moves only slices), else from the seed.
    """
    pool.build_groups(layout)
    pool.run(
        layout,
        load_shard,
        name=name,
        layout=layout,
        config=config,
        optimizer=optimizer,
        full_state=full_state,
    )


def import_model(
    pool: DevicePool,
    layout: Layout,
    *,
    name: str,
    config: ModelConfig,
    source: HFSource,
    optimizer: OptimizerSettings | None = None,
) -> list[dict[str, float]]:
    """Build ``name`` on ``layout`` from the model directory ``source``: each device reads only its own
    slices, memory-mapped (``engine.hf_load``); returns each device's figures (seconds, file bytes)."""
    pool.build_groups(layout)
    smap = shard_map(config, layout, train=optimizer is not None)
    job = ReshardJob(name, config, smap, smap, optimizer)
    return pool.run_on(layout.devices, load_from_hf, job=job, source=source)


def push_weights(pool: DevicePool, layout: Layout, full_state: dict[str, torch.Tensor], *, name: str) -> None:
    """Overwrite inference model-stage ``name`` with ``full_state`` (weight sync after training)."""
    pool.run(layout, set_weights, [(full_state,)] * layout.world_size, name=name)


def alias_model(pool: DevicePool, layout: Layout, *, name: str, target: str) -> None:
    """``name`` shares ``target``'s shards (same layout): nothing to copy or sync."""
    pool.run(layout, alias_shard, name=name, target=target)


def unload_model(pool: DevicePool, layout: Layout, *, name: str) -> None:
    pool.run(layout, drop_shard, name=name)


# Every pass on the padded batch as given: the default of direct calls (a job passes its own section).
PADDED = PassesConfig(pack=False)


def _deadline_tokens(
    layout: Layout, attention_mask: torch.Tensor | None, rows: dispatch.Rows | None, passes: PassesConfig
) -> int | None:
    """The tokens a device's deadline counts (``DevicePool.scope``): packed, the real tokens of the
    fullest replica (what it computes); padded, None (the pool counts the ids it sends, pads included)."""
    if not passes.pack or attention_mask is None:
        return None
    blocks = dispatch.replica_rows(layout, attention_mask.shape[0]) if rows is None else rows
    return max(int(attention_mask[block].sum()) for block in blocks)


def forward(
    pool: DevicePool,
    layout: Layout,
    ids_bs: torch.Tensor,
    *,
    name: str,
    attention_mask: torch.Tensor | None = None,
    passes: PassesConfig = PADDED,
) -> torch.Tensor:
    """Per-token outputs of ``name`` on ``ids_bs`` (padded where ``attention_mask`` is 0): log-probs
    ``[b, s-1]`` (lm head) or values ``[b, s]``; packed or in token-budget micro-batches as ``passes``
    says (the outputs are the padded ones either way)."""
    rows = None if attention_mask is None else dispatch.balanced_rows(layout, attention_mask.sum(dim=1))
    args = dispatch.per_device_args(layout, ids_bs, attention_mask, rows=rows)
    with pool.scope(name, tokens=_deadline_tokens(layout, attention_mask, rows, passes)):
        results = pool.run(
            layout,
            forward_outputs,
            args,
            name=name,
            pack=passes.pack,
            max_tokens=passes.max_tokens_per_device,
            layout=layout,
        )
    return dispatch.collect(layout, results, rows)


def sample(
    pool: DevicePool,
    layout: Layout,
    prompts_bs: torch.Tensor,
    *,
    name: str,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    prompt_mask: torch.Tensor | None = None,
    eos_ids: tuple[int, ...] = (),
    pad_id: int = 0,
) -> torch.Tensor:
    """Generated tokens ``[b, max_new_tokens]`` after each (left-padded) prompt; a row stops at its
    first id in ``eos_ids`` and is filled with ``pad_id`` after it (``engine.forward.generate``)."""
    rows, prompt_len = -(-prompts_bs.shape[0] // layout.dp), prompts_bs.shape[1]  # a replica's, at most
    with pool.scope(name, tokens=rows * (prompt_len + max_new_tokens)):  # its deadline counts decoding
        results = pool.run(
            layout,
            generate,
            dispatch.per_device_args(layout, prompts_bs, prompt_mask),
            name=name,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
            eos_ids=tuple(eos_ids),
            pad_id=pad_id,
        )
    return dispatch.collect(layout, results)


def train(
    pool: DevicePool,
    layout: Layout,
    batch: dict[str, torch.Tensor],
    *,
    name: str,
    loss_fn: LossFn = lm_loss,
    passes: PassesConfig = PADDED,
) -> float:
    """One optimizer step of ``name`` on ``batch``; returns the mean loss over replicas."""
    return train_stats(pool, layout, batch, name=name, loss_fn=loss_fn, passes=passes)["loss"]


def train_stats(
    pool: DevicePool,
    layout: Layout,
    batch: dict[str, torch.Tensor],
    *,
    name: str,
    loss_fn: LossFn = lm_loss,
    with_entropy: bool = False,
    passes: PassesConfig = PADDED,
) -> dict[str, float]:
    """One optimizer step of ``name`` on ``batch``, packed or in token-budget micro-batches as
    ``passes`` says; the loss, the loss function's statistics and ``grad_norm``
    (``engine.train.train_step``), each the mean over replicas."""
    mask = batch.get("attention_mask")
    rows = None if mask is None else dispatch.balanced_rows(layout, mask.sum(dim=1))
    parts = dispatch.per_device_batch(layout, batch, rows)
    with pool.scope(name, tokens=_deadline_tokens(layout, mask, rows, passes)):
        results = pool.run(
            layout,
            train_step,
            [(p,) for p in parts],
            name=name,
            loss_fn=loss_fn,
            with_entropy=with_entropy,
            pack=passes.pack,
            max_tokens=passes.max_tokens_per_device,
            layout=layout,
        )
    rows = [r for r in results if r is not None]
    return {key: sum(r[key] for r in rows) / len(rows) for key in rows[0]}


def full_state(
    pool: DevicePool, layout: Layout, *, name: str, config: ModelConfig
) -> dict[str, torch.Tensor]:
    """Full HF-named parameters of ``name``, assembled from replica 0 (from every device when the layout
    shards the weights over dp: each holds its share)."""
    if layout.shard == "full":
        return gather_state(pool, layout, name=name, config=config, train=False)
    replica0 = Layout(
        tp=layout.tp,
        pp=layout.pp,
        dp=1,
        devices=layout.replica_groups()[0],
        micro_batches=layout.micro_batches,
    )
    shards = pool.run_on(replica0.devices, shard_state, name=name)
    return dispatch.assemble_full_state(replica0, config, shards)


WARM_UP = "nereus/warm-up"
# The model of the warm-up engine: as small as a Llama-style decoder gets.
WARM_UP_MODEL = ModelConfig(
    vocab_size=16,
    hidden_size=8,
    intermediate_size=8,
    num_hidden_layers=1,
    num_attention_heads=1,
    num_key_value_heads=1,
)


def warm_up(pool: DevicePool, ranks: Sequence[int] | None = None) -> float:
    """Build and drop a tiny DeepSpeed engine over ``ranks`` (None: every device); returns seconds.

    The first engine on a fresh worker costs seconds (DeepSpeed's imports and its communication
    backend), later ones a tenth of a second. Paying it when
    devices join keeps it out of the first step, and out of the first transition onto new devices;
    workers prepared for a grow (``DevicePool.prepare`` with ``warm_device``) have paid it already."""
    start = time.perf_counter()
    devices = tuple(range(pool.size) if ranks is None else ranks)
    if not devices:
        return 0.0
    layout = Layout(dp=len(devices), devices=devices)
    pool.build_groups(layout)
    load_model(pool, layout, name=WARM_UP, config=WARM_UP_MODEL, optimizer=OptimizerSettings(lr=1e-3))
    unload_model(pool, layout, name=WARM_UP)
    return time.perf_counter() - start


def warm_device(ctx: DeviceContext) -> None:
    """``warm_up`` as one device's part of it, over every device of its world (collective): what a
    worker prepared for a grow runs in the world of the new workers before it joins the pool's."""
    layout = Layout.contiguous(dp=ctx.world_size)
    ctx.build_groups(layout)
    load_shard(ctx, name=WARM_UP, layout=layout, config=WARM_UP_MODEL, optimizer=OptimizerSettings(lr=1e-3))
    drop_shard(ctx, name=WARM_UP)
