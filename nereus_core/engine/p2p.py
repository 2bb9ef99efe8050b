"""Point-to-point hand-offs between neighbouring pipeline stages.

Shapes are known on both sides (every stage of a replica sees the same batch
shape), so only the payload travels. Ranks are world ranks; every pipeline is
one tp index of one replica, so tp ranks of a stage talk to the same tp rank of
the next stage.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def send(tensor: torch.Tensor, dst: int) -> None:
    dist.send(tensor.contiguous(), dst=dst)


def recv(shape: tuple[int, ...], dtype: torch.dtype, src: int, device: torch.device) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(out, src=src)
    return out
