"""Weight sync of a 70M-parameter model on the CPU device pool: EMU reshard vs the driver path (JSON out).

After a train step the inference copy on another layout takes the new parameters. One run
measures, side by side on the same pool and model, per scenario (4 device workers):

- ``emu``: ``tasks.reshard.sync_copy``, device to device with the EMU reshard plan of the two
  layouts (the path a step takes);
- ``driver``: what a step did before: gather the full state to the driver
  (``model_ops.full_state``), push it to every device of the copy (``model_ops.push_weights``);
- ``link``: the busiest port (the device that sends or receives the most bytes in the plan) and
  that port's point-to-point bandwidth, measured with a plain gloo send/recv of the same number
  of bytes from its largest peer; ``link_fraction`` = those bytes / that bandwidth / EMU seconds
  (end to end, driver wall clock) and ``exchange_link_fraction`` (the slowest device's exchange);
  ``all_bytes_fraction``: all the plan's bytes at that one pair's rate over EMU seconds (the floor
  when the CPU cores, shared by every pair of loopback TCP, are the limit rather than one port);
- ``pattern``: the physical limit of the sync on this machine: the plan's bytes per pair as plain
  gloo messages of warm buffers, receives first, its same-device bytes copied meanwhile (no
  Nereus code); ``ceiling_link_fraction`` = the port's ideal seconds / pattern seconds (the most
  ``link_fraction`` can be here) and ``of_ceiling`` = pattern seconds / EMU seconds.

Scenarios: train tp2 on devices 0-1 -> generation tp1 dp2 on devices 2-3, train pp2 -> tp2 on
devices 2-3, and tp2 -> tp1 dp2 on the same devices 0-1 (colocated: half of every tensor is
already there and is copied locally). After each sync the copy is checked bit for bit against
the train stage. Each repeat runs the EMU sync, the driver path, the link probe and the pattern
one after another, so that the medians over ``--repeats`` (all values listed) share the machine's
conditions; the load average is reported with them, since on a shared machine other work takes
the same cores.

    python -m benchmarks.bench_weight_sync [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_reshard import ADAMW, CONFIG  # one 70M model for both benchmarks
from benchmarks.link_probes import p2p_probe, pattern_probe, plan_traffic
from nereus_core.config import ModelConfig
from nereus_core.emu import ReshardPlan, plan_reshard, shard_map
from nereus_core.layout import Layout
from nereus_core.model.weights import param_shapes
from tasks import model_ops
from tasks.reshard import gather_state, sync_copy
from tasks.runtime.device_pool import DevicePool

ROOT = Path(__file__).resolve().parents[1]

TRAIN, COPY = "bench/train", "bench/generate"
SCENARIOS = {
    "tp2_to_tp1dp2": (Layout.contiguous(tp=2), Layout(tp=1, pp=1, dp=2, devices=(2, 3))),
    "pp2_to_tp2": (Layout.contiguous(pp=2, micro_batches=2), Layout(tp=2, pp=1, dp=1, devices=(2, 3))),
    "tp2_to_tp1dp2_colocated": (Layout.contiguous(tp=2), Layout(tp=1, pp=1, dp=2, devices=(0, 1))),
}


def busiest_port(plan: ReshardPlan) -> dict[str, Any]:
    """The device that sends or receives the most bytes, those bytes, and its largest peer."""
    pair, _ = plan_traffic(plan)
    load = [(n, d, "sent") for d, n in plan.sent_bytes().items()]
    load += [(n, d, "received") for d, n in plan.received_bytes().items()]
    nbytes, device, way = max(load)
    src, dst = max((p for p in pair if device in p), key=lambda p: pair[p])
    return {"device": device, "bytes": nbytes, "way": way, "probe_src": src, "probe_dst": dst}


def _params(pool: DevicePool, layout: Layout, name: str, train: bool) -> dict[str, torch.Tensor]:
    state = gather_state(pool, layout, name=name, config=CONFIG, train=train)
    return {k: v for k, v in state.items() if k in shard_map(CONFIG, layout, train=False).names}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _median(values: list[float]) -> dict[str, Any]:
    return {"seconds": round(statistics.median(values), 4), "seconds_all": [round(v, 4) for v in values]}


def bench_scenario(pool: DevicePool, train: Layout, copy: Layout, repeats: int) -> dict[str, Any]:
    """EMU and driver syncs of one train/copy pair, each checked bitwise; the busiest port's bandwidth
    and the plan's pattern as plain gloo. Each repeat measures all four, one after another, so that
    every median is taken under the same conditions."""
    plan = plan_reshard(shard_map(CONFIG, train, train=False), shard_map(CONFIG, copy, train=False))
    port = busiest_port(plan)
    ranks = [port["probe_src"], port["probe_dst"]]
    pairs, local = plan_traffic(plan)
    devices = sorted({*train.devices, *copy.devices})
    model_ops.load_model(pool, train, name=TRAIN, config=CONFIG, optimizer=ADAMW)
    model_ops.load_model(pool, copy, name=COPY, config=CONFIG)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    try:
        model_ops.train(pool, train, {"ids": ids}, name=TRAIN)  # the copy is now one step behind
        expected = _params(pool, train, TRAIN, train=True)
        stale = not _equal(expected, _params(pool, copy, COPY, train=False))
        emu, driver, figures, bandwidths, patterns = [], [], [], [], []
        for _ in range(repeats):
            stats, emu_s, driver_s = _syncs(pool, train, copy)
            emu.append(emu_s)
            figures.append(stats)
            driver.append(driver_s)
            probe = pool.run_on(ranks, p2p_probe, src=ranks[0], dst=ranks[1], nbytes=port["bytes"], repeats=1)
            bandwidths += [b for b in probe if b]
            patterns.append(max(pool.run_on(devices, pattern_probe, pairs=pairs, local=local)))
        driver_equal = _equal(expected, _params(pool, copy, COPY, train=False))
        sync_copy(pool, CONFIG, source=TRAIN, source_layout=train, copy=COPY, copy_layout=copy)
        emu_equal = _equal(expected, _params(pool, copy, COPY, train=False))
    finally:
        model_ops.unload_model(pool, copy, name=COPY)
        model_ops.unload_model(pool, train, name=TRAIN)
    bandwidth, ceiling = statistics.median(bandwidths), statistics.median(patterns)
    middle = sorted(figures, key=lambda f: f["seconds"])[len(figures) // 2]
    row: dict[str, Any] = {
        "train_layout": train.key,
        "copy_layout": copy.key,
        "copy_was_stale": stale,
        "emu": {
            **_median(emu),
            "bitwise_equal": emu_equal,
            "bytes_moved": plan.bytes_moved,
            "bytes_local": plan.bytes_local,
            "messages": middle["messages"],
            "exchange_s": round(middle["exchange_s"], 4),
            "device_s": round(middle["device_s"], 4),
        },
        "driver": {**_median(driver), "bitwise_equal": driver_equal},
        "link": {
            **port,
            "p2p_bytes_per_s": round(bandwidth),
            "p2p_bytes_per_s_all": [round(b) for b in bandwidths],
            "pattern_s_all": [round(c, 4) for c in patterns],
        },
    }
    _add_fractions(row, bytes_moved=plan.bytes_moved, bandwidth=bandwidth, ceiling=ceiling, middle=middle)
    return row


def _syncs(pool: DevicePool, train: Layout, copy: Layout) -> tuple[dict[str, Any], float, float]:
    """One EMU sync (its figures, seconds), then one through the driver (seconds)."""
    start = time.perf_counter()
    stats = sync_copy(pool, CONFIG, source=TRAIN, source_layout=train, copy=COPY, copy_layout=copy)
    emu_s = time.perf_counter() - start
    start = time.perf_counter()
    state = model_ops.full_state(pool, train, name=TRAIN, config=CONFIG)
    model_ops.push_weights(pool, copy, state, name=COPY)
    return stats, emu_s, time.perf_counter() - start


def _add_fractions(
    row: dict[str, Any], *, bytes_moved: int, bandwidth: float, ceiling: float, middle: dict[str, Any]
) -> None:
    """The sync's seconds against the link: the busiest port at the measured pair bandwidth, all the
    plan's bytes at one pair's rate, and the plan's pattern as plain gloo."""
    port_bytes = row["link"]["bytes"]
    seconds = row["emu"]["seconds"]
    row["driver_over_emu"] = round(row["driver"]["seconds"] / seconds, 2)
    ideal = port_bytes / bandwidth
    row["link"]["ideal_s"] = round(ideal, 4)
    row["link_fraction"] = round(ideal / seconds, 3)
    row["exchange_link_fraction"] = round(ideal / middle["exchange_s"], 3)
    # On loopback TCP every byte costs CPU at both ends, so pairs moving at once share the cores:
    # all the plan's bytes at one pair's rate is the floor where the cores, not a port, are the limit.
    floor = bytes_moved / bandwidth
    row["link"]["all_bytes_one_pair_s"] = round(floor, 4)
    row["all_bytes_fraction"] = round(floor / seconds, 3)
    # What this machine can do for the plan's pattern (plain gloo, warm buffers, local copies too):
    # the physical limit. ``ceiling_link_fraction`` is the most ``link_fraction`` could be here.
    row["link"]["pattern_s"] = round(ceiling, 4)
    row["ceiling_link_fraction"] = round(ideal / ceiling, 3)
    row["of_ceiling"] = round(ceiling / seconds, 3)


