"""Prefect tasks of the simulation, and the Dask cluster its runs fan out over.

- ``load_traces``: read each trace's CSV (a path relative to the config's folder, else to
  the working directory) and parse it (``nereus_core.sim.trace``).
- ``simulate_run``: one (trace, strategy, seed) run, ``nereus_core.sim.job.run_job``,
  either in this process or on a Dask worker of the sweep's cluster (by its address),
  kept in the output directory (``storage.sim_dir``) as soon as it is finished.
- ``write_outputs``: summary.json, steps.parquet, plans.json, timing.json and the plots.

``SweepCluster`` decides where the runs go: the shared ``tasks.runtime.cluster.DaskCluster``
(a LocalCluster of a few single-threaded worker processes on loopback, or a client of
an existing scheduler), or nothing when the sweep is small enough to run in the driver.
A run whose worker dies, or whose cluster is gone, raises ``RunLost`` naming it: a run is a
pure function of its job, so Dask does not run it again on another worker (allowed
failures 0) and the task does not retry it; the sweep goes on with the others.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from types import TracebackType

import matplotlib
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from nereus_core.config import ConfigError
from nereus_core.sim.config import SimConfig, SweepSettings
from nereus_core.sim.job import SimJob, SimResult, run_job
from nereus_core.sim.loop import TRANSITION_KINDS
from nereus_core.sim.trace import Trace, TraceError, parse_trace
from storage.sim_dir import SimDir
from tasks.runtime.cluster import Client, DaskCluster, FutureCancelledError, KilledWorker

_CLIENTS: dict[str, Client] = {}


def trace_path(file: str, config_dir: Path) -> Path:
    """A trace file as written in the config: absolute, else under the config's folder, else the cwd."""
    path = Path(file)
    if path.is_absolute():
        return path
    beside = config_dir / path
    return beside if beside.exists() else path


@task(cache_policy=NO_CACHE)
def load_traces(config: SimConfig, config_dir: str) -> dict[str, Trace]:
    """Every trace of the config, parsed; ``ConfigError`` with one line if one cannot be read."""
    out = {}
    for spec in config.traces:
        path = trace_path(spec.file, Path(config_dir))
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as err:
            raise ConfigError(f"traces.{spec.name}.file: cannot read {path}: {err.strerror or err}") from None
        try:
            out[spec.name] = parse_trace(
                text, name=spec.name, devices=spec.devices, steps=spec.steps, shrinks=spec.shrinks
            )
        except TraceError as err:
            raise ConfigError(f"traces.{spec.name}.file ({path}): {err}") from None
    return out


class SweepCluster:
    """Where the runs execute: ``address`` is None in-process, else a Dask scheduler's address."""

    def __init__(self, settings: SweepSettings, runs: int) -> None:
        self.settings, self.runs = settings, runs
        self.address: str | None = None
        self._cluster: DaskCluster | None = None

    @property
    def uses_dask(self) -> bool:
        s = self.settings
        if s.mode == "inprocess":
            return False
        return s.mode == "dask" or s.scheduler_address is not None or self.runs > s.inprocess_max

    def __enter__(self) -> SweepCluster:
        if not self.uses_dask:
            return self
        s = self.settings
        self._cluster = DaskCluster(
            min(s.workers, self.runs), s.scheduler_address, connect_timeout_s=30, allowed_failures=0
        )
        self.address = self._cluster.address
        _CLIENTS[self.address] = self._cluster.client
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.address is not None:
            _CLIENTS.pop(self.address, None)
        if self._cluster is not None:
            self._cluster.close()
            self._cluster = None


class RunLost(RuntimeError):
    """A run that did not finish because its Dask worker died or the sweep's cluster went away;
    ``str(err)`` is one line naming the run."""

    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"run {key} was lost: {why}")
        self.key = key


def execute(job: SimJob, scheduler: str | None) -> SimResult:
    """``run_job`` in this process (``scheduler`` None) or on a worker of the open sweep cluster."""
    if scheduler is None:
        return run_job(job)
    client = _CLIENTS.get(scheduler)
    if client is None:
        raise RunLost(job.key, f"the sweep's Dask cluster at {scheduler} is closed")
    try:
        return client.submit(run_job, job, key=f"sim-{job.key.replace('/', '-')}", pure=False).result()
    except KilledWorker:
        raise RunLost(job.key, "the Dask worker running it died") from None
    except (FutureCancelledError, OSError) as err:  # the client closed, the scheduler went away
        raise RunLost(job.key, f"the sweep's Dask cluster was lost ({type(err).__name__})") from None


