"""One device's EMU pieces of a train model-stage sharded ``full`` (DeepSpeed ZeRO-3), read and filled.

Under ZeRO-3 (``deepspeed/runtime/zero/stage3.py``) every parameter is cut into ``dp`` equal flat
partitions (``box.zero3_range``); dp rank ``k`` keeps partition ``k`` as ``param.ds_tensor``
(the model's dtype, zero-padded past the parameter's end), and the optimizer keeps, per sub-group,
one fp32 flat buffer of its partitions (``fp32_partitioned_groups_flat``: the master weights) with
the AdamW moments keyed by it; ``grad_position[param id]`` says where a parameter's partition
starts in it. The shard map of a ``full`` layout cuts the parameters, masters and moments the same
way, so every piece is a view of the rank's own buffers: reading or filling them moves nothing
inside the DP group (unlike ZeRO-1/2, ``engine.state``).

Boundary: one device's tensors; ``engine.state`` dispatches here for sharded train stages.
"""

from __future__ import annotations

from typing import Any

import torch

from nereus_core.box import Box, zero3_range
from nereus_core.emu import MASTER, MOMENTS, ShardMap, partitioned_kinds
from nereus_core.engine.shard import ModelShard

STEP_KEY = "step"
STEP_BOX = Box((), ())
Pieces = dict[tuple[str, Box], torch.Tensor]


def sharded(shard: ModelShard) -> bool:
    """Whether ``shard`` is a train stage whose parameters DeepSpeed ZeRO-3 partitions."""
    return shard.engine is not None and shard.layout.shard == "full"


def _partitions(shard: ModelShard) -> dict[str, tuple[torch.nn.Parameter, int, int, int]]:
    """Parameter name -> (parameter, sub-group, offset of its partition in the fp32 flat buffer,
    elements of its share: its partition less the padding)."""
    opt, dp, rank = shard.engine.optimizer, shard.layout.dp, shard.groups.coord.dp
    out = {}
    for name, param in shard.stage.named_parameters():
        group, offset, _ = opt.grad_position[opt.get_param_id(param)]
        lo, hi = zero3_range(param.ds_numel, dp, rank)
        out[name] = (param, int(group), int(offset), hi - lo)
    return out


def _flat_buffers(shard: ModelShard, *, create: bool) -> list[dict[str, Any]]:
    """Each sub-group's fp32 partition and its AdamW state (``MOMENTS`` and the step count). Before
    the first step AdamW holds none: zeros (step 0), stored into the optimizer when ``create``
    (a new shard: the next step uses them as if this engine had taken the steps)."""
    opt = shard.engine.optimizer
    out = []
    for flat in opt.fp32_partitioned_groups_flat:
        held = opt.optimizer.state.get(flat) or {}
        if not held:
            held = {
                STEP_KEY: torch.zeros((), dtype=torch.float32),
                **{k: torch.zeros_like(flat) for k in MOMENTS},
            }
            if create:
                opt.optimizer.state[flat] = held
        out.append({MASTER: flat.detach(), **held})
    return out


def pieces(
    shard: ModelShard, smap: ShardMap, device: int, *, create: bool = False
) -> tuple[Pieces, dict[tuple[str, str], torch.Tensor]]:
    """``device``'s pieces of ``shard`` under ``smap`` as views of its ZeRO-3 buffers (weights of
    ``ds_tensor``, masters and moments of the fp32 partitions and AdamW's state, the step count),
    and its flat share of each partitioned kind by ``(param, kind)``. ``create``: a new shard, its
    optimizer state made now."""
    parts = _partitions(shard)
    buffers = _flat_buffers(shard, create=create) if smap.train else []
    out: Pieces = {}
    flats: dict[tuple[str, str], torch.Tensor] = {}
    kinds = partitioned_kinds(shard.config)
    for spec, piece in smap.pieces_on(device):
        if spec.kind == "step":
            out[(spec.name, STEP_BOX)] = buffers[0][STEP_KEY]
            continue
        param, group, offset, numel = parts[spec.param]
        if spec.kind == "param":
            flat = param.ds_tensor.data.view(-1)[:numel]
        else:
            if spec.kind not in kinds:
                raise ValueError(f"{spec.name}: not a kind ZeRO-3 keeps for {shard.config.dtype} weights")
            flat = buffers[group][spec.kind][offset : offset + numel]
            flats[(spec.param, spec.kind)] = flat
        out[(spec.name, piece.box)] = flat[piece.offset : piece.offset + piece.box.numel].view(
            piece.box.shape
        )
    return out, flats


def install(shard: ModelShard, step: torch.Tensor) -> None:
    """Finish a new shard whose pieces were written: the step count into every sub-group's AdamW
    state and the engine; with fp32 weights (no master kind) the weights into the fp32 partition."""
    opt = shard.engine.optimizer
    for held in _flat_buffers(shard, create=True):
        held[STEP_KEY].copy_(step)
    if MASTER not in partitioned_kinds(shard.config):
        for param, group, offset, numel in _partitions(shard).values():
            opt.fp32_partitioned_groups_flat[group].detach()[offset : offset + numel].copy_(
                param.ds_tensor.data.view(-1)[:numel]
            )
    shard.engine.global_steps = int(step.item())
