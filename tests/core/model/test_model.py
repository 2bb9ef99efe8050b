"""nereus_core.model against Hugging Face LlamaForCausalLM and Qwen2ForCausalLM: single process, chained
stages, gloo TP worlds."""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus_core.config import ModelConfig, RopeScaling
from nereus_core.model import (
    LlamaStage,
    hf_config,
    init_full_state,
    shard_dim,
    shard_tensor,
    stage_param_names,
    unshard,
    vocab_parallel_argmax,
    vocab_parallel_logprobs,
    vocab_parallel_sample,
)
from nereus_core.model.llama import rope_inv_freq
from nereus_core.model.tensor_parallel import vocab_parallel_entropy
from nereus_core.model.weights import param_shapes, stage_layers
from tests.support.dist_utils import WorldError, run_world

TINY = ModelConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
)
TINY_TIED = ModelConfig(**{**TINY.model_dump(), "tie_word_embeddings": True})
# tp=4 must divide the kv heads, so the 4-rank world uses 8 query / 4 kv heads (head_dim 8).
TINY_KV4 = ModelConfig(**{**TINY.model_dump(), "num_attention_heads": 8, "num_key_value_heads": 4})
# Qwen2.5's small sizes: q/k/v biases, tied embeddings, theta 1e6, eps 1e-6.
TINY_QWEN = ModelConfig(
    **{
        **TINY.model_dump(),
        "architecture": "Qwen2ForCausalLM",
        "attention_bias": True,
        "tie_word_embeddings": True,
        "rope_theta": 1e6,
        "rms_norm_eps": 1e-6,
    }
)
# Llama 3's scaling with a short original context, so positions past 32 feel every band.
LLAMA3_SCALING = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32
)
TINY_LLAMA3 = ModelConfig(**{**TINY.model_dump(), "rope_theta": 500000.0, "rope_scaling": LLAMA3_SCALING})
BATCH, SEQ, NEW_TOKENS = 2, 10, 8


def _ids(cfg: ModelConfig) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _hf_model(cfg: ModelConfig) -> Any:
    import transformers

    model_class = getattr(transformers, cfg.architecture)
    model = model_class._from_config(hf_config(cfg), attn_implementation="eager")
    result = model.load_state_dict(init_full_state(cfg), strict=False)
    assert not result.unexpected_keys
    assert set(result.missing_keys) == ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    return model.eval()


@functools.cache
def _hf_reference(cfg: ModelConfig) -> dict[str, Any]:
    """HF logits, token log-probs, grads of -mean(logprobs), and greedy tokens for ``_ids(cfg)``."""
    model, ids = _hf_model(cfg), _ids(cfg)
    logits = model(ids).logits
    logprobs = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    (-logprobs.mean()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0)
    return {"logits": logits.detach(), "logprobs": logprobs.detach(), "grads": grads, "tokens": out[:, SEQ:]}


def _stage(cfg: ModelConfig, layers: range, first: bool, last: bool, **tp: Any) -> LlamaStage:
    stage = LlamaStage(cfg, layers=layers, first=first, last=last, **tp)
    stage.load_full_state(init_full_state(cfg))
    return stage


