"""Boxes: N-d regions of a tensor (per-dim ``[start, stop)``), and flat ranges written as boxes.

Boundary: geometry over shapes only; what the boxes of a model-stage are is ``nereus_core.emu``'s.

How a tensor shard's flat elements split over the data-parallel ranks of a layout (``Layout.shard``):

- ``optimizer`` (ZeRO-1/2): Nereus's canonical share of the optimizer state. Flattened row-major
  (``n`` elements), dp rank ``k`` owns ``[k*base + min(k, extra), ...)`` with
  ``base, extra = divmod(n, dp)``: earlier ranks take the remainder. DeepSpeed keeps one flat
  buffer per param group instead; ``engine.state`` converts.
- ``full`` (ZeRO-3): DeepSpeed's own partition of each parameter
  (``deepspeed/runtime/zero/partition_parameters.py``): ``P = ceil(n / dp)`` elements a rank, rank
  ``k`` owning ``[k*P, (k+1)*P)`` cut at ``n`` (its partition is zero-padded past it). The weights,
  their fp32 masters and the AdamW moments all split so, each rank's share a slice of its own
  partition: no exchange to read or fill them.
"""

from __future__ import annotations

import math
from operator import sub
from typing import Literal, NamedTuple


class Box(NamedTuple):
    """An N-d region of a tensor: ``start[d] <= i_d < stop[d]`` on every dim (0-d: the one element)."""

    start: tuple[int, ...]
    stop: tuple[int, ...]

    @classmethod
    def full(cls, shape: tuple[int, ...]) -> Box:
        return cls((0,) * len(shape), tuple(shape))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(map(sub, self.stop, self.start))

    @property
    def numel(self) -> int:
        return math.prod(map(sub, self.stop, self.start))

    def intersect(self, other: Box) -> Box | None:
        """The common region, or None if it is empty."""
        start = tuple(map(max, self.start, other.start))
        stop = tuple(map(min, self.stop, other.stop))
        for a, b in zip(start, stop):  # noqa: B905 (same length by construction; hot path)
            if a >= b:
                return None
        return Box(start, stop)

    def contains(self, other: Box) -> bool:
        pairs = zip(self.start, self.stop, other.start, other.stop, strict=True)
        return all(a <= c and d <= b for a, b, c, d in pairs)

    def relative_to(self, outer: Box) -> Box:
        """This box in the coordinates of ``outer`` (which contains it): a local slice."""
        return Box(
            tuple(a - o for a, o in zip(self.start, outer.start, strict=True)),
            tuple(b - o for b, o in zip(self.stop, outer.start, strict=True)),
        )

    def subtract(self, other: Box) -> list[Box]:
        """Disjoint boxes covering ``self`` minus ``other`` (at most ``2*ndim``)."""
        inter = self.intersect(other)
        if inter is None:
            return [self]
        out: list[Box] = []
        lo, hi = list(self.start), list(self.stop)
        for d in range(len(lo)):
            if lo[d] < inter.start[d]:
                out.append(Box(tuple(lo), (*hi[:d], inter.start[d], *hi[d + 1 :])))
                lo[d] = inter.start[d]
            if inter.stop[d] < hi[d]:
                out.append(Box((*lo[:d], inter.stop[d], *lo[d + 1 :]), tuple(hi)))
                hi[d] = inter.stop[d]
        return out

    def slices(self) -> tuple[slice, ...]:
        """Index a tensor with ``t[box.slices()]``."""
        return tuple(slice(a, b) for a, b in zip(self.start, self.stop, strict=True))


def flat_range_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[Box]:
    """Boxes covering flat elements ``[lo, hi)`` of a row-major ``shape``, in flat order, each contiguous."""
    if lo >= hi:
        return []
    if not shape:
        return [Box((), ())]
    inner = math.prod(shape[1:])
    (r0, c0), (r1, c1) = divmod(lo, inner), divmod(hi, inner)

    def rows(r: int, a: int, b: int) -> list[Box]:
        return [Box((r, *x.start), (r + 1, *x.stop)) for x in flat_range_boxes(shape[1:], a, b)]

    if r0 == r1:
        return rows(r0, c0, c1)
    out = rows(r0, c0, inner) if c0 else []
    first_full = r0 + 1 if c0 else r0
    if r1 > first_full:
        out.append(Box((first_full, *(0,) * (len(shape) - 1)), (r1, *shape[1:])))
    return out + (rows(r1, 0, c1) if c1 else [])


def shift(box: Box, origin: tuple[int, ...]) -> Box:
    """``box`` moved by ``origin`` (local coordinates of a region starting there -> global)."""
    return Box(
        tuple(a + o for a, o in zip(box.start, origin, strict=True)),
        tuple(b + o for b, o in zip(box.stop, origin, strict=True)),
    )


Shard = Literal["optimizer", "full"]


def canonical_range(numel: int, dp: int, rank: int) -> tuple[int, int]:
    """The flat range of a ``numel``-element shard that dp rank ``rank`` owns under ZeRO-1/2."""
    base, extra = divmod(numel, dp)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def zero3_partition(numel: int, dp: int) -> int:
    """Elements of each rank's ZeRO-3 partition of a ``numel``-element shard (padding included)."""
    return math.ceil(numel / dp)


def zero3_range(numel: int, dp: int, rank: int) -> tuple[int, int]:
    """The flat range of a ``numel``-element shard that dp rank ``rank`` holds under ZeRO-3."""
    part = zero3_partition(numel, dp)
    return min(numel, rank * part), min(numel, (rank + 1) * part)


def dp_range(shard: Shard, numel: int, dp: int, rank: int) -> tuple[int, int]:
    """The flat range dp rank ``rank`` owns of a ``numel``-element shard under ``shard``."""
    return (zero3_range if shard == "full" else canonical_range)(numel, dp, rank)


def share_boxes(shard: Shard, box: Box, dp: int, rank: int) -> list[tuple[Box, int]]:
    """``(global box, offset)`` of dp rank ``rank``'s share of the tensor shard ``box``, in flat order;
    ``offset``: where the box starts in the rank's flat buffer of the shard."""
    lo, hi = dp_range(shard, box.numel, dp, rank)
    out, offset = [], 0
    for local in flat_range_boxes(box.shape, lo, hi):
        out.append((shift(local, box.start), offset))
        offset += local.numel
    return out
