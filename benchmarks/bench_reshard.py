"""Reshard a 70M-parameter model on the CPU device pool: live vs durable vs a checkpoint restart (JSON out).

One run measures, side by side on the same machine and pool:

- the machine's limits: memcpy bandwidth of one device worker (warm buffers, and a copy into
  fresh memory, which pays the page faults a new shard pays) and torch.distributed (gloo)
  point-to-point bandwidth between two device workers;
- per scenario (tp2 -> tp4, tp2/pp2 -> tp4/pp1; an inference stage, so parameters only):
  the live path, the durable path (Arrow snapshot under a temporary run dir), and the
  baseline a user has today: assemble the full state on the driver, ``torch.save`` it, close
  the pool, start a new one, ``torch.load``, and load the model on the new layout from it;
- with ``--train`` (default) also tp2 -> tp4 of a train stage (AdamW moments and step move too).

Where the live path's time goes: ``call_s`` is the end-to-end time outside the devices
(planning on the driver, the call to the actors), ``prepare_s`` allocating the new shard and
posting its receives, then reading the old pieces, packing and posting the sends, ``exchange_s``
the local copies and the messages, ``install_s`` making the new shard resident. ``--compare-thp``
runs the live parameter-only reshards on a second pool whose workers back large tensors with
transparent huge pages, interleaved repeat by repeat with the first so that the machine's load
hits both alike.
Every reshard is checked bit for bit against the seeded weights. Ratios: baseline/live, and
the live path's bytes moved per second against the measured point-to-point bandwidth: end to
end (``vs_p2p``), on the devices (``device_vs_p2p``: allocating the new stage, the exchange,
installing) and in the exchange alone; and the transfer floor of each plan (its bytes per
device pair moved at once as warm contiguous buffers, all pairs sharing the cores as in the
reshard) over the live path's device time. Before measuring, one small reshard per worker pays
the first-use costs (imports, DeepSpeed's first engine, the new groups' gloo connections),
as a running job has. Live figures are
medians of ``--repeats`` round trips (old -> new -> old; all seconds listed), the durable path
and the baseline run once each; the load average is reported with them, since on a shared
machine other work competes for the same cores. ``--thp`` backs the workers' large tensors
with transparent huge pages (torch's ``THP_MEM_ALLOC_ENABLE``): a new shard's memory is
faulted in several times faster.

    python -m benchmarks.bench_reshard [--repeats 3] [--no-train] [--no-baseline] [--thp | --compare-thp]
                                       [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.link_probes import p2p_probe, pattern_probe, plan_traffic
from nereus_core.config import ModelConfig
from nereus_core.emu import plan_reshard, shard_map
from nereus_core.engine.device import DeviceContext
from nereus_core.engine.shard import OptimizerSettings
from nereus_core.layout import Layout
from nereus_core.model.weights import init_full_state, param_shapes
from tasks import model_ops
from tasks.reshard import reshard
from tasks.runtime.device_pool import DevicePool

ROOT = Path(__file__).resolve().parents[1]

CONFIG = ModelConfig(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=12,
    num_attention_heads=8,
    num_key_value_heads=4,
    seed=11,
)
ADAMW = OptimizerSettings(lr=1e-4, eps=1e-6)
SCENARIOS = {
    "tp2_to_tp4": (Layout.contiguous(tp=2), Layout.contiguous(tp=4)),
    "tp2pp2_to_tp4": (Layout.contiguous(tp=2, pp=2, micro_batches=2), Layout.contiguous(tp=4)),
}
PROBE_BYTES = 256 * 2**20


# ------------------------------------------------------------------ device-side probes


def memcpy_probe(ctx: DeviceContext, nbytes: int, repeats: int = 5) -> dict[str, float]:
    """This worker's copy bandwidth (bytes/s): into a warm buffer, and into fresh memory (clone)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src).fill_(0.0)
    warm, fresh = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        warm.append(time.perf_counter() - start)
        start = time.perf_counter()
        clone = src.clone()
        fresh.append(time.perf_counter() - start)
        del clone
    return {"warm": nbytes / statistics.median(warm), "fresh": nbytes / statistics.median(fresh)}


