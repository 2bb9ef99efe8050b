"""Batched point-to-point exchange of tensor segments between device actors, with bounded waits.

Both ends of a pair list the segments they exchange in the same agreed order (each side
derives it from the same plan), so only payload bytes travel: no shapes, no headers. The
segments of one direction of a pair become few messages: runs of small segments are packed
into one contiguous buffer, a large segment travels alone and, when its view is contiguous,
straight from the source tensor into the destination tensor (no staging copy). Message
boundaries depend only on segment sizes and dtypes, which both ends know, so they agree.

Every send and receive is posted (non-blocking) before anything is awaited, so no order of
peers can deadlock. Each wait is bounded by one deadline: a peer that died or never posted its
side raises here (gloo closes the pair after a timeout, so the world must be rebuilt after a
failure).

The pipeline's hand-offs between neighbouring pipeline stages (``send_activation``,
``recv_activation``: activations forward, their gradients back) are the plain blocking case: the
shape is known on both sides (every pipeline stage of a replica sees the same batch shape), so only
the payload travels. Every pipeline is one tp index of one replica, so the tp ranks of a pipeline
stage talk to the same tp rank of the next.

Boundary: bytes between world ranks. Which segments to exchange is the caller's business
(``nereus_core.engine.reshard`` for a reshard plan, ``nereus_core.engine.state`` for ZeRO's
partitions); this module knows no shard maps or models.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# A segment at least this large travels as its own message (no packing copy when contiguous).
DIRECT_BYTES = 1 << 18
DEFAULT_TIMEOUT_S = 120.0

Segments = Mapping[int, Sequence[torch.Tensor]]


class ExchangeError(RuntimeError):
    """A point-to-point exchange failed or timed out (a peer died, or never posted its side)."""


@dataclass(frozen=True)
class ExchangeStats:
    """Bytes this rank sent and received, messages posted, and seconds spent."""

    sent: int
    received: int
    messages: int
    seconds: float


def _messages(views: Sequence[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """Group segments into messages: runs of small same-dtype segments, large segments alone."""
    run: list[torch.Tensor] = []
    for view in views:
        if view.numel() == 0:
            continue
        big = view.numel() * view.element_size() >= DIRECT_BYTES
        if run and (big or view.dtype != run[0].dtype):
            yield run
            run = []
        if big:
            yield [view]
        else:
            run.append(view)
    if run:
        yield run


def _in_place(message: list[torch.Tensor]) -> bool:
    """Whether ``message`` travels straight from its tensor (one contiguous segment: no packing)."""
    return len(message) == 1 and message[0].is_contiguous()


def _send_buffer(message: list[torch.Tensor]) -> torch.Tensor:
    if len(message) == 1:
        return message[0].contiguous().view(-1)
    out = torch.empty(sum(v.numel() for v in message), dtype=message[0].dtype, device=message[0].device)
    offset = 0
    for view in message:
        out[offset : offset + view.numel()].view(view.shape).copy_(view)
        offset += view.numel()
    return out


def _recv_buffer(message: list[torch.Tensor]) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """The buffer to receive ``message`` into and what to do with it afterwards (None: nothing)."""
    if _in_place(message):
        return message[0].view(-1), None
    buffer = torch.empty(sum(v.numel() for v in message), dtype=message[0].dtype, device=message[0].device)

    def unpack() -> None:
        offset = 0
        for view in message:
            view.copy_(buffer[offset : offset + view.numel()].view(view.shape))
            offset += view.numel()

    return buffer, unpack


class Exchange:
    """One exchange in flight: ``send`` posts sends (each as soon as it is packed), ``recv`` posts
    receives, ``wait`` awaits them all under one deadline and unpacks.

    With gloo every op is posted at once, but a send's bytes move only once the peer has posted
    the matching receive (gloo's TCP pairs announce a send and wait for the receiver's ready), so
    callers post their receives as early as they can. Other backends (NCCL) get the ops as one
    ``batch_isend_irecv`` in ``wait``, since their separately posted point-to-point ops could
    deadlock.
    """

    def __init__(
        self,
        *,
        tag: int = 0,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.tag, self.timeout_s, self.group = tag, timeout_s, group
        self.start = time.perf_counter()
        self.eager = dist.get_backend(group) == dist.Backend.GLOO
        self.ops: list[dist.P2POp] = []
        self.works: list[Any] = []
        self.unpacks: dict[int, Callable[[], None]] = {}  # by op index: run once that receive is in
        self.keep: list[torch.Tensor] = []  # send buffers must outlive their ops
        self.sent = self.received = 0

    def _post(self, op: dist.P2POp) -> None:
        self.ops.append(op)
        if self.eager:
            with self._failures():
                self.works.append(op.op(op.tensor, op.peer, op.group, op.tag))

    def send(self, outgoing: Segments) -> None:
        """Post ``outgoing[peer]``'s segments to each peer (world ranks). Eager (gloo): first the
        messages sent in place, peer by peer in turn, so that bytes move while the rest are packed
        (tags match them up). A batch (NCCL matches by order, not tag) keeps each peer's order."""
        messages = [
            (peer, i, message)
            for peer in sorted(outgoing)
            for i, message in enumerate(_messages(outgoing[peer]))
        ]
        if self.eager:
            in_place = sorted((m for m in messages if _in_place(m[2])), key=lambda m: m[1])
            messages = in_place + [m for m in messages if not _in_place(m[2])]
        for peer, i, message in messages:
            buffer = _send_buffer(message)
            self.keep.append(buffer)
            self.sent += buffer.numel() * buffer.element_size()
            self._post(dist.P2POp(dist.isend, buffer, peer, self.group, tag=self.tag + i))

    def recv(self, incoming: Segments) -> None:
        """Post receives that fill ``incoming[peer]``'s segments from each peer."""
        for peer in sorted(incoming):
            for i, message in enumerate(_messages(incoming[peer])):
                buffer, unpack = _recv_buffer(message)
                self.received += buffer.numel() * buffer.element_size()
                if unpack is not None:
                    self.unpacks[len(self.ops)] = unpack
                self._post(dist.P2POp(dist.irecv, buffer, peer, self.group, tag=self.tag + i))

    def wait(self) -> ExchangeStats:
        """Await every op (raises ``ExchangeError`` past the deadline), unpacking each receive once in."""
        deadline = time.monotonic() + self.timeout_s
        with self._failures():
            if not self.eager and self.ops:
                self.works = dist.batch_isend_irecv(self.ops)
            one_each = len(self.works) == len(self.ops)  # a batch may give one work for all its ops
            for index, work in enumerate(self.works):  # each receive unpacked while later ones arrive
                work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
                if one_each and index in self.unpacks:
                    self.unpacks.pop(index)()
        for unpack in self.unpacks.values():
            unpack()
        self.keep.clear()
        return ExchangeStats(self.sent, self.received, len(self.ops), time.perf_counter() - self.start)

    @contextmanager
    def _failures(self) -> Iterator[None]:
        try:
            yield
        except RuntimeError as exc:  # gloo: timeout, or "Connection closed by peer"
            peers = sorted({op.peer for op in self.ops})
            raise ExchangeError(
                f"rank {dist.get_rank()}: point-to-point exchange with ranks {peers} failed within "
                f"{self.timeout_s:g}s: {str(exc).splitlines()[0]}"
            ) from exc


