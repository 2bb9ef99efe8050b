"""Every layout of the tiny model, run on the Dask device pool, matches Hugging Face transformers."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM, LlamaForSequenceClassification

from nereus_core.engine.shard import OptimizerSettings
from nereus_core.engine.train import score_mse_loss
from nereus_core.layout import Layout
from nereus_core.model.weights import hf_config, init_full_state
from tasks import model_ops
from tests.support.runtime_setup import GQA_MODEL, contiguous_layout, token_logprobs

CONFIG = GQA_MODEL
FORWARD_LAYOUTS = [(tp, pp, dp) for tp in (1, 2, 4) for pp in (1, 2) for dp in (1, 2) if tp * pp * dp <= 4]
TRAIN_LAYOUTS = [(1, 1, 1), (2, 1, 2), (1, 2, 2), (2, 2, 1)]
# AdamW's step g/(sqrt(v)+eps) turns rounding in near-zero gradients into lr*|dg|/eps; with
# eps=1e-8 that amplifies summation-order noise a million-fold. eps=1e-6 keeps the
# comparison about the parallel math (gradients are also compared directly in test_model).
ADAMW = OptimizerSettings(lr=1e-3, eps=1e-6, weight_decay=0.01)


def _hf() -> LlamaForCausalLM:
    model = LlamaForCausalLM(hf_config(CONFIG))
    model.load_state_dict(init_full_state(CONFIG), strict=not CONFIG.tie_word_embeddings)
    return model.float()


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))


# A layout whose groups list devices out of world-rank order (as after a transition).
PERMUTED = Layout(tp=2, pp=2, dp=1, devices=(3, 1, 2, 0), micro_batches=2)


@pytest.mark.parametrize(
    "layout",
    [contiguous_layout(*dims) for dims in FORWARD_LAYOUTS] + [PERMUTED],
    ids=lambda layout: layout.key,
)
def test_logprobs_and_greedy_generation_match_transformers(pool, ids, layout):
    hf = _hf().eval()
    with torch.no_grad():
        expected_logp = token_logprobs(hf(ids).logits, ids)
        prompts = ids[:, :6]
        expected_tokens = hf.generate(
            prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=6, do_sample=False
        )[:, 6:]
    model_ops.load_model(pool, layout, name="actor/infer", config=CONFIG)
    try:
        logp = model_ops.forward(pool, layout, ids, name="actor/infer")
        tokens = model_ops.sample(pool, layout, prompts, name="actor/infer", max_new_tokens=6)
    finally:
        model_ops.unload_model(pool, layout, name="actor/infer")
    assert logp.shape == expected_logp.shape
    assert (logp - expected_logp).abs().max().item() <= 1e-4
    assert torch.equal(tokens, expected_tokens)


def _reference_after_steps(ids: torch.Tensor, steps: int) -> dict[str, torch.Tensor]:
    model = _hf().train()
    opt = torch.optim.AdamW(
        model.parameters(), lr=ADAMW.lr, betas=ADAMW.betas, eps=ADAMW.eps, weight_decay=ADAMW.weight_decay
    )
    for _ in range(steps):
        opt.zero_grad()
        loss = -token_logprobs(model(ids).logits, ids).mean()
        loss.backward()
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(("tp", "pp", "dp"), TRAIN_LAYOUTS)
def test_two_adamw_steps_match_single_process_reference(pool, ids, tp, pp, dp):
    layout = contiguous_layout(tp, pp, dp)
    expected = _reference_after_steps(ids, steps=2)
    model_ops.load_model(pool, layout, name="actor/train", config=CONFIG, optimizer=ADAMW)
    try:
        losses = [model_ops.train(pool, layout, {"ids": ids}, name="actor/train") for _ in range(2)]
        got = model_ops.full_state(pool, layout, name="actor/train", config=CONFIG)
    finally:
        model_ops.unload_model(pool, layout, name="actor/train")
    assert losses[1] < losses[0]
    assert set(got) == set(expected)
    worst = max((got[k] - expected[k]).abs().max().item() for k in got)
    moved = max((expected[k] - init_full_state(CONFIG)[k]).abs().max().item() for k in got)
    assert moved > 1e-4, "the reference did not move; the comparison would be empty"
    assert worst <= 1e-5, f"max param diff {worst:.3g} after 2 AdamW steps on {layout.key}"


VALUE_CONFIG = CONFIG.model_copy(update={"head": "value"})


@pytest.mark.parametrize(("tp", "pp", "dp"), [(2, 2, 1), (2, 1, 2)])
def test_value_head_forward_and_training_match_transformers(pool, ids, tp, pp, dp):
    layout = contiguous_layout(tp, pp, dp)
    hf = LlamaForSequenceClassification(hf_config(VALUE_CONFIG))
    hf.load_state_dict(init_full_state(VALUE_CONFIG))
    score = torch.linspace(0.0, 1.0, ids.shape[0])

    def per_token_values() -> torch.Tensor:  # HF pools one position; the critic needs all of them
        return hf.score(hf.model(ids).last_hidden_state).squeeze(-1)

    with torch.no_grad():
        expected_values = per_token_values()
    opt = torch.optim.AdamW(hf.parameters(), lr=ADAMW.lr, eps=ADAMW.eps, weight_decay=ADAMW.weight_decay)
    for _ in range(2):
        opt.zero_grad()
        (per_token_values()[:, -1] - score).pow(2).mean().backward()
        opt.step()
    model_ops.load_model(pool, layout, name="critic/train", config=VALUE_CONFIG, optimizer=ADAMW)
    try:
        values = model_ops.forward(pool, layout, ids, name="critic/train")
        batch = {"ids": ids, "score": score}
        for _ in range(2):
            model_ops.train(pool, layout, batch, name="critic/train", loss_fn=score_mse_loss)
        got = model_ops.full_state(pool, layout, name="critic/train", config=VALUE_CONFIG)
    finally:
        model_ops.unload_model(pool, layout, name="critic/train")
    assert (values - expected_values).abs().max().item() <= 1e-5
    expected = hf.state_dict()
    assert set(got) == set(expected)
    assert max((got[k] - expected[k]).abs().max().item() for k in got) <= 1e-5
