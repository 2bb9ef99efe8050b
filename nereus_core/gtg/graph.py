"""The result of planning a transition: its operations, their order, and a replay that checks them.

``TransitionGraph.validate`` trusts nothing the builder computed: it replays the waves from the
shard maps of plan A and plan B, checking capacity after every wave's allocations, data order
(allocs before transfers into a shard, every read of an old shard before its free, snapshots
before rehydrates) and coverage (every destination element written exactly once, checked against
the new shard map and ``emu.min_bytes``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal

from nereus_core.config import ModelConfig
from nereus_core.emu import Box, bytes_per_device, min_bytes, shard_map
from nereus_core.gtg.ops import Edge, Op, ScheduleInvalid
from nereus_core.layout import Layout

Route = Literal["live", "durable", "mixed"]
Mode = Literal["unchanged", "live", "durable"]


@dataclass(frozen=True)
class StageMove:
    """One model-stage from layout ``old`` to ``new``, and how its state travels (``mode``)."""

    stage: str
    config: ModelConfig
    train: bool
    old: Layout
    new: Layout
    mode: Mode = "unchanged"

    @property
    def changed(self) -> bool:
        """Whether state moves (micro-batches alone change no placement)."""
        return not self.old.same_placement(self.new)

    def shard_bytes(self, which: Literal["old", "new"], dtype_bytes: int | None) -> dict[int, int]:
        """Bytes (params, grads, optimizer) of this model-stage's shard on every device of a layout."""
        per = _per_device(self.config, self.old if which == "old" else self.new, self.train, dtype_bytes)
        return {d: sum(kinds.values()) for d, kinds in per}

    def state_bytes(self, which: Literal["old", "new"], dtype_bytes: int | None) -> dict[int, int]:
        """Bytes worth persisting (params and optimizer; gradients are not state between steps)."""
        per = _per_device(self.config, self.old if which == "old" else self.new, self.train, dtype_bytes)
        return {d: kinds["params"] + kinds["optimizer"] for d, kinds in per}


@lru_cache(maxsize=512)
def _per_device(
    config: ModelConfig, layout: Layout, train: bool, dtype_bytes: int | None
) -> tuple[tuple[int, dict[str, int]], ...]:
    """``emu.bytes_per_device``, cached (a transition asks for the same layouts many times)."""
    per = bytes_per_device(config, layout, train=train, dtype_bytes=dtype_bytes)
    return tuple((d, dict(kinds)) for d, kinds in per.items())


def device_loads(
    moves: dict[str, StageMove], which: Literal["old", "new"], dtype_bytes: int | None
) -> dict[int, int]:
    """Bytes every model-stage holds on every device under plan A (``old``) or plan B (``new``)."""
    out: dict[int, int] = defaultdict(int)
    for move in moves.values():
        for d, b in move.shard_bytes(which, dtype_bytes).items():
            out[d] += b
    return dict(out)


def resolve_capacities(
    capacities: dict[int, int], initial: dict[int, int], final: dict[int, int]
) -> dict[int, int]:
    """Capacity of every device either plan uses; a plan-A-only device without one keeps its load."""
    missing = sorted(d for d in final if d not in capacities)
    if missing:
        raise ValueError(
            f"device {missing[0]} is used by plan B but has no capacity; pass capacities for "
            f"every device of plan B (missing: {missing})"
        )
    out = dict(capacities)
    for d, load in initial.items():
        out.setdefault(d, load)
    return out


