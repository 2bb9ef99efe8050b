"""Packed passes (engine.packing) in several layouts on the Dask device pool: the padded batch of
test_padded_runtime (prompts left-padded, responses right-padded) run as packed rows gives
transformers' log-probs, values and entropies on every real token, and a packed train step gives
the padded step's loss, gradient norm and weights, with the layout's micro-batches or with a
token budget that makes a different number of them."""

from __future__ import annotations

import functools

import pytest
import torch

from nereus_core.config.passes import PassesConfig
from nereus_core.engine import packing
from nereus_core.engine.forward import position_ids
from nereus_core.engine.shard import OptimizerSettings
from nereus_core.engine.train import lm_loss, train_step
from nereus_core.layout import Layout
from nereus_core.model.weights import init_full_state
from nereus_core.rl.ppo import minibatch_share, policy_loss
from tasks import model_ops
from tests.support.runtime_setup import contiguous_layout, token_logprobs
from tests.tasks.test_padded_runtime import MODELS, _hf_lm, _hf_values, _padded_batch, _real_targets

PACKED = PassesConfig(pack=True)
FWD_LAYOUTS = [("llama", (1, 1, 1)), ("llama", (2, 2, 1)), ("llama", (1, 2, 2)), ("qwen2", (2, 1, 2))]


def _layout_id(dims: tuple[int, int, int]) -> str:
    return "tp{}-pp{}-dp{}".format(*dims)


SLOW = pytest.mark.slow  # the rest of the matrix (-m slow); the default keeps one case of each axis


def _forward_cases() -> list:
    """Every layout with the slices path; the budget path on the 3-D layout by default, else slow."""
    cases = []
    for model, dims in FWD_LAYOUTS:
        name = f"{model}-{_layout_id(dims)}"
        cases.append(pytest.param(model, dims, None, id=f"{name}-slices"))
        marks = () if dims == (2, 2, 1) else (SLOW,)
        cases.append(pytest.param(model, dims, 12, id=f"{name}-budget12", marks=marks))
    return cases


@pytest.mark.parametrize(("model", "dims", "max_tokens"), _forward_cases())
def test_packed_logprobs_and_values_match_transformers(
    pool, model: str, dims: tuple[int, int, int], max_tokens: int | None
) -> None:
    cfg, layout = MODELS[model], contiguous_layout(*dims)
    value_cfg = cfg.model_copy(update={"head": "value", "tie_word_embeddings": False})
    ids, mask = _padded_batch()
    with torch.no_grad():
        logits = _hf_lm(cfg)(ids, attention_mask=mask, position_ids=position_ids(mask)).logits
    expected_logp, expected_values = token_logprobs(logits, ids), _hf_values(cfg, ids, mask)
    passes = PACKED.model_copy(update={"max_tokens_per_device": max_tokens})
    model_ops.load_model(pool, layout, name="actor/infer", config=cfg)
    model_ops.load_model(pool, layout, name="critic/infer", config=value_cfg)
    try:
        logp = model_ops.forward(pool, layout, ids, name="actor/infer", attention_mask=mask, passes=passes)
        values = model_ops.forward(pool, layout, ids, name="critic/infer", attention_mask=mask, passes=passes)
    finally:
        model_ops.unload_model(pool, layout, name="actor/infer")
        model_ops.unload_model(pool, layout, name="critic/infer")
    real_targets, real = _real_targets(mask), mask.bool()
    assert logp.shape == expected_logp.shape and values.shape == expected_values.shape
    assert (logp - expected_logp)[real_targets].abs().max().item() <= 1e-5
    assert (values - expected_values)[real].abs().max().item() <= 1e-5
    assert not logp[~real_targets].any() and not values[~real].any()  # pads read 0


TRAIN_ROWS = 8


@functools.cache
def _train_batch() -> dict[str, torch.Tensor]:
    """Eight padded rows (the four of ``_padded_batch`` and the same masks reversed, other ids),
    response-token targets, per-row advantages, old log-probs near the model's, and transformers'
    entropies for the loss function to check."""
    ids, mask = _padded_batch()
    gen = torch.Generator().manual_seed(9)
    other = torch.randint(1, MODELS["llama"].vocab_size, ids.shape, generator=gen)
    ids = torch.cat([ids, other.masked_fill(mask.flip(0) == 0, 0)])
    mask = torch.cat([mask, mask.flip(0)])
    targets = torch.cat([torch.zeros(TRAIN_ROWS, 1, dtype=mask.dtype), _real_targets(mask).long()], dim=1)
    with torch.no_grad():
        logits = _hf_lm(MODELS["llama"])(ids, attention_mask=mask, position_ids=position_ids(mask)).logits
    logp_all = torch.log_softmax(logits[:, :-1], -1)
    return {
        "ids": ids,
        "attention_mask": mask,
        "mask": targets,
        "tokens_per_row": torch.full((TRAIN_ROWS,), float(targets.sum()) / TRAIN_ROWS),
        "old_logp": token_logprobs(logits, ids) + 0.1 * torch.randn(TRAIN_ROWS, 11, generator=gen),
        "advantages": torch.randn(TRAIN_ROWS, generator=gen)[:, None].expand(-1, 11).contiguous(),
        "hf_entropy": -(logp_all.exp() * logp_all).sum(-1),
    }


