"""The demo's task, "count": continue the prompt's digits by counting up, mod 10.

In plain words. Token ids 1..10 stand for the digits 0..9; id 0 is reserved and every other id
is a non-digit. A prompt is ``prompt_len`` random digits (seeded). The response should count up
from the prompt's last digit, wrapping 9 -> 0: after a prompt ending in 7 the right response is
8 9 0 1 2 ... Each response position is judged against the digit just before it (the previous
response token, or the prompt's last digit for the first position): 1 if it is that digit plus
one (mod 10), 0.25 if it is some other digit, 0 if it is not a digit. After a non-digit the
most recent digit before it is the reference. The score is the mean over positions, in [0, 1].
Judging each position by its predecessor means a response that slips once and then counts on
correctly from the slip loses only the slipped position, so the score is dense enough for PPO.

Baselines. A policy sampling uniformly from V tokens scores ``(1 + 9c) / V`` with c the digit
credit: at every position exactly one token is right and nine others are digits (see
``random_policy_score``; 0.102 for V=32, 0.0127 for V=256). One that has learned to emit digits
but not to count scores ``(1 + 9c) / 10 = 0.325``; counting scores 1. Why this task: it is
checkable by a rule (no learned judge), offline, and a 4-layer, 64-wide model learns it (copy
the last token, add one) by PPO on two CPU cores in minutes.

Boundary: token ids in, scores out; no model, files or randomness beyond the generators passed in.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

DIGIT_CREDIT = 0.25
FIRST_DIGIT_ID = 1  # token id of digit 0; digits 0..9 are ids 1..10
NUM_DIGITS = 10
MIN_VOCAB = FIRST_DIGIT_ID + NUM_DIGITS
_NUM_SYNTHETIC_KINDS = 5


class TaskSettings(BaseModel):
    """The task the policy is trained on and how its responses are scored."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: Literal["count"] = Field(default="count", description="The task; only 'count' exists.")
    prompt_len: int = Field(default=8, ge=1, le=4096, description="Digits per prompt.")
    response_len: int = Field(default=8, ge=1, le=4096, description="Tokens per response.")
    digit_credit: float = Field(
        default=DIGIT_CREDIT, ge=0, le=1, description="Credit for a digit that is not the right one."
    )


def is_digit(tokens: torch.Tensor) -> torch.Tensor:
    """True where a token id stands for a digit."""
    return (tokens >= FIRST_DIGIT_ID) & (tokens < FIRST_DIGIT_ID + NUM_DIGITS)


def digit_token(digits: torch.Tensor) -> torch.Tensor:
    """Token ids of digits 0..9."""
    return digits + FIRST_DIGIT_ID


def token_digit(tokens: torch.Tensor) -> torch.Tensor:
    """Digits of token ids (meaningful only where ``is_digit``)."""
    return tokens - FIRST_DIGIT_ID


def make_prompts(settings: TaskSettings, batch: int, seed: int, step: int) -> torch.Tensor:
    """``[batch, prompt_len]`` random digit tokens, the same for the same (seed, step)."""
    # SeedSequence mixes (seed, step) so nearby pairs give unrelated streams.
    state = int(np.random.SeedSequence([seed, step]).generate_state(1, dtype=np.uint64)[0])
    generator = torch.Generator().manual_seed(state & (2**63 - 1))
    digits = torch.randint(0, NUM_DIGITS, (batch, settings.prompt_len), generator=generator)
    return digit_token(digits)


def position_scores(
    prompts_bp: torch.Tensor, responses_bt: torch.Tensor, digit_credit: float = DIGIT_CREDIT
) -> torch.Tensor:
    """``[b, t]`` float score of each response position (1, ``digit_credit`` or 0)."""
    p = prompts_bp.shape[1]
    if p < 1:
        raise ValueError("rule_score needs prompts of at least one token")
    seq = torch.cat([prompts_bp, responses_bt], dim=1)
    positions = torch.arange(seq.shape[1], device=seq.device).expand_as(seq)
    # Position of the most recent digit at or before each token (-1: none yet).
    last_digit_at = torch.where(is_digit(seq), positions, torch.full_like(positions, -1)).cummax(dim=1)
    ref_at = last_digit_at.values[:, p - 1 : -1]  # strictly before each response position
    ref_digit = token_digit(seq.gather(1, ref_at.clamp_min(0)))
    expected = digit_token((ref_digit + 1) % NUM_DIGITS)
    digit = is_digit(responses_bt)
    right = digit & (ref_at >= 0) & (responses_bt == expected)
    credit = torch.where(digit, digit_credit, 0.0)
    return torch.where(right, 1.0, credit).to(torch.float32)


def rule_score(
    prompts_bp: torch.Tensor, responses_bt: torch.Tensor, digit_credit: float = DIGIT_CREDIT
) -> torch.Tensor:
    """``[b]`` score in [0, 1] of each response: the mean of its ``position_scores``."""
    return position_scores(prompts_bp, responses_bt, digit_credit).mean(dim=1)


