"""What the ``nereus`` command reads on the way in: a YAML config file, ``--set`` overrides,
``NEREUS_SCHEDULER_ADDRESS``, ``NEREUS_MAX_LOCAL_DEVICES`` (a ceiling on a local cluster's device
slots), the machine's CPUs and available memory, and the state of a run directory.

Each ends bad input in ``ConfigError`` (or a reason string) with one line; validation itself is
``nereus_core.config.parse_config`` and ``nereus_core.preflight``. Nothing here starts Prefect, Dask
or a run directory: the commands in flows/cli/main.py call these before any of them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nereus_core.config import ConfigError, NereusConfig, parse_config, shown, with_overrides
from nereus_core.config.from_yaml import parse_yaml

if TYPE_CHECKING:  # the data's loaders are imported only when a run is checked
    from flows.job.data import Prepared

SCHEDULER_ENV = "NEREUS_SCHEDULER_ADDRESS"
MAX_DEVICES_ENV = "NEREUS_MAX_LOCAL_DEVICES"  # an explicit ceiling on a local cluster's slots
CONFIG_MAX_CHARS = 1_000_000


def _describe(value: Any) -> str:
    names = {list: "a list", str: "a string", int: "a number", float: "a number", bool: "a boolean"}
    return names.get(type(value), type(value).__name__)


def read_config_file(path: Path) -> dict[str, Any]:
    """The mapping in a YAML config file; ``ConfigError`` with one line if there is none."""
    try:
        with path.open(encoding="utf-8") as handle:
            text = handle.read(CONFIG_MAX_CHARS + 1)  # a config is small; never read a huge file whole
    except FileNotFoundError:
        raise ConfigError("no such file") from None
    except IsADirectoryError:
        raise ConfigError("is a directory, not a config file") from None
    except UnicodeDecodeError:
        raise ConfigError("is not a text file; expected YAML") from None
    except OSError as err:
        raise ConfigError(f"cannot read it: {err.strerror or err}") from None
    if len(text) > CONFIG_MAX_CHARS:
        raise ConfigError(f"is over {CONFIG_MAX_CHARS:,} characters; a config file is a few thousand")
    data = parse_yaml(text)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"must be a mapping of sections (name, cluster, model, job, plan), got {_describe(data)}"
        )
    return data


def apply_sets(data: dict[str, Any], items: Sequence[str]) -> dict[str, Any]:
    """``with_overrides`` with values read as YAML, so 3, 0.5, true and [0, 1] keep their type."""
    out = data
    for item in items:  # one at a time, so a later item may replace or extend an earlier one
        out = with_overrides(out, [item])
        key, _, raw = item.partition("=")
        *parents, leaf = key.strip().split(".")
        node = out
        for part in parents:
            node = node[part]
        try:
            node[leaf] = parse_yaml(raw)
        except ConfigError as err:
            raise ConfigError(f"--set {shown(item)}: the value is {err}") from None
    return out


def load_config(
    path: Path,
    *,
    sets: Sequence[str] = (),
    steps: int | None = None,
    environ: dict[str, str] | None = None,
) -> NereusConfig:
    """Read, override and validate a config: file < NEREUS_SCHEDULER_ADDRESS < --set < --steps."""
    data = read_config_file(path)
    address = (os.environ if environ is None else environ).get(SCHEDULER_ENV, "").strip()
    if address:
        data = with_overrides(data, [f"cluster.scheduler_address={address}"])
    data = apply_sets(data, sets)
    if steps is not None:
        data = apply_sets(data, [f"job.steps={steps}"])
    return parse_config(data)


def default_out_dir(cfg: NereusConfig) -> Path:
    return Path("runs") / f"{cfg.name}-{datetime.now():%Y%m%d-%H%M%S}"


def _available_memory() -> int | None:
    """Bytes this machine can still hand out (``MemAvailable``), or None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_bounds(cfg: NereusConfig, *, devices: int | None = None, resume: bool = False) -> None:
    """``nereus_core.preflight.check`` against this machine (CPUs this process may use, memory
    available now, ``NEREUS_MAX_LOCAL_DEVICES``); ``ConfigError`` with one line if a bound is broken."""
    from nereus_core.preflight import Machine, check, host_memory_warning

    raw = os.environ.get(MAX_DEVICES_ENV, "").strip()
    if raw and not (raw.isdigit() and int(raw) >= 1):
        raise ConfigError(f"{MAX_DEVICES_ENV}={shown(raw)}: give a whole number of device slots, at least 1")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    machine = Machine(
        cpus=cpus, available_memory=_available_memory(), max_local_devices=int(raw) if raw else None
    )
    check(cfg, machine, devices=devices, resume=resume)
    warning = host_memory_warning(cfg, machine, devices=devices)
    if warning:  # a run may still fit: the capacity is what the cost model counts
        print(f"nereus: warning: {warning}", file=sys.stderr)


def run_dir_problem(root: Path, *, resuming: bool) -> str | None:
    """Why no driver may start on the run directory ``root`` now, or None: another driver holds its
    lock, it holds a completed run, or its summary or newest checkpoint cannot be read. An early look
    so that these end in one line before Prefect or Dask start; the flow takes the lock itself."""
    if not root.exists():
        return None
    from storage.errors import RunDirError
    from storage.lock import lock_holder
    from storage.run_dir import RunDir

    holder = lock_holder(root)
    if holder is not None:
        return f"in use by {holder}; wait for it to finish" + ("" if resuming else " or choose another --out")
    run = RunDir(root)
    try:
        summary = run.read_summary() if (root / "summary.json").exists() else {}
        if summary.get("status") == "completed":
            if resuming:
                return "holds a completed run, nothing to resume; start a new one with nereus run --out NEW"
            return "already holds a completed run; choose another --out"
        if run.latest_checkpoint() is None and resuming:
            return "no checkpoint to resume from (none was written); start it again with nereus run"
    except (RunDirError, ValueError, LookupError, TypeError, AttributeError) as err:
        text = " ".join(str(err).split())
        return text if isinstance(err, RunDirError) else f"a file of it is damaged: {shown(text, 200)}"
    return None


def check_run_inputs(cfg: NereusConfig) -> Prepared:
    """What ``nereus run`` checks before anything starts, each problem one ``ConfigError`` line: the
    machine's bounds, the trackers' packages, and the model's files, the data, the tokenizer and the
    reward (``flows.job.data.prepare``); returns the job data so made, for the flow's ``prepared``."""
    from flows.job import tracking
    from flows.job.data import prepare

    check_bounds(cfg)
    tracking.require(cfg.trainer.logger)
    return prepare(cfg)