# ------------------------------------------------------------------------ driver


def transfer_floor(pool: DevicePool, old: Layout, new: Layout, *, train: bool) -> float:
    """``pattern_probe`` of the plan old -> new: its bytes per device pair, moved as raw buffers (its
    same-device copies left out); the slowest device's seconds."""
    plan = plan_reshard(shard_map(CONFIG, old, train=train), shard_map(CONFIG, new, train=train))
    pairs, _ = plan_traffic(plan)
    devices = sorted({d for pair in pairs for d in pair})
    return max(pool.run_on(devices, pattern_probe, pairs=pairs, local={}, repeats=3))


def _check(pool: DevicePool, layout: Layout, name: str, expected: dict[str, torch.Tensor]) -> bool:
    got = model_ops.full_state(pool, layout, name=name, config=CONFIG)
    return set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in expected)


def _figures(stats: dict[str, Any]) -> dict[str, Any]:
    out = {k: (round(v, 4) if isinstance(v, float) and k != "seconds" else v) for k, v in stats.items()}
    out["bytes_per_s"] = round(stats["bytes_moved"] / stats["seconds"])
    return out


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per key, the median over runs (the run with the median ``seconds`` for non-numbers)."""
    middle = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]
    out = {}
    for key, value in middle.items():
        numbers = isinstance(value, float | int) and not isinstance(value, bool)
        out[key] = statistics.median(r[key] for r in runs) if numbers else value
    out["seconds_all"] = [round(r["seconds"], 4) for r in runs]
    return out


def bench_paths(
    pool: DevicePool,
    old: Layout,
    new: Layout,
    expected: dict[str, torch.Tensor],
    *,
    train: bool,
    repeats: int,
) -> dict[str, Any]:
    """Live old -> new and back ``repeats`` times (medians), then durable old -> new; all checked bitwise."""
    name = "bench/train" if train else "bench/infer"
    optimizer = ADAMW if train else None
    model_ops.load_model(pool, old, name=name, config=CONFIG, optimizer=optimizer)
    out: dict[str, Any] = {}
    try:
        if train:  # one step, so that there are moments to move (the weights are no longer the seed's)
            ids = torch.randint(0, CONFIG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
            model_ops.train(pool, old, {"ids": ids}, name=name)
            expected = model_ops.full_state(pool, old, name=name, config=CONFIG)
        runs, back = [], []
        for _ in range(repeats):
            runs.append(reshard(pool, name, CONFIG, old, new, optimizer=optimizer))
            back.append(reshard(pool, name, CONFIG, new, old, optimizer=optimizer))
        out["live"], out["live_back"] = _figures(_median(runs)), _figures(_median(back))
        out["live"]["bitwise_equal"] = _check(pool, old, name, expected)  # after repeats round trips
        with tempfile.TemporaryDirectory(prefix="bench-reshard-") as run_dir:
            kwargs = {"path": "durable", "optimizer": optimizer, "run_dir": run_dir}
            out["durable"] = _figures(reshard(pool, name, CONFIG, old, new, **kwargs))
            out["durable"]["bitwise_equal"] = _check(pool, new, name, expected)
    finally:
        for layout in (old, new):
            model_ops.unload_model(pool, layout, name=name)
    return out


def bench_env(
    pool: DevicePool, devices: int, expected: dict[str, torch.Tensor], repeats: int, env: dict[str, str]
) -> dict[str, Any]:
    """Live parameter-only reshards on ``pool`` and on a pool whose workers get ``env``, interleaved
    round trip by round trip; the medians of each (``live_plain``, ``live_thp``: the other pool)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # inherited by the second pool's worker processes
    try:
        thp = DevicePool(devices)
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v
    out: dict[str, Any] = {}
    try:
        warm_up(thp)
        for key, (old, new) in SCENARIOS.items():
            runs: dict[str, list[dict[str, Any]]] = {"live_plain": [], "live_thp": []}
            for p in (pool, thp):
                model_ops.load_model(p, old, name="bench/infer", config=CONFIG)
            for _ in range(repeats):
                for which, p in (("live_plain", pool), ("live_thp", thp)):
                    runs[which].append(reshard(p, "bench/infer", CONFIG, old, new))
                    reshard(p, "bench/infer", CONFIG, new, old)
            out[key] = {w: _figures(_median(r)) for w, r in runs.items()}
            for which, p in (("live_plain", pool), ("live_thp", thp)):
                out[key][which]["bitwise_equal"] = _check(p, old, "bench/infer", expected)
                model_ops.unload_model(p, old, name="bench/infer")
    finally:
        thp.close()
    return out


