"""The simulation flow: what `nereus simulate CONFIG --out DIR` does.

    CONFIG --parse_sim_config--> SimConfig
           --load_traces (task)--> one Trace per trace (data/traces/*.csv)
           --> jobs: traces x their strategies x seeds
           --> SweepCluster: in this process (small sweeps), a Dask LocalCluster of a few
               single-threaded workers, or an existing scheduler (sweep.scheduler_address)
           --> simulate_run (task) per job, submitted together; each runs
               nereus_core.sim.job.run_job here or on a Dask worker
           --> build_summary --> write_outputs (task): summary.json, steps.parquet,
               plans.json, timing.json, plots/

summary.json: the job (algorithm, group_size, its model-stages), per trace its devices
and steps, per strategy the mean over seeds of mean_step_s, throughput_tokens_per_s,
transitions, transition_s_total, transition_overhead_frac (and the controller's share,
retunes, per-seed values; nereus_core/sim/results.py defines each), and ``compare``: the
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
from prefect.runtime import flow_run as prefect_flow_run
from prefect.task_runners import ThreadPoolTaskRunner

from nereus_core.config import ConfigError
from nereus_core.sim.config import SimConfig, parse_sim_config
from nereus_core.sim.job import SimJob
from nereus_core.sim.results import build_summary
from nereus_core.sim.trace import Trace
from tasks.sim_tasks import SweepCluster, load_traces, simulate_run, write_outputs


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


@flow(name="nereus-simulate", log_prints=False)
def simulate_flow(config: SimConfig, config_dir: str, out_dir: str) -> dict[str, Any]:
    """Replay every trace of ``config`` through its strategies and seeds; write the outputs to ``out_dir``."""
    logger = get_run_logger()
    started = time.perf_counter()
    traces = load_traces(config, config_dir)
    jobs = [
        SimJob(config, traces[spec.name], strategy, seed)
        for spec in config.traces
        for strategy in config.strategies_for(spec)
        for seed in config.seeds
    ]
    with SweepCluster(config.sweep, len(jobs)) as cluster:
        where = f"Dask at {cluster.address}" if cluster.address else "this process"
        logger.info("%d runs (%d traces) on %s", len(jobs), len(traces), where)
        futures = [simulate_run.submit(job, cluster.address) for job in jobs]
        results = [f.result() for f in futures]
    info = {
        name: {
            "steps": t.steps,
            "devices_min": int(t.devices.min()),
            "devices_max": int(t.devices.max()),
            "file": next(s.file for s in config.traces if s.name == name),
        }
        for name, t in traces.items()
    }
    summary = build_summary(
        ((r.trace, r.strategy, r.seed, r.summary) for r in results),
        traces=info,
        adaptive=_header(config)["adaptive"],
        header=_header(config),
    )
    write_outputs(out_dir, results, summary, time.perf_counter() - started)
    logger.info("wrote %s in %.1f s", out_dir, time.perf_counter() - started)
    return summary


def run_simulation(config_path: Path, out_dir: Path) -> dict[str, Any]:
    """Read the config and run the flow, with as many task threads as runs can be in flight."""
    config = read_sim_config(config_path)
    config_dir = str(config_path.resolve().parent)
    check_groups(config, load_traces.fn(config, config_dir))  # bad traces fail here, before Prefect starts
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
