"""nereus_core/rl/rollout.cut_to_longest: the response columns after the batch's longest response are
pads only, so a rollout cut to it gives the same log-probs (a Hugging Face Llama on both widths is the
evidence), advantages, losses, gradients and length statistics on every real token as the full one."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from nereus_core.rl import ppo, rollout
from nereus_core.rl.algorithm import AlgorithmConfig

P, T, STOPS = 3, 9, (3, 5)
# Four responses of 2, 6, 3 and 6 tokens (each ends on a stop id), padded with 0 to T columns.
RESPONSES = torch.tensor(
    [
        [7, 3, 0, 0, 0, 0, 0, 0, 0],
        [8, 9, 6, 7, 8, 5, 0, 0, 0],
        [6, 6, 5, 0, 0, 0, 0, 0, 0],
        [9, 8, 7, 6, 9, 3, 0, 0, 0],
    ]
)
PROMPTS = torch.tensor([[0, 4, 6], [2, 4, 6], [0, 0, 9], [1, 2, 4]])
PROMPT_MASK = (PROMPTS != 0).long()
VALUES = torch.linspace(-1, 1, 4 * T).view(4, T)
SETTINGS = ppo.PPOConfig(
    kl_coef=0.1, kl_kind="k3", use_kl_loss=True, kl_loss_coef=0.2, whiten_advantages=True
)


def full_rollout() -> rollout.Rollout:
    return rollout.Rollout(
        prompts=PROMPTS,
        prompt_mask=PROMPT_MASK,
        responses=RESPONSES,
        mask=rollout.response_mask(RESPONSES, STOPS),
        rule_score=torch.tensor([1.0, 0.0, 0.5, 0.25]),
    )


def hf_logp(model: LlamaForCausalLM, r: rollout.Rollout) -> torch.Tensor:
    """Log-probs ``[b, s-1]`` of each next token, left- and right-padded as the engine runs them."""
    mask = r.attention_mask.long()
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    logits = model(r.ids, attention_mask=mask, position_ids=positions).logits
    return torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, r.ids[:, 1:, None])[..., 0]


def test_a_rollout_is_cut_to_its_longest_response_and_only_its_response_columns() -> None:
    r = full_rollout()
    r.rollout_logp = -torch.rand(4, T) * r.mask
    cut = rollout.cut_to_longest(r)
    assert cut.response_len == 6 == int(r.lengths.max()) and torch.equal(cut.lengths, r.lengths)
    assert torch.equal(cut.responses, RESPONSES[:, :6]) and torch.equal(
        cut.rollout_logp, r.rollout_logp[:, :6]
    )
    assert cut.prompts is r.prompts and cut.prompt_mask is r.prompt_mask and cut.rule_score is r.rule_score
    assert not (r.mask[:, 6:]).any()  # what was cut held no real token
    assert rollout.cut_to_longest(cut) is cut  # as wide as its longest already
    assert rollout.length_stats(cut.mask, T) == rollout.length_stats(r.mask, T)  # the limit stays T


def test_the_cut_rollout_gives_the_same_passes_advantages_losses_and_gradients() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2
    )
    model = LlamaForCausalLM(config).eval()
    full, cut = full_rollout(), rollout.cut_to_longest(full_rollout())
    real = cut.mask.bool()
    outs = {}
    for name, r in (("full", full), ("cut", cut)):
        with torch.no_grad():
            logp_full = hf_logp(model, r)
        t = r.response_len
        r.old_logp, r.ref_logp = (
            rollout.response_logp(logp_full, t),
            rollout.response_logp(logp_full, t) - 0.1,
        )
        r.values = VALUES[:, :t]  # a value head's outputs: causal, as the log-probs
        r.score = r.rule_score
        rollout.compute_advantages(r, SETTINGS)
        outs[name] = (r, logp_full)
    (f, f_logp), (c, c_logp) = outs["full"], outs["cut"]
    assert torch.allclose(f.old_logp[:, :6][real], c.old_logp[real], atol=1e-5)
    for key in ("rewards", "advantages", "returns"):
        assert torch.allclose(getattr(f, key)[:, :6], getattr(c, key), atol=1e-5), key
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        algo = AlgorithmConfig(name="grpo", group_size=2, loss_agg_mode=mode, loss_scale_tokens=T)
        results = []
        for r, logp_full in ((f, f_logp), (c, c_logp)):
            logp = (logp_full + 0.01).requires_grad_()  # a policy a little off the old one
            loss, stats = rollout.grpo_objective(
                logp, r.train_batch(torch.arange(4)), settings=SETTINGS, algorithm=algo
            )
            loss.backward()
            results.append((loss.detach(), stats, logp.grad[:, -r.response_len :][:, :6]))
        (fl, fs, fg), (cl, cs, cg) = results
        assert float(fl) == pytest.approx(float(cl), rel=1e-6) and float(fl) != 0.0, mode
        assert torch.allclose(fg, cg, atol=1e-7) and fg.abs().sum() > 0, mode
        assert all(float(fs[k]) == pytest.approx(float(cs[k]), rel=1e-5, abs=1e-7) for k in fs), mode
