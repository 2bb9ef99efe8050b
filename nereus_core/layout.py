"""The layout of one model-stage: parallel degrees and the device slots it uses.

A layout validates itself when built (like torchtitan's ``ParallelDims``) and
callers ask it for coordinates and groups instead of recomputing them.

Rank order inside a layout: ``devices[i]`` has coordinates
``(dp, pp, tp) = (i // (pp*tp), (i // tp) % pp, i % tp)``: tp varies fastest,
then pp, then dp. One data-parallel replica (an EMU) is therefore a contiguous
run of ``tp*pp`` devices. Device slots are world ranks of the device pool.
"""

from __future__ import annotations

from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Coord(NamedTuple):
    dp: int
    pp: int
    tp: int


class Layout(BaseModel):
    """tp x pp x dp over an ordered tuple of device slots."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tp: int = Field(default=1, ge=1, le=1024, description="Tensor-parallel degree.")
    pp: int = Field(default=1, ge=1, le=1024, description="Pipeline-parallel degree.")
    dp: int = Field(default=1, ge=1, le=4096, description="Data-parallel degree (replicas).")
    devices: tuple[int, ...] = Field(description="Ordered device slots, tp*pp*dp of them.")
    micro_batches: int = Field(default=1, ge=1, le=4096, description="Micro-batches per replica.")

    @model_validator(mode="after")
    def _check(self) -> Layout:
        need = self.tp * self.pp * self.dp
        if len(self.devices) != need:
            raise ValueError(
                f"layout tp*pp*dp={self.tp}*{self.pp}*{self.dp}={need} but devices lists "
                f"{len(self.devices)} slots; list exactly {need}"
            )
        seen: set[int] = set()
        for d in self.devices:
            if d < 0:
                raise ValueError(f"device {d} is negative; device slots are 0..N-1")
            if d in seen:
                raise ValueError(f"device {d} is used twice in one layout; each slot may appear once")
            seen.add(d)
        return self

    @classmethod
    def contiguous(
        cls, tp: int = 1, pp: int = 1, dp: int = 1, first: int = 0, micro_batches: int = 1
    ) -> Layout:
        """The layout on slots ``first .. first + tp*pp*dp - 1``."""
        n = tp * pp * dp
        return cls(tp=tp, pp=pp, dp=dp, devices=tuple(range(first, first + n)), micro_batches=micro_batches)

    def devices_error(self, pool_size: int) -> str | None:
        """Why this layout does not fit a pool of ``pool_size`` slots, or None."""
        if self.world_size > pool_size:
            return (
                f"tp*pp*dp={self.world_size} exceeds cluster.devices={pool_size}; "
                "lower a degree or add devices"
            )
        bad = [d for d in self.devices if d >= pool_size]
        if bad:
            return f"device {bad[0]} is outside the pool; valid slots are 0..{pool_size - 1}"
        return None

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def key(self) -> str:
        """A short stable name, e.g. ``tp2.pp1.dp2@0-1-2-3``."""
        return f"tp{self.tp}.pp{self.pp}.dp{self.dp}@{'-'.join(map(str, self.devices))}"

    def coord(self, index: int) -> Coord:
        """Coordinates of the ``index``-th device of this layout."""
        return Coord(index // (self.pp * self.tp), (index // self.tp) % self.pp, index % self.tp)

    def coord_of_device(self, device: int) -> Coord:
        return self.coord(self.devices.index(device))

    def device(self, dp: int, pp: int, tp: int) -> int:
        return self.devices[(dp * self.pp + pp) * self.tp + tp]

    def tp_groups(self) -> list[tuple[int, ...]]:
        """Device slots of every TP group (same dp, pp), in a fixed order."""
        return [
            tuple(self.device(d, p, t) for t in range(self.tp))
            for d in range(self.dp)
            for p in range(self.pp)
        ]

    def pp_groups(self) -> list[tuple[int, ...]]:
        """Device slots of every pipeline (same dp, tp), stage 0 first."""
        return [
            tuple(self.device(d, p, t) for p in range(self.pp))
            for d in range(self.dp)
            for t in range(self.tp)
        ]

    def dp_groups(self) -> list[tuple[int, ...]]:
        """Device slots of every data-parallel group (same pp, tp)."""
        return [
            tuple(self.device(d, p, t) for d in range(self.dp))
            for p in range(self.pp)
            for t in range(self.tp)
        ]

    def replica_groups(self) -> list[tuple[int, ...]]:
        """Device slots of every model replica (tp*pp slots; one EMU each)."""
        n = self.tp * self.pp
        return [self.devices[d * n : (d + 1) * n] for d in range(self.dp)]

    def stage_layers(self, num_layers: int, pp_rank: int) -> range:
        """The contiguous decoder layers held by pipeline stage ``pp_rank`` (earlier stages get the extra)."""
        base, extra = divmod(num_layers, self.pp)
        start = pp_rank * base + min(pp_rank, extra)
        return range(start, start + base + (1 if pp_rank < extra else 0))
