"""Padded, variable-length batches in every layout on the Dask device pool, against transformers:
left-padded prompts and right-padded responses (an attention mask, positions from each row's first
real token) through the lm head and the value head, a train step, and greedy generation that stops
per row at EOS."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import transformers

from nereus_core.config import ModelConfig
from nereus_core.engine.forward import position_ids
from nereus_core.engine.shard import OptimizerSettings
from nereus_core.engine.train import lm_loss
from nereus_core.model.weights import hf_config, init_full_state
from nereus_core.rl.rollout import response_mask
from tasks import model_ops
from tests.support.runtime_setup import GQA_MODEL, contiguous_layout, token_logprobs

LLAMA = GQA_MODEL.model_copy(update={"seed": 11})
# Qwen2 as its larger sizes: q/k/v biases, untied embeddings (tied ones cannot be pipelined).
QWEN2 = LLAMA.model_copy(
    update={
        "architecture": "Qwen2ForCausalLM",
        "attention_bias": True,
        "rope_theta": 1e6,
        "rms_norm_eps": 1e-6,
    }
)
MODELS = {"llama": LLAMA, "qwen2": QWEN2}
LAYOUTS = [(tp, pp, dp) for tp in (1, 2) for pp in (1, 2) for dp in (1, 2) if tp * pp * dp <= 4]
ROWS, PROMPT, RESPONSE = 4, 7, 5
LEFT_PADS = (0, 3, 1, 6)  # pads before each prompt (the last row keeps a single real prompt token)
RESPONSE_LENS = (5, 2, 4, 1)
PAD = 0


def _layout_id(dims: tuple[int, int, int]) -> str:
    return "tp{}-pp{}-dp{}".format(*dims)


def _padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, attention_mask)`` ``[4, 12]``: left-padded prompts, right-padded responses, pads = PAD."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, LLAMA.vocab_size, (ROWS, PROMPT + RESPONSE), generator=gen)
    cols = torch.arange(PROMPT + RESPONSE)
    prompt_real = cols[None, :PROMPT] >= torch.tensor(LEFT_PADS)[:, None]
    response_real = cols[None, :RESPONSE] < torch.tensor(RESPONSE_LENS)[:, None]
    mask = torch.cat([prompt_real, response_real], dim=1).long()
    return ids.masked_fill(mask == 0, PAD), mask


def _real_targets(mask: torch.Tensor) -> torch.Tensor:
    """``[b, s-1]``: log-probs of real tokens given a real context (a row's first real token has
    none: its log-prob is read from a pad)."""
    return mask[:, 1:].bool() & mask[:, :-1].bool()


def _hf_lm(cfg: ModelConfig) -> Any:
    model = getattr(transformers, cfg.architecture)(hf_config(cfg))
    model.load_state_dict(init_full_state(cfg), strict=not cfg.tie_word_embeddings)
    return model.float().eval()


def _hf_values(cfg: ModelConfig, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token values of the same weights in transformers' sequence-classification model."""
    value_cfg = cfg.model_copy(update={"head": "value", "tie_word_embeddings": False})
    name = cfg.architecture.replace("ForCausalLM", "ForSequenceClassification")
    model = getattr(transformers, name)(hf_config(value_cfg))
    model.load_state_dict(init_full_state(value_cfg))
    with torch.no_grad():
        hidden = model.model(ids, attention_mask=mask, position_ids=position_ids(mask)).last_hidden_state
        return model.score(hidden).squeeze(-1)


@pytest.mark.parametrize("dims", LAYOUTS, ids=_layout_id)
@pytest.mark.parametrize("model", list(MODELS))
def test_padded_logprobs_and_values_match_transformers(pool, model: str, dims: tuple[int, int, int]) -> None:
    cfg, layout = MODELS[model], contiguous_layout(*dims)
    value_cfg = cfg.model_copy(update={"head": "value", "tie_word_embeddings": False})
    ids, mask = _padded_batch()
    with torch.no_grad():
        logits = _hf_lm(cfg)(ids, attention_mask=mask, position_ids=position_ids(mask)).logits
    expected_logp, expected_values = token_logprobs(logits, ids), _hf_values(cfg, ids, mask)
    model_ops.load_model(pool, layout, name="actor/infer", config=cfg)
    model_ops.load_model(pool, layout, name="critic/infer", config=value_cfg)
    try:
        logp = model_ops.forward(pool, layout, ids, name="actor/infer", attention_mask=mask)
        values = model_ops.forward(pool, layout, ids, name="critic/infer", attention_mask=mask)
        unmasked = model_ops.forward(pool, layout, ids, name="actor/infer")
    finally:
        model_ops.unload_model(pool, layout, name="actor/infer")
        model_ops.unload_model(pool, layout, name="critic/infer")
    real_targets, real = _real_targets(mask), mask.bool()
    assert logp.shape == expected_logp.shape and values.shape == expected_values.shape
    assert (logp - expected_logp)[real_targets].abs().max().item() <= 1e-4
    assert (values - expected_values)[real].abs().max().item() <= 1e-4
    # The mask matters: without it the padded rows' real tokens read the pads.
    assert (unmasked - expected_logp)[real_targets].abs().max().item() > 1e-3


