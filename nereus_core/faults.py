"""Named fault points for fault-injection tests, armed by the caller with ``arm(points)``.

Boundary: this module only remembers which points are armed in this process and
fires each once; it reads nothing from the environment. The ``nereus`` CLI arms
the points named in its ``NEREUS_FAULT`` variable, and the device pool arms the
same points on every worker it starts (a snapshot is written inside a worker).
Points and what they do:

- ``kill-driver:move``: the driver kills itself (SIGKILL) after a transition's first wave of units
  moved state, while work remains (later units, or the inference copies' relinks): the journal
  shows done units and the switch is half done;
- ``fail-worker:move``: every device of a live move raises once its new shards are installed (its
  old ones kept aside): the switch fails in live workers and rolls back in memory;
- ``kill-worker:rehydrate``: the driver kills device rank 1's worker as a rehydration starts;
- ``fail-snapshot-write``: a device's snapshot writer raises ``OSError(ENOSPC)`` (disk full);
- ``fill-disk:switch``: before the checkpoint that precedes a plan switch the driver fills the run
  directory's file system with a filler file until the file system itself answers ENOSPC, and
  removes it after the checkpoint attempt (a real full disk for the writers; tests mount a tmpfs).

Nothing fires unless a point was armed; production runs never arm one.
"""

from __future__ import annotations

import errno
from collections.abc import Iterable

POINTS: tuple[str, ...] = (
    "kill-driver:move",
    "fail-worker:move",
    "kill-worker:rehydrate",
    "fail-snapshot-write",
    "fill-disk:switch",
)

_armed: set[str] = set()
_fired: set[str] = set()


def arm(points: Iterable[str]) -> None:
    """Arm exactly ``points`` in this process (none: disarm all); each fires once after arming."""
    wanted = set(points)
    unknown = sorted(wanted - set(POINTS))
    if unknown:
        raise ValueError(f"unknown fault point {unknown[0][:80]!r}; known points: {', '.join(POINTS)}")
    _armed.clear()
    _armed.update(wanted)
    _fired.clear()


def armed_points() -> tuple[str, ...]:
    """The points armed in this process (fired or not), to arm the same ones elsewhere."""
    return tuple(p for p in POINTS if p in _armed)


def armed(point: str) -> bool:
    """True the first time it is asked about an armed ``point``; False otherwise."""
    if point not in _armed or point in _fired:
        return False
    _fired.add(point)
    return True


def disk_full(what: str) -> OSError:
    return OSError(errno.ENOSPC, f"No space left on device (injected fault) writing {what}")
