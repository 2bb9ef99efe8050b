"""Training on one device of a layout: DeepSpeed ZeRO over the DP group, GPipe over stages.

DeepSpeed owns the optimizer (AdamW, ZeRO-partitioned over the DP group) and the
gradient reduction; ``engine.optimizer`` builds its engine when a train stage is
loaded. The pipeline schedule is ours (GPipe, Huang et al. 2019): all micro-batches
forward, then all backward in reverse order. Non-last stages backpropagate the
surrogate ``sum(out * grad_out)``, whose gradient equals the true one, through
``engine.backward`` without the 1/GAS scaling the last stage already applied.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nereus_core.engine import p2p
from nereus_core.engine.forward import head_outputs, micro_batches, stage_forward
from nereus_core.engine.shard import get_shard
from nereus_core.parallel.device import DeviceContext

LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]


def lm_loss(logp_bt: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Negative mean log-likelihood of the tokens (masked by ``batch['mask']`` when given)."""
    mask = batch.get("mask")
    if mask is None:
        return -logp_bt.mean()
    mask = mask[:, 1:].to(logp_bt.dtype)
    return -(logp_bt * mask).sum() / mask.sum().clamp(min=1.0)


def score_mse_loss(values_bs: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean squared error of the last token's value against ``batch['score']`` (reward-model fitting)."""
    return (values_bs[:, -1] - batch["score"].to(values_bs.dtype)).pow(2).mean()


def _slice(batch: dict[str, torch.Tensor], mb: slice, device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v[mb].to(device) for k, v in batch.items()}


def train_step(
    ctx: DeviceContext,
    batch: dict[str, torch.Tensor],
    *,
    name: str,
    loss_fn: LossFn = lm_loss,
) -> dict[str, float] | None:
    """One optimizer step on this replica's ``batch`` (``batch['ids']`` ``[b, s]`` plus per-sequence extras).

    The loss of a micro-batch is ``loss_fn(outputs, micro-batch)`` with the head's outputs
    (``forward.head_outputs``: log-probs ``[b, s-1]`` or values ``[b, s]``); the step's
    loss is their mean over micro-batches and replicas (DeepSpeed averages over DP).
    """
    shard = get_shard(ctx, name)
    if shard.engine is None:
        raise RuntimeError(
            f"model-stage {name!r} on device {ctx.rank} has no optimizer; load it for training"
        )
    engine, groups = shard.engine, shard.groups
    ids_bs = batch["ids"].to(ctx.device)
    positions = torch.arange(ids_bs.shape[1], device=ctx.device)
    slices = micro_batches(ids_bs.shape[0], groups.layout.micro_batches)
    engine.train()
    saved, losses = [], []
    for mb in slices:
        x, out = stage_forward(shard, ids_bs[mb], positions)
        if groups.is_last_stage:
            outputs = head_outputs(shard, out, ids_bs[mb])
            out = loss_fn(outputs, _slice(batch, mb, ctx.device))
            losses.append(out.detach())
        saved.append((x, out))
    for x, out in reversed(saved):
        if groups.is_last_stage:
            engine.backward(out)
        else:
            grad = p2p.recv(tuple(out.shape), out.dtype, groups.next_rank, ctx.device)
            engine.backward((out * grad).sum(), scale_wrt_gas=False)
        if not groups.is_first_stage:
            p2p.send(x.grad, groups.prev_rank)
        engine.step()
    if groups.is_last_stage and groups.coord.tp == 0:
        return {"loss": float(torch.stack(losses).mean())}
    return None
