"""The ``nereus`` command line: its parser and one handler per command.

    CONFIG file --cli.inputs--> NereusConfig --cli.inputs--> run dir --cli.prefect_server--> flows.job.rl_job
             (bounded YAML, --set, preflight)  (lock, damage)   (API answers; watchdog)

Files and the environment are read on the way in by flows/cli/inputs.py (the config, ``--set``,
``NEREUS_SCHEDULER_ADDRESS``, ``NEREUS_MAX_LOCAL_DEVICES``, the machine's CPUs and memory, the run
directory) and Prefect's settings by flows/cli/prefect_server.py (``PREFECT_API_URL`` and the heartbeat).
Bad input ends here with one line on stderr and exit status 2, never a traceback, before Prefect,
Dask or a run directory start. ``nereus plan`` prints through flows/cli/plan_command.py. Flows are imported
lazily so that ``nereus --help`` and config errors stay fast. A new command is a ``cmd_*`` handler
and a few lines in ``build_parser``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

from flows.cli import data as cli_data
from flows.cli import prefect_server as cli_prefect
from flows.cli import stopping as cli_stopping
from flows.cli import watchdog as cli_watchdog
from flows.cli.inputs import (
    MAX_DEVICES_ENV,
    SCHEDULER_ENV,
    check_bounds,
    check_run_inputs,
    default_out_dir,
    load_config,
    read_config_file,
    run_dir_problem,
)
from nereus_core import __version__, faults
from nereus_core.config import ConfigError, parse_config
from nereus_core.plan import MODELS

__all__ = ["FAULT_ENV", "MAX_DEVICES_ENV", "SCHEDULER_ENV", "build_parser", "main"]

FAULT_ENV = "NEREUS_FAULT"  # fault-injection tests: <point>[,<point>...] (nereus_core.faults.POINTS)
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
EXIT_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader has gone


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line instead of usage + error."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"nereus: error: {message} (see '{self.prog} --help')\n")


class _CommandsFormatter(argparse.HelpFormatter):
    """Keeps each command's help on its name's line in ``nereus --help``: argparse measures the
    command names at their group's indent but prints them one level deeper, so it would wrap the
    longest one (``selfcheck``) onto two lines."""

    def add_argument(self, action: argparse.Action) -> None:
        super().add_argument(action)
        subactions = getattr(action, "_get_subactions", list)()  # the command names, if any
        names = [len(sub.metavar or sub.dest) for sub in subactions]
        if names:
            deeper = max(names) + self._current_indent + self._indent_increment
            self._action_max_length = max(self._action_max_length, deeper)


def _fail(where: str | os.PathLike[str] | None, message: str, code: int = EXIT_USAGE) -> int:
    if cli_stopping.signalled():  # an error the stop caused: the stop's own line says it all
        cli_stopping.finish()
    # a storage error names the damaged file under ``where`` already: say the path once
    named = where is None or message.startswith(f"{os.fspath(where)}/")
    print(f"nereus: error: {message}" if named else f"nereus: error: {where}: {message}", file=sys.stderr)
    return code


def _stopped(out: str | os.PathLike[str], err: Exception) -> int:
    """A run that stopped on its own terms (the job cannot go on, another driver holds its directory)."""
    resume = "" if "in use by pid" in str(err) else f"; once fixed, continue it with nereus resume {out}"
    return _fail(out, f"{' '.join(str(err).split())}{resume}", EXIT_FAILED)


def _prefect_problem() -> int | None:
    """Exit status 2 with one line if the configured Prefect API does not answer; otherwise None,
    with the watchdog started when this run will start Prefect's temporary server."""
    cli_prefect.prefect_defaults()
    problem = cli_prefect.api_problem()
    if problem:
        return _fail(None, problem)
    if cli_prefect.configured_api_url() is None:
        cli_watchdog.start_watchdog()
    # The Dask scheduler's and nannies' INFO lines drown the run's own progress.
    logging.getLogger("distributed").setLevel(logging.WARNING)
    return None


def _drive(flow: Callable[..., Any], out: Path, where: Path, **kwargs: Any) -> int:
    """Run a PPO or self-check flow into ``out``; a stop the user can act on is one line (about
    ``where``, the config or the run directory, when the input is to blame)."""
    from nereus_core.job import JobFailed
    from nereus_core.rewards.registry import RewardError
    from storage.lock import RunLocked
    from tasks.runtime.device_actor import DevicePoolError

    try:
        flow(out_dir=str(out), **kwargs)
    except (ConfigError, FileNotFoundError) as err:
        return _fail(where, str(err))
    except (JobFailed, RunLocked, RewardError) as err:  # a reward that fails mid-run: its one line
        return _stopped(out, err)
    except DevicePoolError as err:  # too few workers, a lost one: its first line (the log has the rest)
        return _stopped(out, RuntimeError(str(err).splitlines()[0]))
    print(f"nereus: done: {out}")
    return EXIT_OK


