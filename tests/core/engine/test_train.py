"""The PPO statistics of a train step (nereus_core/engine/train.py): loss, clip fraction, approximate
KL, entropy and the global gradient norm, in several layouts (tp, pp, dp; ZeRO 0/1/2) of a gloo world,
against the same quantities written out in plain torch on one device; and with left-padded prompts
and ragged responses, against the token-means of the whole batch. With gradient checkpointing
(``model.gradient_checkpointing``) tp, pp and dp give the same floats as without it."""

from __future__ import annotations

import functools
import os
from typing import Any

import pytest
import torch

from nereus_core.engine.device import DeviceContext
from nereus_core.engine.dispatch import per_device_batch
from nereus_core.engine.forward import position_ids
from nereus_core.engine.optimizer import OptimizerSettings
from nereus_core.engine.shard import load_shard
from nereus_core.engine.train import train_step
from nereus_core.layout import Layout
from nereus_core.model.llama import DecoderLayer
from nereus_core.model.weights import hf_config, init_full_state
from nereus_core.rl.ppo import PPOConfig
from nereus_core.rl.rollout import actor_objective
from tests.support.dist_utils import run_world
from tests.support.model_configs import TWO_HEADS

STATS_MODEL = TWO_HEADS
PROMPT, RESPONSE, ROWS = 3, 5, 4
ACTOR = PPOConfig(clip_ratio=0.2)
# name -> (layout, ZeRO stage). Each layout cuts the 4 rows into the same two chunks of two (two
# micro-batches of one replica, or one per replica), so one single-device reference fits them all.
# ZeRO-1/2 give DeepSpeed's norm; stage 0 the engine's own.
STAT_LAYOUTS = {
    "tp2": (Layout.contiguous(tp=2, micro_batches=2), 1),
    "pp2": (Layout.contiguous(pp=2, micro_batches=2), 1),
    "dp2-zero2": (Layout.contiguous(dp=2), 2),
    "tp2-zero0": (Layout.contiguous(tp=2, micro_batches=2), 0),
    "tp1": (Layout(tp=1, pp=1, dp=1, devices=(0,), micro_batches=2), 1),
}


def _reference_model() -> Any:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM._from_config(hf_config(STATS_MODEL), attn_implementation="eager")
    model.load_state_dict(init_full_state(STATS_MODEL))
    return model.float()


