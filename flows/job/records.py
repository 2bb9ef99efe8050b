"""What an RL run records: stage timings, per-step history, transitions, decisions and the summary.

    stage timings  -> metrics/steps.parquet (and the step's response lengths), a table per step
                      (run logger), artifact nereus-step-timings
    phase times    -> each row's ``phase``; each phase's wall (``phase_<kind>_s``) and how many pools
                      ran in it at once (``phase_<kind>_pools``) in the step's history line
    step history   -> metrics/history.parquet (scores, losses, PPO statistics, lengths, wall, overhead,
                      the periodic checkpoint after the step: its attempts and a failure)
    transitions    -> metrics/transitions.parquet, artifact nereus-transitions
    every step     -> trainer.logger's trackers (flows/job/tracking.py), the progress bar on a terminal
    the end        -> summary.json

Steps are 0-based in every table and log line (step 0 is the first; a checkpoint "at step N" holds
the state after N steps, the one step N starts from).

Boundary: recording only; the flow decides what happens (flows/job/rl_job.py) and the job's rules
are nereus_core.job's. Timing: a task times its model-stages as spans (tasks/spans.py) that the
step reads into a ``TaskCall``'s timed rows; ``task_call`` times a Prefect task call from outside (its
rows get the task's orchestration overhead), ``plain`` times a driver-side call, ``record_call``
records a task call timed elsewhere (one of a phase's pools, run at once), ``reused`` records a
stage whose result another's stood in for (no time), ``phase`` times a phase
(``nereus_core.plan.PHASES``: generation, the forward passes, the train stages) from its first
task's start to its last one's end.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from prefect import get_run_logger
from prefect.artifacts import create_table_artifact

from flows.job.step_report import step_table
from flows.job.tracking import (
    ProgressBar,
    Trackers,
    flat_params,
    progress_bar,
    step_metrics,
    transition_metrics,
)
from nereus_core.config import NereusConfig
from nereus_core.controller.decide import Decision, TransitionTiming
from nereus_core.cost.transition_cost import TRANSITION_TERMS, TransitionEstimate
from nereus_core.job import JobState, Switch
from nereus_core.plan import layouts_json
from storage.run_dir import STEPS_TABLE, TRANSITIONS_TABLE, RunDir

HISTORY_TABLE = "metrics/history.parquet"
LENGTH_STATS = ("response_len_mean", "response_len_max", "response_clip_frac")  # rollout.length_stats
TERMS = TRANSITION_TERMS  # the order of TransitionEstimate.terms
VERIFIED = ("verified_bitwise", "verified_max_diff")
# actor/generate's vLLM engines rebuilt by a switch (flows/job/engine_switch.py)
ENGINE_REBUILD = ("engine_rebuild_s", "engine_start_s", "engine_verified", "engine_probe_logp_diff_max")
CHECKPOINT_ATTEMPTS = 2  # a checkpoint that fails is tried once more
CHECKPOINT_ERROR_CHARS = 300  # the history line keeps this much of a failed attempt's error


def past_transitions(rows: list[dict[str, Any]]) -> list[TransitionTiming]:
    """The committed switches of ``rows`` (metrics/transitions.parquet) as the controller calibrates on
    them: the prediction's unscaled terms and the seconds it took (rows without terms are skipped)."""
    out = []
    for r in rows:
        # wire, ops and durable were recorded from the first; a term added later reads as 0 in older rows
        terms = [r.get(f"predicted_{k}_s", None if k in TERMS[:3] else 0.0) for k in TERMS]
        if r.get("status") != "committed" or None in terms or not r.get("actual_s") or not sum(terms):
            continue
        estimate = TransitionEstimate(
            seconds=float(r["predicted_cost_s"]),
            **{f"{k}_s": float(t) for k, t in zip(TERMS, terms, strict=True)},
            critical_bytes=0,
            transfers=0,
            analytic=False,
        )
        out.append(TransitionTiming(predicted=estimate, seconds=float(r["actual_s"])))
    return out


