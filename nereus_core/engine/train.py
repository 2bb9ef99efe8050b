"""Training on one device of a layout: DeepSpeed ZeRO over the DP group, GPipe or 1F1B over stages.

DeepSpeed owns the optimizer (AdamW, ZeRO-partitioned over the DP group) and the
gradient reduction; ``engine.optimizer`` builds its engine when a train stage is
loaded. Without a pipeline each micro-batch's backward follows its forward (gradient accumulation);
a pipeline runs the layout's schedule (``Layout.schedule``): GPipe (Huang et al. 2019), all
micro-batches forward, then all backward; or 1F1B (PipeDream-Flush, Narayanan et al. 2021), each
stage ``pp - 1 - stage`` forwards ahead, then one backward (the oldest micro-batch's) after each
forward, then the rest. Backwards always run oldest first, so every schedule adds the micro-batches'
gradients in the same order and trains bit for bit alike. Activations travel forward and their gradients
back with non-blocking sends (a 1F1B stage sends forward while its neighbour sends back), each
awaited before the step ends. Non-last stages backpropagate the
surrogate ``sum(out * grad_out)``, whose gradient equals the true one, through
``engine.backward`` without the 1/GAS scaling the last stage already applied.

Packed steps (``pack``, ``engine.packing``) run each micro-batch's real tokens as one row and
hand the loss function the same padded outputs. With a token budget the number of micro-batches
varies from step to step while DeepSpeed's ``gradient_accumulation_steps`` is fixed, so the step
drives the accumulation boundary itself (``set_gradient_accumulation_boundary``) and weights each
micro-batch's loss by its rows' share of the replica's batch (``scale_wrt_gas=False``): with equal
slices that is DeepSpeed's 1/GAS, and the PPO loss stays the token-mean over the mini-batch
(``ppo.minibatch_share``), as verl's dynamic batch size weights by each micro-batch's share.
Data-parallel replicas run the most micro-batches any of them needs (ZeRO-2 reduces gradients
at every micro-batch, a collective all replicas must join).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from nereus_core.engine import packing
from nereus_core.engine.device import DeviceContext
from nereus_core.engine.exchange import recv_activation, send_activation_async
from nereus_core.engine.forward import (
    head_outputs,
    micro_batches,
    packed_head_outputs,
    padding,
    rows,
    stage_forward,
)
from nereus_core.engine.shard import ModelShard, bind_layout, get_shard
from nereus_core.layout import Layout
from nereus_core.model.tensor_parallel import vocab_parallel_entropy
from nereus_core.rl.ppo import last_value, minibatch_share

# A micro-batch's loss, or its loss and statistics (detached 0-dim tensors, e.g. a clip fraction).
LossFn = Callable[
    [torch.Tensor, dict[str, torch.Tensor]], torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]
]


def lm_loss(logp_bt: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Negative mean log-likelihood of the tokens (masked by ``batch['mask']`` ``[b, s]`` when given: its
    columns 1.. mark the targets; with ``batch['tokens_per_row']`` the mean is over the mini-batch,
    ``ppo.minibatch_share``)."""
    mask = batch.get("mask")
    if mask is None:
        return -logp_bt.mean()
    mask = mask[:, 1:].to(logp_bt.dtype)
    share = minibatch_share(mask, batch.get("tokens_per_row"))
    return -(logp_bt * mask).sum() / mask.sum().clamp(min=1.0) * share


