"""Gradient clipping of a train step (``OptimizerSettings.grad_clip``, DeepSpeed's gradient_clipping,
nereus_core/engine/optimizer.py): three AdamW steps of a tiny model whose gradient norm is well above
1, clipped at 1.0, in several layouts (one device; tp2; pp2; dp2; tp2 and pp2 without ZeRO) against plain
torch on one device with ``torch.nn.utils.clip_grad_norm_``; the norm clipped by is the global one
over every shard, and the reported ``grad_norm`` is the norm before clipping."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from nereus_core.config import ConfigError, parse_config
from nereus_core.engine.device import DeviceContext
from nereus_core.engine.dispatch import assemble_full_state, per_device_batch
from nereus_core.engine.optimizer import OptimizerSettings, deepspeed_config
from nereus_core.engine.shard import load_shard, shard_state
from nereus_core.engine.train import lm_loss, train_step
from nereus_core.job import optimizer_settings
from nereus_core.layout import Layout
from nereus_core.model.llama import LlamaStage
from nereus_core.model.weights import init_full_state
from tests.support.dist_utils import run_world
from tests.support.model_configs import TWO_HEADS

MODEL = TWO_HEADS
ROWS, SEQ, STEPS = 4, 8, 3
CLIP = 1.0
# The loss scaled so that the gradient norm (about 0.8 unscaled) is far above CLIP: clipping acts.
LOSS_SCALE = 20.0
ADAMW = OptimizerSettings(lr=1e-2, eps=1e-6, weight_decay=0.01, grad_clip=CLIP)
# Each layout cuts the 4 rows into the same two chunks of two (two micro-batches of one replica, or
# one per replica), so one single-device reference fits them all.
LAYOUTS = {
    "tp1": (Layout(tp=1, pp=1, dp=1, devices=(0,), micro_batches=2), 1),
    "tp2": (Layout.contiguous(tp=2, micro_batches=2), 1),
    "pp2": (Layout.contiguous(pp=2, micro_batches=2), 1),
    "dp2": (Layout.contiguous(dp=2), 1),
    "tp2-zero0": (Layout.contiguous(tp=2, micro_batches=2), 0),
    "pp2-zero0": (Layout.contiguous(pp=2, micro_batches=2), 0),
}
# fp32 rounding: the layouts sum the same gradients in another order (observed differences <= 1e-6
# after three steps; an unclipped run is more than 1e-3 away).
ATOL = 1e-5


def scaled_lm_loss(logp_bt: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return LOSS_SCALE * lm_loss(logp_bt, batch)


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, MODEL.vocab_size, (ROWS, SEQ), generator=gen) for _ in range(STEPS)]


def _reference(clip: float | None) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Plain torch on one device: AdamW, the two chunks' losses averaged, ``clip_grad_norm_`` at
    ``clip`` (None: no clipping); returns the final weights and each step's norm before clipping."""
    stage = LlamaStage(MODEL, layers=range(MODEL.num_hidden_layers), first=True, last=True)
    stage.load_full_state(init_full_state(MODEL))
    params = list(stage.parameters())
    opt = torch.optim.AdamW(
        params, lr=ADAMW.lr, betas=ADAMW.betas, eps=ADAMW.eps, weight_decay=ADAMW.weight_decay
    )
    norms = []
    for ids in _batches():
        opt.zero_grad()
        for rows in (slice(0, 2), slice(2, 4)):
            logits = stage(ids[rows], torch.arange(SEQ))
            logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[rows, 1:, None])[..., 0]
            (-LOSS_SCALE * logp.mean() / 2).backward()
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip is not None else float("inf"))
        norms.append(float(norm))
        opt.step()
    return {k: v.clone() for k, v in stage.local_state().items()}, norms


def _clip_world(rank: int, world: int) -> dict[str, Any]:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="1")  # DeepSpeed reads them; the world exists
    ctx = DeviceContext(rank=rank, world_size=world, backend="gloo", device=torch.device("cpu"))
    out: dict[str, Any] = {}
    for name, (layout, zero_stage) in LAYOUTS.items():
        ctx.build_groups(layout)  # collective: every rank, member or not
        if rank not in layout.devices:
            continue
        settings = ADAMW.model_copy(update={"zero_stage": zero_stage})
        load_shard(ctx, name=name, layout=layout, config=MODEL, optimizer=settings)
        norms = []
        for ids in _batches():
            part = per_device_batch(layout, {"ids": ids})[layout.devices.index(rank)]
            result = train_step(ctx, part, name=name, loss_fn=scaled_lm_loss)
            norms.append(None if result is None else result["grad_norm"])
        index = layout.devices.index(rank)
        out[name] = {"index": index, "state": shard_state(ctx, name=name), "norms": norms}
    return out


def _max_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.timeout(240)
def test_clipping_at_one_matches_clip_grad_norm_on_one_device_in_every_layout() -> None:
    clipped, norms = _reference(CLIP)
    unclipped, _ = _reference(None)
    # Clipping acts on every step, and it changes the weights far beyond the tolerance.
    assert min(norms) > 3 * CLIP, norms
    assert _max_gap(clipped, unclipped) > 100 * ATOL
    results = run_world(2, _clip_world, timeout_s=220)
    for name, (layout, _) in LAYOUTS.items():
        ranks = [r[name] for r in results if name in r]
        shards = [None] * len(layout.devices)
        for r in ranks:
            shards[r["index"]] = r["state"]
        got = assemble_full_state(layout, MODEL, shards)
        gap = _max_gap(got, clipped)
        assert gap <= ATOL, f"{name}: weights {gap:.2e} from the clipped reference"
        reported = [n for r in ranks for n in r["norms"] if n is not None]
        assert len(reported) == STEPS * layout.dp, name
        # The norm reported is the global one before clipping, the same on every replica.
        for step, ref in enumerate(norms):
            for got_norm in reported[step::STEPS]:
                assert got_norm == pytest.approx(ref, rel=1e-5), f"{name} step {step}: grad_norm"


def test_ppo_grad_clip_defaults_to_verls_and_reaches_both_train_stages() -> None:
    for ppo, want in (({}, 1.0), ({"grad_clip": 0.5}, 0.5), ({"grad_clip": 0}, 0.0)):
        config = parse_config({"ppo": ppo})
        for stage in ("actor/train", "critic/train"):
            settings = optimizer_settings(config, stage)
            assert settings is not None and settings.grad_clip == want, (ppo, stage)
            assert deepspeed_config(settings, 1, 2)["gradient_clipping"] == want, (ppo, stage)
    with pytest.raises(ConfigError, match=r"ppo\.grad_clip=-1: must be >= 0"):
        parse_config({"ppo": {"grad_clip": -1}})