@dataclass(frozen=True)
class TransitionGraph:
    """A transition A -> B as a DAG of operations, a wave schedule and its timing.

    ``waves``: sets of op ids that run concurrently, in order (no two share a port, every edge
    points to a later wave). ``peak_bytes``: the most each device holds along the waves, counting
    a wave's allocations before its frees. ``critical_path_s``/``critical_path``: the longest
    chain through data, memory and port edges with ``LinkModel`` durations (the makespan when
    every op starts as soon as its predecessors finish); ``critical_link_bytes``: bytes per link on
    it. ``bytes_moved``: bytes that leave a device (transfers, snapshots, rehydrates).
    """

    ops: tuple[Op, ...]
    edges: tuple[Edge, ...]
    waves: tuple[tuple[str, ...], ...]
    route: Route
    reason: str
    durable_stages: tuple[str, ...]
    peak_bytes: dict[int, int]
    critical_path_s: float
    critical_path: tuple[str, ...]
    critical_link_bytes: dict[str, int]
    waves_s: float
    start_s: dict[str, float]
    moves: dict[str, StageMove] = field(repr=False)
    dtype_bytes: int | None = None
    _by_id: dict[str, Op] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_id", {op.id: op for op in self.ops})

    def op(self, op_id: str) -> Op:
        return self._by_id[op_id]

    @property
    def bytes_moved(self) -> int:
        return sum(op.nbytes for op in self.ops if op.kind in ("transfer", "snapshot", "rehydrate"))

    @property
    def link_bytes(self) -> int:
        """Bytes sent between devices (transfers only)."""
        return sum(op.link_bytes for op in self.ops)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ops by id, edges, waves, route and timing."""
        return {
            "route": self.route,
            "reason": self.reason,
            "durable_stages": list(self.durable_stages),
            "stages": {
                s: {"mode": m.mode, "old": m.old.key, "new": m.new.key, "train": m.train}
                for s, m in self.moves.items()
            },
            "ops": [op.to_dict() for op in self.ops],
            "edges": [e.to_list() for e in self.edges],
            "waves": [list(w) for w in self.waves],
            "peak_bytes": {str(d): b for d, b in sorted(self.peak_bytes.items())},
            "critical_path_s": self.critical_path_s,
            "critical_path": list(self.critical_path),
            "critical_link_bytes": self.critical_link_bytes,
            "waves_s": self.waves_s,
            "bytes_moved": self.bytes_moved,
        }

    def validate(self, capacities: dict[int, int]) -> None:
        """Replay the schedule; raise ``ScheduleInvalid`` naming every broken rule (first 20)."""
        problems = _check_waves(self)
        if not problems:
            problems += _check_memory(self, capacities)
            problems += _check_data_order(self)
            problems += _check_coverage(self)
        if problems:
            more = f"\n... and {len(problems) - 20} more" if len(problems) > 20 else ""
            raise ScheduleInvalid("invalid transition schedule:\n" + "\n".join(problems[:20]) + more)


def replay_peaks(
    waves: tuple[tuple[str, ...], ...], by_id: dict[str, Op], initial: dict[int, int]
) -> tuple[dict[int, int], list[dict[int, int]], dict[int, int]]:
    """Peak bytes per device along ``waves`` (allocs of a wave before its frees), the load after
    each wave's allocations, and the load at the end."""
    load = dict(initial)
    peak = dict(initial)
    after_allocs = []
    for wave in waves:
        for op_id in wave:
            op = by_id[op_id]
            if op.kind == "alloc":
                load[op.device] = load.get(op.device, 0) + op.nbytes  # type: ignore[index]
                peak[op.device] = max(peak.get(op.device, 0), load[op.device])  # type: ignore[index]
        after_allocs.append(dict(load))
        for op_id in wave:
            op = by_id[op_id]
            if op.kind == "free":
                load[op.device] -= op.nbytes  # type: ignore[index]
    return peak, after_allocs, load


def _check_waves(g: TransitionGraph) -> list[str]:
    problems = []
    ids = [op.id for op in g.ops]
    if len(set(ids)) != len(ids):
        problems.append("op ids are not unique")
    wave_of: dict[str, int] = {}
    for i, wave in enumerate(g.waves):
        ports: set[tuple[str, int]] = set()
        for op_id in wave:
            if op_id in wave_of:
                problems.append(f"{op_id} is scheduled twice")
            wave_of[op_id] = i
            for port in g.op(op_id).ports:
                if port in ports:
                    problems.append(f"wave {i}: two ops use port {port} at once")
                ports.add(port)
    problems += [f"{i} is in no wave" for i in ids if i not in wave_of]
    for e in g.edges:
        if e.before not in wave_of or e.after not in wave_of:
            problems.append(f"edge {e.before} -> {e.after} names an unknown op")
        elif wave_of[e.before] >= wave_of[e.after]:
            problems.append(f"{e.kind} edge {e.before} -> {e.after} does not point to a later wave")
    if ids and g.waves[-1] != ("commit",):
        problems.append("commit is not alone in the last wave")
    return problems


def _check_memory(g: TransitionGraph, capacities: dict[int, int]) -> list[str]:
    initial = device_loads(g.moves, "old", g.dtype_bytes)
    final = device_loads(g.moves, "new", g.dtype_bytes)
    caps = resolve_capacities(capacities, initial, final)
    problems = []
    held = {(s, d) for s, m in g.moves.items() if m.changed for d in m.old.devices}
    made: set[tuple[str, int]] = set()
    for op in g.ops:
        key = (op.stage, op.device)
        if op.kind == "alloc":
            if key in made or op.device not in g.moves[op.stage].new.devices:  # type: ignore[operator]
                problems.append(f"{op.id}: allocated twice or not a device of plan B's layout")
            made.add(key)  # type: ignore[arg-type]
        elif op.kind == "free":
            if key not in held:
                problems.append(f"{op.id}: frees a shard that plan A does not hold")
            held.discard(key)  # type: ignore[arg-type]
    problems += [f"old shard {s}@{d} is never freed" for s, d in sorted(held)]
    _, after_allocs, end = replay_peaks(g.waves, g._by_id, initial)
    for i, (wave, load) in enumerate(zip(g.waves, after_allocs, strict=True)):
        for d in sorted({g.op(x).device for x in wave if g.op(x).kind == "alloc"}):  # type: ignore[type-var]
            if load[d] > caps[d]:  # type: ignore[index]
                problems.append(f"wave {i}: device {d} holds {load[d]} B, over its capacity {caps[d]} B")
    for d in sorted(set(end) | set(final)):
        if end.get(d, 0) != final.get(d, 0):
            problems.append(f"device {d} ends with {end.get(d, 0)} B, plan B puts {final.get(d, 0)} B there")
    return problems