class QuietCompletedTasks(logging.Filter):
    """Drops the per-task "Finished in state Completed()" line during the steps: it costs ~3 ms a task
    here (console and API) and says nothing the step table does not. Failures, retries and every
    other task log still pass; the UI still shows every task run and its state."""

    def filter(self, record: logging.LogRecord) -> bool:
        done = str(record.msg).startswith("Finished in state Completed")
        return not (record.levelno == logging.INFO and done)


class TimedRow(NamedTuple):
    """One row of the steps table as a task call measured it: a model's stage (``generate``,
    ``infer``, ``train``, ``sync``, ...), its tokens, its seconds inside the task (a span's) and (when
    the span says) its start."""

    model: str
    stage: str
    tokens: int
    seconds: float
    started: float | None = None  # time.perf_counter() when it began; None: when the call did


@dataclass
class TaskCall:
    """The rows one task call ran: ``add(model, stage, tokens, seconds inside[, started])``."""

    rows: list[TimedRow] = field(default_factory=list)

    def add(self, model: str, stage: str, tokens: int, seconds: float, started: float | None = None) -> None:
        self.rows.append(TimedRow(model, stage, tokens, seconds, started))


class JobRecords:
    """The run's tables, kept in memory and rewritten after every change (they are small)."""

    def __init__(self, run: RunDir, *, first_step: int = 0, config: NereusConfig | None = None) -> None:
        self.run, self.t0, self.first_step = run, time.perf_counter(), first_step
        self.rows = [r for r in run.read_rows(STEPS_TABLE) if r["step"] < first_step]
        self.history = [h for h in run.read_rows(HISTORY_TABLE) if h["step"] < first_step]
        self.transitions = run.read_rows(TRANSITIONS_TABLE) if first_step else []
        self.task_overheads: list[float] = []  # per Prefect task call: its time outside its stages
        self.checkpoint_s = 0.0
        self.in_flight: Any = None  # a checkpoint being written in the background (flows/job/checkpoints.py)
        # Run time of the kept steps before this driver took over (0 on a fresh run).
        self.before_s = float(self.history[-1].get("run_s") or 0.0) if self.history else 0.0
        self.config = config
        self.console = config is None or "console" in config.trainer.logger
        self.trackers: Trackers = Trackers([])
        self.progress: ProgressBar | None = None
        self._phase: str | None = None  # the phase running now (its rows name it)
        self._phases: dict[str, float] = {}  # this step's phases: their wall times
        self._pools: dict[str, int] = {}  # and how many pools ran at once in each

    @contextmanager
    def tracking(self) -> Iterator[None]:
        """The trackers of ``trainer.logger`` and the progress bar, open while the steps run."""
        if self.config is not None:
            cfg = self.config
            params = flat_params(cfg.model_dump(mode="json"))
            names = cfg.trainer.logger
            self.trackers = Trackers.open(
                names, self.run.root, cfg.trainer.project_name, self.run.root.name, params
            )
            self.progress = progress_bar(cfg.job.steps, self.first_step)
        failed = True
        try:
            yield
            failed = False
        finally:
            self.trackers.close(failed)
            if self.progress is not None:
                self.progress.close()

    def _row(self, step: int, plan_id: str, timed: TimedRow | tuple, start: float, outer: float) -> None:
        timed = TimedRow(*timed)  # a plain (model, stage, tokens, seconds) too
        self.rows.append(
            {
                "step": step,
                "model": timed.model,
                "stage": timed.stage,
                "plan_id": plan_id,
                "phase": self._phase,
                "start_s": (start if timed.started is None else timed.started) - self.t0,
                "duration_s": timed.seconds,
                "tokens": timed.tokens,
                "task_overhead_s": outer - timed.seconds,  # Prefect's share: the task call minus its body
            }
        )

    def record_call(self, step: int, plan_id: str, call: TaskCall, start: float, outer: float) -> None:
        """A Prefect task call that took ``outer`` seconds from ``start`` (``time.perf_counter``); its
        orchestration overhead is split evenly over its rows."""
        inside = sum(r.seconds for r in call.rows)
        self.task_overheads.append(outer - inside)
        share = (outer - inside) / max(len(call.rows), 1)
        for timed in call.rows:
            self._row(step, plan_id, timed, start, timed.seconds + share)

    @contextmanager
    def task_call(self, step: int, plan_id: str) -> Iterator[TaskCall]:
        """Time a Prefect task call from outside (``record_call``)."""
        call, start = TaskCall(), time.perf_counter()
        yield call
        self.record_call(step, plan_id, call, start, time.perf_counter() - start)

    @contextmanager
    def plain(self, step: int, plan_id: str, model: str, stage: str, tokens: int) -> Iterator[None]:
        """Time a driver-side call as a row (no task overhead)."""
        start = time.perf_counter()
        yield
        seconds = time.perf_counter() - start
        self._row(step, plan_id, TimedRow(model, stage, tokens, seconds), start, seconds)

    def reused(self, step: int, plan_id: str, model: str, stage: str, tokens: int) -> None:
        """A model's stage the step did not run because another's result is the same (the actor's old
        log-probs: its train step's own, ``Algorithm.reuses_old_logp``): a row of 0 seconds marked
        ``reused``, which the step's table shows instead of a time."""
        now = time.perf_counter()
        self._row(step, plan_id, TimedRow(model, stage, tokens, 0.0), now, 0.0)
        self.rows[-1]["reused"] = True

    @contextmanager
    def phase(self, kind: str, pools: int = 1) -> Iterator[None]:
        """Time one phase of the step (``pools`` of its stages' pools running at once); the rows
        recorded inside it name it."""
        start, self._phase = time.perf_counter(), kind
        try:
            yield
        finally:
            self._phase = None
        self._phases[kind] = self._phases.get(kind, 0.0) + time.perf_counter() - start
        self._pools[kind] = max(self._pools.get(kind, 0), pools)

    def step_rows(self, step: int) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["step"] == step]

    def finish_step(self, stats: dict[str, Any], wall_s: float, steps: int) -> None:
        """The step's rows, table, artifact and history line."""
        start, step = time.perf_counter(), stats["step"]
        rows = self.step_rows(step)
        inside = sum(r["duration_s"] for r in rows)
        busy = busy_s(rows)  # == inside unless stages ran at once (a phased plan)
        lengths = {k: stats[k] for k in LENGTH_STATS if k in stats}
        for r in rows:
            r["step_wall_s"] = wall_s
            r.update(lengths)  # the step's response lengths beside its stage times
        stats.update(wall_s=wall_s, stage_s=inside, overhead_s=wall_s - busy)
        stats.update({f"phase_{k}_s": v for k, v in self._phases.items()})
        stats.update({f"phase_{k}_pools": n for k, n in self._pools.items()})
        self._phases, self._pools = {}, {}
        stats["run_s"] = self.before_s + time.perf_counter() - self.t0
        self.run.write_rows(STEPS_TABLE, self.rows)
        note = f"Stage timings of step {step} (wall {wall_s:.3f} s, overhead {wall_s - busy:.3f} s)"
        level = logging.INFO if self.console else logging.DEBUG
        get_run_logger().log(level, "step %d (of 0-%d)\n%s", step, steps - 1, step_table(rows, stats))
        create_table_artifact(
            key="nereus-step-timings",
            table=[
                {k: rounded(r[k]) for k in ("step", "model", "stage", "duration_s", "tokens")} for r in rows
            ],
            description=note,
        )
        self.trackers.log(step_metrics(stats, rows), step)
        if self.progress is not None:
            self.progress.update(stats)
        stats["bookkeeping_s"] = time.perf_counter() - start  # the trackers' time included
        self.history.append(stats)
        self.run.write_rows(HISTORY_TABLE, self.history)

    def probes_ran(self, step: int, timings: Sequence[Any], seconds: float) -> None:
        """The probes run after ``step`` (``tasks.probes``) in its history line: ``probe_s``, the
        seconds they held the job up, and ``probes``, each ``stage@tp<degree>: seconds``."""
        row = next((h for h in reversed(self.history) if h["step"] == step), None)
        if row is not None:
            what = (f"{t.request.stage}@tp{t.request.tp}: {t.seconds:.4f} s" for t in timings)
            row.update(probe_s=row.get("probe_s", 0.0) + seconds, probes="; ".join(what))
            self.run.write_rows(HISTORY_TABLE, self.history)

    def checkpoint_outcome(self, step: int, errors: list[str], attempts: int) -> None:
        """The periodic checkpoint after ``step`` in its history line (``errors``: its failed attempts'
        of at most ``attempts``): ``checkpoint_attempts``, ``checkpoint_failed`` (none was written) and
        the last failed attempt's ``checkpoint_error``. The run goes on either way."""
        failed = len(errors) >= attempts
        row = next(h for h in reversed(self.history) if h["step"] == step)
        row.update(
            checkpoint_attempts=len(errors) + (not failed),
            checkpoint_failed=failed,
            checkpoint_error=errors[-1][:CHECKPOINT_ERROR_CHARS] if errors else None,
        )
        self.run.write_rows(HISTORY_TABLE, self.history)
        if failed:
            get_run_logger().warning(
                "no checkpoint at step %d after %d attempts; the run goes on, the previous checkpoint "
                "stays the resume point (metrics/history.parquet: checkpoint_failed)",
                step + 1,
                attempts,
            )

    def transition(
        self,
        transition_id: str,
        step: int,
        state: JobState,
        switch: Switch,
        stats: dict[str, Any],
        status: str,
    ) -> dict[str, Any]:
        """Record a switch's outcome (``stats``: the transition subflow's figures and the checkpoint's)."""
        d: Decision = switch.decision
        predicted = d.transition
        row = {
            "transition_id": transition_id,
            "step": step,
            "from_plan_id": state.plan_id,
            "to_plan_id": switch.plan_id,
            "reason": "; ".join(filter(None, (switch.reason, stats.get("note")))),
            "forced": d.forced,
            "predicted_gain_s": d.gain_per_step_s * d.horizon_steps,
            "predicted_cost_s": predicted.seconds if predicted else 0.0,
            "actual_s": stats.get("seconds", 0.0),
            # The prediction's unscaled terms: what calibration fits, read back on resume.
            **{
                f"predicted_{k}_s": v
                for k, v in zip(TERMS, predicted.terms if predicted else (0.0,) * len(TERMS), strict=True)
            },
            "bytes_moved": int(stats.get("bytes_moved", 0)),
            "status": status,
            "route": stats.get("route", ""),
            "checkpoint_s": stats.get("checkpoint_s", 0.0),
            # The parts of actual_s (the decision to the next step; the rest: the engines' rebuild)
            "recovery": stats.get("recovery", ""),
            "recovery_s": stats.get("recovery_s", 0.0),
            "staged_in_place": stats.get("staged_in_place", ""),  # written from kept shards, no copy
            "verify_s": stats.get("verify_s", 0.0),
            "moves_s": stats.get("moves_s", 0.0),
            "retire_s": stats.get("retire_s", 0.0),
            "rollback_s": stats.get("rollback_s", 0.0),  # a failed live switch undone in memory
            "gtg_critical_path_s": stats.get("gtg_critical_path_s", 0.0),
            "devices": switch.devices,
            "recorded_at": time.time(),
            **{k: stats[k] for k in (*VERIFIED, *ENGINE_REBUILD) if k in stats},
        }
        self.transitions.append(row)
        self.run.write_rows(TRANSITIONS_TABLE, self.transitions)
        if status == "committed":  # plans/ holds every plan the run used (the run directory's contract)
            self.run.write_plan(switch.plan_id, layouts_json(switch.layouts))
        self.trackers.log(transition_metrics(row), step)
        keys = ("transition_id", "status", "route", "reason", "predicted_cost_s", "actual_s", "bytes_moved")
        keys += tuple(f"predicted_{k}_s" for k in TERMS)
        create_table_artifact(
            key="nereus-transitions",
            table=[{k: rounded(t.get(k)) for k in keys} for t in self.transitions],
            description="Plan switches of this run so far (metrics/transitions.parquet)",
        )
        return row

    def summary(self, state: JobState, wall_s: float, fit: dict[str, Any]) -> dict[str, Any]:
        history = self.history
        k = min(5, len(history))
        mean = lambda key, part: sum(h[key] for h in part) / len(part)  # noqa: E731
        walls = sum(h["wall_s"] for h in history)
        return {
            "status": "completed",
            "steps": len(history),
            "steps_after_resume": len(history) - self.first_step if self.first_step else None,
            "wall_s": wall_s,  # this driver's (since it opened the run)
            "run_s": self.before_s + wall_s,  # and the kept steps' before a resume
            "reward_first": mean("score", history[:k]),
            "reward_last": mean("score", history[-k:]),
            "score_first": mean("rule_score", history[:k]),
            "score_last": mean("rule_score", history[-k:]),
            "transitions": sum(t["status"] == "committed" for t in self.transitions),
            "transition_s_total": sum(t["actual_s"] for t in self.transitions),
            "final_plan_id": state.plan_id,
            "tokens_per_s": sum(h["tokens"] for h in history) / walls,
            "overhead_frac": sum(h["overhead_s"] for h in history) / walls,
            "snapshot_s": self.checkpoint_s,
            # After each step: its table to the logger, the Prefect artifact, the tables (not in step walls).
            "bookkeeping_median_s": statistics.median(h["bookkeeping_s"] for h in history),
            "task_overhead_median_s": statistics.median(self.task_overheads) if self.task_overheads else None,
            "reward_fit": {"first_mse": fit.get("first_loss"), "last_mse": fit.get("last_loss")},
            "history": history,
        }


