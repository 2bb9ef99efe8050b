"""GRPO's advantages, loss and gradients (nereus_core/rl/grpo.py) against TRL's own GRPOTrainer code on
one identical batch.

TRL is the peer users know. Its loss is called as written (``GRPOTrainer._compute_loss`` on a
stand-in trainer that holds only the attributes the method reads); its advantages are computed
inline in ``_generate_and_score_completions``, which needs a whole trainer, so that part is
reproduced below and says which lines it follows. Both sides get the same log-probs from the same
tiny model, so what is compared is the maths after the model.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from nereus_core.rl.grpo import TRL_LOSS_TYPES, group_advantages, grpo_loss
from tests.support.tensors import close

try:
    from trl.trainer.grpo_trainer import GRPOTrainer
    from trl.trainer.utils import nanstd
except ImportError:  # TRL is an optional peer: pip install -e '.[peer]'
    GRPOTrainer = None

needs_trl = pytest.mark.skipif(GRPOTrainer is None, reason="TRL is not installed (pip install -e '.[peer]')")

G = 4  # responses per prompt
PROMPTS = 3
PROMPT_LEN, WIDTH, VOCAB = 3, 6, 11
MAX_COMPLETION_LENGTH = 8  # wider than the batch, as a generation limit is


class TinyLM(torch.nn.Module):
    """Embedding, tanh, projection: enough for log-probs with gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, VOCAB)

    def forward(self, ids_bt: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(ids_bt)))


