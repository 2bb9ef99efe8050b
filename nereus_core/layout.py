"""The layout of one model-stage: parallel degrees and the device slots it uses.

A layout validates itself when built (like torchtitan's ``ParallelDims``) and
callers ask it for coordinates and groups instead of recomputing them.

Rank order inside a layout: ``devices[i]`` has coordinates
``(dp, pp, tp) = (i // (pp*tp), (i // tp) % pp, i % tp)``: tp varies fastest,
then pp, then dp. One data-parallel replica (an EMU) is therefore a contiguous
run of ``tp*pp`` devices. Device slots are world ranks of the device pool.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from pydantic import Field, model_validator

from nereus_core.frozen import Frozen


class Coord(NamedTuple):
    dp: int
    pp: int
    tp: int


class Layout(Frozen):
    """tp x pp x dp over an ordered tuple of device slots."""

    tp: int = Field(default=1, ge=1, le=1024, description="Tensor-parallel degree.")
    pp: int = Field(default=1, ge=1, le=1024, description="Pipeline-parallel degree.")
    dp: int = Field(default=1, ge=1, le=4096, description="Data-parallel degree (replicas).")
    devices: tuple[int, ...] = Field(description="Ordered device slots, tp*pp*dp of them.")
    micro_batches: int = Field(default=1, ge=1, le=4096, description="Micro-batches per replica.")
    schedule: Literal["gpipe", "1f1b"] = Field(
        default="gpipe",
        description="Order of a train pipeline's micro-batches (pp > 1): gpipe runs every forward, then "
        "every backward, holding all micro-batches' activations; 1f1b (PipeDream-Flush, Megatron's) "
        "backpropagates the oldest micro-batch after each forward once the pipeline is full, holding "
        "at most pp - stage of them.",
    )
    recompute: bool = Field(
        default=False,
        description="A train stage recomputes every decoder layer in its backward pass (gradient "
        "checkpointing), keeping only each layer's input; always on when model.gradient_checkpointing "
        "is set. Ignored by forward and generation stages.",
    )
    shard: Literal["optimizer", "full"] = Field(
        default="optimizer",
        description="What a train stage splits over its data-parallel ranks: optimizer (ZeRO-1/2: the AdamW "
        "state; weights and gradients whole on every replica) or full (ZeRO-3, as verl's FSDP and "
        "OpenRLHF's ZeRO-3: weights, gradients and optimizer state, each layer's weights gathered for its "
        "forward and backward). full needs pp=1. Forward and generation stages hold whole weights.",
    )

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
        if self.schedule == "1f1b" and self.pp == 1:
            raise ValueError("schedule 1f1b orders a pipeline's micro-batches; it needs pp > 1 (or gpipe)")
        if self.shard == "full" and self.pp > 1:
            # DeepSpeed's ZeRO-3 gathers a layer's weights by a trace of one forward per backward; a
            # pipeline's micro-batches in flight broke it (wrong gradients from the second step on).
            raise ValueError("shard full (ZeRO-3) runs without a pipeline; set pp=1 or shard: optimizer")
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

    def same_placement(self, other: Layout) -> bool:
        """Whether ``other`` has the same degrees on the same devices, sharded alike: moving between the
        two moves no state (micro-batch counts, the pipeline schedule and recomputation change no
        placement)."""
        return (self.tp, self.pp, self.dp, self.devices, self.shard) == (
            other.tp,
            other.pp,
            other.dp,
            other.devices,
            other.shard,
        )

    def memory_choices(self) -> list[Layout]:
        """Every train-stage memory choice at this layout's degrees and devices (sharding over dp,
        recomputation, a pipeline's schedule), this layout first."""
        shards = ("optimizer", "full") if self.pp == 1 and self.dp > 1 else ("optimizer",)
        schedules = ("gpipe", "1f1b") if self.pp > 1 and self.micro_batches > 1 else ("gpipe",)
        out = [self]
        for shard in shards:
            for recompute in (False, True):
                for schedule in schedules:
                    other = self.model_copy(
                        update={"shard": shard, "recompute": recompute, "schedule": schedule}
                    )
                    if other != self:
                        out.append(other)
        return out

    def memory_choice(self) -> str:
        """``shard: full, recompute: true`` (and the schedule on a pipeline): this layout's memory
        choices as its plan fields."""
        parts = [f"shard: {self.shard}", f"recompute: {str(self.recompute).lower()}"]
        if self.pp > 1:
            parts.append(f"schedule: {self.schedule}")
        return ", ".join(parts)

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

    def stage_layers(self, num_layers: int, pp_rank: int, *, head_layers: float) -> range:
        """The contiguous decoder layers held by pipeline stage ``pp_rank``.

        The last stage also runs the head, worth ``head_layers`` decoder layers of compute (a 152k-token
        lm head is about two layers of a 7B model; a value head, none). The layers are split as
        ``num_layers + k`` over the stages with the last stage giving ``k`` of its share to the head
        (keeping at least one layer) and earlier stages taking the extra; ``k`` is the whole number
        next to ``head_layers`` that makes the busiest stage lightest (Megatron-LM's
        ``account_for_loss_in_pipeline_split`` gives the head one layer's slot). ``head_layers=0``
        is the even split."""
        counts = stage_layer_counts(num_layers, self.pp, head_layers)
        start = sum(counts[:pp_rank])
        return range(start, start + counts[pp_rank])


def stage_layer_counts(num_layers: int, pp: int, head_layers: float) -> tuple[int, ...]:
    """Decoder layers per pipeline stage, first stage first (the rule ``Layout.stage_layers`` states)."""
    if not 1 <= pp <= num_layers:
        raise ValueError(f"pp={pp} needs 1 <= pp <= layers={num_layers}")
    if head_layers < 0:
        raise ValueError(f"head_layers={head_layers} is negative")

    def split(k: int) -> tuple[int, ...]:
        if pp == 1:
            return (num_layers,)
        last = max(1, (num_layers + k) // pp - k)  # the last stage's share of num_layers + k, less k
        base, extra = divmod(num_layers - last, pp - 1)
        return (*(base + (1 if rank < extra else 0) for rank in range(pp - 1)), last)

    def busiest(counts: tuple[int, ...]) -> float:
        return max(max(counts[:-1], default=0), counts[-1] + head_layers)

    floor = int(head_layers)
    ks = (floor, floor + 1) if head_layers > floor else (floor,)
    return min((split(k) for k in ks), key=busiest)  # ties: the smaller k