def busy_s(rows: list[dict[str, Any]]) -> float:
    """Seconds in which some stage of ``rows`` ran: the union of their ``[start_s, start_s +
    duration_s]`` intervals (stages of one phase's pools run at once and count once)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted((r["start_s"], r["start_s"] + r["duration_s"]) for r in rows):
        total += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return total


def rounded(value: Any, digits: int = 4) -> Any:
    """A float to ``digits`` significant digits (artifacts are read by people); anything else as is."""
    if not isinstance(value, float) or value == 0.0 or not math.isfinite(value):
        return value
    return round(value, digits - 1 - math.floor(math.log10(abs(value))))


DECISION_INFO_CHARS = 120  # the INFO line's reason is cut here; the whole of it is at DEBUG


def log_decision(decision: Decision, step: int) -> None:
    """The controller's decision in one short INFO line; its numbers and rejected alternatives at DEBUG."""
    logger = get_run_logger()
    reason = decision.reason
    if len(reason) > DECISION_INFO_CHARS:
        reason = reason[: DECISION_INFO_CHARS - 3] + "..."
    forced = " (forced)" if decision.forced else ""
    logger.info("controller after step %d: %s%s: %s", step, decision.action, forced, reason)
    cost = decision.transition.seconds if decision.transition else 0.0
    logger.debug(
        "  %s; gain %.4g s/step x %d steps vs cost %.4g s; decided in %.1f ms",
        decision.reason,
        decision.gain_per_step_s,
        decision.horizon_steps,
        cost,
        decision.elapsed_s * 1000,
    )
    for alt in decision.alternatives[:3]:
        logger.debug("  rejected %s: %s (%s)", alt.plan_id, alt.reason, alt.detail)


def done_line(summary: dict[str, Any]) -> str:
    """The run's last line: every step it made and its whole run time, a resume's share named."""
    steps, after = summary["steps"], summary.get("steps_after_resume")
    what = f"{steps} steps, {after} of them after the resume," if after is not None else f"{steps} steps"
    first, last = summary["score_first"], summary["score_last"]
    return f"done: {what} in {summary['run_s']:.1f} s; rule score {first:.3f} -> {last:.3f}"