def completion_logp(model: TinyLM, input_ids: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
    """Log-prob of each of the last ``logits_to_keep`` tokens given the ones before it."""
    logits_btv = model(input_ids)[:, -logits_to_keep - 1 : -1]
    targets_bt = input_ids[:, -logits_to_keep:]
    return torch.log_softmax(logits_btv, dim=-1).gather(-1, targets_bt[..., None]).squeeze(-1)


def make_batch(seed: int = 0) -> dict[str, Any]:
    """3 prompts x 4 responses of 1 to 6 tokens; the second group's rewards are all equal."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = TinyLM().double()
    b = PROMPTS * G
    prompt_ids = torch.randint(0, VOCAB, (b, PROMPT_LEN), generator=gen)
    completion_ids = torch.randint(0, VOCAB, (b, WIDTH), generator=gen)
    lengths = torch.tensor([6, 1, 3, 5, 2, 6, 4, 1, 5, 3, 6, 2])
    mask = (torch.arange(WIDTH)[None, :] < lengths[:, None]).double()
    rewards = torch.rand(b, generator=gen, dtype=torch.float64)
    rewards[G : 2 * G] = 0.5
    with torch.no_grad():
        logp = completion_logp(model, torch.cat([prompt_ids, completion_ids], dim=1), WIDTH)
    # Off-policy by up to ~0.5 nats so that both clip bounds bind on some tokens.
    old = (logp + 0.3 * torch.randn(b, WIDTH, generator=gen, dtype=torch.float64)) * mask
    ref = (logp + 0.3 * torch.randn(b, WIDTH, generator=gen, dtype=torch.float64)) * mask
    return {
        "model": model,
        "prompt_ids": prompt_ids,
        "completion_ids": completion_ids,
        "mask": mask,
        "rewards": rewards,
        "old": old,
        "ref": ref,
    }


def trl_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str) -> torch.Tensor:
    """TRL 1.16's advantages, reproduced from trl/trainer/grpo_trainer.py,
    ``GRPOTrainer._generate_and_score_completions``, branch ``multi_objective_aggregation ==
    "sum_then_normalize"`` with one reward function of weight 1 and no unscorable rows."""
    mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
    mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
    if scale_rewards in ["group", "none"]:
        std_rewards = nanstd(rewards.view(-1, num_generations), dim=1)
        std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
    else:  # "batch"
        std_rewards = nanstd(rewards).expand_as(rewards)
    advantages = rewards - mean_grouped_rewards
    if scale_rewards != "none":
        advantages = advantages / (std_rewards + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def trl_rloo_advantages(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Reproduced from trl/trainer/rloo_trainer.py, ``RLOOTrainer._generate_and_score_completions``
    (normalize_advantages=False, its default; no unscorable rows)."""
    grouped_rewards = rewards.view(-1, num_generations)
    scorable_counts = (~torch.isnan(grouped_rewards)).sum(dim=1, keepdim=True)
    grouped_sum = torch.nansum(grouped_rewards, dim=1, keepdim=True)
    baselines = (grouped_sum - grouped_rewards) / (scorable_counts - 1)
    return rewards - baselines.view(-1)


class _OneProcess:
    """The accelerator calls ``_compute_loss`` makes, for one process."""

    num_processes = 1
    sync_gradients = True

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def reduce(self, x: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return x


def trl_loss(
    batch: dict[str, Any], advantages: torch.Tensor, rows: slice = slice(None), **cfg: Any
) -> torch.Tensor:
    """TRL's ``GRPOTrainer._compute_loss`` itself, on a stand-in holding the attributes it reads.

    ``cfg``: loss_type, beta, epsilon, epsilon_high, use_bias_correction_kl and, for micro-batches,
    gradient_accumulation_steps, steps_per_generation and num_items_in_batch. The stand-in's
    log-prob function is this test's, so both sides see identical log-probs.
    """
    model = batch["model"]

    def logps_and_entropies(
        model_: TinyLM, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, **_: Any
    ) -> tuple[torch.Tensor, torch.Tensor, None]:
        logp = completion_logp(model_, input_ids, logits_to_keep)
        return logp, torch.zeros_like(logp), None

    epsilon = cfg["epsilon"]
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=logps_and_entropies,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=cfg["beta"],
        loss_type=cfg["loss_type"],
        epsilon_low=epsilon,
        epsilon_high=epsilon if cfg["epsilon_high"] is None else cfg["epsilon_high"],
        args=SimpleNamespace(
            use_bias_correction_kl=cfg["use_bias_correction_kl"],
            delta=None,
            steps_per_generation=cfg.get("steps_per_generation", 1),
        ),
        use_vllm=False,
        model=model,
        current_gradient_accumulation_steps=cfg.get("gradient_accumulation_steps", 1),
        max_completion_length=MAX_COMPLETION_LENGTH,
        accelerator=_OneProcess(),
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
    )
    mask = batch["mask"][rows]
    inputs = {
        "prompt_ids": batch["prompt_ids"][rows],
        "prompt_mask": torch.ones_like(batch["prompt_ids"][rows]),
        "completion_ids": batch["completion_ids"][rows],
        "completion_mask": mask.long(),
        "advantages": advantages[rows],
        "old_per_token_logps": batch["old"][rows],
        "ref_per_token_logps": batch["ref"][rows],
        "num_items_in_batch": cfg.get("num_items_in_batch", mask.sum()),
    }
    return GRPOTrainer._compute_loss(trainer, model, inputs)


def nereus_loss(batch: dict[str, Any], advantages: torch.Tensor, rows: slice = slice(None), **kw: Any):
    ids = torch.cat([batch["prompt_ids"][rows], batch["completion_ids"][rows]], dim=1)
    logp = completion_logp(batch["model"], ids, WIDTH)
    return grpo_loss(
        logp,
        batch["old"][rows],
        advantages[rows],
        batch["mask"][rows],
        ref_logp_bt=batch["ref"][rows],
        max_len=MAX_COMPLETION_LENGTH,
        **kw,
    )


def grads(model: TinyLM, loss: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, list(model.parameters())))


KL_SETTINGS = [  # (beta, use_bias_correction_kl, epsilon_high)
    (0.0, False, None),
    (0.04, False, None),
    (0.04, True, 0.28),
]


@needs_trl
@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_advantages_equal_trl(scale_rewards: str) -> None:
    rewards = make_batch()["rewards"]
    close(
        group_advantages(rewards, G, scale_rewards=scale_rewards), trl_advantages(rewards, G, scale_rewards)
    )


@needs_trl
def test_leave_one_out_equals_trl_rloo() -> None:
    rewards = make_batch()["rewards"]
    close(
        group_advantages(rewards, G, scale_rewards="none", baseline="leave_one_out"),
        trl_rloo_advantages(rewards, G),
    )