def bench_baseline(
    pool: DevicePool, old: Layout, new: Layout, devices: int
) -> tuple[dict[str, Any], DevicePool]:
    """Checkpoint restart: driver-assembled full state, torch.save, close, new pool, torch.load, load."""
    name = "bench/infer"
    model_ops.load_model(pool, old, name=name, config=CONFIG)
    parts: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
        path = Path(tmp) / "full_state.pt"
        start = time.perf_counter()
        full = model_ops.full_state(pool, old, name=name, config=CONFIG)
        parts["assemble_s"] = time.perf_counter() - start
        torch.save(full, path)
        parts["save_s"] = time.perf_counter() - start - sum(parts.values())
        del full
        pool.close()
        parts["stop_s"] = time.perf_counter() - start - sum(parts.values())
        pool = DevicePool(devices)
        parts["start_s"] = time.perf_counter() - start - sum(parts.values())
        full = torch.load(path)
        parts["load_s"] = time.perf_counter() - start - sum(parts.values())
        model_ops.load_model(pool, new, name=name, config=CONFIG, full_state=full)
        parts["shard_s"] = time.perf_counter() - start - sum(parts.values())
        seconds = time.perf_counter() - start
        size = path.stat().st_size
    model_ops.unload_model(pool, new, name=name)
    out = {
        "seconds": round(seconds, 3),
        "checkpoint_bytes": size,
        **{k: round(v, 3) for k, v in parts.items()},
    }
    return out, pool