def _greedy(stages: list[LlamaStage], ids: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Prefill then one token at a time through the chained stages, each with its own cache."""
    caches = [stage.new_cache(ids.shape[0], ids.shape[1] + NEW_TOKENS) for stage in stages]
    x, positions, tokens = ids, torch.arange(ids.shape[1]), []
    for _ in range(NEW_TOKENS):
        for stage, cache in zip(stages, caches, strict=True):
            x = stage(x, positions, cache)
        tokens.append(vocab_parallel_argmax(x[:, -1], group, tp_rank=stages[-1].tp_rank))
        x, positions = tokens[-1][:, None], positions[-1:] + 1
    return torch.stack(tokens, dim=1)


def _assert_grads_match(cfg: ModelConfig, grads: dict[str, torch.Tensor], atol: float = 1e-5) -> None:
    ref = _hf_reference(cfg)["grads"]
    assert set(grads) == set(ref)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref[name], atol=atol, rtol=0, msg=name)


# --- weights and shard map ---------------------------------------------------------------


@pytest.mark.parametrize("cfg", [TINY, TINY_TIED, TINY_QWEN], ids=["untied", "tied", "qwen2"])
def test_init_full_state_has_hf_names_and_shapes(cfg: ModelConfig) -> None:
    full = init_full_state(cfg)
    hf_shapes = {name: tuple(t.shape) for name, t in _hf_model(cfg).named_parameters()}
    assert {name: tuple(t.shape) for name, t in full.items()} == hf_shapes
    again = init_full_state(cfg)
    assert all(torch.equal(full[name], again[name]) for name in full)
    assert torch.equal(full["model.norm.weight"], torch.ones(cfg.hidden_size))
    assert abs(full["model.embed_tokens.weight"].std().item() - cfg.init_std) < 2e-3


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(sorted(param_shapes(TINY))), tp=st.sampled_from([1, 2]))
def test_shard_then_unshard_is_identity(name: str, tp: int) -> None:
    full = torch.randn(param_shapes(TINY)[name])
    shards = [shard_tensor(full, name, rank, tp) for rank in range(tp)]
    dim = shard_dim(name)
    for shard in shards:
        assert shard.is_contiguous() and shard.data_ptr() != full.data_ptr()
        if dim is not None:
            assert shard.shape[dim] == full.shape[dim] // tp
    assert torch.equal(unshard(name, shards), full)


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_stage_param_names_partition_the_model(pp: int) -> None:
    from nereus_core.layout import Layout

    layout = Layout.contiguous(pp=pp)
    held = [stage_param_names(TINY, stage_layers(TINY, layout, p), p == 0, p == pp - 1) for p in range(pp)]
    flat = [name for names in held for name in names]
    assert sorted(flat) == sorted(param_shapes(TINY)) and len(flat) == len(set(flat))
    assert stage_param_names(TINY_TIED, range(4), True, True) == list(param_shapes(TINY_TIED))
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        stage_param_names(TINY_TIED, range(2), True, False)


def test_stage_named_parameters_are_hf_names_with_local_shapes() -> None:
    stage = LlamaStage(TINY, layers=range(2, 4), first=False, last=True, tp_rank=1, tp_size=2)
    shapes = {name: tuple(p.shape) for name, p in stage.named_parameters()}
    assert list(shapes) == stage_param_names(TINY, range(2, 4), False, True)
    assert shapes["model.layers.2.self_attn.q_proj.weight"] == (32, 64)
    assert shapes["model.layers.2.self_attn.k_proj.weight"] == (16, 64)
    assert shapes["model.layers.3.mlp.down_proj.weight"] == (64, 64)
    assert shapes["lm_head.weight"] == (128, 64)
    assert not stage.state_dict().keys() - set(shapes)
    # The gradient norm counts a weight on every tp rank exactly when it is split over them.
    split = {name for name, p in stage.named_parameters() if getattr(p, "tensor_model_parallel", False)}
    assert split == {name for name in shapes if shard_dim(name) is not None}
    assert "model.norm.weight" not in split and "lm_head.weight" in split


# --- single process against HF ---------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg", [TINY, TINY_TIED, TINY_QWEN, TINY_LLAMA3], ids=["untied", "tied", "qwen2", "llama3-rope"]
)
def test_single_stage_matches_hf(cfg: ModelConfig) -> None:
    ref, ids = _hf_reference(cfg), _ids(cfg)
    stage = _stage(cfg, range(4), True, True)
    logits = stage(ids, torch.arange(SEQ))
    logprobs = vocab_parallel_logprobs(logits[:, :-1], ids[:, 1:], None)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, ref["logits"], atol=1e-5, rtol=0)
    torch.testing.assert_close(logprobs, ref["logprobs"], atol=1e-5, rtol=0)
    (-logprobs.mean()).backward()
    _assert_grads_match(cfg, {name: p.grad for name, p in stage.named_parameters()})


def test_two_chained_stages_match_hf() -> None:
    """Stage 0 (layers 0-1) -> stage 1 (layers 2-3), backward split at the boundary as an engine would."""
    ref, ids = _hf_reference(TINY), _ids(TINY)
    stage0, stage1 = _stage(TINY, range(0, 2), True, False), _stage(TINY, range(2, 4), False, True)
    hidden = stage0(ids, torch.arange(SEQ))
    received = hidden.detach().requires_grad_()
    logits = stage1(received, torch.arange(SEQ))
    torch.testing.assert_close(logits, ref["logits"], atol=1e-5, rtol=0)
    logprobs = vocab_parallel_logprobs(logits[:, :-1], ids[:, 1:], None)
    torch.testing.assert_close(logprobs, ref["logprobs"], atol=1e-5, rtol=0)
    (-logprobs.mean()).backward()
    hidden.backward(received.grad)
    grads = {name: p.grad for s in (stage0, stage1) for name, p in s.named_parameters()}
    _assert_grads_match(TINY, grads)


@pytest.mark.parametrize("split", [(4,), (2, 2)], ids=["pp1", "pp2"])
def test_kv_cache_greedy_decode_matches_hf_generate(split: tuple[int, ...]) -> None:
    bounds = [sum(split[:i]) for i in range(len(split) + 1)]
    stages = [
        _stage(TINY, range(bounds[i], bounds[i + 1]), i == 0, i == len(split) - 1) for i in range(len(split))
    ]
    with torch.no_grad():
        tokens = _greedy(stages, _ids(TINY))
    assert torch.equal(tokens, _hf_reference(TINY)["tokens"])


def test_left_padding_matches_hf() -> None:
    """Left-padded prompts: attention_mask + per-row positions, prefill and cached decode."""
    model, ids = _hf_model(TINY), _ids(TINY)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    stage = _stage(TINY, range(4), True, True)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, position_ids=positions).logits
        expected = model.generate(
            ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0
        )[:, SEQ:]
        cache = stage.new_cache(BATCH, SEQ + NEW_TOKENS)
        logits = stage(ids, positions, cache, attention_mask=mask)
        tokens = [vocab_parallel_argmax(logits[:, -1], None)]
        for _ in range(NEW_TOKENS - 1):
            mask = torch.cat([mask, torch.ones(BATCH, 1, dtype=mask.dtype)], dim=1)
            positions = positions[:, -1:] + 1
            tokens.append(
                vocab_parallel_argmax(stage(tokens[-1][:, None], positions, cache, mask)[:, -1], None)
            )
    real = ids.new_ones(ids.shape, dtype=torch.bool)
    real[0, :3] = False
    torch.testing.assert_close(logits[real], ref[real], atol=1e-5, rtol=0)
    assert torch.equal(torch.stack(tokens, dim=1), expected)


def test_llama3_rope_scaling_matches_hf_far_positions() -> None:
    """Llama 3's frequencies equal HF's, and change the logits at positions past the original context."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config(TINY_LLAMA3), "cpu")
    ours = rope_inv_freq(head_dim=TINY_LLAMA3.head_dim, theta=500000.0, scaling=LLAMA3_SCALING)
    torch.testing.assert_close(ours, hf_freq, atol=0, rtol=1e-6)
    plain = rope_inv_freq(head_dim=TINY_LLAMA3.head_dim, theta=500000.0, scaling=None)
    assert (ours < plain).any() and (ours == plain).any()  # some bands scaled, the shortest kept
    positions, ids = torch.arange(SEQ) + 200, _ids(TINY_LLAMA3)
    with torch.no_grad():
        ref = _hf_model(TINY_LLAMA3)(ids, position_ids=positions[None].expand(BATCH, -1)).logits
        logits = _stage(TINY_LLAMA3, range(4), True, True)(ids, positions)
        unscaled = ModelConfig(**{**TINY_LLAMA3.model_dump(), "rope_scaling": None})
        logits_unscaled = _stage(unscaled, range(4), True, True)(ids, positions)
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)
    assert (logits_unscaled - ref).abs().max() > 1e-3


