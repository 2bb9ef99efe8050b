"""Rolling a failed live switch back in memory, from the old shards its moves kept.

A live move that keeps its source (``ReshardJob.keep_old``) puts each device's old shard aside in
``ctx.retired`` when it installs the new one, and the shard is never written after that: it still
holds plan A's state bit for bit. When the switch ends:

- committed: ``release_retired`` forgets the old shards (their memory is freed);
- failed in a live worker: the driver rebuilds the world on the same workers (a failed exchange may
  have closed gloo pairs, so no group of the old world is trusted) and runs ``restore_shard`` for
  every model-stage of plan A. Each device takes its kept shard back (or, for a model-stage the
  switch did not move, the one still resident) and rebuilds it on the new world's groups of the
  same layout: weights copied into a new stage; for a train stage a new DeepSpeed engine whose ZeRO
  partitions (fp32 masters, AdamW moments, step) are copied from the old engine's, partition for
  partition. The layout is the same, so the partitioning is too: no exchange, no collective beyond
  the engine's own set-up.

Boundary: device-side functions over one ``DeviceContext``; the driver's side is
``flows/job/transition.py``.
"""

from __future__ import annotations

import torch

from nereus_core.emu import ShardMap
from nereus_core.engine.device import DeviceContext
from nereus_core.engine.optimizer import OptimizerSettings, make_engine
from nereus_core.engine.shard import ModelShard, new_stage


def release_retired(ctx: DeviceContext) -> int:
    """Forget the old shards a committed switch kept; returns how many there were."""
    kept = len(ctx.retired)
    ctx.retired.clear()
    return kept


def restore_shard(
    ctx: DeviceContext, *, name: str, smap: ShardMap, optimizer: OptimizerSettings | None
) -> bool:
    """Make plan A's shard of ``name`` (on ``smap``'s layout, whose groups the new world built)
    resident again, rebuilt on the new groups with its state copied bitwise; any new shard of
    ``name`` the failed switch installed is dropped. True when this device holds a shard of it."""
    old = ctx.retired.pop(name, None) or ctx.resident.get(name)
    ctx.resident.pop(name, None)
    if ctx.rank not in smap.layout.devices:
        return False
    if not isinstance(old, ModelShard) or old.layout != smap.layout:
        held = old.layout.key if isinstance(old, ModelShard) else type(old).__name__
        raise RuntimeError(
            f"device {ctx.rank}: no kept shard of {name} on {smap.layout.key} to roll back to (holds {held})"
        )
    groups = ctx.view(smap.layout)
    stage = new_stage(smap.config, groups, ctx.device)
    _copy_tensors(old.stage.state_dict(keep_vars=True), stage.state_dict(keep_vars=True), name)
    shard = ModelShard(name=name, config=smap.config, groups=groups, stage=stage)
    if optimizer is None:
        stage.eval()
        stage.requires_grad_(False)
    else:
        shard.engine = make_engine(stage, groups, optimizer, ctx.backend)
        _copy_partitions(old.engine, shard.engine, name)
    ctx.resident[name] = shard
    return True


def _copy_tensors(src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor], what: str) -> None:
    if list(src) != list(dst):
        raise RuntimeError(f"{what}: the rebuilt stage's tensors differ from the kept one's")
    with torch.no_grad():
        for key, tensor in dst.items():
            tensor.copy_(src[key])


def _copy_partitions(old: object, new: object, what: str) -> None:
    """The old DeepSpeed ZeRO-1/2 engine's fp32 partitions and their AdamW state into the new one's."""
    old_opt, new_opt = old.optimizer, new.optimizer  # type: ignore[attr-defined]
    if not hasattr(new_opt, "single_partition_of_fp32_groups"):
        raise NotImplementedError(f"{what}: rolling back optimizer state needs zero_stage 1 or 2")
    kept_parts, made_parts = old_opt.single_partition_of_fp32_groups, new_opt.single_partition_of_fp32_groups
    pairs = list(zip(kept_parts, made_parts, strict=True))
    with torch.no_grad():
        for kept, made in pairs:
            if kept.shape != made.shape:
                raise RuntimeError(f"{what}: ZeRO partition {tuple(made.shape)} != kept {tuple(kept.shape)}")
            made.copy_(kept)
            held = old_opt.optimizer.state.get(kept)
            new_opt.optimizer.state.pop(made, None)
            if held:
                new_opt.optimizer.state[made] = {k: v.clone() for k, v in held.items()}
    new.global_steps = old.global_steps  # type: ignore[attr-defined]
