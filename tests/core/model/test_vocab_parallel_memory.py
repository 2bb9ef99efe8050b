"""Chunked log-probs and entropy: the same numbers as the full log-softmax, without its memory.

The reference is autograd through ``torch.log_softmax(logits.float()).gather(...)`` (values and
gradients), and for tp=2 the single-device result of the gathered logits, in a gloo world.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from nereus_core.model import tensor_parallel
from nereus_core.model.tensor_parallel import vocab_parallel_entropy, vocab_parallel_logprobs
from tests.support.dist_utils import run_world

VOCAB = 24


def _case(scale: float, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits ``[3, 7, VOCAB]`` (the caller slices off the last position), targets and loss weights."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(3, 7, VOCAB, generator=gen) * scale).to(dtype)
    targets = torch.randint(0, VOCAB, (3, 6), generator=gen)
    weights = torch.randn(3, 6, generator=gen)
    return logits, targets, weights


def _reference(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> tuple[Any, Any]:
    z = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(z[:, :-1].float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (logp * weights).sum().backward()
    return logp.detach(), z.grad


def _chunked(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> tuple[Any, Any]:
    z = logits.clone().requires_grad_(True)
    logp = vocab_parallel_logprobs(z[:, :-1], targets, None)
    (logp * weights).sum().backward()
    return logp.detach(), z.grad


@pytest.mark.parametrize("chunk", [1 << 24, 2 * VOCAB, 5], ids=["one-chunk", "two-rows", "under-a-row"])
@pytest.mark.parametrize("scale", [1.0, 30.0, 1e4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_and_grads_match_log_softmax_gather(
    monkeypatch: pytest.MonkeyPatch, chunk: int, scale: float, dtype: torch.dtype
) -> None:
    monkeypatch.setattr(tensor_parallel, "LOGPROB_CHUNK_ELEMENTS", chunk)
    logits, targets, weights = _case(scale, dtype)
    ref_logp, ref_grad = _reference(logits, targets, weights)
    logp, grad = _chunked(logits, targets, weights)
    assert logp.dtype == torch.float32 and grad.dtype == dtype
    torch.testing.assert_close(logp, ref_logp, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad)
    assert torch.equal(grad[:, -1], torch.zeros_like(grad[:, -1]))


def test_single_device_bad_target_raises() -> None:
    with pytest.raises((RuntimeError, IndexError)):
        vocab_parallel_logprobs(torch.zeros(2, VOCAB), torch.tensor([0, VOCAB]), None)


def test_logprobs_save_only_the_logits_and_per_row_numbers() -> None:
    """Backward keeps the caller's logits (no copy) and ``[rows]`` vectors; the log-softmax formula
    keeps a ``[rows, V]`` fp32 tensor of its own, so this check can tell them apart."""
    logits, targets, _ = _case(1.0, torch.float32)
    z = logits.clone().requires_grad_(True)

    def saved_by(fn: Any) -> list[torch.Tensor]:
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            fn(z[:, :-1], targets)
        return saved

    ours = saved_by(lambda x, t: vocab_parallel_logprobs(x, t, None))
    wide = [t for t in ours if t.dim() and t.shape[-1] == VOCAB]
    assert len(wide) == 1 and wide[0].data_ptr() == z.data_ptr()
    assert sum(t.numel() for t in ours if t is not wide[0]) <= 3 * targets.numel()
    formula = saved_by(lambda x, t: torch.log_softmax(x.float(), -1).gather(-1, t.unsqueeze(-1)))
    assert any(t.shape[-1] == VOCAB and t.data_ptr() != z.data_ptr() for t in formula if t.dim())


class _LargestOutputs(TorchDispatchMode):
    """Records the element count of every tensor an op allocates (views of other tensors excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.numels: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        flat_args = [*args, *(kwargs or {}).values()]
        inputs = {a.untyped_storage().data_ptr() for a in flat_args if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.numels.append((str(func), t.numel()))
        return out


def test_no_full_width_temporary_but_the_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tensor_parallel, "LOGPROB_CHUNK_ELEMENTS", 4 * VOCAB)
    logits, targets, weights = _case(3.0, torch.float32)
    x = logits[:, :-1].detach().requires_grad_(True)  # a strided view: chunks must not copy it whole
    full = x.numel()
    with _LargestOutputs() as forward_ops:
        logp = vocab_parallel_logprobs(x, targets, None)
    with _LargestOutputs() as backward_ops:
        (grad,) = torch.autograd.grad(logp, x, weights)
    assert max(n for _, n in forward_ops.numels) <= 4 * VOCAB
    wide = [op for op, n in backward_ops.numels if n > 4 * VOCAB]
    assert wide == ["aten.empty_like.default"] and grad.numel() == full
    with _LargestOutputs() as entropy_ops:
        vocab_parallel_entropy(x, None)
    assert max(n for _, n in entropy_ops.numels) <= 4 * VOCAB


@pytest.mark.parametrize("scale", [0.1, 4.0, 1e3])
def test_chunked_entropy_equals_one_pass(monkeypatch: pytest.MonkeyPatch, scale: float) -> None:
    logits = _case(scale, torch.float32, seed=3)[0][:, :-1]
    whole = vocab_parallel_entropy(logits, None)
    monkeypatch.setattr(tensor_parallel, "LOGPROB_CHUNK_ELEMENTS", 2 * VOCAB)
    chunked = vocab_parallel_entropy(logits, None)
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=0)
    p = torch.softmax(logits.double(), dim=-1)
    exact = -(p * torch.log_softmax(logits.double(), dim=-1)).sum(dim=-1)
    torch.testing.assert_close(chunked.double(), exact, rtol=1e-5, atol=1e-6)