def _run_flow(args: argparse.Namespace, module: str, flow_name: str, what: str, *, bounded: bool) -> int:
    """Validate CONFIG (and, when ``bounded``, the machine's bounds and the run directory), then run
    the flow; everything up to the flow call is quick and ends bad input in one line."""
    try:
        cfg = load_config(args.config, sets=args.set, steps=args.steps)
        # bounds, trackers, model files, data, reward: one line, nothing started; the data made once
        prepared = {"prepared": check_run_inputs(cfg)} if bounded else {}
    except ConfigError as err:
        return _fail(args.config, str(err))
    out = args.out or default_out_dir(cfg)
    problem = run_dir_problem(out, resuming=False) if bounded else None
    if problem:
        return _fail(out, problem)
    cli_stopping.install_for_run(cfg.name, out, args.config)
    status = _prefect_problem()
    if status is not None:
        return status
    flow = getattr(importlib.import_module(module), flow_name)
    what = what.format(algorithm=cfg.algorithm.name.upper())
    print(f"nereus: {cfg.name}: {what} on {cfg.cluster.devices} device slots -> {out}")
    return _drive(flow, out, args.config, config=cfg, **prepared)


def cmd_run(args: argparse.Namespace) -> int:
    what = f"{{algorithm}} for {args.steps or 'the configured'} steps"  # PPO or GRPO, from the config
    return _run_flow(args, "flows.job.rl_job", "rl_job", what, bounded=True)


def cmd_selfcheck(args: argparse.Namespace) -> int:
    return _run_flow(args, "flows.selfcheck", "selfcheck_flow", "runtime self-check", bounded=False)


def cmd_resume(args: argparse.Namespace) -> int:
    """Continue the unfinished run in DIR from its newest checkpoint (optionally on --devices N)."""
    config = Path(args.run_dir) / "config.yaml"
    if not config.is_file():
        return _fail(args.run_dir, "not a run directory (no config.yaml); give the --out of a nereus run")
    problem = run_dir_problem(Path(args.run_dir), resuming=True)
    if problem:
        return _fail(args.run_dir, problem)
    try:
        cfg = parse_config(read_config_file(config))
    except ConfigError as err:
        return _fail(config, str(err))
    try:  # --devices N is bounded like cluster.devices of a new run
        check_bounds(cfg, devices=args.devices, resume=True)
    except ConfigError as err:
        return _fail(args.run_dir, str(err))
    cli_stopping.install_for_run(cfg.name, Path(args.run_dir), None)
    status = _prefect_problem()
    if status is not None:
        return status
    from flows.job.rl_job import rl_job

    on = f" on {args.devices} device slots" if args.devices else ""
    print(f"nereus: {cfg.name}: resuming {args.run_dir}{on}")
    return _drive(rl_job, Path(args.run_dir), Path(args.run_dir), config=cfg, devices=args.devices)


def cmd_plan(args: argparse.Namespace) -> int:
    """Print the plan the controller picks for CONFIG, its predicted cost and the runners-up."""
    from flows.cli.plan_command import print_plan

    try:
        cfg = load_config(args.config, sets=args.set)
    except ConfigError as err:
        return _fail(args.config, str(err))
    return print_plan(cfg, profile=args.profile)


def cmd_simulate(args: argparse.Namespace) -> int:
    """Run the trace-driven simulation of CONFIG (flows/simulate.py) into DIR."""
    cli_prefect.prefect_defaults()  # before flows.simulate imports Prefect, which reads them once
    from flows.simulate import SweepFailed, check_sweep, read_sim_config, run_simulation
    from nereus_core.sim.loop import SimError

    try:
        cfg = read_sim_config(args.config)
        out = args.out or Path("runs") / f"{cfg.name}-{datetime.now():%Y%m%d-%H%M%S}"
        check_sweep(args.config, out)  # bad traces, another sweep's --out: before Prefect starts
    except ConfigError as err:
        return _fail(args.config, str(err))
    runs = len(cfg.seeds) * sum(len(cfg.strategies_for(spec)) for spec in cfg.traces)
    cli_stopping.install_for_sweep(cfg.name, runs, out, args.config)
    status = _prefect_problem()
    if status is not None:
        return status
    print(f"nereus: {cfg.name}: simulating {len(cfg.traces)} traces x {len(cfg.seeds)} seeds -> {out}")
    started = datetime.now()
    try:
        run_simulation(args.config, out)
    except (ConfigError, SimError) as err:
        return _fail(args.config, str(err))
    except SweepFailed as err:
        return _fail(out, str(err), EXIT_FAILED)
    print(f"nereus: done in {(datetime.now() - started).total_seconds():.0f} s: {out}/summary.json")
    return EXIT_OK


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
    from flows.cli.report import write_report
    from storage.errors import RunDirError

    try:
        paths = write_report(args.run_dir)
    except (FileNotFoundError, RunDirError) as err:  # no summary, or a damaged one
        return _fail(args.run_dir, str(err))
    for path in paths:
        print(f"nereus: wrote {path}")
    return EXIT_OK