def exchange(
    outgoing: Segments,
    incoming: Segments,
    *,
    tag: int = 0,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    group: dist.ProcessGroup | None = None,
) -> ExchangeStats:
    """Send ``outgoing[peer]`` segments to each peer and fill ``incoming[peer]`` from each, concurrently.

    Peers are world ranks. The peer on the other side must list the same segments (same
    sizes, dtypes and order) in its ``incoming``/``outgoing`` for this rank, with the same
    ``tag``. Raises ``ExchangeError`` if any message is not through within ``timeout_s``.
    ``group`` (default: the world) is the process group whose connections carry the bytes.
    """
    ex = Exchange(tag=tag, timeout_s=timeout_s, group=group)
    ex.send(outgoing)
    ex.recv(incoming)
    return ex.wait()


def send_activation(tensor: torch.Tensor, dst: int) -> None:
    """Send ``tensor`` to the neighbouring pipeline stage at world rank ``dst`` (blocking)."""
    dist.send(tensor.contiguous(), dst=dst)


def send_activation_async(tensor: torch.Tensor, dst: int) -> tuple[Any, torch.Tensor]:
    """Post a send of ``tensor`` to the neighbouring pipeline stage at world rank ``dst``; returns the
    work to wait on and the contiguous tensor it reads (kept alive until then)."""
    payload = tensor.contiguous()
    return dist.isend(payload, dst=dst), payload


def recv_activation(
    shape: tuple[int, ...], dtype: torch.dtype, src: int, device: torch.device
) -> torch.Tensor:
    """Receive a ``shape`` tensor from the neighbouring pipeline stage at world rank ``src`` (blocking)."""
    out = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(out, src=src)
    return out