def _entropy_gap(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Largest gap between the engine's entropy and transformers' on this micro-batch's targets."""
    targets = batch["mask"][:, 1:].bool()
    return (batch["entropy"] - batch["hf_entropy"])[targets].abs().max().detach()


def lm_loss_checked(logp_bt: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
    """``lm_loss``, with the entropy gap as a statistic."""
    return lm_loss(logp_bt, batch), {"entropy_gap": _entropy_gap(batch)}


def ppo_loss_checked(logp_bt: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
    """PPO's clipped surrogate, token-mean over the mini-batch (``minibatch_share``)."""
    mask = batch["mask"][:, 1:].to(logp_bt.dtype)
    loss, stats = policy_loss(logp_bt, batch["old_logp"], batch["advantages"], mask, clip_ratio=0.2)
    share = minibatch_share(mask, batch["tokens_per_row"])
    return loss * share, {**stats, "entropy_gap": _entropy_gap(batch)}


LOSSES = {"lm": lm_loss_checked, "ppo": ppo_loss_checked}


def _step(pool, dims: tuple[int, int, int], loss: str, passes: PassesConfig) -> tuple[dict, dict]:
    layout, cfg = contiguous_layout(*dims), MODELS["llama"]
    optimizer = OptimizerSettings(lr=1e-3, eps=1e-6, weight_decay=0.01)
    model_ops.load_model(pool, layout, name="actor/train", config=cfg, optimizer=optimizer)
    try:
        stats = model_ops.train_stats(
            pool,
            layout,
            _train_batch(),
            name="actor/train",
            loss_fn=LOSSES[loss],
            with_entropy=True,
            passes=passes,
        )
        return stats, model_ops.full_state(pool, layout, name="actor/train", config=cfg)
    finally:
        model_ops.unload_model(pool, layout, name="actor/train")


def _close(got: float, expected: float) -> bool:
    return abs(got - expected) <= 1e-5 * max(abs(expected), 1e-3)


# By default: pp with PPO's loss whole, tp x dp with the LM loss under a budget; the rest slow.
TRAIN_DEFAULT = {((1, 2, 1), "ppo", None), ((2, 1, 2), "lm", 16)}
TRAIN_CASES = [
    pytest.param(
        dims,
        loss,
        max_tokens,
        id=f"{_layout_id(dims)}-{loss}-{'budget16' if max_tokens else 'slices'}",
        marks=() if (dims, loss, max_tokens) in TRAIN_DEFAULT else (SLOW,),
    )
    for dims in [(1, 2, 1), (2, 1, 2)]
    for loss in LOSSES
    for max_tokens in (None, 16)
]


@pytest.mark.parametrize(("dims", "loss", "max_tokens"), TRAIN_CASES)
def test_packed_train_step_matches_padded(
    pool, dims: tuple[int, int, int], loss: str, max_tokens: int | None
) -> None:
    padded_stats, padded_state = _step(pool, dims, loss, model_ops.PADDED)
    passes = PACKED.model_copy(update={"max_tokens_per_device": max_tokens})
    stats, state = _step(pool, dims, loss, passes)
    assert set(stats) == set(padded_stats)
    for key in ("loss", "grad_norm"):
        assert _close(stats[key], padded_stats[key]), (key, stats[key], padded_stats[key])
    assert stats["entropy_gap"] <= 1e-5 and padded_stats["entropy_gap"] <= 1e-5
    init = init_full_state(MODELS["llama"])
    moved = max((padded_state[k] - init[k]).abs().max().item() for k in state)
    assert moved > 1e-4, "the step did not move the weights; the comparison would be empty"
    assert max((state[k] - padded_state[k]).abs().max().item() for k in state) <= 1e-5


def test_a_budget_makes_a_different_number_of_micro_batches() -> None:
    """The budget case above is not the slices case in disguise: 16 real tokens per micro-batch
    cut a replica's rows into more micro-batches than the layout's two."""

    batch = _train_batch()
    mbs = packing.micro_batches(batch["ids"], batch["attention_mask"], micro_batches=2, max_tokens=16)
    assert len(mbs) > 2 and all(p.tokens <= 16 for p in mbs)


def _replica_steps(pool, packs: list[bool]) -> dict[str, torch.Tensor]:
    """Train steps on two data-parallel replicas of two micro-batches under ZeRO-2 (it reduces
    gradients at every micro-batch). With at most 12 real tokens per micro-batch, replica 0's rows
    (12, 10, 2, 12 real tokens) make three micro-batches and replica 1's (6, 6, 10, 2) two: a packed
    step must run three on both, and DeepSpeed's count of two per step must hold again after it."""
    layout, cfg = Layout.contiguous(tp=1, pp=1, dp=2, micro_batches=2), MODELS["llama"]
    batch = _train_batch()
    parts = [{k: v[rows] for k, v in batch.items()} for rows in ([0, 2, 3, 7], [1, 6, 5, 4])]
    assert packing.real_lengths(parts[0]["attention_mask"]).tolist() == [12, 10, 2, 12]
    optimizer = OptimizerSettings(lr=1e-3, eps=1e-6, weight_decay=0.01, zero_stage=2)
    model_ops.load_model(pool, layout, name="actor/train", config=cfg, optimizer=optimizer)
    try:
        for pack in packs:
            pool.run(layout, train_step, [(p,) for p in parts], name="actor/train", pack=pack, max_tokens=12)
        return model_ops.full_state(pool, layout, name="actor/train", config=cfg)
    finally:
        model_ops.unload_model(pool, layout, name="actor/train")


def test_replicas_with_different_budget_splits_then_a_padded_step(pool) -> None:
    """A packed step whose replicas need different micro-batch counts, then a padded step (DeepSpeed
    counts micro-batches again), lands where two padded steps do."""
    padded = _replica_steps(pool, [False, False])
    packed_first = _replica_steps(pool, [True, False])
    init = init_full_state(MODELS["llama"])
    assert max((padded[k] - init[k]).abs().max().item() for k in padded) > 1e-4
    assert max((packed_first[k] - padded[k]).abs().max().item() for k in padded) <= 1e-5