def test_chunks_are_a_thirty_second_of_the_rows_or_the_minimum() -> None:
    """Shapes only (meta tensors): a Qwen-sized vocab over 4 x 1024 tokens, strided as ``out[:, :-1]``."""
    big = torch.empty(4, 1025, 152064, device="meta")[:, :-1]
    blocks = list(tensor_parallel._blocks(big))
    assert len(blocks) == 32 and {big[idx].shape[:-1].numel() for idx in blocks} == {128}
    small = torch.empty(2, 10, 152064, device="meta")
    assert list(tensor_parallel._blocks(small)) == [(slice(0, 2),)]  # 27-row minimum: one chunk


# --- tp=2 over gloo ------------------------------------------------------------------------


def _tp_logprobs(rank: int, world: int, cases: list[tuple[float, torch.dtype]]) -> list[dict[str, Any]]:
    tensor_parallel.LOGPROB_CHUNK_ELEMENTS = 2 * VOCAB // world + 1  # several chunks, not whole rows
    part = VOCAB // world
    results = []
    for scale, dtype in cases:
        logits, targets, weights = _masked(*_case(scale, dtype, seed=7))
        z = logits[..., rank * part : (rank + 1) * part].clone().requires_grad_(True)
        logp = vocab_parallel_logprobs(z[:, :-1], targets, dist.group.WORLD)
        (grad,) = torch.autograd.grad(logp, z, weights)
        entropy = vocab_parallel_entropy(z.detach()[:, :-1], dist.group.WORLD)
        results.append({"logprobs": logp.detach(), "grad": grad, "entropy": entropy})
    return results


def _masked(
    logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row 0, position 0: the upper half of the vocab (rank 1's whole shard at tp=2) is -inf and the
    target is in the lower half."""
    logits, targets = logits.clone(), targets.clone()
    logits[0, 0, VOCAB // 2 :] = float("-inf")
    targets[0, 0] = 3
    return logits, targets, weights


def test_tp2_matches_single_device() -> None:
    cases = [(1.0, torch.float32), (1e4, torch.float32), (30.0, torch.bfloat16)]
    per_rank = run_world(2, _tp_logprobs, cases)
    for i, (scale, dtype) in enumerate(cases):
        logits, targets, weights = _masked(*_case(scale, dtype, seed=7))
        ref_logp, ref_grad = _reference(logits, targets, weights)
        assert ref_logp.isfinite().all()
        grad = torch.cat([r[i]["grad"] for r in per_rank], dim=-1)
        torch.testing.assert_close(grad, ref_grad)
        # Entropy of a row with -inf logits is NaN on one device too (0 * -inf): compare the others.
        entropy = vocab_parallel_entropy(logits[:, :-1], None)
        for r in per_rank:
            torch.testing.assert_close(r[i]["logprobs"], ref_logp, rtol=1e-6, atol=1e-5)
            torch.testing.assert_close(r[i]["entropy"][1:], entropy[1:], rtol=1e-6, atol=1e-6)