def score_mse_loss(values_bs: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean squared error of the last real token's value (``last_value``) against ``batch['score']``
    (reward-model fitting)."""
    last_b = last_value(values_bs, batch.get("attention_mask"))
    return (last_b - batch["score"].to(values_bs.dtype)).pow(2).mean()


def _slice(batch: dict[str, torch.Tensor], mb: slice, device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v[mb].to(device) for k, v in batch.items()}


def train_step(
    ctx: DeviceContext,
    batch: dict[str, torch.Tensor],
    *,
    name: str,
    loss_fn: LossFn = lm_loss,
    with_entropy: bool = False,
    pack: bool = False,
    max_tokens: int | None = None,
    layout: Layout | None = None,
) -> dict[str, float] | None:
    """One optimizer step on this replica's ``batch`` (``batch['ids']`` ``[b, s]`` plus per-sequence extras;
    ``batch['attention_mask']`` ``[b, s]``, when present, marks the padding, as ``forward.padding``).

    The loss of a micro-batch is ``loss_fn(outputs, micro-batch)`` with the head's outputs
    (``forward.head_outputs``: log-probs ``[b, s-1]`` or values ``[b, s]``); a loss function may
    return statistics beside it. ``with_entropy`` (lm head only) adds ``entropy`` ``[b, s-1]`` to
    each micro-batch: the policy's entropy over the full vocab, aligned with the log-probs.
    ``pack`` runs packed micro-batches (at most ``max_tokens`` real tokens each, when given); the
    loss function sees the same padded tensors, 0 at pads.
    ``layout``: the plan's layout of the stage, when its micro-batches, schedule or recomputation
    changed since it was placed (``shard.bind_layout``); it recomputes every decoder layer when the
    layout or the model's flag says so.
    The last stage's tp-rank-0 device returns the loss and each statistic as their mean over
    micro-batches (the caller averages replicas, as DeepSpeed averages gradients over DP), and
    ``grad_norm``: the global gradient norm before clipping, over every rank of the layout.
    """
    shard = get_shard(ctx, name)
    bind_layout(ctx, shard, layout)
    shard.stage.recompute = shard.config.gradient_checkpointing or shard.layout.recompute
    if shard.engine is None:
        raise RuntimeError(
            f"model-stage {name!r} on device {ctx.rank} has no optimizer; load it for training"
        )
    if with_entropy and shard.config.head == "value":
        raise ValueError(f"model-stage {name!r} has a value head: it has no entropy; pass with_entropy=False")
    if pack and packing.worth_packing(batch.get("attention_mask"), max_tokens):
        return _packed_step(ctx, shard, batch, loss_fn, with_entropy, max_tokens)
    engine, groups = shard.engine, shard.groups
    ids_bs = batch["ids"].to(ctx.device)
    positions, mask = padding(batch.get("attention_mask"), ids_bs.shape[1], ctx.device)
    engine.train()
    stats: list[dict[str, torch.Tensor]] = []
    slices = micro_batches(ids_bs.shape[0], groups.layout.micro_batches)
    schedule = _Schedule(shard, ctx.device, len(slices))
    for mb in slices:
        x, out = stage_forward(shard, ids_bs[mb], **rows(positions, mask, mb), sends=schedule.sends)
        if groups.is_last_stage:
            mb_batch = _slice(batch, mb, ctx.device)
            if with_entropy:
                mb_batch["entropy"] = vocab_parallel_entropy(out[:, :-1].detach(), groups.tp_group)
            out, mb_stats = _loss_and_stats(loss_fn(head_outputs(shard, out, ids_bs[mb]), mb_batch))
            stats.append({"loss": out.detach(), **mb_stats})
        schedule.forwarded(x, out)
    grad_norm = schedule.finish()
    if groups.is_last_stage and groups.coord.tp == 0:
        # One stacked tensor, one host transfer: a sync per statistic would stall an accelerator.
        means = torch.stack([torch.stack([s[k] for s in stats]).float().mean() for k in stats[0]])
        return {**dict(zip(stats[0], means.tolist(), strict=True)), "grad_norm": grad_norm}
    return None


def _packed_micro_batches(
    shard: ModelShard, batch: dict[str, torch.Tensor], max_tokens: int | None, device: torch.device
) -> list[packing.Packed]:
    """This replica's packed micro-batches; with a budget, as many as the replica needing most."""
    groups = shard.groups
    ids_bs, mask = batch["ids"].to(device), batch.get("attention_mask")
    counts = {"micro_batches": groups.layout.micro_batches, "max_tokens": max_tokens}
    packed = packing.micro_batches(ids_bs, mask, **counts)
    if max_tokens is not None and groups.layout.dp > 1:
        most = torch.tensor(len(packed), device=device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=groups.dp_group)
        if int(most) > len(packed):
            packed = packing.micro_batches(ids_bs, mask, **counts, count=int(most))
    return packed


def _packed_step(
    ctx: DeviceContext,
    shard: ModelShard,
    batch: dict[str, torch.Tensor],
    loss_fn: LossFn,
    with_entropy: bool,
    max_tokens: int | None,
) -> dict[str, float] | None:
    """``train_step`` on packed micro-batches, each loss weighted by its rows' share."""
    groups = shard.groups
    packed_mbs = _packed_micro_batches(shard, batch, max_tokens, ctx.device)
    weights = [p.row_count / batch["ids"].shape[0] for p in packed_mbs]
    shard.engine.train()
    stats: list[dict[str, torch.Tensor]] = []
    schedule = _Schedule(shard, ctx.device, len(packed_mbs), weighted=True)
    for packed, weight in zip(packed_mbs, weights, strict=True):
        x, out = stage_forward(
            shard, packed.ids, packed.positions, segments=packed.cu_seqlens, sends=schedule.sends
        )
        if groups.is_last_stage:
            mb_batch = _slice(batch, packed.rows, ctx.device)
            if with_entropy:
                entropy = vocab_parallel_entropy(out[:, :-1].detach(), groups.tp_group)
                mb_batch["entropy"] = packing.unpack_targets(packed, entropy)
            loss, mb_stats = _loss_and_stats(loss_fn(packed_head_outputs(shard, out, packed), mb_batch))
            stats.append({"loss": loss.detach(), **mb_stats})
            out = loss * weight
        schedule.forwarded(x, out)
    grad_norm = schedule.finish()
    if groups.is_last_stage and groups.coord.tp == 0:
        w = torch.tensor(weights, dtype=torch.float64, device=ctx.device)
        means = torch.stack([(torch.stack([s[k] for s in stats]).double() * w).sum() for k in stats[0]])
        return {**dict(zip(stats[0], means.tolist(), strict=True)), "grad_norm": grad_norm}
    return None


