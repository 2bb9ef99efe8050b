"""nereus_core/rl/rollout.py with variable lengths: response masks from stop ids, the padded rollout's
attention mask and lengths, and padding that no loss, estimator or statistic can see."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus_core.rl import ppo, rollout

PROMPT, MAX_NEW_TOKENS = 3, 6
SETTINGS = ppo.PPOConfig(kl_coef=0.1, kl_kind="k3", use_kl_loss=True, kl_loss_coef=0.2, value_clip=0.3)


def test_response_mask_keeps_the_first_stop_token_and_nothing_after() -> None:
    responses = torch.tensor([[5, 7, 2, 2, 9], [5, 6, 6, 6, 6], [3, 5, 1, 3, 3], [4, 4, 4, 4, 3]])
    mask = rollout.response_mask(responses, eos_ids=(3, 5))
    assert mask.tolist() == [[1, 0, 0, 0, 0], [1, 0, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    # Pad id equal to a stop id: the mask still ends at the first one.
    padded = torch.tensor([[8, 0, 0, 0], [8, 8, 8, 8]])
    assert rollout.response_mask(padded, eos_ids=(0,)).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert rollout.response_mask(responses).tolist() == torch.ones(4, 5).tolist()
    assert rollout.length_stats(mask, limit=5) == {
        "response_len_mean": 2.0,
        "response_len_max": 5.0,
        "response_clip_frac": 0.25,
    }


def test_stopping_refuses_negative_ids() -> None:
    with pytest.raises(ValueError, match="eos_ids"):
        rollout.Stopping(eos_ids=(-1,))
    assert rollout.NO_STOP.eos_ids == () and rollout.NO_STOP.pad_id == 0


def test_padded_rollout_attention_mask_lengths_and_columns() -> None:
    r = rollout.Rollout(
        prompts=torch.tensor([[0, 0, 4], [5, 6, 7]]),
        prompt_mask=torch.tensor([[0, 0, 1], [1, 1, 1]]),
        responses=torch.tensor([[8, 2, 0], [9, 9, 9]]),
        mask=torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]),
    )
    assert r.attention_mask.tolist() == [[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]
    assert r.lengths.tolist() == [2, 3] and r.response_len == 3
    assert r.columns()["response_length"].tolist() == [2, 3]
    batch = r.train_batch(torch.tensor([1, 0]))
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 0]]
    assert batch["tokens_per_row"].tolist() == [2.5, 2.5]
    unpadded = rollout.Rollout(prompts=r.prompts, responses=r.responses, mask=torch.ones(2, 3))
    assert unpadded.attention_mask.tolist() == torch.ones(2, 6).tolist()


def test_final_score_reads_the_last_real_token() -> None:
    values = torch.tensor([[0.1, 0.2, 0.3, 9.0], [0.5, 0.6, 0.7, 0.8]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    assert rollout.final_score(values, mask).tolist() == pytest.approx([0.3, 0.8])
    assert rollout.final_score(values).tolist() == pytest.approx([9.0, 0.8])


def test_minibatch_shares_average_to_the_minibatch_token_mean() -> None:
    """Micro-batch token-means times their shares, averaged as the engine averages micro-batches,
    equal the token-mean of the whole mini-batch; with equal lengths every share is exactly 1."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, generator=gen)
    mask = (torch.arange(5) < torch.tensor([5, 1, 3, 2, 4, 1])[:, None]).float()
    per_row = mask.sum() / 6
    parts = [
        ppo.masked_mean(x[s], mask[s]) * ppo.minibatch_share(mask[s], per_row.expand(2))
        for s in (slice(0, 2), slice(2, 4), slice(4, 6))
    ]
    assert float(torch.stack(parts).mean()) == pytest.approx(float(ppo.masked_mean(x, mask)), rel=1e-6)
    assert float(ppo.minibatch_share(torch.ones(2, 5), torch.tensor([5.0, 5.0]))) == 1.0