@task(
    cache_policy=NO_CACHE, retries=0, task_run_name="simulate-{job.trace.name}-{job.strategy}-seed{job.seed}"
)
def simulate_run(job: SimJob, scheduler: str | None, out_dir: str) -> SimResult:
    """Simulate one (trace, strategy, seed), here or on the sweep's Dask cluster, and keep it in
    ``out_dir``."""
    result = execute(job, scheduler)
    SimDir(out_dir).write_run(result)
    s = result.summary
    get_run_logger().info(
        "%s: mean step %.3g s, %.4g tokens/s, %d transitions (%.3g s), %d controller calls",
        job.key,
        s["mean_step_s"],
        s["throughput_tokens_per_s"],
        s["transitions"],
        s["transition_s_total"],
        s["controller_calls"],
    )
    return result


def timing(results: list[SimResult], wall_s: float) -> dict:
    """Run-dependent figures, kept out of summary.json: wall time and the controller's measured time."""
    records = [r for res in results for r in res.records]
    calls = sum(r["decide_calls"] for r in records)
    single = [r["decide_wall_s"] for r in records if r["decide_calls"] == 1]
    return {
        "wall_s": round(wall_s, 2),
        "controller_calls": calls,
        "controller_wall_s_total": round(sum(r["decide_wall_s"] for r in records), 3),
        "controller_wall_ms_median": round(1e3 * statistics.median(single), 2) if single else None,
        "controller_wall_ms_max": round(1e3 * max(single), 2) if single else None,
    }


@task(cache_policy=NO_CACHE)
def write_outputs(out_dir: str, results: list[SimResult], summary: dict, wall_s: float) -> list[str]:
    """summary.json, steps.parquet, plans.json, timing.json and plots/*.png under ``out_dir``."""
    paths = SimDir(out_dir).write_tables(results, summary, timing(results, wall_s))
    rows = [r for res in results for r in res.records]
    paths += write_plots(Path(out_dir) / "plots", rows, summary)
    return [str(p) for p in paths]


def _step_time_plot(trace: str, rows: list[dict], path: Path) -> Path:
    """Step latency of every strategy over one trace (first seed), transitions marked, devices beside."""
    seed = min(r["seed"] for r in rows)
    mine = [r for r in rows if r["seed"] == seed]
    fig, (ax, dev) = plt.subplots(2, 1, figsize=(9, 6), sharex=True, height_ratios=(3, 1))
    for i, name in enumerate(sorted({r["strategy"] for r in mine})):
        runs = sorted((r for r in mine if r["strategy"] == name), key=lambda r: r["step"])
        color = f"C{i}"
        ax.plot([r["step"] for r in runs], [r["step_s"] for r in runs], color=color, lw=0.8, label=name)
        moves = [r for r in runs if r["move"] in TRANSITION_KINDS]
        ax.scatter(
            [r["step"] for r in moves], [r["step_s"] for r in moves], color=color, marker="v", s=30, zorder=3
        )
    ax.set_yscale("log")
    ax.set_ylabel("step latency (s)")
    ax.set_title(f"{trace}: step latency per strategy (triangles: transitions, relaunches), seed {seed}")
    ax.legend(fontsize=8)
    first = sorted((r for r in mine if r["strategy"] == mine[0]["strategy"]), key=lambda r: r["step"])
    dev.step([r["step"] for r in first], [r["devices"] for r in first], where="post", color="k")
    dev.set_ylabel("devices")
    dev.set_xlabel("step")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def _ratio_plot(summary: dict, path: Path) -> Path | None:
    """Throughput of the adaptive strategy over each other one, per cluster size (fixed-size traces)."""
    sizes: dict[int, dict[str, float]] = {}
    for info in summary["traces"].values():
        if info.get("devices_min") != info.get("devices_max") or not info.get("compare"):
            continue
        sizes[info["devices_max"]] = {k: v["throughput_ratio"] for k, v in info["compare"].items()}
    if not sizes:
        return None
    others = sorted({k for v in sizes.values() for k in v})
    order = sorted(sizes)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(others)
    for i, name in enumerate(others):
        xs = [j + i * width for j in range(len(order))]
        values = [sizes[n].get(name, float("nan")) for n in order]
        bars = ax.bar(xs, values, width=width, label=f"vs {name}")
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(order))], [str(n) for n in order])
    ax.set_xlabel("GPUs")
    ax.set_ylabel(f"throughput ratio ({summary.get('adaptive', 'adaptive')} / other)")
    ax.set_title("throughput ratio per cluster size")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def write_plots(out: Path, rows: list[dict], summary: dict) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for trace in summary["traces"]:
        mine = [r for r in rows if r["trace"] == trace]
        if mine:
            paths.append(_step_time_plot(trace, mine, out / f"step_time_{trace}.png"))
    ratio = _ratio_plot(summary, out / "throughput_ratios.png")
    return paths + ([ratio] if ratio else [])