def _config_args(cmd: argparse.ArgumentParser, *, example: str, out: str | None) -> None:
    cmd.add_argument("config", type=Path, metavar="CONFIG", help=f"YAML config, e.g. {example}")
    if out:
        cmd.add_argument("--out", type=Path, metavar="DIR", help=out)


def _set_arg(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set job.batch_size=16 (repeatable; values are YAML)",
    )


def _flow_args(cmd: argparse.ArgumentParser, *, out: str, steps: str) -> None:
    """What ``_run_flow`` reads: CONFIG, --out, --steps (``steps``: what they are for) and --set."""
    _config_args(cmd, example="examples/tiny_ppo.yaml", out=out)
    cmd.add_argument("--steps", type=int, metavar="N", help=f"steps to {steps} (sets job.steps)")
    _set_arg(cmd)


def _run_dir_arg(cmd: argparse.ArgumentParser, what: str) -> None:
    cmd.add_argument("run_dir", type=Path, metavar="DIR", help=f"{what} (the --out of a nereus run)")


_Command = Callable[[str, Callable[[argparse.Namespace], int], str, str], argparse.ArgumentParser]


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command; each help line fits one line of ``nereus --help``."""
    parser = _Parser(
        prog="nereus",
        description="RL post-training (PPO, GRPO) whose parallel layouts change while the job runs.",
        formatter_class=_CommandsFormatter,
    )
    parser.add_argument("--version", action="version", version=f"nereus {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")

    def command(
        name: str, handler: Callable[[argparse.Namespace], int], summary: str, description: str
    ) -> argparse.ArgumentParser:
        cmd = sub.add_parser(name, help=summary, description=description)
        cmd.set_defaults(handler=handler)
        return cmd

    _job_commands(command)
    _offline_commands(command)
    cli_data.add_data_command(sub, fail=_fail)
    return parser


def _job_commands(command: _Command) -> None:
    """run, resume, plan and selfcheck: the commands about a job of CONFIG."""
    run = command(
        "run",
        cmd_run,
        "run the PPO or GRPO job of CONFIG",
        "Run the RL post-training job of CONFIG: PPO, or GRPO with algorithm.name: grpo.",
    )
    _flow_args(run, out="run directory (default runs/NAME-TIMESTAMP)", steps="run")

    resume = command(
        "resume",
        cmd_resume,
        "continue an interrupted run from its newest checkpoint",
        "Continue an interrupted run (and its transition) from its newest checkpoint.",
    )
    _run_dir_arg(resume, "the run to continue")
    resume.add_argument(
        "--devices", type=int, metavar="N", help="resume on N device slots; the controller re-plans for them"
    )

    plan = command(
        "plan",
        cmd_plan,
        "show the plan the controller picks for CONFIG, and why",
        "Show the plan the controller picks for CONFIG and why; nothing runs (a path/to/file.py:function "
        "reward is imported only in a short-lived worker process, to check it).",
    )
    _config_args(plan, example="examples/tiny_ppo.yaml", out=None)
    plan.add_argument(
        "--profile", choices=("cpu", "h100"), default="cpu", help="hardware profile (default cpu)"
    )
    _set_arg(plan)

    check = command(
        "selfcheck",
        cmd_selfcheck,
        "check every layout of CONFIG against one device",
        "Check every layout of CONFIG against the single-device reference.",
    )
    _flow_args(check, out="output folder (default runs/NAME-TIMESTAMP)", steps="check")


def _offline_commands(command: _Command) -> None:
    """simulate, report and export: the commands that start no device pool."""
    simulate = command(
        "simulate",
        cmd_simulate,
        "trace-driven simulation of every strategy of CONFIG",
        "Trace-driven simulation of every strategy of CONFIG.",
    )
    _config_args(simulate, example="examples/paper_sim.yaml", out="output folder (default runs/NAME-TIME)")

    report = command("report", cmd_report, "plot a run into DIR/plots", "Plot a run into DIR/plots.")
    _run_dir_arg(report, "the run to plot")

    export = command(
        "export",
        cmd_export,
        "write a model of a run in Hugging Face format",
        "Write one model of a run, as of a committed step, in Hugging Face format.",
    )
    _run_dir_arg(export, "the run to export from")
    export.add_argument("--model", required=True, choices=MODELS, help="which model to write (required)")
    export.add_argument(
        "--step", type=int, metavar="N", help="the committed step to write (default: the newest)"
    )
    export.add_argument(
        "--hf", required=True, type=Path, metavar="OUT", help="folder to write the model into (required)"
    )


def _quiet_broken_pipe() -> int:
    """The reader of stdout has gone (``nereus plan | head -1``): say nothing more. Python would
    flush stdout again at exit and print a traceback, so stdout becomes /dev/null first."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_PIPE


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
        status = args.handler(args)
        sys.stdout.flush()  # here, not at exit, so that a closed pipe is caught below
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except BaseException as err:  # a command that runs a flow stops on a signal through here
        return cli_stopping.on_exception(err)
    if cli_stopping.signalled():  # a signal that came as the command ended
        cli_stopping.finish()
    return status


if __name__ == "__main__":
    raise SystemExit(main())
