"""Inference on one device of a layout: token log-probs and KV-cache generation.

Each function runs on every device of a layout at once (the device actors call
it) with that device's replica of the batch. Pipeline stages hand hidden states
forward point-to-point; the last stage turns its vocab-split logits into
log-probs or sampled tokens without gathering the vocabulary (tensor_parallel).
Only the last stage's tp-rank-0 device returns a tensor; the others return None,
and ``dispatch.collect`` stitches replicas back together.
"""

from __future__ import annotations

import torch

from nereus_core.engine import p2p
from nereus_core.engine.shard import ModelShard, get_shard
from nereus_core.model.tensor_parallel import vocab_parallel_logprobs, vocab_parallel_sample
from nereus_core.parallel.device import DeviceContext, RankGroups


def micro_batches(batch: int, count: int) -> list[slice]:
    """``count`` equal slices of a replica's batch."""
    if batch % count:
        raise ValueError(f"replica batch {batch} is not divisible by micro_batches={count}")
    size = batch // count
    return [slice(i * size, (i + 1) * size) for i in range(count)]


def stage_forward(
    shard: ModelShard,
    ids: torch.Tensor,
    positions: torch.Tensor,
    *,
    cache: object | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Receive this stage's input (or take the ids), run the stage, send the output on.

    Returns ``(stage input, stage output)``; the input is a leaf that requires grad
    on non-first stages when grad is enabled, so training can send its grad back.
    """
    groups = shard.groups
    if groups.is_first_stage:
        x = ids
    else:
        shape = (ids.shape[0], ids.shape[1], shard.config.hidden_size)
        x = p2p.recv(shape, dtype or shard.dtype, groups.prev_rank, ids.device)
        x.requires_grad_(torch.is_grad_enabled())
    out = shard.module(x, positions, cache) if cache is not None else shard.module(x, positions)
    if not groups.is_last_stage:
        p2p.send(out.detach(), groups.next_rank)
    return x, out


def _returns(groups: RankGroups) -> bool:
    return groups.is_last_stage and groups.coord.tp == 0


def head_outputs(shard: ModelShard, out: torch.Tensor, ids_bs: torch.Tensor) -> torch.Tensor:
    """The last stage's per-token outputs: log p(ids[:, t+1]) ``[b, s-1]`` (lm head) or values ``[b, s]``."""
    if shard.config.head == "value":
        return out
    groups = shard.groups
    return vocab_parallel_logprobs(out[:, :-1], ids_bs[:, 1:], groups.tp_group, tp_rank=groups.coord.tp)


@torch.no_grad()
def forward_outputs(ctx: DeviceContext, ids_bs: torch.Tensor, *, name: str) -> torch.Tensor | None:
    """``head_outputs`` for this replica's ids ``[b, s]``, micro-batch by micro-batch."""
    shard = get_shard(ctx, name)
    groups = shard.groups
    ids_bs = ids_bs.to(ctx.device)
    positions = torch.arange(ids_bs.shape[1], device=ctx.device)
    outs = []
    for mb in micro_batches(ids_bs.shape[0], groups.layout.micro_batches):
        _, out = stage_forward(shard, ids_bs[mb], positions)
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
    *,
    name: str,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
) -> torch.Tensor | None:
    """Sample ``max_new_tokens`` after each prompt of this replica; returns ``[b, max_new_tokens]``.

    Prefill runs the whole prompt through the pipeline, then one token per step;
    the last stage samples and sends the token back to the first stage.
    """
    shard = get_shard(ctx, name)
    groups = shard.groups
    prompt_bs = prompt_bs.to(ctx.device)
    b, prompt_len = prompt_bs.shape
    cache = shard.stage.new_cache(b, prompt_len + max_new_tokens)
    gen = sampling_generator(seed, groups.coord.dp, ctx.device)
    first_rank = groups.pp_ranks[0]
    last_rank = groups.pp_ranks[-1]
    ids, start, tokens = prompt_bs, 0, []
    for step in range(max_new_tokens):
        positions = torch.arange(start, start + ids.shape[1], device=ctx.device)
        _, out = stage_forward(shard, ids, positions, cache=cache)
        start += ids.shape[1]
        more = step + 1 < max_new_tokens
        if groups.is_last_stage:
            token_b = vocab_parallel_sample(
                out[:, -1], temperature, gen, groups.tp_group, tp_rank=groups.coord.tp
            )
            tokens.append(token_b)
            if more and groups.layout.pp_enabled:
                p2p.send(token_b, first_rank)
            ids = token_b[:, None]
        elif groups.is_first_stage and more:
            ids = p2p.recv((b,), torch.int64, last_rank, ctx.device)[:, None]
        else:
            ids = torch.empty((b, 1), dtype=torch.int64, device=ctx.device)  # shape only
    return torch.stack(tokens, dim=1).cpu() if _returns(groups) else None
