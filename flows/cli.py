"""The ``nereus`` command line.

    CONFIG file --load_config--> NereusConfig --check_bounds--> run_dir_problem --> flows.ppo_job
                (config_yaml: bounded YAML)      (preflight: machine)  (lock, damage)

This is where files and the environment are read on the way in: the YAML
config, ``--set`` overrides, ``NEREUS_SCHEDULER_ADDRESS``, ``NEREUS_MAX_LOCAL_DEVICES``
(a ceiling on a local cluster's device slots; default 4 per CPU) and the machine's
CPUs and available memory. Validation itself is ``nereus_core.config.parse_config``
and ``nereus_core.preflight``; bad input ends here with one line on stderr and exit
status 2, never a traceback, before Prefect, Dask or a run directory start. Flows are
imported lazily so that ``nereus --help`` and config errors stay fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

from nereus_core import __version__, faults
from nereus_core.config import ConfigError, NereusConfig, parse_config, shown, with_overrides
from nereus_core.config_yaml import parse_yaml

SCHEDULER_ENV = "NEREUS_SCHEDULER_ADDRESS"
FAULT_ENV = "NEREUS_FAULT"  # fault-injection tests: <point>[,<point>...] (nereus_core.faults.POINTS)
MAX_DEVICES_ENV = "NEREUS_MAX_LOCAL_DEVICES"  # an explicit ceiling on a local cluster's slots
CONFIG_MAX_CHARS = 1_000_000
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
MODELS = ("actor", "critic", "reference", "reward")


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line instead of usage + error."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"nereus: error: {message} (see '{self.prog} --help')\n")


def _fail(where: str | os.PathLike[str], message: str, code: int = EXIT_USAGE) -> int:
    # a storage error names the damaged file under ``where`` already: say the path once
    named = message.startswith(f"{os.fspath(where)}/")
    print(f"nereus: error: {message}" if named else f"nereus: error: {where}: {message}", file=sys.stderr)
    return code


def _stopped(out: str | os.PathLike[str], err: Exception) -> int:
    """A run that stopped on its own terms (the job cannot go on, another driver holds its directory)."""
    resume = "" if "in use by pid" in str(err) else f"; once fixed, continue it with nereus resume {out}"
    return _fail(out, f"{' '.join(str(err).split())}{resume}", EXIT_FAILED)


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
    from nereus_core.preflight import Machine, check

    raw = os.environ.get(MAX_DEVICES_ENV, "").strip()
    if raw and not (raw.isdigit() and int(raw) >= 1):
        raise ConfigError(f"{MAX_DEVICES_ENV}={shown(raw)}: give a whole number of device slots, at least 1")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    machine = Machine(
        cpus=cpus, available_memory=_available_memory(), max_local_devices=int(raw) if raw else None
    )
    check(cfg, machine, devices=devices, resume=resume)


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


def _run_flow(args: argparse.Namespace, module: str, flow_name: str, what: str, *, bounded: bool) -> int:
    """Validate CONFIG (and, when ``bounded``, the machine's bounds and the run directory), then run
    the flow; everything up to the flow call is quick and ends bad input in one line."""
    # Prefect's embedded server gets 20 s to start by default; a busy 2-core machine can need more.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    try:
        cfg = load_config(args.config, sets=args.set, steps=args.steps)
        if bounded:
            check_bounds(cfg)
    except ConfigError as err:
        return _fail(args.config, str(err))
    out = args.out or default_out_dir(cfg)
    problem = run_dir_problem(out, resuming=False) if bounded else None
    if problem:
        return _fail(out, problem)
    flow_fn = getattr(importlib.import_module(module), flow_name)
    from nereus_core.job import JobFailed
    from storage.lock import RunLocked

    print(f"nereus: {cfg.name}: {what} on {cfg.cluster.devices} device slots -> {out}")
    # The Dask scheduler's and nannies' INFO lines drown the run's own progress.
    logging.getLogger("distributed").setLevel(logging.WARNING)
    try:
        flow_fn(config=cfg, out_dir=str(out))
    except ConfigError as err:
        return _fail(args.config, str(err))
    except (JobFailed, RunLocked) as err:
        return _stopped(out, err)
    print(f"nereus: done: {out}")
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    what = f"PPO for {args.steps or 'the configured'} steps"
    return _run_flow(args, "flows.ppo_job", "ppo_job", what, bounded=True)


def cmd_selfcheck(args: argparse.Namespace) -> int:
    return _run_flow(args, "flows.selfcheck", "selfcheck_flow", "runtime self-check", bounded=False)


def cmd_export(args: argparse.Namespace) -> int:
    from storage import SnapshotError
    from storage.export import export_hf

    try:
        path = export_hf(args.run_dir, model=args.model, step=args.step, out=args.hf)
    except (FileNotFoundError, ValueError, LookupError, SnapshotError) as err:
        # RunDirError and SnapshotNotFoundError (which lists the committed steps) among them
        return _fail(args.run_dir, " ".join(str(err).strip("'\"").split()))
    print(f"nereus: exported {args.model} to {path}")
    return EXIT_OK


def cmd_report(args: argparse.Namespace) -> int:
    from flows.report import write_report
    from storage.errors import RunDirError

    try:
        paths = write_report(args.run_dir)
    except (FileNotFoundError, RunDirError) as err:  # no summary, or a damaged one
        return _fail(args.run_dir, str(err))
    for path in paths:
        print(f"nereus: wrote {path}")
    return EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    """Print the plan the controller picks for CONFIG, its predicted cost and the runners-up."""
    from nereus_core.controller import ControllerState, Observation, decide
    from nereus_core.cost_model import Workload
    from nereus_core.hardware import get_profile
    from nereus_core.plan import GlobalPlan, default_plan

    try:
        cfg = load_config(args.config, sets=args.set)
    except ConfigError as err:
        return _fail(args.config, str(err))
    profile = get_profile(args.profile)
    obs = Observation(
        step=0,
        remaining_steps=cfg.job.steps,
        devices=cfg.cluster.devices,
        memory_per_device=int(cfg.cluster.memory_per_device),
        workload=Workload.from_config(cfg),
    )
    fresh = ControllerState.initial(cfg.model, profile)
    decision = decide(obs, fresh)
    print(_plan_header(cfg, profile.name, obs, fresh.settings.headroom))
    if decision.chosen is None:
        print(f"no plan fits: {decision.reason}")
    else:
        print(_plan_table(decision.chosen))
    initial = GlobalPlan.of(default_plan(cfg.plan))  # the plan `nereus run` starts on
    if decision.chosen is not None and initial != decision.chosen.plan:
        started = ControllerState.initial(cfg.model, profile, plan=initial, devices=obs.devices)
        from_config = decide(obs, started)
        current = from_config.current
        where = f"step {current.step_s:.4g} s, {current.memory_peak / 2**30:.3f} GiB/slot" if current else ""
        print(f"\nconfig plan {initial.plan_id} ({initial.placement}): {where}")
        print(f"  a job started on it would {from_config.action}: {from_config.reason}")
    if decision.alternatives:
        print("\nrejected alternatives")
        for alt in decision.alternatives:
            gib = alt.memory_peak / 2**30
            print(f"  {alt.plan_id}  step {alt.step_s:9.4g} s  {gib:7.2f} GiB/slot  {alt.reason}")
            print(f"      {alt.description}")
            print(f"      why: {alt.detail}")
    return EXIT_OK if decision.chosen is not None else EXIT_FAILED


def _plan_header(cfg: NereusConfig, profile: str, obs: Any, headroom: float) -> str:
    gib = obs.memory_per_device / 2**30
    w = obs.workload
    return (
        f"nereus plan: {cfg.name} on {obs.devices} slots x {gib:.2f} GiB ({profile} profile, "
        f"{headroom:.0%} headroom)\nworkload: batch {w.batch}, prompt {w.prompt_len}, "
        f"response mean {w.response_mean:g} (high {w.response_high})"
    )


def _plan_table(chosen: Any) -> str:
    plan = chosen.plan
    lines = [
        f"\nchosen {plan.plan_id}  {plan.placement}  step {chosen.step_s:.4g} s "
        f"(weight sync {chosen.sync_s:.3g} s)",
        f"  {'model-stage':<16} {'tp':>3} {'pp':>3} {'dp':>4} {'mb':>4}  {'slots':<12} {'latency s':>10} "
        f"{'GiB/slot':>9}",
    ]
    for stage, layout in plan.layouts.items():
        est = chosen.stages[stage]
        slots = f"{layout.devices[0]}..{layout.devices[-1]}"
        lines.append(
            f"  {stage:<16} {layout.tp:>3} {layout.pp:>3} {layout.dp:>4} {layout.micro_batches:>4}  "
            f"{slots:<12} {est.seconds:>10.4g} {est.memory.total / 2**30:>9.3f}"
        )
    lines.append(
        f"  busiest slot: {chosen.memory_peak / 2**30:.3f} GiB of {chosen.usable / 2**30:.2f} GiB usable"
    )
    return "\n".join(lines)


def cmd_simulate(args: argparse.Namespace) -> int:
    """Run the trace-driven simulation of CONFIG (flows/simulate.py) into DIR."""
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from flows.simulate import read_sim_config, run_simulation
    from nereus_core.sim.engine import SimError

    try:
        cfg = read_sim_config(args.config)
    except ConfigError as err:
        return _fail(args.config, str(err))
    out = args.out or Path("runs") / f"{cfg.name}-{datetime.now():%Y%m%d-%H%M%S}"
    print(f"nereus: {cfg.name}: simulating {len(cfg.traces)} traces x {len(cfg.seeds)} seeds -> {out}")
    logging.getLogger("distributed").setLevel(logging.WARNING)
    started = datetime.now()
    try:
        run_simulation(args.config, out)
    except (ConfigError, SimError) as err:
        return _fail(args.config, str(err))
    print(f"nereus: done in {(datetime.now() - started).total_seconds():.0f} s: {out}/summary.json")
    return EXIT_OK


def cmd_resume(args: argparse.Namespace) -> int:
    """Continue the unfinished run in DIR from its newest checkpoint (optionally on --devices N)."""
    config = Path(args.run_dir) / "config.yaml"
    if not config.is_file():
        return _fail(args.run_dir, "not a run directory (no config.yaml); give the --out of a nereus run")
    problem = run_dir_problem(Path(args.run_dir), resuming=True)
    if problem:
        return _fail(args.run_dir, problem)
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    try:
        cfg = parse_config(read_config_file(config))
    except ConfigError as err:
        return _fail(config, str(err))
    try:  # --devices N is bounded like cluster.devices of a new run
        check_bounds(cfg, devices=args.devices, resume=True)
    except ConfigError as err:
        return _fail(args.run_dir, str(err))
    from flows.ppo_job import ppo_job
    from nereus_core.job import JobFailed
    from storage.lock import RunLocked

    on = f" on {args.devices} device slots" if args.devices else ""
    print(f"nereus: {cfg.name}: resuming {args.run_dir}{on}")
    logging.getLogger("distributed").setLevel(logging.WARNING)
    try:
        ppo_job(config=cfg, out_dir=str(args.run_dir), devices=args.devices)
    except (ConfigError, FileNotFoundError) as err:
        return _fail(args.run_dir, str(err))
    except (JobFailed, RunLocked) as err:
        return _stopped(args.run_dir, err)
    print(f"nereus: done: {args.run_dir}")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="nereus",
        description="PPO post-training whose parallel layouts change while the job runs.",
    )
    parser.add_argument("--version", action="version", version=f"nereus {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser("run", help="run the PPO job of CONFIG")
    check = sub.add_parser(
        "selfcheck", help="check every layout of CONFIG against the single-device reference"
    )
    for cmd, handler in ((run, cmd_run), (check, cmd_selfcheck)):
        cmd.add_argument(
            "config", type=Path, metavar="CONFIG", help="YAML config, e.g. examples/tiny_ppo.yaml"
        )
        cmd.add_argument(
            "--out", type=Path, metavar="DIR", help="run directory (default runs/NAME-TIMESTAMP)"
        )
        cmd.add_argument("--steps", type=int, metavar="N", help="steps to run (sets job.steps)")
        cmd.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config field, e.g. --set job.batch_size=16 (repeatable; values are YAML)",
        )
        cmd.set_defaults(handler=handler)

    plan = sub.add_parser("plan", help="show the plan the controller picks for CONFIG and why (no execution)")
    plan.add_argument("config", type=Path, metavar="CONFIG")
    plan.add_argument(
        "--profile", choices=("cpu", "h100"), default="cpu", help="hardware profile (default cpu)"
    )
    plan.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field"
    )
    plan.set_defaults(handler=cmd_plan)
    simulate = sub.add_parser("simulate", help="trace-driven simulation of every strategy of CONFIG")
    simulate.add_argument("config", type=Path, metavar="CONFIG", help="e.g. examples/paper_sim.yaml")
    simulate.add_argument("--out", type=Path, metavar="DIR", help="output folder (default runs/NAME-TIME)")
    simulate.set_defaults(handler=cmd_simulate)
    resume = sub.add_parser(
        "resume",
        help="continue an interrupted run (and its interrupted transition) from its newest checkpoint",
    )
    resume.add_argument("run_dir", type=Path, metavar="DIR")
    resume.add_argument(
        "--devices", type=int, metavar="N", help="resume on N device slots; the controller re-plans for them"
    )
    resume.set_defaults(handler=cmd_resume)
    report = sub.add_parser("report", help="plot a run into DIR/plots")
    report.add_argument("run_dir", type=Path, metavar="DIR")
    report.set_defaults(handler=cmd_report)
    export = sub.add_parser("export", help="write a model in Hugging Face format")
    export.add_argument("run_dir", type=Path, metavar="DIR")
    export.add_argument("--model", required=True, choices=MODELS)
    export.add_argument("--step", type=int, metavar="N")
    export.add_argument("--hf", required=True, type=Path, metavar="OUT")
    export.set_defaults(handler=cmd_export)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``nereus`` script; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as done:  # --help, --version and usage errors; argparse has printed them
        return done.code if isinstance(done.code, int) else EXIT_USAGE
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        faults.arm(p.strip() for p in os.environ.get(FAULT_ENV, "").split(",") if p.strip())
    except ValueError as err:
        print(f"nereus: {FAULT_ENV}: {err}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        print("nereus: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