def _hf_after_one_step(cfg: ModelConfig, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    model = _hf_lm(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.01)
    logits = model(ids, attention_mask=mask, position_ids=position_ids(mask)).logits
    targets = _real_targets(mask).float()
    loss = -(token_logprobs(logits, ids) * targets).sum() / targets.sum()
    loss.backward()
    opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("dims", [(2, 2, 1), (1, 2, 2)], ids=_layout_id)
def test_padded_train_step_matches_transformers(pool, dims: tuple[int, int, int]) -> None:
    """One AdamW step on the mean log-likelihood of the real tokens of the whole batch (``lm_loss``),
    though micro-batches and replicas hold different numbers of them."""
    layout, cfg = contiguous_layout(*dims), LLAMA
    ids, mask = _padded_batch()
    expected = _hf_after_one_step(cfg, ids, mask)
    optimizer = OptimizerSettings(lr=1e-3, eps=1e-6, weight_decay=0.01)
    model_ops.load_model(pool, layout, name="actor/train", config=cfg, optimizer=optimizer)
    try:
        # lm_loss counts target columns mask[:, 1:]: a row's first real token is not a target.
        targets = torch.cat([torch.zeros(ROWS, 1, dtype=mask.dtype), _real_targets(mask).long()], dim=1)
        per_row = torch.full((ROWS,), float(targets.sum()) / ROWS)  # the mini-batch's, on every row
        batch = {"ids": ids, "attention_mask": mask, "mask": targets, "tokens_per_row": per_row}
        model_ops.train(pool, layout, batch, name="actor/train", loss_fn=lm_loss)
        got = model_ops.full_state(pool, layout, name="actor/train", config=cfg)
    finally:
        model_ops.unload_model(pool, layout, name="actor/train")
    moved = max((expected[k] - init_full_state(cfg)[k]).abs().max().item() for k in got)
    assert moved > 1e-4, "the reference did not move; the comparison would be empty"
    assert max((got[k] - expected[k]).abs().max().item() for k in got) <= 1e-5


GEN_PROMPT, NEW_TOKENS = 6, 8


def _left_padded_prompts() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    prompts = torch.randint(1, LLAMA.vocab_size, (ROWS, GEN_PROMPT), generator=gen)
    mask = (torch.arange(GEN_PROMPT)[None] >= torch.tensor([0, 2, 4, 1])[:, None]).long()
    return prompts.masked_fill(mask == 0, PAD), mask


@functools.cache
def _eos_case(model: str, stops: str) -> dict[str, Any]:
    """Stop ids taken from the model's own greedy continuations and transformers' tokens for them,
    padded to NEW_TOKENS with PAD. ``stops="some"``: rows stop at different steps and some may run
    to the limit; ``"all"``: every row stops by its third token, so generation ends early."""
    hf, (prompts, mask) = _hf_lm(MODELS[model]), _left_padded_prompts()
    greedy = dict(attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=PAD)
    with torch.no_grad():
        free = hf.generate(prompts, **greedy)[:, GEN_PROMPT:]
        eos = (int(free[0, 1]), int(free[2, 4])) if stops == "some" else tuple(set(free[:, 2].tolist()))
        out = hf.generate(prompts, eos_token_id=list(eos), **greedy)[:, GEN_PROMPT:]
    if stops == "all":
        assert out.shape[1] <= 3, "transformers did not end early; the case is degenerate"
    expected = torch.full((ROWS, NEW_TOKENS), PAD)
    expected[:, : out.shape[1]] = out
    return {"prompts": prompts, "mask": mask, "eos": eos, "expected": expected}


@pytest.mark.parametrize(
    "dims", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (1, 2, 2)], ids=_layout_id
)
@pytest.mark.parametrize("stops", ["some", "all"])
@pytest.mark.parametrize("model", list(MODELS))
def test_greedy_generation_with_eos_matches_transformers(
    pool, model: str, stops: str, dims: tuple[int, int, int]
) -> None:
    layout, case = contiguous_layout(*dims), _eos_case(model, stops)
    model_ops.load_model(pool, layout, name="actor/generate", config=MODELS[model])
    try:
        tokens = model_ops.sample(
            pool,
            layout,
            case["prompts"],
            name="actor/generate",
            max_new_tokens=NEW_TOKENS,
            prompt_mask=case["mask"],
            eos_ids=case["eos"],
            pad_id=PAD,
        )
    finally:
        model_ops.unload_model(pool, layout, name="actor/generate")
    lengths = response_mask(tokens, case["eos"]).sum(1)
    assert lengths.min() < NEW_TOKENS and len(set(lengths.tolist())) > 1, "rows must stop at different steps"
    assert torch.equal(tokens, case["expected"])
