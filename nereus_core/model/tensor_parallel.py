"""Megatron-style tensor-parallel layers and vocab-parallel heads over one process group.

Follows Megatron-LM (Shoeybi et al., 2019, arXiv:1909.08053), section 3:
a column-parallel linear splits its output features and needs the full input
on every rank (``copy_to_tp``: identity forward, all-reduce of the input grad
backward); a row-parallel linear splits its input features and sums partial
outputs (``reduce_from_tp``: all-reduce forward, identity backward). An
attention or MLP block is column-then-row, so it costs one all-reduce forward
and one backward.

The vocab dim of the logits stays split: log-probabilities use the global max
and the global sum of exponentials (two scalar all-reduces per token) instead
of gathering ``[..., V]`` logits, as Megatron's ``vocab_parallel_cross_entropy``.
Sampling is Gumbel-max (``argmax(logits/T + g)``, g ~ Gumbel(0, 1); Gumbel 1954,
see Maddison et al., 2014, arXiv:1411.0052) with the noise drawn for the full
vocab from a generator in the same state on every tp rank, so the ranks agree
without exchanging anything but the per-rank best.

Log-probs keep no ``[..., V]`` softmax for backward, on one rank or many: the autograd
function saves the logits it was given (which the graph would hold anyway) and the max and
log-sum-exp per row, and backward recomputes softmax a chunk of rows at a time straight into
the gradient; the forward, too, runs over chunks of rows. This is NeMo-RL's
``ChunkedDistributedGatherLogprob`` and the memory saving of TRL's ``selective_log_softmax``:
the actor's peak holds the logits and their gradient, not also a log-softmax and the
gradient of the gather.

Entropy over the split vocab is ``H = log Z - sum_j softmax_j(z) * z_j`` with the logits
shifted by their global max: one max and one two-value sum all-reduce per token, the same
pattern as the log-probs, so the statistic costs no gather either.

Every weight split over the tp ranks is marked ``tensor_model_parallel`` (Megatron's
attribute): DeepSpeed's gradient norm counts a marked parameter on every tp rank and an
unmarked (replicated) one on tp rank 0 only (``deepspeed.runtime.utils.is_model_parallel_parameter``).

Every function is a no-op fast path when the group is None or has one rank.
The tp index of a rank defaults to its rank in the group; pass ``tp_rank`` when
a layout's tp index differs from that (torch orders group ranks by world rank).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

Group = dist.ProcessGroup | None


def group_size(group: Group) -> int:
    """Ranks in ``group``; 1 when the group is None."""
    return 1 if group is None else dist.get_world_size(group)


def _tp_rank(group: Group, tp_rank: int | None) -> int:
    if tp_rank is not None:
        return tp_rank
    return 0 if group is None else dist.get_rank(group)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Identity forward; all-reduce (sum) of the gradient backward."""
    if group_size(group) == 1:
        return x
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-reduce (sum) forward; identity backward."""
    if group_size(group) == 1:
        return x
    return _ReduceFromTP.apply(x, group)


def _split_parameter(local: torch.Tensor) -> nn.Parameter:
    """A parameter holding one tp rank's slice, marked so the gradient norm counts every slice."""
    param = nn.Parameter(local)
    param.tensor_model_parallel = True  # type: ignore[attr-defined]
    return param


def _local_size(size: int, tp_size: int, what: str) -> int:
    if size % tp_size:
        raise ValueError(f"{what}={size} does not split into tp={tp_size} equal shards")
    return size // tp_size