# --- sampling ------------------------------------------------------------------------------


def test_sample_is_gumbel_max_and_follows_softmax() -> None:
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(3))
    ids = vocab_parallel_sample(logits, 0.7, torch.Generator().manual_seed(5), None)
    uniform = torch.rand(3, 16, generator=torch.Generator().manual_seed(5))
    assert torch.equal(ids, torch.argmax(logits / 0.7 - torch.log(-torch.log(uniform)), dim=-1))
    assert torch.equal(vocab_parallel_sample(logits, 0.0, torch.Generator(), None), logits.argmax(-1))
    row = torch.tensor([[0.0, 1.0, 2.0, -1.0]]).expand(40_000, 4)
    counts = torch.bincount(
        vocab_parallel_sample(row, 1.0, torch.Generator().manual_seed(0), None), minlength=4
    )
    torch.testing.assert_close(counts / 40_000, torch.softmax(row[0], -1), atol=0.01, rtol=0)


def _full_softmax_entropy(logits: torch.Tensor) -> torch.Tensor:
    """-sum p log p over the whole vocab, from the definition (float64), as a reference."""
    p = torch.softmax(logits.double(), dim=-1)
    return -(p * p.log()).sum(dim=-1).float()


def test_entropy_single_device_is_the_softmax_entropy() -> None:
    logits = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(2)) * 4
    entropy = vocab_parallel_entropy(logits, None)
    torch.testing.assert_close(entropy, _full_softmax_entropy(logits), atol=1e-5, rtol=0)
    uniform = vocab_parallel_entropy(torch.zeros(2, 16), None)
    torch.testing.assert_close(uniform, torch.full((2,), math.log(16)))