@needs_trl
@pytest.mark.parametrize(("beta", "bias_kl", "epsilon_high"), KL_SETTINGS)
@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
@pytest.mark.parametrize("loss_type", list(TRL_LOSS_TYPES))
def test_loss_and_gradients_equal_trl(
    loss_type: str, scale_rewards: str, beta: float, bias_kl: bool, epsilon_high: float | None
) -> None:
    batch = make_batch()
    model = batch["model"]
    trl_adv = trl_advantages(batch["rewards"], G, scale_rewards)
    expected = trl_loss(
        batch,
        trl_adv,
        loss_type=loss_type,
        beta=beta,
        epsilon=0.2,
        epsilon_high=epsilon_high,
        use_bias_correction_kl=bias_kl,
    )
    adv = group_advantages(batch["rewards"], G, scale_rewards=scale_rewards)
    loss, stats = nereus_loss(
        batch,
        adv,
        loss_agg_mode=TRL_LOSS_TYPES[loss_type],
        epsilon=0.2,
        epsilon_high=epsilon_high,
        kl_coef=beta,
        kl_ratio_weighted=bias_kl,
    )
    assert 0 < float(stats["clip_frac"]) < 1  # the batch exercises the clip
    close(loss, expected)
    for mine, theirs in zip(grads(model, loss), grads(model, expected), strict=True):
        assert theirs.abs().max() > 1e-4  # a real gradient, not zeros on both sides
        close(mine, theirs)


@needs_trl
@pytest.mark.parametrize(
    ("loss_type", "wrong"),
    [
        ("grpo", {"loss_agg_mode": "token-mean"}),
        ("dapo", {"loss_agg_mode": "seq-mean-token-mean"}),
        ("dr_grpo", {"loss_agg_mode": "seq-mean-token-sum"}),
        ("dapo", {"epsilon_high": 0.28}),
        ("dapo", {"kl_coef": 0.0}),
        ("dapo", {"kl_ratio_weighted": False}),
    ],
)
def test_a_mismatched_setting_is_caught(loss_type: str, wrong: dict[str, Any]) -> None:
    """The comparison can fail: one setting off and the loss or a gradient differs."""
    batch = make_batch()
    adv = trl_advantages(batch["rewards"], G, "group")
    expected = trl_loss(
        batch,
        adv,
        loss_type=loss_type,
        beta=0.04,
        epsilon=0.2,
        epsilon_high=None,
        use_bias_correction_kl=True,
    )
    kw = {"loss_agg_mode": TRL_LOSS_TYPES[loss_type], "kl_coef": 0.04, "kl_ratio_weighted": True} | wrong
    loss, _ = nereus_loss(batch, adv, **kw)
    model = batch["model"]
    diffs = [
        float((a - b).abs().max()) for a, b in zip(grads(model, loss), grads(model, expected), strict=True)
    ]
    assert max([abs(float((loss - expected).detach())), *diffs]) > 1e-4


@needs_trl
def test_dapo_over_micro_batches_equals_trl() -> None:
    """TRL's dapo divides every micro-batch by the whole generation batch's token count; so does
    token-mean given ``num_tokens``, and the micro-batches' losses add up to the whole batch's."""
    batch = make_batch()
    adv = trl_advantages(batch["rewards"], G, "group")
    total = batch["mask"].sum()
    whole, _ = nereus_loss(batch, adv, loss_agg_mode="token-mean", kl_coef=0.04)
    parts = []
    for rows in (slice(0, 5), slice(5, None)):  # uneven halves, cutting a group
        expected = trl_loss(
            batch,
            adv,
            rows,
            loss_type="dapo",
            beta=0.04,
            epsilon=0.2,
            epsilon_high=None,
            use_bias_correction_kl=False,
            gradient_accumulation_steps=2,
            steps_per_generation=2,
            num_items_in_batch=total,
        )
        loss, _ = nereus_loss(batch, adv, rows, loss_agg_mode="token-mean", kl_coef=0.04, num_tokens=total)
        close(loss, expected)
        parts.append(loss)
    close(sum(parts), whole)