def random_policy_score(vocab_size: int, digit_credit: float = DIGIT_CREDIT) -> float:
    """Expected score of a policy uniform over ``vocab_size`` tokens: ``(1 + 9 * c) / V``.

    Each position has one right token (score 1) and nine other digits (score c) whatever came
    before, since the reference digit always exists (prompts are all digits).
    """
    check_vocab(vocab_size)
    return (1.0 + (NUM_DIGITS - 1) * digit_credit) / vocab_size


def check_vocab(vocab_size: int) -> None:
    """Raise ValueError unless the vocabulary holds the digit ids 1..10."""
    if vocab_size < MIN_VOCAB:
        raise ValueError(
            f"the count task needs vocab_size >= {MIN_VOCAB} (digits are ids 1..10), got {vocab_size}"
        )


def _count_from(last_b: torch.Tensor, length: int) -> torch.Tensor:
    """``[b, length]`` tokens counting up from digit ``last_b`` (exclusive)."""
    steps = torch.arange(1, length + 1, device=last_b.device)
    return digit_token((last_b[:, None] + steps) % NUM_DIGITS)


def _count_with_slips(
    last_b: torch.Tensor, length: int, slip_b: torch.Tensor, generator: torch.Generator, vocab_size: int
) -> torch.Tensor:
    """Counting where each token is, with probability ``slip_b``, a random one; counting goes on
    from the latest digit, so a digit slip restarts the count from there."""
    b = last_b.shape[0]
    ref = last_b.clone()
    out = torch.empty(b, length, dtype=torch.long)
    for i in range(length):
        slip = torch.rand(b, generator=generator) < slip_b
        noise = torch.randint(0, vocab_size, (b,), generator=generator)
        token = torch.where(slip, noise, digit_token((ref + 1) % NUM_DIGITS))
        out[:, i] = token
        ref = torch.where(is_digit(token), token_digit(token), ref)
    return out


def synthetic_responses(
    prompts: torch.Tensor, response_len: int, generator: torch.Generator, vocab_size: int
) -> torch.Tensor:
    """``[b, response_len]`` responses spanning all scores, for fitting a reward model.

    Each row is one of, with equal chance: uniform random tokens (score about 3.25/V); random
    digits (about 0.325); a perfect count (1); a count where each token slips to a random one
    with a per-row probability drawn from U(0, 1) (anywhere in between); a perfect count for a
    random prefix, then random tokens. ``prompts`` must end in a digit (``make_prompts`` does).
    """
    check_vocab(vocab_size)
    if not bool(is_digit(prompts[:, -1]).all()):
        raise ValueError("synthetic_responses needs prompts that end in a digit token")
    prompts = prompts.cpu()
    b, t = prompts.shape[0], response_len
    last = token_digit(prompts[:, -1])
    count = _count_from(last, t)
    random_tokens = torch.randint(0, vocab_size, (b, t), generator=generator)
    random_digits = digit_token(torch.randint(0, NUM_DIGITS, (b, t), generator=generator))
    slips = _count_with_slips(last, t, torch.rand(b, generator=generator), generator, vocab_size)
    prefix_len = torch.randint(0, t + 1, (b, 1), generator=generator)
    prefix = torch.where(torch.arange(t) < prefix_len, count, random_tokens)
    kind = torch.randint(0, _NUM_SYNTHETIC_KINDS, (b,), generator=generator)
    choices = torch.stack([random_tokens, random_digits, count, slips, prefix])
    return choices[kind, torch.arange(b)]


def describe(settings: TaskSettings, vocab_size: int) -> str:
    """One line saying what the score means, with its baselines, for logs."""
    c = settings.digit_credit
    return (
        f"{settings.name}: count up mod 10 from the prompt's last digit; per position 1 = next digit, "
        f"{c:g} = other digit, 0 = non-digit; uniform random over V={vocab_size} scores "
        f"{random_policy_score(vocab_size, c):.3f}, random digits {(1 + 9 * c) / NUM_DIGITS:.3f}, perfect 1"
    )


def summarize_scores(scores_b: torch.Tensor) -> str:
    """One line: mean, min, max and how many responses are perfect."""
    perfect = int((scores_b >= 1.0).sum())
    return (
        f"score {float(scores_b.mean()):.3f} (min {float(scores_b.min()):.3f}, "
        f"max {float(scores_b.max()):.3f}, perfect {perfect}/{scores_b.numel()})"
    )


def render(prompt_p: torch.Tensor, response_t: torch.Tensor) -> str:
    """One sequence as digits, e.g. ``3 1 4 | 5 6 _ 8`` (``_`` for a non-digit), for logs."""

    def show(tokens: torch.Tensor) -> str:
        return " ".join(str(int(tok) - FIRST_DIGIT_ID) if bool(is_digit(tok)) else "_" for tok in tokens)

    return f"{show(prompt_p)} | {show(response_t)}"


__all__ = [
    "DIGIT_CREDIT",
    "MIN_VOCAB",
    "TaskSettings",
    "check_vocab",
    "describe",
    "digit_token",
    "is_digit",
    "make_prompts",
    "position_scores",
    "random_policy_score",
    "render",
    "rule_score",
    "summarize_scores",
    "synthetic_responses",
    "token_digit",
]