class ColumnParallelLinear(nn.Module):
    """``y_local = x @ W_local.T (+ b_local)`` with W (and b) split on output features (dim 0).

    A bias (Qwen2's q/k/v) is split like the rows it adds to: each rank holds its slice.

    ``copy_input=False`` when the caller already applied ``copy_to_tp`` once for
    several projections of the same input (q/k/v, gate/up): one all-reduce backward
    instead of one per projection.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp_size: int = 1,
        tp_group: Group = None,
        copy_input: bool = True,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.copy_input = copy_input
        local = _local_size(out_features, tp_size, "out_features")
        self.weight = _split_parameter(torch.empty(local, in_features, dtype=dtype))
        self.bias = _split_parameter(torch.empty(local, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = copy_to_tp(x, self.tp_group)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = sum_ranks x_local @ W_local.T`` with W split on input features (dim 1); no bias."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp_size: int = 1,
        tp_group: Group = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.tp_group = tp_group
        local = _local_size(in_features, tp_size, "in_features")
        self.weight = _split_parameter(torch.empty(out_features, local, dtype=dtype))

    def forward(self, x_local: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp(F.linear(x_local, self.weight), self.tp_group)


class VocabParallelEmbedding(nn.Module):
    """Embedding split by vocab rows (dim 0): look up the local range, zero the rest, all-reduce."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_group: Group = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.tp_group = tp_group
        local = _local_size(num_embeddings, tp_size, "num_embeddings")
        self.vocab_start = tp_rank * local
        self.weight = _split_parameter(torch.empty(local, embedding_dim, dtype=dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if group_size(self.tp_group) == 1:
            return F.embedding(ids, self.weight)
        local_ids = ids - self.vocab_start
        outside = (local_ids < 0) | (local_ids >= self.weight.shape[0])
        out = F.embedding(local_ids.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.tp_group)


def _all_reduce(x: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup) -> torch.Tensor:
    dist.all_reduce(x, op=op, group=group)
    return x


# A log-prob or entropy pass works on one chunk of logit rows at a time: 1/32 of the rows, or
# 4M elements (16 MiB in fp32) when that is more, so its temporaries are a few percent of the
# ``[..., V]`` logits and the chunks few enough that their kernel launches do not count.
LOGPROB_CHUNKS = 32
LOGPROB_CHUNK_ELEMENTS = 1 << 22


def _row_blocks(lead: tuple[int, ...], rows: int) -> Iterator[tuple[int | slice, ...]]:
    """Indices over the leading dims ``lead`` of ``[*lead, V]`` logits, each selecting at most ``rows``
    rows (at least one): basic indices, so every block is a view, even of a strided slice such as
    ``out[:, :-1]`` that flattening would copy."""
    if not lead:
        yield ()
        return
    inner = math.prod(lead[1:])
    if inner <= rows:
        step = max(1, rows // max(inner, 1))
        for start in range(0, lead[0], step):
            yield (slice(start, start + step),)
        return
    for i in range(lead[0]):
        for rest in _row_blocks(lead[1:], rows):
            yield (i, *rest)


def _blocks(logits: torch.Tensor) -> Iterator[tuple[int | slice, ...]]:
    """Chunks of ``logits`` rows, ``LOGPROB_CHUNKS`` of them or ``LOGPROB_CHUNK_ELEMENTS`` elements each."""
    lead = tuple(logits.shape[:-1])
    rows = max(1, -(-math.prod(lead) // LOGPROB_CHUNKS), LOGPROB_CHUNK_ELEMENTS // max(logits.shape[-1], 1))
    return _row_blocks(lead, rows)


def _row_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, fp32: the max of the logits and ``sum exp(z - max)``, one chunk of rows at a time."""
    row_max = torch.empty(logits.shape[:-1], dtype=torch.float32, device=logits.device)
    sum_exp = torch.empty_like(row_max)
    for idx in _blocks(logits):
        z = logits[idx].float()
        block_max = z.amax(dim=-1)
        row_max[idx] = block_max
        sum_exp[idx] = (z - block_max.unsqueeze(-1)).exp_().sum(dim=-1)
        del z  # before the next chunk is made, not after: one chunk alive at a time
    return row_max, sum_exp


def _log_normalizer(logits_local: torch.Tensor, group: Group) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row over the whole vocab: the max ``m`` and ``log sum exp(z - m)``, so ``log Z`` is their sum.

    Over tp shards each rank rescales its sum to the global max, ``s_r * exp(m_r - m)``, and one
    max and one sum all-reduce of ``[...]`` finish it: one pass over the logits, as flash-attention's
    online softmax (Milakov & Gimelshein, 2018, arXiv:1805.02867).
    """
    row_max, sum_exp = _row_stats(logits_local)
    if group_size(group) > 1:
        local_max = row_max
        row_max = _all_reduce(local_max.clone(), dist.ReduceOp.MAX, group)
        scale = (local_max - row_max).exp_()
        # A shard whose row is all -inf (masked columns) has sum NaN and adds nothing.
        sum_exp = torch.where(scale > 0, sum_exp * scale, 0.0)
        sum_exp = _all_reduce(sum_exp, dist.ReduceOp.SUM, group)
    return row_max, sum_exp.log_()


def _target_logits(
    logits_local: torch.Tensor, targets: torch.Tensor, group: Group, tp_rank: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``z_target`` per row (fp32), the local column index of each target and, over tp shards, whether
    the target is in this rank's columns (None on one rank: every target is, and a bad id raises)."""
    if group_size(group) == 1:
        return logits_local.gather(-1, targets.unsqueeze(-1)).squeeze(-1).float(), targets, None
    part = logits_local.shape[-1]
    local_targets = targets - tp_rank * part
    inside = (local_targets >= 0) & (local_targets < part)
    index = local_targets.masked_fill(~inside, 0)
    target_logit = logits_local.gather(-1, index.unsqueeze(-1)).squeeze(-1).float().masked_fill(~inside, 0.0)
    return _all_reduce(target_logit, dist.ReduceOp.SUM, group), index, inside


class _VocabParallelLogprobs(torch.autograd.Function):
    """log p(target) = (z_target - max) - log(sum exp(z - max)), each term reduced over the vocab shards.

    Saves the logits it was given (the caller's tensor, no copy) and two fp32 numbers per row;
    backward recomputes the softmax one chunk of rows at a time, straight into the gradient.
    """

    @staticmethod
    def forward(
        ctx: Any, logits_local: torch.Tensor, targets: torch.Tensor, group: Group, tp_rank: int
    ) -> torch.Tensor:
        row_max, log_sum = _log_normalizer(logits_local, group)
        target_logit, index, inside = _target_logits(logits_local, targets, group, tp_rank)
        ctx.save_for_backward(logits_local, row_max, log_sum, index, inside)
        return (target_logit - row_max).sub_(log_sum)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        # d log p(t) / d z_j = onehot_j(t) - softmax_j(z), restricted to this shard's columns.
        logits, row_max, log_sum, index, inside = ctx.saved_tensors
        grad = grad.float()
        target_grad = grad if inside is None else grad * inside
        grad_logits = torch.empty_like(logits, memory_format=torch.contiguous_format)
        for idx in _blocks(logits):
            block = logits[idx].float() - row_max[idx].unsqueeze(-1)
            block.sub_(log_sum[idx].unsqueeze(-1)).exp_().mul_(grad[idx].unsqueeze(-1).neg())
            block.scatter_add_(-1, index[idx].unsqueeze(-1), target_grad[idx].unsqueeze(-1))
            grad_logits[idx] = block
            del block
        return grad_logits, None, None, None


def vocab_parallel_logprobs(
    logits_local: torch.Tensor, targets: torch.Tensor, group: Group, *, tp_rank: int | None = None
) -> torch.Tensor:
    """log p(targets) in fp32 from vocab-split logits ``[..., V/tp]`` and global target ids ``[...]``.

    Keeps no ``[..., V]`` log-softmax for backward (see ``_VocabParallelLogprobs``); the gradient
    has the dtype of ``logits_local``.
    """
    return _VocabParallelLogprobs.apply(logits_local, targets, group, _tp_rank(group, tp_rank))


@torch.no_grad()
def vocab_parallel_entropy(logits_local: torch.Tensor, group: Group) -> torch.Tensor:
    """Entropy (nats, fp32) of softmax over the full vocab from vocab-split logits ``[..., V/tp]``.

    A statistic, not a loss: no gradient. Equals the single-device entropy of the gathered logits.
    Computed one chunk of rows at a time, as verl's ``entropy_from_logits_with_chunking``.
    """
    entropy = torch.empty(logits_local.shape[:-1], dtype=torch.float32, device=logits_local.device)
    if group_size(group) == 1:
        for idx in _blocks(logits_local):
            logp = torch.log_softmax(logits_local[idx].float(), dim=-1)
            entropy[idx] = -(logp.exp() * logp).sum(dim=-1)
            del logp
        return entropy
    row_max = torch.empty_like(entropy)
    for idx in _blocks(logits_local):
        row_max[idx] = logits_local[idx].float().amax(dim=-1)
    row_max = _all_reduce(row_max, dist.ReduceOp.MAX, group)
    # [..., 2]: sum exp(z') and sum exp(z') * z' (z' = z - global max), reduced in one all-reduce.
    sums = torch.empty((*entropy.shape, 2), dtype=torch.float32, device=logits_local.device)
    for idx in _blocks(logits_local):
        shifted = logits_local[idx].float() - row_max[idx].unsqueeze(-1)
        exp = shifted.exp()
        sums[idx] = torch.stack([exp.sum(dim=-1), exp.mul_(shifted).sum(dim=-1)], dim=-1)
        del shifted, exp
    sum_exp, sum_exp_z = _all_reduce(sums, dist.ReduceOp.SUM, group).unbind(dim=-1)
    return sum_exp.log() - sum_exp_z / sum_exp


def _argmax_over_shards(scores_local: torch.Tensor, group: Group, tp_rank: int | None) -> torch.Tensor:
    """Global argmax of vocab-split scores; ties go to the lowest global id, as ``torch.argmax``."""
    best, index = scores_local.max(dim=-1)
    if group_size(group) == 1:
        return index
    part = scores_local.shape[-1]
    global_index = index + _tp_rank(group, tp_rank) * part
    size = group_size(group)
    all_best = [torch.empty_like(best) for _ in range(size)]
    all_index = [torch.empty_like(global_index) for _ in range(size)]
    dist.all_gather(all_best, best.contiguous(), group=group)
    dist.all_gather(all_index, global_index.contiguous(), group=group)
    best_rd, index_rd = torch.stack(all_best), torch.stack(all_index)
    winners = best_rd == best_rd.max(dim=0, keepdim=True).values
    sentinel = torch.iinfo(index_rd.dtype).max
    return index_rd.masked_fill(~winners, sentinel).min(dim=0).values


def vocab_parallel_argmax(
    logits_local: torch.Tensor, group: Group, *, tp_rank: int | None = None
) -> torch.Tensor:
    """Global ids of the largest logit from vocab-split logits ``[..., V/tp]``."""
    return _argmax_over_shards(logits_local.float(), group, tp_rank)


def vocab_parallel_sample(
    logits_local: torch.Tensor,
    temperature: float,
    generator: torch.Generator,
    group: Group,
    *,
    tp_rank: int | None = None,
) -> torch.Tensor:
    """Global ids sampled from softmax(logits / temperature) by Gumbel-max; temperature 0 is argmax.

    ``generator`` must be in the same state on every tp rank; each call advances it
    by one full-vocab draw per row, on every rank alike (argmax draws nothing).
    """
    if temperature < 0:
        raise ValueError(f"temperature={temperature} is negative; use 0 for greedy or a positive value")
    if temperature == 0:
        return vocab_parallel_argmax(logits_local, group, tp_rank=tp_rank)
    part = logits_local.shape[-1]
    vocab = part * group_size(group)
    shape = (*logits_local.shape[:-1], vocab)
    uniform = torch.rand(shape, generator=generator, device=generator.device, dtype=torch.float32)
    gumbel = -torch.log(-torch.log(uniform.clamp_(min=torch.finfo(torch.float32).tiny)))
    start = _tp_rank(group, tp_rank) * part
    gumbel_local = gumbel[..., start : start + part].to(logits_local.device)
    return _argmax_over_shards(logits_local.float() / temperature + gumbel_local, group, tp_rank)
