"""What a reward worker process (``nereus_core.rewards.worker``) may see and use: an environment of
its own (a few harmless names from the driver, the names ``reward.pass_env`` lists and the values of
``reward.env``, nothing else: no tracker tokens, no cloud keys), an address-space and a CPU-time
limit (``setrlimit`` in the worker before the user's file is imported), deadlines, and a log file
for what it prints.

Boundary: stdlib only (the worker imports it). The one module of nereus_core that reads the
process environment, and only to copy the names the config lists into a child's environment; no
setting of Nereus is ever read from it.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass, replace

# What a Python program and the tools it may start expect to find, none of it a secret: where
# programs are, the home directory (caches such as ~/.cache), the locale and time zone, the temp dir.
BASE_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR")
CPU_GRACE_S = 5  # past the soft CPU limit the kernel sends SIGXCPU, past the hard one SIGKILL


@dataclass(frozen=True)
class WorkerSettings:
    """How a reward worker runs: ``reward.*`` of the config (``RewardConfig.worker_settings``), whose
    defaults these are. ``log_path``: where its stdout and stderr go (None: a temp file)."""

    timeout_s: float = 30.0  # a rule scorer takes milliseconds; math checkers on odd input, seconds
    load_timeout_s: float = 60.0  # a file that imports torch or transformers takes seconds on a busy host
    max_memory: int = 4 * 2**30  # address space: a few libraries and their data; CUDA torch needs more
    max_cpu_s: int = 3600
    env: tuple[tuple[str, str], ...] = ()
    pass_env: tuple[str, ...] = ()
    log_path: str | None = None

    def logging_to(self, path: str | None) -> WorkerSettings:
        return replace(self, log_path=path)


def child_environment(settings: WorkerSettings) -> dict[str, str]:
    """The worker's whole environment: ``BASE_ENV`` and ``settings.pass_env`` copied from the driver
    where set, then ``settings.env``. Nothing else of the driver's environment reaches the worker."""
    driver = os.environ  # read only for the names listed: the child's environment, not a setting
    names = dict.fromkeys((*BASE_ENV, *settings.pass_env))
    out = {name: driver[name] for name in names if name in driver}
    out.update(settings.env)
    return out


def apply_limits(max_memory: int, max_cpu_s: int) -> None:
    """Limit this process (the worker, before it imports the user's file): its address space, its CPU
    seconds, and no core file (SIGXCPU would write one). Hard limits too, so the user's code cannot
    raise them again."""
    _lower(resource.RLIMIT_CORE, 0, 0)
    _lower(resource.RLIMIT_AS, max_memory, max_memory)
    _lower(resource.RLIMIT_CPU, max_cpu_s, max_cpu_s + CPU_GRACE_S)


def _lower(which: int, soft: int, hard: int) -> None:
    """Set a limit, never above the hard limit this process already has (it could not raise it)."""
    _, current = resource.getrlimit(which)
    if current != resource.RLIM_INFINITY:
        soft, hard = min(soft, current), min(hard, current)
    resource.setrlimit(which, (soft, hard))


def size_text(n: int) -> str:
    """Bytes as the config writes them: 4GiB, 512MiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n}B"


__all__ = ["BASE_ENV", "WorkerSettings", "apply_limits", "child_environment", "size_text"]