def _response_logp_and_entropy(
    model: Any, ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    kwargs = {}
    if attention_mask is not None:
        kwargs = {"attention_mask": attention_mask, "position_ids": position_ids(attention_mask)}
    logp_all = torch.log_softmax(model(ids, **kwargs).logits[:, :-1].float(), dim=-1)
    logp = logp_all.gather(-1, ids[:, 1:, None])[..., 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp[:, -RESPONSE:], entropy[:, -RESPONSE:]


def _stats_batch() -> dict[str, torch.Tensor]:
    """Ragged response masks; old log-probs near the model's, so some ratios leave the clip range."""
    gen = torch.Generator().manual_seed(8)
    ids = torch.randint(0, STATS_MODEL.vocab_size, (ROWS, PROMPT + RESPONSE), generator=gen)
    lengths = torch.tensor([5, 2, 4, 1])
    mask = (torch.arange(RESPONSE) < lengths[:, None]).float()
    with torch.no_grad():
        logp, _ = _response_logp_and_entropy(_reference_model(), ids)
    old_logp = logp + 0.3 * torch.randn(logp.shape, generator=gen)
    advantages = torch.randn(logp.shape, generator=gen)
    return {"ids": ids, "mask": mask, "old_logp": old_logp, "advantages": advantages}


def _reference_stats(batch: dict[str, torch.Tensor]) -> dict[str, float]:
    """The clipped surrogate and its statistics written out in plain torch, one device, two chunks;
    the gradient norm from the full model's ``.grad``."""
    model = _reference_model()
    chunks = []
    for rows in (slice(0, 2), slice(2, 4)):
        logp, entropy = _response_logp_and_entropy(model, batch["ids"][rows])
        mask, old, adv = batch["mask"][rows], batch["old_logp"][rows], batch["advantages"][rows]
        ratio = (logp - old).exp()
        unclipped, clipped = -adv * ratio, -adv * ratio.clamp(0.8, 1.2)

        def mean(x: torch.Tensor, mask: torch.Tensor = mask) -> torch.Tensor:
            return (x * mask).sum() / mask.sum()

        chunks.append(
            {
                "loss": mean(torch.maximum(unclipped, clipped)),
                "clip_frac": mean((clipped > unclipped).float()),
                "approx_kl": mean(old - logp),
                "entropy": mean(entropy),
            }
        )
    stats = {key: torch.stack([c[key] for c in chunks]).mean() for key in chunks[0]}
    stats["loss"].backward()
    grad_sq = sum(p.grad.double().square().sum() for p in model.parameters())
    return {**{k: float(v.detach()) for k, v in stats.items()}, "grad_norm": float(grad_sq.sqrt())}


def _padded_batch() -> dict[str, torch.Tensor]:
    """``_stats_batch`` with left-padded prompts, its attention mask and the rows' tokens per row."""
    batch = _stats_batch()
    prompt_mask = (torch.arange(PROMPT) >= torch.tensor([0, 2, 1, 2])[:, None]).long()
    attention_mask = torch.cat([prompt_mask, batch["mask"].long()], dim=1)
    with torch.no_grad():
        logp, _ = _response_logp_and_entropy(_reference_model(), batch["ids"], attention_mask)
    gen = torch.Generator().manual_seed(9)
    per_row = batch["mask"].sum() / ROWS
    return {
        **batch,
        "attention_mask": attention_mask,
        "old_logp": logp + 0.3 * torch.randn(logp.shape, generator=gen),
        "tokens_per_row": per_row.expand(ROWS).clone(),
    }


def _whole_batch_stats(batch: dict[str, torch.Tensor]) -> dict[str, float]:
    """The clipped surrogate and its statistics as token-means over all rows at once (the padded
    forward as transformers runs it), and the gradient norm of that loss."""
    model = _reference_model()
    logp, entropy = _response_logp_and_entropy(model, batch["ids"], batch["attention_mask"])
    mask, old, adv = batch["mask"], batch["old_logp"], batch["advantages"]
    ratio = (logp - old).exp()
    unclipped, clipped = -adv * ratio, -adv * ratio.clamp(0.8, 1.2)

    def mean(x: torch.Tensor) -> torch.Tensor:
        return (x * mask).sum() / mask.sum()

    stats = {
        "loss": mean(torch.maximum(unclipped, clipped)),
        "clip_frac": mean((clipped > unclipped).float()),
        "approx_kl": mean(old - logp),
        "entropy": mean(entropy),
    }
    stats["loss"].backward()
    grad_sq = sum(p.grad.double().square().sum() for p in model.parameters())
    return {**{k: float(v.detach()) for k, v in stats.items()}, "grad_norm": float(grad_sq.sqrt())}


def _stats_world(
    rank: int, world: int, batch: dict[str, torch.Tensor], layouts: dict | None = None
) -> dict[str, Any]:
    """Each layout's train-step statistics; a name ending in ``-gc`` trains with gradient
    checkpointing (``model.gradient_checkpointing``)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="1")  # DeepSpeed reads them; the world exists
    ctx = DeviceContext(rank=rank, world_size=world, backend="gloo", device=torch.device("cpu"))
    objective = functools.partial(actor_objective, settings=ACTOR)
    out = {}
    for name, (layout, zero_stage) in (layouts or STAT_LAYOUTS).items():
        ctx.build_groups(layout)  # collective: every rank, member or not
        if rank not in layout.devices:
            continue
        load_shard(
            ctx,
            name=name,
            layout=layout,
            config=STATS_MODEL.model_copy(update={"gradient_checkpointing": name.endswith("-gc")}),
            optimizer=OptimizerSettings(zero_stage=zero_stage),
        )
        part = per_device_batch(layout, batch)[layout.devices.index(rank)]
        before = _LAYER_CALLS[0]
        out[name] = train_step(ctx, part, name=name, loss_fn=objective, with_entropy=True)
        out[f"{name}:layer_calls"] = _LAYER_CALLS[0] - before
    return out


_LAYER_CALLS = [0]  # decoder-layer forwards run in this process (a recompute runs one more)
_layer_forward = DecoderLayer.forward


def _counted(self: DecoderLayer, *args: Any, **kwargs: Any) -> torch.Tensor:
    _LAYER_CALLS[0] += 1
    return _layer_forward(self, *args, **kwargs)


DecoderLayer.forward = _counted  # type: ignore[method-assign]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("padded", [False, True], ids=["chunks", "padded-whole-batch"])
def test_train_step_statistics_match_one_device_in_every_layout(padded: bool) -> None:
    batch = _padded_batch() if padded else _stats_batch()
    expected = _whole_batch_stats(batch) if padded else _reference_stats(batch)
    # The case is not degenerate: some tokens clip, the policies differ, gradients flow.
    assert 0 < expected["clip_frac"] < 1 and abs(expected["approx_kl"]) > 1e-3 and expected["grad_norm"] > 0
    # Without padding the world also runs tp2, pp2 and dp2 with gradient checkpointing (``-gc``).
    layouts = STAT_LAYOUTS if padded else STAT_LAYOUTS | CHECKPOINTED
    results = run_world(2, _stats_world, batch, layouts, timeout_s=200)
    for name, (layout, _) in STAT_LAYOUTS.items():
        replicas = [r[name] for r in results if r.get(name) is not None]
        assert len(replicas) == layout.dp, f"{name}: one result per replica"
        got = {key: sum(r[key] for r in replicas) / len(replicas) for key in replicas[0]}
        assert set(got) == set(expected), name
        for key, value in expected.items():
            assert got[key] == pytest.approx(value, abs=1e-5, rel=1e-5), f"{name}: {key}"
        assert len({r["grad_norm"] for r in replicas}) == 1, f"{name}: grad_norm differs between replicas"
    if not padded:
        _check_gradient_checkpointing(results)


CHECKPOINTED = {f"{name}-gc": STAT_LAYOUTS[name] for name in ("tp2", "pp2", "dp2-zero2")}


def _check_gradient_checkpointing(results: list[dict[str, Any]]) -> None:
    """Recomputing each decoder layer in the backward pass (tp all-reduces, pipeline sends and ZeRO
    reductions included) gives the step without it exactly, and each layer really ran again."""
    for name in ("tp2", "pp2", "dp2-zero2"):
        plain = [r[name] for r in results if r.get(name) is not None]
        again = [r[f"{name}-gc"] for r in results if r.get(f"{name}-gc") is not None]
        assert plain and plain == again, name  # bitwise: the same floats, replica by replica
        for r in results:
            if r.get(name) is not None:
                assert r[f"{name}-gc:layer_calls"] == 2 * r[f"{name}:layer_calls"] > 0, name
