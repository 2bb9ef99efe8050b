"""The simulation flow: what `nereus simulate CONFIG --out DIR` does.

    CONFIG --parse_sim_config--> SimConfig
           --load_traces (task)--> one Trace per trace (data/traces/*.csv)
           --> jobs: traces x their strategies x seeds
           --> DIR's finished runs (storage.sim_dir; another config's DIR is refused): skipped
           --> SweepCluster: in this process (small sweeps), a Dask LocalCluster of a few
               single-threaded workers, or an existing scheduler (sweep.scheduler_address)
           --> simulate_run (task) per missing job, submitted together; each runs
               nereus_core.sim.job.run_job here or on a Dask worker and keeps it in DIR/runs/
           --> build_summary over every finished run --> write_outputs (task): summary.json,
               steps.parquet, plans.json, timing.json, plots/

A sweep stopped part-way (a signal, a lost worker) writes the summary of the runs finished so
far, with the others under ``missing``, and the same command finishes it: only the missing runs
run, and the summary is the one a sweep run straight through writes.

summary.json: the job (algorithm, group_size, its model-stages), per trace its devices
and steps, per strategy the mean over seeds of mean_step_s, throughput_tokens_per_s,
transitions, transition_s_total, transition_overhead_frac, checkpoint_s_total (periodic
checkpoints, each strategy's own cadence), lost_s_total (steps rerun after devices were lost),
relaunches and relaunch_s_total (the peers' restarts) (and the controller's share, retunes, per-seed
values; nereus_core/sim/results.py defines each), and ``compare``: the
adaptive strategy's throughput ratio and step-latency change against every other
strategy. Everything in it is deterministic in the config and seeds; wall time and the
controller's measured time go to timing.json.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import yaml
from prefect import flow, get_run_logger
from prefect.futures import as_completed
from prefect.runtime import flow_run as prefect_flow_run
from prefect.task_runners import ThreadPoolTaskRunner

from nereus_core.config import ConfigError
from nereus_core.sim.config import SimConfig, parse_sim_config
from nereus_core.sim.job import SimJob, SimResult
from nereus_core.sim.results import build_summary
from nereus_core.sim.trace import Trace
from storage.sim_dir import SimDir, run_file_key
from tasks.sim_tasks import RunLost, SweepCluster, load_traces, simulate_run, write_outputs


class SweepFailed(RuntimeError):
    """Runs of the sweep were lost (a dead worker, a lost cluster) after the others were written;
    ``str(err)`` is one line naming the first lost run and how to finish the sweep."""


def read_sim_config(path: Path) -> SimConfig:
    """The ``SimConfig`` in a YAML file; ``ConfigError`` with one line if it is missing or invalid."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError("no such file") from None
    except IsADirectoryError:
        raise ConfigError("is a directory, not a config file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read it: {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"not valid YAML: {' '.join(str(err).split())}") from None
    return parse_sim_config(data)


def check_groups(config: SimConfig, traces: dict[str, Trace]) -> None:
    """``ConfigError`` naming the first trace and step whose batch (the step's sequences) does not
    split into whole groups of ``algorithm.group_size`` responses per prompt (``batch_error``'s rule)."""
    for name, trace in traces.items():
        for k, batch in enumerate(trace.batch.tolist()):
            problem = config.algorithm.batch_error(int(batch), 1)
            if problem:
                raise ConfigError(f"traces.{name}: step {k}, column batch: {problem}")


def _header(config: SimConfig) -> dict[str, Any]:
    adaptive = next((n for n, s in config.strategies.items() if s.kind == "nereus"), None)
    m = config.model
    return {
        "name": config.name,
        "model": {
            "hidden_size": m.hidden_size,
            "layers": m.num_hidden_layers,
            "heads": m.num_attention_heads,
            "kv_heads": m.num_key_value_heads,
            "vocab": m.vocab_size,
        },
        "algorithm": config.algorithm.name,
        "group_size": config.algorithm.group_size,
        "stages": [str(s) for s in config.stages],
        "profile": config.profile,
        "seeds": list(config.seeds),
        "adaptive": adaptive,
        "noise": config.noise.model_dump(),
        "decision": config.decision.model_dump(),
    }


def sweep_identity(config: SimConfig, traces: dict[str, Trace]) -> dict[str, Any]:
    """What a sweep's runs are of, for telling its output directory from another sweep's: the config
    without ``sweep`` (where the runs execute changes none of them) and each trace's digest."""
    return {
        "config": config.model_dump(mode="json", exclude={"sweep"}),
        "traces": {name: t.digest() for name, t in sorted(traces.items())},
    }


def sweep_jobs(config: SimConfig, traces: dict[str, Trace]) -> list[SimJob]:
    """Every (trace, strategy, seed) run of the config, in the order of the summary and the tables."""
    return [
        SimJob(config, traces[spec.name], strategy, seed)
        for spec in config.traces
        for strategy in config.strategies_for(spec)
        for seed in config.seeds
    ]


def _file_key(job: SimJob) -> str:
    return run_file_key(job.trace.name, job.strategy, job.seed)


def _run_missing(cluster: SweepCluster, jobs: list[SimJob], out_dir: str) -> list[RunLost]:
    """Run ``jobs`` where ``cluster`` says, each kept in ``out_dir`` as it finishes; the runs lost."""
    logger = get_run_logger()
    logger.info(
        "%d runs on %s", len(jobs), f"Dask at {cluster.address}" if cluster.address else "this process"
    )
    futures = [simulate_run.submit(job, cluster.address, out_dir) for job in jobs]
    lost: list[RunLost] = []
    try:
        for future in as_completed(futures):
            try:
                future.result()
            except RunLost as err:
                logger.error("%s", err)
                lost.append(err)
    except BaseException:  # stopped: the runs not started yet never start
        for future in futures:
            future.wrapped_future.cancel()
        raise
    return lost


def _write_finished(
    config: SimConfig,
    traces: dict[str, Trace],
    jobs: list[SimJob],
    out_dir: str,
    started: float,
    *,
    stopping: bool = False,
) -> dict[str, Any]:
    """summary.json and the tables of every finished run of ``jobs`` (``missing``: the keys of the
    others); the summary. ``stopping``: written without a task run, which would ask Prefect's API."""
    sim_dir = SimDir(out_dir)
    finished = sim_dir.finished()
    results = [sim_dir.read_run(_file_key(j)) for j in jobs if _file_key(j) in finished]
    missing = [j.key for j in jobs if _file_key(j) not in finished]
    summary = sweep_summary(config, traces, results, missing)
    write = write_outputs.fn if stopping else write_outputs
    write(out_dir, results, summary, time.perf_counter() - started)
    return summary


def sweep_summary(
    config: SimConfig, traces: dict[str, Trace], results: list[SimResult], missing: list[str]
) -> dict[str, Any]:
    """summary.json's content for the finished ``results`` (in job order) and the ``missing`` runs."""
    info = {
        name: {
            "steps": t.steps,
            "devices_min": int(t.devices.min()),
            "devices_max": int(t.devices.max()),
            "file": next(s.file for s in config.traces if s.name == name),
        }
        for name, t in traces.items()
    }
    header = _header(config)
    summary = build_summary(
        ((r.trace, r.strategy, r.seed, r.summary) for r in results),
        traces=info,
        adaptive=header["adaptive"],
        header=header,
    )
    summary["missing"] = missing
    return summary


def _sweep(
    config: SimConfig,
    traces: dict[str, Trace],
    jobs: list[SimJob],
    todo: list[SimJob],
    out_dir: str,
    started: float,
) -> list[RunLost]:
    """Run ``todo`` on the sweep's cluster; the runs lost. Stopped (a signal, a cancellation), it
    writes the summary of every finished run of ``jobs`` before the cluster closes (a busy worker
    takes seconds to stop) and stops."""
    with SweepCluster(config.sweep, len(todo)) as cluster:
        try:
            return _run_missing(cluster, todo, out_dir)
        except BaseException:
            missing = _write_finished(config, traces, jobs, out_dir, started, stopping=True)["missing"]
            get_run_logger().warning(
                "stopped: %d of %d runs missing; the summary covers the rest", len(missing), len(jobs)
            )
            raise


@flow(name="nereus-simulate", log_prints=False)
def simulate_flow(config: SimConfig, config_dir: str, out_dir: str) -> dict[str, Any]:
    """Replay every trace of ``config`` through its strategies and seeds into ``out_dir``; runs
    finished there already are kept, not run again."""
    logger = get_run_logger()
    started = time.perf_counter()
    traces = load_traces(config, config_dir)
    jobs = sweep_jobs(config, traces)
    sim_dir = SimDir(out_dir)
    sim_dir.claim(sweep_identity(config, traces))
    finished = sim_dir.finished()
    todo = [j for j in jobs if _file_key(j) not in finished]
    if len(todo) < len(jobs):
        logger.info(
            "%d of %d runs finished in %s already; running the rest",
            len(jobs) - len(todo),
            len(jobs),
            out_dir,
        )
    lost = _sweep(config, traces, jobs, todo, out_dir, started) if todo else []
    summary = _write_finished(config, traces, jobs, out_dir, started)
    missing = summary["missing"]
    if lost:
        raise SweepFailed(
            f"{lost[0]}; {len(missing)} of {len(jobs)} runs are missing from {out_dir} "
            "(its summary covers the others); the same command runs only those"
        )
    logger.info("wrote %s in %.1f s", out_dir, time.perf_counter() - started)
    return summary


def check_sweep(config_path: Path, out_dir: Path) -> SimConfig:
    """The config, its traces and ``out_dir`` checked before Prefect starts: ``ConfigError`` with one
    line for a bad config or trace, or an ``out_dir`` that holds another sweep's runs."""
    config = read_sim_config(config_path)
    traces = load_traces.fn(config, str(config_path.resolve().parent))
    check_groups(config, traces)
    SimDir(out_dir).check(sweep_identity(config, traces))
    return config


def run_simulation(config_path: Path, out_dir: Path) -> dict[str, Any]:
    """Check the config and run the flow, with as many task threads as runs can be in flight."""
    config = check_sweep(config_path, out_dir)
    config_dir = str(config_path.resolve().parent)
    workers = config.sweep.workers if config.sweep.mode != "inprocess" else 1
    runner = ThreadPoolTaskRunner(max_workers=max(1, workers))
    return simulate_flow.with_options(task_runner=runner)(
        config=config, config_dir=config_dir, out_dir=str(out_dir)
    )


@flow(name="nereus-simulate-config")
def simulate_config(config: str = "examples/paper_sim.yaml", out_dir: str | None = None) -> dict[str, Any]:
    """The simulation of the config file ``config`` (a path from the working directory) into
    ``out_dir`` (default ``runs/sim-<flow run id>``): the entry point of the Prefect deployment."""
    out = out_dir or f"runs/sim-{str(prefect_flow_run.id)[:8]}"
    return run_simulation(Path(config), Path(out))
