"""Which Nereus packages a worker imports, the check that runs on each worker before it does, and
what a local worker process has imported before it starts.

Boundary: no Dask here (``tasks.runtime.cluster`` runs the check on the workers and turns its answer
into a ``ClusterError``). A Dask worker puts its local directory first on ``sys.path``, and that
directory holds a ``storage/`` spill directory that would shadow Nereus's own ``storage``
package: the check takes it off before anything of Nereus is imported there, and
reports the first package that does not resolve as on the driver.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

# Nereus's top-level packages: each must resolve on a worker as it does on the driver.
NEREUS_PACKAGES = ("nereus_core", "storage", "tasks", "flows")

# What every device worker imports (the actor, the engine it runs, torch): 5-10 s of CPU a worker,
# paid by all of a LocalCluster's workers at once on the same cores when each imports it itself.
WORKER_MODULES = (
    "distributed",
    "torch",
    "transformers",
    "tasks.runtime.device_actor",
    "nereus_core.engine.train",
    "nereus_core.engine.forward",
    "nereus_core.engine.reshard",
    "nereus_core.engine.weight_sync",
)
# DeepSpeed, with what its first engine imports: torch._dynamo (the optimizer's constructor) and the
# Muon optimizer its sanity check loads (a torch.compile at import: inductor). 3-10 s a worker.
DEEPSPEED_MODULES = (
    "deepspeed",
    "deepspeed.runtime.engine",
    "deepspeed.runtime.zero.muon.muon_optimizer",
    "torch._dynamo",
    "torch.optim",
)


def forkserver_preload() -> list[str]:
    """The modules a local cluster's fork server imports once, so that every worker process forked
    from it starts with them. DeepSpeed and dynamo only on a build of torch without CUDA or ROCm:
    they ask for a device count, and a process must not fork once CUDA has started."""
    import torch

    cpu_build = torch.version.cuda is None and torch.version.hip is None
    return [*WORKER_MODULES, *(DEEPSPEED_MODULES if cpu_build else ())]


def nereus_packages() -> dict[str, str | None]:
    """Where each Nereus package's ``__init__.py`` is in this process (None: no regular package)."""
    found: dict[str, str | None] = {}
    for name in NEREUS_PACKAGES:
        spec = importlib.util.find_spec(name)  # a top-level name: found, not imported
        found[name] = spec.origin if spec is not None and spec.has_location else None
    return found


def import_guard() -> Callable[..., dict[str, Any]]:
    """The function ``DaskCluster.guard_imports`` runs on a worker. Built inside a function, so that
    Dask sends it by value: sent by reference, unpickling it would import Nereus on the worker before
    its path is fixed.
    It returns the worker's pid and the first package that resolves wrongly, with where it resolves."""

    def guard(packages: dict[str, str | None], driver_host: str, dask_worker: Any = None) -> dict[str, Any]:
        import importlib
        import importlib.util
        import os
        import socket
        import sys

        # The worker's local directory holds Dask's spill directory ``storage/``, and Dask puts it
        # first on the path, as do the nanny and a LocalCluster's scheduler (whose path a spawned
        # worker inherits) with theirs: all under a ``dask-scratch-space``. Nothing of Nereus is there.
        def scratch(path: str) -> bool:
            real = os.path.realpath(path)
            return real == local or "dask-scratch-space" in real.split(os.sep)

        local = os.path.realpath(dask_worker.local_directory)
        sys.path[:] = [p for p in sys.path if not p or not scratch(p)]
        importlib.invalidate_caches()
        here: dict[str, str] = {}
        for name in packages:
            try:
                spec = importlib.util.find_spec(name)
            except (ImportError, ValueError):
                spec = None
            if spec is None or not (spec.has_location and spec.origin):
                folders = list(spec.submodule_search_locations or []) if spec is not None else []
                found = f"the folder {folders[0]}" if folders else "nothing (not installed there)"
                return {"pid": os.getpid(), "problem": (name, found)}
            here[name] = os.path.realpath(spec.origin)
        # On the driver's host, the very same files; elsewhere, one installation of all of them.
        roots = {os.path.dirname(os.path.dirname(p)) for p in here.values()}
        for name, origin in here.items():
            expected = packages[name]
            if socket.gethostname() == driver_host:
                if expected is None or origin != os.path.realpath(expected):
                    return {"pid": os.getpid(), "problem": (name, origin)}
            elif len(roots) > 1:
                return {"pid": os.getpid(), "problem": (name, f"{origin}, apart from the others")}
        return {"pid": os.getpid(), "problem": None}

    return guard
