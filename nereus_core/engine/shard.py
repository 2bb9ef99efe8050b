"""The part of one model-stage resident on one device slot.

A ``ModelShard`` is what a device holds for a model-stage: its pipeline stage
of the model (this tp rank's slices of the layers of this pp rank), the process
groups of the layout, and, for train stages, the DeepSpeed engine that owns the
optimizer. It is built on every device of a layout by ``load_shard`` (run by the
device actors) and found again by name in ``DeviceContext.resident``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from nereus_core.config import ModelConfig
from nereus_core.engine.device import DeviceContext, RankGroups
from nereus_core.engine.optimizer import OptimizerSettings, make_engine
from nereus_core.layout import Layout
from nereus_core.model.llama import LlamaStage
from nereus_core.model.weights import init_full_state, param_dtype, stage_layers


@dataclass
class ModelShard:
    """One device's share of one model-stage."""

    name: str
    config: ModelConfig
    groups: RankGroups
    stage: LlamaStage
    engine: Any | None = None  # deepspeed.DeepSpeedEngine for train stages

    @property
    def layout(self) -> Layout:
        return self.groups.layout

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the weights and of the activations between stages (``model.dtype``)."""
        return param_dtype(self.config)

    @property
    def module(self) -> Any:
        """What to call forward on: the DeepSpeed engine when training, else the stage."""
        return self.engine if self.engine is not None else self.stage

    def local_state(self) -> dict[str, torch.Tensor]:
        return self.stage.local_state()


def new_stage(config: ModelConfig, groups: RankGroups, device: torch.device) -> LlamaStage:
    """This rank's pipeline stage with placeholder weights in ``model.dtype``, for the caller to fill
    (e.g. a reshard)."""
    layout, coord = groups.layout, groups.coord
    stage = LlamaStage(
        config,
        layers=stage_layers(config, layout, coord.pp),
        first=groups.is_first_stage,
        last=groups.is_last_stage,
        tp_rank=coord.tp,
        tp_size=layout.tp,
        tp_group=groups.tp_group if layout.tp_enabled else None,
    )
    return stage.to(device=device, dtype=param_dtype(config))


def build_stage(
    config: ModelConfig,
    groups: RankGroups,
    device: torch.device,
    full_state: dict[str, torch.Tensor] | None = None,
) -> LlamaStage:
    """This rank's pipeline stage, from ``full_state`` or seeded weights (every rank derives the same)."""
    stage = new_stage(config, groups, device)
    stage.load_full_state(init_full_state(config) if full_state is None else full_state)
    return stage


def load_shard(
    ctx: DeviceContext,
    *,
    name: str,
    layout: Layout,
    config: ModelConfig,
    optimizer: OptimizerSettings | None = None,
    full_state: dict[str, torch.Tensor] | None = None,
) -> str:
    """Build ``name`` on this device under ``layout`` (groups built beforehand); returns the layout key.

    Weights come from ``full_state`` (HF names) when given, else from the config's seed.
    """
    groups = ctx.view(layout)
    stage = build_stage(config, groups, ctx.device, full_state)
    shard = ModelShard(name=name, config=config, groups=groups, stage=stage)
    if optimizer is not None:
        shard.engine = make_engine(stage, groups, optimizer, ctx.backend)
    else:
        stage.eval()
        stage.requires_grad_(False)
    ctx.resident[name] = shard
    return layout.key


@torch.no_grad()
def set_weights(ctx: DeviceContext, full_state: dict[str, torch.Tensor], *, name: str) -> None:
    """Overwrite an inference shard's weights with its slices of ``full_state`` (e.g. after a train step)."""
    shard = get_shard(ctx, name)
    if shard.engine is not None:
        raise RuntimeError(f"{name!r} is a train stage; its weights move with its optimizer state")
    shard.stage.load_full_state(full_state)


def alias_shard(ctx: DeviceContext, *, name: str, target: str) -> None:
    """Make ``name`` another name for ``target`` on this device (same layout: no copy, no sync)."""
    ctx.resident[name] = get_shard(ctx, target)


def shard_state(ctx: DeviceContext, *, name: str) -> dict[str, torch.Tensor]:
    """This device's parameter slices of ``name`` (cloned, HF names)."""
    return {k: v.detach().clone().cpu() for k, v in get_shard(ctx, name).local_state().items()}


def drop_shard(ctx: DeviceContext, *, name: str) -> None:
    """Forget ``name`` on this device, if it is there."""
    ctx.resident.pop(name, None)


def drop_all(ctx: DeviceContext) -> None:
    """Forget every model-stage on this device (before its world is rebuilt)."""
    ctx.resident.clear()
    ctx.retired.clear()


def bind_layout(ctx: DeviceContext, shard: ModelShard, layout: Layout | None) -> None:
    """Run ``shard`` under ``layout`` from now on. A plan may change a model-stage's micro-batches or
    pipeline schedule without moving its state (``Layout.same_placement``): the shard takes the
    layout's groups view, and its DeepSpeed engine the new gradient accumulation steps."""
    old = shard.groups.layout
    if layout is None or layout == old:
        return
    if not old.same_placement(layout):
        raise RuntimeError(
            f"model-stage {shard.name!r} on device {ctx.rank} is placed as {old.key}, not {layout.key}; "
            "a new placement moves its state first (a transition)"
        )
    shard.groups = ctx.view(layout)
    if shard.engine is not None and layout.micro_batches != old.micro_batches:
        shard.engine.set_train_batch_size(layout.micro_batches * layout.dp)  # micro-batch size 1: bookkeeping


def get_shard(ctx: DeviceContext, name: str) -> ModelShard:
    shard = ctx.resident.get(name)
    if not isinstance(shard, ModelShard):
        raise KeyError(f"device {ctx.rank} holds no model-stage {name!r}; load it first")
    return shard
