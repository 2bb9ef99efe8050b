"""nereus_core/rl/rollout.py's GRPO pieces: grouped prompts, group advantages on a rollout, whole-group
mini-batches and the GRPO objective on a micro-batch."""

from __future__ import annotations

import torch

from nereus_core.rl import grpo, ppo, rollout
from nereus_core.rl.algorithm import AlgorithmConfig

ALGO = AlgorithmConfig(name="grpo", group_size=4)


def _rollout(b: int = 8, t: int = 3, seed: int = 0) -> rollout.Rollout:
    gen = torch.Generator().manual_seed(seed)
    r = rollout.Rollout(
        prompts=rollout.grouped(torch.arange(b // 4 * 2).view(-1, 2), 4),
        responses=torch.randint(1, 11, (b, t), generator=gen),
        mask=torch.ones(b, t),
    )
    r.score = torch.rand(b, generator=gen)
    r.old_logp = -torch.rand(b, t, generator=gen)
    r.ref_logp = -torch.rand(b, t, generator=gen)
    return r


def test_grouped_puts_the_copies_of_a_prompt_next_to_each_other() -> None:
    out = rollout.grouped(torch.tensor([[1, 2], [3, 4]]), 3)
    assert out.tolist() == [[1, 2]] * 3 + [[3, 4]] * 3


def test_group_advantages_of_the_score_on_every_token() -> None:
    r = _rollout()
    rollout.compute_group_advantages(r, ALGO, ppo.PPOConfig(kl_coef=0.0))
    expected_b = grpo.group_advantages(r.score, 4)
    assert torch.allclose(r.advantages, expected_b[:, None].expand(8, 3))
    assert torch.allclose(r.rewards.sum(dim=1), r.score) and r.returns is None
    assert torch.allclose(r.advantages[:, 0].view(2, 4).sum(dim=1), torch.zeros(2), atol=1e-5)


def test_a_kl_penalty_lowers_each_reward_by_its_summed_token_penalty() -> None:
    r = _rollout()
    settings = ppo.PPOConfig(kl_coef=0.1, kl_kind="k1")
    rollout.compute_group_advantages(r, ALGO, settings)
    penalty_b = 0.1 * (r.old_logp - r.ref_logp).sum(dim=1)
    assert torch.allclose(r.rewards.sum(dim=1), r.score - penalty_b, atol=1e-6)
    assert torch.allclose(r.advantages[:, 0], grpo.group_advantages(r.score - penalty_b, 4), atol=1e-5)


def test_minibatches_keep_whole_groups_and_group_size_one_is_the_plain_shuffle() -> None:
    rows = rollout.minibatch_rows(16, 2, torch.Generator().manual_seed(0), group_size=4)
    assert sorted(torch.cat(rows).tolist()) == list(range(16))
    for part in rows:
        groups = {int(i) // 4 for i in part}
        assert len(part) == 4 * len(groups)  # every row of a group it holds
    plain = rollout.minibatch_rows(16, 2, torch.Generator().manual_seed(0))
    old = list(torch.randperm(16, generator=torch.Generator().manual_seed(0)).view(2, -1))
    assert all(torch.equal(a, b) for a, b in zip(plain, old, strict=True))


def test_grpo_objective_is_grpo_loss_on_the_response_and_uses_the_kl_term_when_asked() -> None:
    r = _rollout()
    rollout.compute_group_advantages(r, ALGO, ppo.PPOConfig(kl_coef=0.0))
    batch = r.train_batch(torch.arange(8))
    p, t = r.prompts.shape[1], r.response_len
    logp_full = torch.cat([-torch.rand(8, p - 1), r.old_logp + 0.05], dim=1).requires_grad_()
    settings = ppo.PPOConfig(kl_coef=0.0, use_kl_loss=True, kl_loss_coef=0.5)
    loss, stats = rollout.grpo_objective(logp_full, batch, settings=settings, algorithm=ALGO)
    expected, _ = grpo.grpo_loss(
        logp_full[:, -t:], batch["old_logp"], batch["advantages"], batch["mask"],
        ref_logp_bt=batch["ref_logp"], kl_coef=0.5, max_len=t,
    )  # fmt: skip
    assert torch.allclose(loss, expected) and "kl_loss" in stats and float(stats["kl_loss"]) > 0
    loss.backward()
    assert logp_full.grad[:, : p - 1].abs().sum() == 0 and logp_full.grad[:, -t:].abs().sum() > 0
    no_kl, stats = rollout.grpo_objective(logp_full, batch, settings=ppo.PPOConfig(), algorithm=ALGO)
    assert "kl_loss" not in stats and not torch.allclose(no_kl, loss)


def test_token_mean_over_ragged_micro_batches_is_the_mini_batchs_token_mean() -> None:
    """Micro-batches of equal rows but different real tokens, averaged as the engine does, give the
    whole mini-batch's token-mean loss and gradient (token-mean); the seq-mean modes need no weight."""
    r = _rollout(b=8, t=5)
    r.mask = torch.tensor([[1.0] * 5] * 2 + [[1.0, 1.0, 0.0, 0.0, 0.0]] * 6)  # rows 0-1 long, 2-7 short
    rollout.compute_group_advantages(r, ALGO, ppo.PPOConfig(kl_coef=0.0))
    logp_full = torch.cat([-torch.rand(8, r.prompts.shape[1] - 1), r.old_logp + 0.05], dim=1)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        algorithm = AlgorithmConfig(name="grpo", group_size=4, loss_agg_mode=mode)
        settings = ppo.PPOConfig(kl_coef=0.0)
        whole_in = logp_full.clone().requires_grad_()
        batch = r.train_batch(torch.arange(8))
        whole, _ = rollout.grpo_objective(whole_in, batch, settings=settings, algorithm=algorithm)
        whole.backward()
        parts_in = logp_full.clone().requires_grad_()
        halves = [torch.arange(0, 4), torch.arange(4, 8)]
        tokens_per_row = batch["tokens_per_row"]
        losses = []
        for rows in halves:
            part = {k: v[rows] for k, v in batch.items()}
            part["tokens_per_row"] = tokens_per_row[rows]  # the mini-batch's, as train_batch gives it
            losses.append(
                rollout.grpo_objective(parts_in[rows], part, settings=settings, algorithm=algorithm)[0]
            )
        averaged = torch.stack(losses).mean()
        averaged.backward()
        assert torch.allclose(averaged, whole, atol=1e-6), mode
        assert torch.allclose(parts_in.grad, whole_in.grad, atol=1e-7), mode
