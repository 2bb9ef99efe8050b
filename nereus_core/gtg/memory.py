"""Memory order of a transition: in which order allocations and frees can run on every device.

The abstract problem. Each changed model-stage ``s`` has an old shard ``(s, d)`` on every device
of its plan-A layout and a new shard on every device of its plan-B layout; unchanged model-stages
are a constant ``base`` load. An old shard can be freed once every new shard of its model-stage is
allocated (copy, then free: until the stage's targets are complete, all of plan A stays to fall back
on): ``needs[(s, d)]`` lists those allocations (empty on the durable route, where the shard is
snapshotted and dropped). Transfers
use no memory of their own (they write into the allocated destination; staging buffers are not
counted). Find a sequence of all allocations and frees such that no allocation takes a device
over its capacity.

The search (``find_order``). Frees run as soon as they may (they only give memory back). An
allocation on a device with room for *all* of that device's remaining allocations is taken at
once: it can never block anything (only allocations on the same device compete for memory), so
such forced moves lose no solution. Otherwise the search branches over the allocations that fit,
best first (those that complete a free on a short device), depth first, remembering dead states
(the set of allocations done fixes everything else). A state is dead early when a relaxation
fails (``closure``): an old shard is optimistically freeable once the allocations it waits for on
other devices are possible, and a subset DP per device (at most one allocation per model-stage)
says which allocations some order places; allocations that never become possible wait on a
cycle, and a device that cannot place all of its own is overfull. Run at the start, the same
checks explain a deadlock in words (``Deadlock``). Unbounded, the search is exact for this
abstraction; ``budget`` caps the branching states, and running out is reported as such, not as
impossibility (proving that no order exists is what costs).

From a found sequence, ``memory_edges`` derives edges that make *every* topological order safe:
on a device that cannot hold everything at once, its allocations are chained in sequence order
and each waits for the earliest frees (already before it in the sequence) that bring the
worst case, all other old shards still held, under capacity.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Key = tuple[str, int]  # (model-stage, device)


@dataclass(frozen=True)
class MemoryProblem:
    """Loads, shards and capacities of one transition (see the module doc)."""

    capacity: dict[int, int]
    base: dict[int, int]
    old: dict[Key, int]
    new: dict[Key, int]
    needs: dict[Key, frozenset[Key]]

    def initial(self, device: int) -> int:
        return self.base.get(device, 0) + sum(b for (_, d), b in self.old.items() if d == device)

    def final(self, device: int) -> int:
        return self.base.get(device, 0) + sum(b for (_, d), b in self.new.items() if d == device)


@dataclass
class Deadlock:
    """Why no order was found.

    ``conflict``: a model-stage's old and new shards must sit on a device at once and do not fit
    (``forced`` names those stages: no order helps them). ``cycle``: allocations that wait, through
    frees on other devices, for themselves. ``overfull``: a device cannot place all its new shards in
    any order. ``stuck``: every order tried gets stuck. ``exhausted``: the budget ran out.
    """

    kind: Literal["conflict", "cycle", "overfull", "stuck", "exhausted"]
    allocs: list[Key]  # the allocations concerned, by device
    detail: dict[Key, tuple[int, int]] = field(default_factory=dict)  # alloc -> (bytes at least, capacity)
    held: dict[int, list[Key]] = field(default_factory=dict)  # device -> old shards still held there

    @property
    def forced(self) -> set[str]:
        return {stage for stage, _ in self.allocs} if self.kind == "conflict" else set()

    @property
    def devices(self) -> set[int]:
        return {d for _, d in self.allocs}

    def describe(self, limit: int = 3) -> str:
        if self.kind == "exhausted":
            return "no live order found within the search budget (one may exist; raise search_budget)"
        parts = []
        for stage, d in self.allocs[:limit]:
            olds = ", ".join(s for s, _ in self.held.get(d, [])) or "none"
            if self.kind == "conflict":
                least, cap = self.detail[(stage, d)]
                parts.append(
                    f"device {d} must hold {stage}'s old and new shards at once ({least} B with what "
                    f"stays there) but has capacity {cap} B"
                )
            elif self.kind == "cycle":
                parts.append(
                    f"{stage} never fits on device {d}: the old shards there ({olds}) wait, through "
                    "frees on other devices, for allocations that cannot come first (a wait cycle)"
                )
            elif self.kind == "overfull":
                parts.append(f"device {d} cannot place all its new shards in any order next to ({olds})")
            else:
                parts.append(f"{stage} on device {d} is left waiting for frees of ({olds})")
        more = f" (+{len(self.allocs) - limit} more)" if len(self.allocs) > limit else ""
        lead = "every order tried gets stuck: " if self.kind == "stuck" else ""
        return "no live order exists: " + lead + "; ".join(parts) + more


@dataclass
class _State:
    load: dict[int, int]
    placed: dict[int, int]  # bytes of allocations done, per device
    pending: dict[int, int]  # bytes of allocations still to do, per device
    todo: set[Key]
    waiting: dict[Key, int]  # free -> allocations it still waits for
    events: list[tuple[str, Key]] = field(default_factory=list)

    def copy(self) -> _State:
        return _State(
            dict(self.load),
            dict(self.placed),
            dict(self.pending),
            set(self.todo),
            dict(self.waiting),
            list(self.events),
        )


class _Search:
    def __init__(self, problem: MemoryProblem) -> None:
        self.p = problem
        self.unlocks: dict[Key, list[Key]] = {a: [] for a in problem.new}
        for f, allocs in sorted(problem.needs.items()):
            for a in sorted(allocs):
                self.unlocks[a].append(f)
        # Old shards on an allocation's own device that wait for it: still held when it runs.
        self.held_at: dict[Key, list[Key]] = {
            a: [f for f in self.unlocks[a] if f[1] == a[1]] for a in problem.new
        }
        self._dp: dict[tuple[object, ...], tuple[set[int], bool]] = {}
        self.on_device: dict[int, list[Key]] = {}
        for a in sorted(problem.new, key=lambda k: (k[1], k[0])):
            self.on_device.setdefault(a[1], []).append(a)

    def root(self) -> _State:
        p = self.p
        devices = set(p.capacity) | {d for _, d in p.old} | {d for _, d in p.new}
        load = {d: p.initial(d) for d in devices}
        pending = dict.fromkeys(devices, 0)
        for (_, d), b in p.new.items():
            pending[d] += b
        waiting = {f: len(p.needs.get(f, ())) for f in p.old}
        state = _State(load, dict.fromkeys(devices, 0), pending, set(p.new), waiting)
        touched = set()
        for f in sorted(p.old):
            if state.waiting[f] == 0:
                touched.add(self._free(state, f))
        self._settle(state, touched | devices)
        return state

    def _free(self, state: _State, f: Key) -> int:
        state.load[f[1]] -= self.p.old[f]
        state.events.append(("free", f))
        return f[1]

    def alloc(self, state: _State, a: Key) -> set[int]:
        state.todo.discard(a)
        state.load[a[1]] += self.p.new[a]
        state.placed[a[1]] += self.p.new[a]
        state.pending[a[1]] -= self.p.new[a]
        state.events.append(("alloc", a))
        touched = set()
        for f in self.unlocks[a]:
            state.waiting[f] -= 1
            if state.waiting[f] == 0:
                touched.add(self._free(state, f))
        return touched

    def _settle(self, state: _State, touched: set[int]) -> None:
        """Take every forced allocation: those on devices with room for all they still need."""
        work = sorted(touched)
        while work:
            d = work.pop()
            if state.pending.get(d, 0) and state.load[d] + state.pending[d] <= self.p.capacity[d]:
                more: set[int] = set()
                for a in self.on_device[d]:
                    if a in state.todo:
                        more |= self.alloc(state, a)
                work.extend(sorted(more))

    def settle_after(self, state: _State, a: Key) -> None:
        self._settle(state, self.alloc(state, a) | {a[1]})

    def candidates(self, state: _State) -> list[Key]:
        p = self.p
        fits = [a for a in state.todo if state.load[a[1]] + p.new[a] <= p.capacity[a[1]]]
        short = {d for d, left in state.pending.items() if left and state.load[d] + left > p.capacity[d]}

        def score(a: Key) -> tuple[float, float, int, int, str]:
            completes = partial = 0.0
            for f in self.unlocks[a]:
                weight = p.old[f] * (1.0 if f[1] in short else 0.1)
                if state.waiting[f] == 1:
                    completes += weight
                elif state.waiting[f] > 1:
                    partial += weight / state.waiting[f]
            return (-completes, -partial, p.new[a], a[1], a[0])

        return sorted(fits, key=score)

    def least_load(self, state: _State, a: Key) -> int:
        """A lower bound of ``a``'s device load when ``a`` runs: what stays, what is placed, ``a``, and
        the old shards there that wait for ``a``."""
        p, d = self.p, a[1]
        held = sum(p.old[f] for f in self.held_at[a] if state.waiting[f])
        return p.base.get(d, 0) + state.placed[d] + p.new[a] + held

    def closure(self, state: _State) -> tuple[set[Key], set[int]]:
        """Allocations that can never run from ``state`` on, and devices that cannot place all of theirs.

        A relaxation solved to a fixpoint. An old shard is *possibly freed* once every allocation
        it waits for on other devices is *possible*; on each device a subset DP over its remaining
        allocations (an old shard there held until those it waits for there are placed, and forever
        if not possibly freed) says which allocations can be placed in some order. What stays
        impossible waits on a cycle; a device whose allocations cannot all be placed is overfull in
        every order. Either way no order exists from ``state``.
        """
        p = self.p
        by_device: dict[int, list[Key]] = {}
        for a in sorted(state.todo):
            by_device.setdefault(a[1], []).append(a)
        held = {f for f, left in state.waiting.items() if left}
        possible: set[Key] = set()
        complete: dict[int, bool] = {}
        changed = True
        while changed:
            changed = False
            for d, allocs in by_device.items():
                if complete.get(d):
                    continue
                if state.load[d] + state.pending[d] <= p.capacity[d]:
                    placed, whole = set(range(len(allocs))), True
                else:
                    olds = tuple(
                        (
                            p.old[f],
                            any(a[1] != d and a not in possible and a in state.todo for a in p.needs[f]),
                            sum(1 << i for i, a in enumerate(allocs) if a in p.needs[f]),
                        )
                        for f in sorted(held)
                        if f[1] == d
                    )
                    room = p.capacity[d] - p.base.get(d, 0) - state.placed[d]
                    key = (tuple(p.new[a] for a in allocs), olds, room)
                    if key not in self._dp:
                        self._dp[key] = _orders([p.new[a] for a in allocs], olds, room)
                    placed, whole = self._dp[key]
                complete[d] = whole
                for i in placed:
                    if allocs[i] not in possible:
                        possible.add(allocs[i])
                        changed = True
        return state.todo - possible, {d for d, whole in complete.items() if not whole}

    def hopeless(self, state: _State) -> bool:
        never, overfull = self.closure(state)
        return bool(never or overfull)

    def diagnose(self, state: _State, default: str = "stuck") -> Deadlock | None:
        """Why ``state`` cannot be completed (None when no cheap argument shows it and ``default`` is
        empty): conflicts first, then the closure, else ``default`` with the allocations left."""
        p = self.p
        held: dict[int, list[Key]] = {}
        for f, left in sorted(state.waiting.items()):
            if left:
                held.setdefault(f[1], []).append(f)
        by_device = sorted(state.todo, key=lambda k: (k[1], k[0]))
        detail = {a: (self.least_load(state, a), p.capacity[a[1]]) for a in by_device}
        conflicts = [a for a in by_device if detail[a][0] > detail[a][1]]
        if conflicts:
            return Deadlock("conflict", conflicts, detail, held)
        never, overfull = self.closure(state)
        if never:
            return Deadlock("cycle", [a for a in by_device if a in never], detail, held)
        if overfull:
            return Deadlock("overfull", [a for a in by_device if a[1] in overfull], detail, held)
        if not default:
            return None
        return Deadlock(default, by_device, detail, held)  # type: ignore[arg-type]


Events = list[tuple[str, Key]]


def _orders(new: list[int], olds: tuple[tuple[int, bool, int], ...], room: int) -> tuple[set[int], bool]:
    """On one device: which allocations (sizes ``new``) some order places within ``room``, and whether
    one order places all. ``olds``: (bytes, held for good, bitmask of the allocations here it waits
    for); an old shard is held until those are placed. A DP over subsets (``len(new)`` is at most
    the number of model-stages)."""
    k = len(new)
    reach = [False] * (1 << k)
    reach[0] = True
    placed: set[int] = set()
    for mask in range(1 << k):
        if not reach[mask]:
            continue
        size = sum(new[i] for i in range(k) if mask >> i & 1)
        held = sum(b for b, stuck, wants in olds if stuck or wants & ~mask)
        for i in range(k):
            if not mask >> i & 1 and size + new[i] + held <= room:
                reach[mask | 1 << i] = True
                placed.add(i)
    return placed, reach[-1]


def find_order(problem: MemoryProblem, budget: int) -> tuple[Events | None, Deadlock | None, int]:
    """A safe sequence of ``("alloc" | "free", key)`` events (or None and why not), and the number
    of branching states visited."""
    search = _Search(problem)
    root = search.root()
    if not root.todo:
        return root.events, None, 0
    proof = search.diagnose(root, default="")
    if proof is not None:
        return None, proof, 0
    dead: set[frozenset[Key]] = set()
    stack = [(root, iter(search.candidates(root)))]
    nodes = 0
    while stack:
        state, options = stack[-1]
        choice = next(options, None)
        if choice is None:
            dead.add(frozenset(state.todo))
            stack.pop()
            continue
        child = state.copy()
        search.settle_after(child, choice)
        if not child.todo:
            return child.events, None, nodes
        key = frozenset(child.todo)
        if key in dead:
            continue
        nodes += 1
        if search.hopeless(child):
            dead.add(key)
            continue
        if nodes > budget:
            return None, Deadlock("exhausted", sorted(root.todo, key=lambda k: (k[1], k[0]))), nodes
        stack.append((child, iter(search.candidates(child))))
    return None, search.diagnose(root), nodes


def memory_edges(problem: MemoryProblem, events: Events) -> list[tuple[Key, Key, str]]:
    """``(free key, alloc key, 'free')`` and ``(alloc key, alloc key, 'alloc')`` edges (see module doc)."""
    pos = {e: i for i, e in enumerate(events)}
    edges: list[tuple[Key, Key, str]] = []
    devices = sorted({d for _, d in problem.new})
    for d in devices:
        allocs = sorted((k for k in problem.new if k[1] == d), key=lambda k: pos[("alloc", k)])
        frees = sorted((k for k in problem.old if k[1] == d), key=lambda k: pos[("free", k)])
        held = problem.initial(d)
        if held + sum(problem.new[a] for a in allocs) <= problem.capacity[d]:
            continue  # the device holds everything at once: any order is safe
        chosen: set[Key] = set()
        added = 0
        for i, a in enumerate(allocs):
            added += problem.new[a]
            excess = held + added - problem.capacity[d]
            for f in frees:
                if excess <= 0 or pos[("free", f)] > pos[("alloc", a)]:
                    break
                if f not in chosen:
                    chosen.add(f)
                    held -= problem.old[f]
                    excess -= problem.old[f]
                    edges.append((f, a, "free"))
            if excess > 0:
                raise AssertionError(f"device {d}: the found order does not fit at {a}; this is a bug")
            if i:
                edges.append((allocs[i - 1], a, "alloc"))
    return edges