def _loss_and_stats(
    result: torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    if isinstance(result, torch.Tensor):
        return result, {}
    loss, stats = result
    return loss, {k: v.detach() for k, v in stats.items()}


class _Schedule:
    """When each micro-batch's backward runs. Without a pipeline, right after its forward (gradient
    accumulation: one micro-batch's activations live at a time); with one, as the layout's schedule
    says (the module docstring). Then the optimizer step. ``weighted``: the losses carry their own
    weights and the last backward marks the accumulation boundary (``_boundary``)."""

    def __init__(self, shard: ModelShard, device: torch.device, count: int, *, weighted: bool = False):
        self.shard, self.device, self.count, self.weighted = shard, device, count, weighted
        layout, coord = shard.groups.layout, shard.groups.coord
        # Forwards a stage runs before its first backward: none without a pipeline, all under GPipe.
        if not layout.pp_enabled:
            self.ahead = 0
        elif layout.schedule == "1f1b":
            self.ahead = min(count - 1, layout.pp - 1 - coord.pp)
        else:
            self.ahead = count
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.sends: list[Any] = []  # sends in flight, with the tensors they read
        self.done = 0
        # ZeRO-1/2 compute the norm of the reduced, partitioned gradients in their step, over the DP
        # group and the mpu's tp x pp group (``optimizer.LayoutMpu``), before they clip; without ZeRO
        # DeepSpeed keeps none, so it is taken from the DP-reduced grads before the step clips them.
        self.zero = shard.engine.zero_optimization_stage() > 0
        self.norm_sq = torch.zeros((), dtype=torch.float64, device=device)

    def forwarded(self, x: torch.Tensor, out: torch.Tensor) -> None:
        self.saved.append((x, out))
        if len(self.saved) > self.ahead:
            self._backward(*self.saved.pop(0))  # 1F1B and no pipeline: the oldest

    def _backward(self, x: torch.Tensor, out: torch.Tensor) -> None:
        engine, groups = self.shard.engine, self.shard.groups
        last = self.done == self.count - 1
        if self.weighted:
            engine.set_gradient_accumulation_boundary(last)
        if groups.is_last_stage:
            engine.backward(out, scale_wrt_gas=not self.weighted)
        else:
            grad = recv_activation(tuple(out.shape), out.dtype, groups.next_rank, self.device)
            engine.backward((out * grad).sum(), scale_wrt_gas=False)
        if not groups.is_first_stage:
            self.sends.append(send_activation_async(x.grad, groups.prev_rank))
        if not self.zero and last:
            self.norm_sq = _tp_grad_norm_sq(self.shard, self.device)
        engine.step()  # DeepSpeed steps the optimizer at the last micro-batch only
        self.done += 1

    def finish(self) -> float:
        """The backwards still to run (oldest first), the sends awaited, then the global gradient norm
        of the step (before clipping)."""
        for x, out in self.saved:
            self._backward(x, out)
        self.saved.clear()
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()
        engine, groups = self.shard.engine, self.shard.groups
        if self.weighted:
            _release_boundary(engine)
        if self.zero:
            norm = engine.get_global_grad_norm()
            if norm is None:
                raise RuntimeError(
                    "DeepSpeed computed no gradient norm; keep zero_optimization.compute_grad_norm on"
                )
            return float(torch.as_tensor(norm, dtype=torch.float64, device=self.device))
        if groups.layout.pp_enabled:
            # Each stage holds its own layers: the global squared norm is the sum over stages.
            dist.all_reduce(self.norm_sq, group=groups.pp_group)
        return float(self.norm_sq.sqrt())


def _release_boundary(engine: Any) -> None:
    """Hand the accumulation boundary back to DeepSpeed's micro-step count, realigned to a
    multiple of ``gradient_accumulation_steps`` so that a following padded step's last
    micro-batch is the boundary again."""
    engine.set_gradient_accumulation_boundary(None)
    engine.micro_steps += -engine.micro_steps % engine.gradient_accumulation_steps()


def _tp_grad_norm_sq(shard: ModelShard, device: torch.device) -> torch.Tensor:
    """Squared norm of this stage's gradients over its tp ranks: a split weight counts on every
    rank, a replicated one (same gradient on every rank) on tp rank 0, as DeepSpeed's ZeRO norm."""
    groups = shard.groups
    norm_sq = torch.zeros((), dtype=torch.float64, device=device)
    for param in shard.stage.parameters():
        if param.grad is not None and (
            getattr(param, "tensor_model_parallel", False) or groups.coord.tp == 0
        ):
            norm_sq += param.grad.double().square().sum()
    if groups.layout.tp_enabled:
        dist.all_reduce(norm_sq, group=groups.tp_group)
    return norm_sq
