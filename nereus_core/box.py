"""Boxes: N-d regions of a tensor (per-dim ``[start, stop)``), and flat ranges written as boxes.

Boundary: geometry over shapes only; what the boxes of a model-stage are is ``nereus_core.emu``'s.
"""

from __future__ import annotations

import math
from operator import sub
from typing import NamedTuple


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