def _step(
    logp_full: torch.Tensor,
    values_full: torch.Tensor,
    entropy_full: torch.Tensor,
    fields: dict[str, torch.Tensor],
    junk: dict[str, torch.Tensor] | None,
) -> dict[str, Any]:
    """Advantages, both objectives (with entropy, KL loss) and their gradients on one batch.

    ``junk``, when given, overwrites the estimators' outputs in the padding columns, so the losses
    see arbitrary values there (the estimators' own zeros are checked separately)."""
    r = rollout.Rollout(
        prompts=fields["prompts"],
        responses=fields["responses"],
        mask=fields["mask"],
        score=fields["score"],
        old_logp=fields["old_logp"],
        ref_logp=fields["ref_logp"],
        values=fields["values"],
    )
    rollout.compute_advantages(r, SETTINGS)
    out = {"rewards": r.rewards, "advantages": r.advantages, "returns": r.returns}
    if junk is not None:
        pad = r.mask == 0
        r.advantages = torch.where(pad, junk["advantages"], r.advantages)
        r.returns = torch.where(pad, junk["returns"], r.returns)
    batch = r.train_batch(torch.arange(r.mask.shape[0]))
    batch["entropy"] = entropy_full
    logp_full = logp_full.clone().requires_grad_(True)
    values_full = values_full.clone().requires_grad_(True)
    actor_loss, actor_stats = rollout.actor_objective(logp_full, batch, settings=SETTINGS)
    critic_loss, critic_stats = rollout.critic_objective(values_full, batch, settings=SETTINGS)
    (actor_loss + critic_loss).backward()
    return {
        **out,
        "actor_loss": actor_loss.detach(),
        "critic_loss": critic_loss.detach(),
        **actor_stats,
        **critic_stats,
        "logp_grad": logp_full.grad,
        "values_grad": values_full.grad,
        **rollout.length_stats(r.mask, limit=MAX_NEW_TOKENS),
    }


def _append(x: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, extra.to(x.dtype)], dim=1)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 6), min_size=1, max_size=4).filter(lambda ls: sum(ls) >= 2),
    extra=st.integers(1, 4),
    scale=st.sampled_from([1e-3, 1.0, 30.0, 1e3]),
    seed=st.integers(0, 2**16),
)
def test_appended_padding_changes_no_loss_gradient_or_statistic(
    lengths: list[int], extra: int, scale: float, seed: int
) -> None:
    """Extra masked response columns holding arbitrary values: same rewards, advantages and returns
    on the real tokens (zeros in the padding), same losses, statistics and gradients."""
    gen = torch.Generator().manual_seed(seed)
    b, t = len(lengths), MAX_NEW_TOKENS
    s = PROMPT + t

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    mask = (torch.arange(t) < torch.tensor(lengths)[:, None]).float()
    fields = {
        "prompts": torch.randint(1, 9, (b, PROMPT), generator=gen),
        "responses": torch.randint(1, 9, (b, t), generator=gen),
        "mask": mask,
        "score": randn(b),
        "old_logp": -randn(b, t).abs(),
        "ref_logp": -randn(b, t).abs(),
        "values": randn(b, t),
    }
    logp_full, values_full, entropy_full = -randn(b, s - 1).abs(), randn(b, s), randn(b, s - 1).abs()
    base = _step(logp_full, values_full, entropy_full, fields, junk=None)

    def junk(*shape: int) -> torch.Tensor:
        return scale * randn(*shape)

    padded_fields = {
        **{k: _append(v, junk(b, extra)) for k, v in fields.items() if k not in ("prompts", "score", "mask")},
        "prompts": fields["prompts"],
        "score": fields["score"],
        "mask": _append(mask, torch.zeros(b, extra)),
    }
    padded = _step(
        _append(logp_full, junk(b, extra)),
        _append(values_full, junk(b, extra)),
        _append(entropy_full, junk(b, extra)),
        padded_fields,
        junk={"advantages": junk(b, t + extra), "returns": junk(b, t + extra)},
    )
    for key in ("rewards", "advantages", "returns", "logp_grad"):
        torch.testing.assert_close(padded[key][:, : base[key].shape[1]], base[key], rtol=1e-5, atol=1e-6)
        assert not padded[key][:, base[key].shape[1] :].any(), f"{key}: padding must stay 0"
    # The value head's extra column is the state after the last padded token: it is never read.
    torch.testing.assert_close(padded["values_grad"][:, :s], base["values_grad"], rtol=1e-5, atol=1e-6)
    assert not padded["values_grad"][:, s:].any()
    scalars = [k for k in base if k not in ("rewards", "advantages", "returns", "logp_grad", "values_grad")]
    assert "entropy" in scalars and "response_clip_frac" in scalars
    for key in scalars:
        assert float(padded[key]) == pytest.approx(float(base[key]), rel=1e-5, abs=1e-6), key
