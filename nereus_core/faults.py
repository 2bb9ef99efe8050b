"""Named fault points for fault-injection tests: ``NEREUS_FAULT=<point>[,<point>...]`` arms them.

An armed point fires once per process. Points and what they do:

- ``kill-driver:move``: the driver kills itself (SIGKILL) as a transition's first move starts;
- ``kill-worker:rehydrate``: the driver kills device rank 1's worker as a rehydration starts;
- ``fail-snapshot-write``: a device's snapshot writer raises ``OSError(ENOSPC)`` (disk full).

Nothing fires unless the variable names the point; production runs never set it.
"""

from __future__ import annotations

import errno
import os

ENV = "NEREUS_FAULT"
_fired: set[str] = set()


def armed(point: str) -> bool:
    """True once per process when ``point`` is named in ``NEREUS_FAULT``."""
    if point in _fired or point not in os.environ.get(ENV, "").split(","):
        return False
    _fired.add(point)
    return True


def disk_full(what: str) -> OSError:
    return OSError(errno.ENOSPC, f"No space left on device (injected fault) writing {what}")