# --- tensor parallel over gloo -------------------------------------------------------------


def _tp_world_case(rank: int, world: int, cfg: ModelConfig) -> dict[str, Any]:
    group = dist.group.WORLD
    stage = _stage(cfg, range(cfg.num_hidden_layers), True, True, tp_rank=rank, tp_size=world, tp_group=group)
    ids = _ids(cfg)
    logits = stage(ids, torch.arange(SEQ))
    logprobs = vocab_parallel_logprobs(logits[:, :-1], ids[:, 1:], group)
    (-logprobs.mean()).backward()
    with torch.no_grad():
        tokens = _greedy([stage], ids, group)
        samples = vocab_parallel_sample(logits[:, -1], 0.8, torch.Generator().manual_seed(11), group)
    return {
        "logits": logits.detach(),
        "logprobs": logprobs.detach(),
        "entropy": vocab_parallel_entropy(logits, group),
        "grads": {name: p.grad for name, p in stage.named_parameters()},
        "tokens": tokens,
        "samples": samples,
    }


def _tp_world(rank: int, world: int, cfgs: list[ModelConfig]) -> list[dict[str, Any]]:
    return [_tp_world_case(rank, world, cfg) for cfg in cfgs]


def _check_tp_case(cfg: ModelConfig, per_rank: list[dict[str, Any]]) -> None:
    ref = _hf_reference(cfg)
    logits = torch.cat([r["logits"] for r in per_rank], dim=-1)
    torch.testing.assert_close(logits, ref["logits"], atol=1e-5, rtol=0)
    entropy = _full_softmax_entropy(ref["logits"])
    for r in per_rank:
        torch.testing.assert_close(r["logprobs"], ref["logprobs"], atol=1e-4, rtol=0)
        torch.testing.assert_close(r["entropy"], entropy, atol=1e-5, rtol=0)
        assert torch.equal(r["tokens"], ref["tokens"])
        assert torch.equal(r["samples"], per_rank[0]["samples"])
    expected_samples = vocab_parallel_sample(logits[:, -1], 0.8, torch.Generator().manual_seed(11), None)
    assert torch.equal(per_rank[0]["samples"], expected_samples)
    grads = {name: unshard(name, [r["grads"][name] for r in per_rank]) for name in per_rank[0]["grads"]}
    _assert_grads_match(cfg, grads)


@pytest.mark.parametrize(
    ("world", "cfgs"), [(2, [TINY, TINY_TIED, TINY_QWEN, TINY_LLAMA3]), (4, [TINY_KV4])], ids=["tp2", "tp4"]
)
def test_tensor_parallel_world_matches_hf(world: int, cfgs: list[ModelConfig]) -> None:
    results = run_world(world, _tp_world, cfgs)
    for i, cfg in enumerate(cfgs):
        _check_tp_case(cfg, [per_rank[i] for per_rank in results])


def _argmax_ties(rank: int, world: int) -> torch.Tensor:
    logits_local = torch.zeros(2, 4)  # every id ties: torch.argmax picks global id 0
    logits_local[1, 1] = 1.0  # row 1: each rank's local id 1 ties; the lowest global id is 1
    return vocab_parallel_argmax(logits_local, dist.group.WORLD)


def _fails_on_rank_one(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("boom on rank one")
    return rank


def test_argmax_ties_rank_check_and_world_errors() -> None:
    for ids in run_world(2, _argmax_ties):
        assert ids.tolist() == [0, 1]
    with pytest.raises(WorldError, match="boom on rank one"):
        run_world(2, _fails_on_rank_one)
