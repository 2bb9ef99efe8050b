"""Inference on one device of a layout: token log-probs and KV-cache generation.

Each function runs on every device of a layout at once (the device actors call
it) with that device's replica of the batch. Pipeline stages hand hidden states
forward point-to-point; the last stage turns its vocab-split logits into
log-probs or sampled tokens without gathering the vocabulary (tensor_parallel).
Only the last stage's tp-rank-0 device returns a tensor; the others return None,
and ``dispatch.collect`` stitches replicas back together.

Padding, as verl and transformers: prompts are left-padded and responses right-padded, so
every response starts at the same column. An ``attention_mask`` ``[b, s]`` (1 real, 0 pad)
hides pad keys, and positions count from each row's first real token (``position_ids``). A
batch without padding (no mask, or all ones) runs the plain causal path, bit for bit as
before. Generation stops a row at its first stop id (EOS) and fills the rest with ``pad_id``,
as transformers' ``generate``; it ends early once every row of the replica has stopped.
Packed passes (``pack``, ``packing``) keep this boundary: they run each micro-batch's real
tokens as one row and return the same padded outputs, 0 where the padded path read pads.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from nereus_core.engine import packing
from nereus_core.engine.device import DeviceContext, RankGroups
from nereus_core.engine.exchange import recv_activation, send_activation, send_activation_async
from nereus_core.engine.shard import ModelShard, bind_layout, get_shard
from nereus_core.layout import Layout
from nereus_core.model.tensor_parallel import vocab_parallel_logprobs, vocab_parallel_sample


def micro_batches(batch: int, count: int) -> list[slice]:
    """``count`` equal slices of a replica's batch."""
    if batch % count:
        raise ValueError(f"replica batch {batch} is not divisible by micro_batches={count}")
    size = batch // count
    return [slice(i * size, (i + 1) * size) for i in range(count)]


def position_ids(attention_mask_bs: torch.Tensor) -> torch.Tensor:
    """Each token's position counted from its row's first real token, ``[b, s]``; pads before it get 0.

    As transformers' ``generate`` derives them (``cumsum(mask) - 1``) and verl passes them to training.
    """
    return (attention_mask_bs.long().cumsum(-1) - 1).clamp_min(0)


def padding(
    attention_mask_bs: torch.Tensor | None, length: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(positions, attention_mask)`` for a batch of ``length`` columns: ``arange`` and None when
    nothing is padded (the plain causal path), else per-row positions and the mask on ``device``."""
    if attention_mask_bs is None or bool(attention_mask_bs.all()):
        return torch.arange(length, device=device), None
    if attention_mask_bs.shape[-1] != length:
        raise ValueError(f"attention_mask has {attention_mask_bs.shape[-1]} columns; the ids have {length}")
    mask = attention_mask_bs.to(device)
    return position_ids(mask), mask


def stage_forward(
    shard: ModelShard,
    ids: torch.Tensor,
    positions: torch.Tensor,
    *,
    cache: object | None = None,
    attention_mask: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    segments: torch.Tensor | None = None,
    last_only: bool = False,
    sends: list[Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Receive this stage's input (or take the ids), run the stage, send the output on.

    Returns ``(stage input, stage output)``; the input is a leaf that requires grad
    on non-first stages when grad is enabled, so training can send its grad back.
    ``segments`` (a packed row's ``cu_seqlens``) and ``last_only`` go to the stage (``LlamaStage``).
    ``sends``: post the output's send without waiting and append it here (the caller awaits it).
    """
    groups = shard.groups
    if groups.is_first_stage:
        x = ids
    else:
        shape = (ids.shape[0], ids.shape[1], shard.config.hidden_size)
        x = recv_activation(shape, dtype or shard.dtype, groups.prev_rank, ids.device)
        x.requires_grad_(torch.is_grad_enabled())
    if segments is not None:
        out = shard.module(x, positions, segments=segments)
    elif attention_mask is not None:
        out = shard.module(x, positions, cache, attention_mask=attention_mask, last_only=last_only)
    elif cache is not None:
        out = shard.module(x, positions, cache, last_only=last_only)
    else:
        out = shard.module(x, positions)
    if not groups.is_last_stage:
        if sends is None:
            send_activation(out.detach(), groups.next_rank)
        else:
            sends.append(send_activation_async(out.detach(), groups.next_rank))
    return x, out


def _returns(groups: RankGroups) -> bool:
    return groups.is_last_stage and groups.coord.tp == 0


def head_outputs(shard: ModelShard, out: torch.Tensor, ids_bs: torch.Tensor) -> torch.Tensor:
    """The last stage's per-token outputs: log p(ids[:, t+1]) ``[b, s-1]`` (lm head) or values ``[b, s]``."""
    if shard.config.head == "value":
        return out
    groups = shard.groups
    return vocab_parallel_logprobs(out[:, :-1], ids_bs[:, 1:], groups.tp_group, tp_rank=groups.coord.tp)


def packed_head_outputs(shard: ModelShard, out: torch.Tensor, packed: packing.Packed) -> torch.Tensor:
    """``head_outputs`` of a packed micro-batch, padded back to its rows: log-probs
    ``[rows, s-1]`` (0 where t or t+1 is not a real token of the row) or values ``[rows, s]``."""
    if shard.config.head == "value":
        return packing.unpack_tokens(packed, out)
    return packing.unpack_targets(packed, head_outputs(shard, out, packed.ids))


def rows(positions: torch.Tensor, mask: torch.Tensor | None, mb: slice) -> dict[str, torch.Tensor | None]:
    """A micro-batch's ``positions`` (shared ``[s]`` or per-row ``[b, s]``) and ``attention_mask``."""
    return {
        "positions": positions[mb] if positions.dim() == 2 else positions,
        "attention_mask": None if mask is None else mask[mb],
    }


@torch.no_grad()
def forward_outputs(
    ctx: DeviceContext,
    ids_bs: torch.Tensor,
    attention_mask_bs: torch.Tensor | None = None,
    *,
    name: str,
    pack: bool = False,
    max_tokens: int | None = None,
    layout: Layout | None = None,
) -> torch.Tensor | None:
    """``head_outputs`` for this replica's ids ``[b, s]`` (padded where ``attention_mask_bs`` is 0),
    micro-batch by micro-batch. ``pack`` runs each micro-batch's real tokens as one packed row
    (``packing``), at most ``max_tokens`` real tokens each; the outputs are padded alike.
    ``layout``: the plan's layout of the stage (``shard.bind_layout``)."""
    shard = get_shard(ctx, name)
    bind_layout(ctx, shard, layout)
    groups = shard.groups
    ids_bs = ids_bs.to(ctx.device)
    if pack and packing.worth_packing(attention_mask_bs, max_tokens):
        outs = []
        counts = {"micro_batches": groups.layout.micro_batches, "max_tokens": max_tokens}
        for packed in packing.micro_batches(ids_bs, attention_mask_bs, **counts):
            _, out = stage_forward(shard, packed.ids, packed.positions, segments=packed.cu_seqlens)
            if groups.is_last_stage:
                outs.append(packed_head_outputs(shard, out, packed))
        return torch.cat(outs).cpu() if _returns(groups) else None
    positions, mask = padding(attention_mask_bs, ids_bs.shape[1], ctx.device)
    outs = []
    for mb in micro_batches(ids_bs.shape[0], groups.layout.micro_batches):
        _, out = stage_forward(shard, ids_bs[mb], **rows(positions, mask, mb))
        if groups.is_last_stage:
            outs.append(head_outputs(shard, out, ids_bs[mb]))
    return torch.cat(outs).cpu() if _returns(groups) else None


def sampling_generator(seed: int, dp_rank: int, device: torch.device) -> torch.Generator:
    """The same generator state on every tp rank of a replica; replicas differ."""
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + dp_rank)


