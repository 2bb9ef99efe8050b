"""What one device holds: the bytes of the model state resident on it (the controller's memory reading).

Boundary: a device-side reading over one ``DeviceContext``. It counts every distinct tensor storage
reachable from the device's model-stages: parameters and gradients of each shard, and the
optimizer's buffers (DeepSpeed's flat fp32 partitions, AdamW's moments). Storages are counted
at their own size, so with ``model.dtype: bf16`` weights and gradients count 2 bytes an element
and the fp32 master partitions and moments 4 (``emu.bytes_per_device`` is the matching model).
Aliased model-stages share storages and count once. Activations and KV caches live only inside
a stage's call and are not resident between steps, so they are not in this reading (the cost
model's transient terms cover them).
"""

from __future__ import annotations

from typing import Any

import torch

from nereus_core.engine.device import DeviceContext
from nereus_core.engine.shard import ModelShard

_MAX_DEPTH = 4


def _walk(obj: Any, seen_objects: set[int], out: dict[int, int], depth: int) -> None:
    if depth > _MAX_DEPTH or id(obj) in seen_objects:
        return
    seen_objects.add(id(obj))
    if isinstance(obj, torch.Tensor):
        for t in (obj, obj.grad):
            # Meta tensors (DeepSpeed's round_robin_bit16_meta placeholders) hold no memory.
            if t is not None and t.numel() and not t.is_meta:
                storage = t.untyped_storage()
                out[storage.data_ptr()] = storage.nbytes()
        return
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple, set)):
        items = list(obj)
    elif isinstance(obj, torch.optim.Optimizer):
        items = [obj.state, obj.param_groups]
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith(("deepspeed", "torch.optim")):
        items = list(vars(obj).values())
    else:
        return
    for item in items:
        _walk(item, seen_objects, out, depth + 1)


def held_bytes(ctx: DeviceContext) -> int:
    """Bytes of the distinct tensor storages this device's model-stages hold (see the module docstring)."""
    storages: dict[int, int] = {}
    seen: set[int] = set()
    for shard in {id(s): s for s in ctx.resident.values() if isinstance(s, ModelShard)}.values():
        for p in shard.stage.parameters():
            _walk(p, seen, storages, 0)
        if shard.engine is not None:
            _walk(shard.engine.optimizer, seen, storages, 0)
    return sum(storages.values())