def warm_up(pool: DevicePool) -> float:
    """First use on each worker (imports, DeepSpeed's first engine, the gloo pairs of the sync)."""
    start = time.perf_counter()
    tiny = ModelConfig(num_attention_heads=8, num_key_value_heads=4)
    for train, copy in SCENARIOS.values():
        model_ops.load_model(pool, train, name="warm/train", config=tiny, optimizer=ADAMW)
        model_ops.load_model(pool, copy, name="warm/copy", config=tiny)
        sync_copy(pool, tiny, source="warm/train", source_layout=train, copy="warm/copy", copy_layout=copy)
        model_ops.unload_model(pool, copy, name="warm/copy")
        model_ops.unload_model(pool, train, name="warm/train")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="syncs of each path per scenario (medians)")
    parser.add_argument("--only", choices=sorted(SCENARIOS), action="append", help="run these scenarios")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    started = time.perf_counter()
    params = sum(math.prod(s) for s in param_shapes(CONFIG).values())
    report: dict[str, Any] = {
        "model": {**CONFIG.model_dump(), "parameters": params, "bytes_fp32": params * 4},
        "machine": {"cpus": os.cpu_count(), "devices": 4, "loadavg_start": os.getloadavg()},
        "scenarios": {},
    }
    with DevicePool(4) as pool:
        report["machine"]["warm_up_s"] = round(warm_up(pool), 1)
        for key in args.only or SCENARIOS:
            train, copy = SCENARIOS[key]
            report["scenarios"][key] = bench_scenario(pool, train, copy, args.repeats)
    report["machine"]["loadavg_end"] = os.getloadavg()
    report["wall_s"] = round(time.perf_counter() - started, 1)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