@torch.no_grad()
def generate(
    ctx: DeviceContext,
    prompt_bs: torch.Tensor,
    prompt_mask_bs: torch.Tensor | None = None,
    *,
    name: str,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    eos_ids: tuple[int, ...] = (),
    pad_id: int = 0,
) -> torch.Tensor | None:
    """Sample up to ``max_new_tokens`` after each left-padded prompt of this replica; returns
    ``[b, max_new_tokens]``, each row padded with ``pad_id`` after its first id in ``eos_ids``.

    Prefill runs the whole prompt through the pipeline, then one token per step (the head runs on
    the last position only: no logits for the rest of the prompt); the last stage
    samples and, with pipeline stages, broadcasts the tokens to the others so that every stage
    knows which rows stopped and when all have (then the loop ends). A stopped row keeps being fed
    ``pad_id`` with its mask at 1, as transformers does; its outputs are discarded.
    """
    shard = get_shard(ctx, name)
    groups = shard.groups
    prompt_bs = prompt_bs.to(ctx.device)
    b, prompt_len = prompt_bs.shape
    cache = shard.stage.new_cache(b, prompt_len + max_new_tokens)
    gen = sampling_generator(seed, groups.coord.dp, ctx.device)
    positions, mask = padding(prompt_mask_bs, prompt_len, ctx.device)
    if mask is not None and not bool(mask[:, -1].all()):
        raise ValueError("prompts must be left-padded: every row's last prompt column must be a real token")
    stop_ids = torch.tensor(eos_ids, dtype=torch.int64, device=ctx.device)
    running_b = torch.ones(b, dtype=torch.bool, device=ctx.device)
    ids, tokens = prompt_bs, []
    for step in range(max_new_tokens):
        _, out = stage_forward(shard, ids, positions, cache=cache, attention_mask=mask, last_only=True)
        if step + 1 == max_new_tokens:
            if groups.is_last_stage:
                tokens.append(_next_token(shard, out, temperature, gen, running_b, pad_id))
            break
        if groups.is_last_stage:
            token_b = _next_token(shard, out, temperature, gen, running_b, pad_id)
            tokens.append(token_b)
        else:
            token_b = torch.empty((b,), dtype=torch.int64, device=ctx.device)
        if groups.layout.pp_enabled:
            dist.broadcast(token_b, src=groups.pp_ranks[-1], group=groups.pp_group)
        running_b &= ~torch.isin(token_b, stop_ids)
        if eos_ids and not bool(running_b.any()):
            break
        ids = token_b[:, None]
        positions = positions[..., -1:] + 1
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(b, 1)], dim=1)
    if not _returns(groups):
        return None
    out_bt = torch.full((b, max_new_tokens), pad_id, dtype=torch.int64, device=ctx.device)
    out_bt[:, : len(tokens)] = torch.stack(tokens, dim=1)
    return out_bt.cpu()


def _next_token(
    shard: ModelShard,
    out: torch.Tensor,
    temperature: float,
    gen: torch.Generator,
    running_b: torch.Tensor,
    pad_id: int,
) -> torch.Tensor:
    """The last stage's next token of every row; ``pad_id`` for rows that already stopped."""
    groups = shard.groups
    token_b = vocab_parallel_sample(out[:, -1], temperature, gen, groups.tp_group, tp_rank=groups.coord.tp)
    return torch.where(running_b, token_b, torch.full_like(token_b, pad_id))