def _check_data_order(g: TransitionGraph) -> list[str]:
    wave_of = {op_id: i for i, wave in enumerate(g.waves) for op_id in wave}
    at = {(op.kind, op.stage, op.device): wave_of[op.id] for op in g.ops if op.device is not None}
    never = len(g.waves)
    last_snapshot: dict[str, int] = defaultdict(lambda: -1)
    last_moved: dict[str, int] = defaultdict(lambda: -1)  # a live model-stage's targets complete
    for op in g.ops:
        if op.kind == "snapshot":
            last_snapshot[op.stage] = max(last_snapshot[op.stage], wave_of[op.id])
        elif op.kind in ("transfer", "copy"):
            last_moved[op.stage] = max(last_moved[op.stage], wave_of[op.id])
    problems = []
    for op in g.ops:
        w = wave_of[op.id]
        if op.kind in ("transfer", "copy"):
            src, dst = (op.src, op.dst) if op.kind == "transfer" else (op.device, op.device)
            if at.get(("alloc", op.stage, dst), never) >= w:
                problems.append(f"{op.id} runs before its destination shard is allocated")
            if at.get(("free", op.stage, src), -1) <= w:
                problems.append(f"{op.id} reads a shard that is already freed")
            if op.kind == "transfer" and wave_of.get("regroup", never) >= w:
                problems.append(f"{op.id} runs before regroup")
        elif op.kind == "rehydrate":
            if at.get(("alloc", op.stage, op.device), never) >= w:
                problems.append(f"{op.id} runs before its shard is allocated")
            if last_snapshot[op.stage] >= w:
                problems.append(f"{op.id} runs before the snapshot of {op.stage} is complete")
        elif op.kind == "free" and g.moves[op.stage].mode == "durable":
            snap = at.get(("snapshot", op.stage, op.device))
            if snap is not None and snap >= w:
                problems.append(f"{op.id} frees the shard before its snapshot")
        elif op.kind == "free" and last_moved[op.stage] >= w:
            problems.append(f"{op.id} frees a source shard before the model-stage's targets are complete")
    return problems


def _check_coverage(g: TransitionGraph) -> list[str]:
    problems = []
    for s, move in g.moves.items():
        ops = [op for op in g.ops if op.stage == s]
        if not move.changed or move.mode == "unchanged":
            problems += [f"{op.id}: {s} does not change layout but has ops" for op in ops[:1]]
            continue
        old = shard_map(move.config, move.old, train=move.train, dtype_bytes=g.dtype_bytes)
        new = shard_map(move.config, move.new, train=move.train, dtype_bytes=g.dtype_bytes)
        if move.mode == "durable":
            problems += _check_durable(g, move, ops, old)
            continue
        moved = [op for op in ops if op.kind in ("transfer", "copy")]
        regions: dict[tuple[str, int], list[Box]] = defaultdict(list)
        for op in moved:
            dst = op.dst if op.kind == "transfer" else op.device
            src = op.src if op.kind == "transfer" else op.device
            regions[(op.tensor, dst)].append(op.region)  # type: ignore[index, arg-type]
            if not any(p.device == src and p.box.contains(op.region) for p in old.tensor(op.tensor).pieces):  # type: ignore[arg-type]
                problems.append(f"{op.id}: device {src} does not hold that region under plan A")
        claimed = 0
        for spec in new.tensors:
            for piece in spec.pieces:
                got = [r for r in regions.get((spec.name, piece.device), []) if piece.box.contains(r)]
                claimed += len(got)
                if sum(r.numel for r in got) != piece.box.numel or _overlap(got):
                    problems.append(f"{s}: {spec.name} on device {piece.device} is not written exactly once")
        if claimed != len(moved):
            problems.append(f"{s}: some moved regions fall outside every destination piece")
        sent = sum(op.nbytes for op in moved if op.kind == "transfer")
        if sent != min_bytes(old, new):
            problems.append(f"{s}: transfers move {sent} B, the least possible is {min_bytes(old, new)} B")
    return problems


def _check_durable(g: TransitionGraph, move: StageMove, ops: list[Op], old: Any) -> list[str]:
    problems = []
    distinct = sum(b.numel * spec.itemsize for spec in old.tensors for b in {p.box for p in spec.pieces})
    written = sum(op.nbytes for op in ops if op.kind == "snapshot")
    if written != distinct:
        problems.append(f"{move.stage}: snapshots write {written} B, the state has {distinct} B")
    want = move.state_bytes("new", g.dtype_bytes)
    got = {op.device: op.nbytes for op in ops if op.kind == "rehydrate"}
    if got != want:
        problems.append(f"{move.stage}: rehydrates read {got}, plan B's shards need {want}")
    return problems


def _overlap(boxes: list[Box]) -> bool:
    return any(boxes[i].intersect(boxes[j]) is not None for i in range(len(boxes)) for j in range(i))