def warm_up(pool: DevicePool) -> float:
    """First use on each worker: imports, DeepSpeed's first engine, the groups' connections (seconds)."""
    start = time.perf_counter()
    tiny = ModelConfig(num_attention_heads=8, num_key_value_heads=4)
    old, new = Layout.contiguous(tp=2), Layout.contiguous(tp=4)
    model_ops.load_model(pool, old, name="warm-up", config=tiny, optimizer=ADAMW)
    reshard(pool, "warm-up", tiny, old, new, optimizer=ADAMW)
    model_ops.unload_model(pool, new, name="warm-up")
    return time.perf_counter() - start


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--train", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--baseline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the checkpoint restart (a new pool per scenario)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="live round trips per scenario (medians)")
    parser.add_argument(
        "--thp",
        action="store_true",
        help="THP_MEM_ALLOC_ENABLE=1 for the workers: torch backs large tensors with huge pages",
    )
    parser.add_argument(
        "--compare-thp",
        action="store_true",
        help="also run the parameter-only live reshards on a pool with THP workers, interleaved",
    )
    parser.add_argument(
        "--compare-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="as --compare-thp, the second pool's workers with these environment variables instead",
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    return parser


def _measure(pool: DevicePool, args: argparse.Namespace, report: dict[str, Any]) -> float:
    """Every scenario's paths on ``pool`` into ``report``; returns one pair's p2p bytes per second."""
    expected = init_full_state(CONFIG)
    report["machine"]["warm_up_s"] = round(warm_up(pool), 1)
    mem = pool.run_on([0], memcpy_probe, nbytes=PROBE_BYTES)[0]
    p2p = pool.run_on([0, 1], p2p_probe, src=0, dst=1, nbytes=PROBE_BYTES, repeats=5)[1]
    report["limits"] = {
        "memcpy_bytes_per_s": round(mem["warm"]),
        "fresh_copy_bytes_per_s": round(mem["fresh"]),
        "p2p_bytes_per_s": round(p2p),
    }
    report["scenarios"] = {}
    for key, (old, new) in SCENARIOS.items():
        row = bench_paths(pool, old, new, expected, train=False, repeats=args.repeats)
        report["scenarios"][key] = row
        report["scenarios"][key]["transfer_floor_s"] = transfer_floor(pool, old, new, train=False)
    if args.train:
        old, new = SCENARIOS["tp2_to_tp4"]
        row = bench_paths(pool, old, new, expected, train=True, repeats=args.repeats)
        report["scenarios"]["tp2_to_tp4_train"] = row
        row["transfer_floor_s"] = transfer_floor(pool, old, new, train=True)
    if args.compare_thp or args.compare_env:
        env = dict(e.split("=", 1) for e in args.compare_env) or {"THP_MEM_ALLOC_ENABLE": "1"}
        report["machine"]["compared_env"] = env
        for key, rows in bench_env(pool, args.devices, expected, args.repeats, env).items():
            report["scenarios"][key]["live"] = rows["live_plain"]
            report["scenarios"][key]["live_thp"] = rows["live_thp"]
    return p2p


def _ratios(scenarios: dict[str, Any], p2p: float) -> None:
    """Each scenario's live reshards against one pair's bandwidth, the floor and the other paths."""
    for row in scenarios.values():
        for live in (row["live"], *([row["live_thp"]] if "live_thp" in row else [])):
            live["vs_p2p"] = round(live["bytes_per_s"] / p2p, 3)
            live["device_vs_p2p"] = round(live["bytes_moved"] / live["device_s"] / p2p, 3)
            live["exchange_vs_p2p"] = round(live["bytes_moved"] / live["exchange_s"] / p2p, 3)
            live["floor_over_device"] = round(row["transfer_floor_s"] / live["device_s"], 3)
            # Where the end-to-end time goes: the driver's planning and the call, the devices' phases.
            live["call_s"] = round(live["seconds"] - live["device_s"], 4)
        if "live_thp" in row:
            row["live_over_thp"] = round(row["live"]["seconds"] / row["live_thp"]["seconds"], 2)
        if "baseline" in row:
            row["baseline_over_live"] = round(row["baseline"]["seconds"] / live["seconds"], 1)
            row["baseline_over_durable"] = round(row["baseline"]["seconds"] / row["durable"]["seconds"], 1)


def main() -> None:
    args = _parser().parse_args()
    if args.thp:
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"  # inherited by the worker processes
    if args.compare_thp or args.compare_env:
        os.environ["NEREUS_WORKER_START"] = "spawn"  # each pool's workers in the environment of then
    started = time.perf_counter()
    params = sum(math.prod(s) for s in param_shapes(CONFIG).values())
    report: dict[str, Any] = {
        "model": {**CONFIG.model_dump(), "parameters": params, "bytes_fp32": params * 4},
        "machine": {
            "cpus": os.cpu_count(),
            "devices": args.devices,
            "thp_mem_alloc": os.environ.get("THP_MEM_ALLOC_ENABLE") == "1",
            "loadavg_start": os.getloadavg(),
        },
    }
    pool = DevicePool(args.devices)
    try:
        p2p = _measure(pool, args, report)
        for key, (old, new) in SCENARIOS.items() if args.baseline else ():
            report["scenarios"][key]["baseline"], pool = bench_baseline(pool, old, new, args.devices)
    finally:
        pool.close()
    _ratios(report["scenarios"], p2p)
    report["machine"]["loadavg_end"] = os.getloadavg()
    report["wall_s"] = round(time.perf_counter() - started, 1)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
