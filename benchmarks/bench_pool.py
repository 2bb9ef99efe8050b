"""Device pool timings: world formation, layout groups, world rebuilds, dispatch.

Prints one JSON object. Everything is measured in this one run on this machine
(one Dask worker process per device slot, gloo):

- ``start_4_s`` / ``world_4_s``: a 4-device pool: cluster + actors, then the rendezvous;
- ``build_groups_s``: per layout shape, the median of 5 builds (5 device orders of the
  same shape, so each is a fresh set of groups);
- ``rebuild_s``: ``resize`` 2 -> 4 (new worker processes + a fresh world) and 4 -> 2;
- ``dispatch_s``: median round trip of ``run_all`` with a no-op and with a one-float all-reduce;
- ``close_4_s``: actors leave, client and cluster close, worker processes gone.

Usage: ``python -m benchmarks.bench_pool [--devices 4] [--repeats 5]``
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from nereus_core.engine.device import DeviceContext
from nereus_core.layout import Layout
from tasks.runtime.device_pool import DevicePool

SHAPES: dict[str, dict[str, int]] = {
    "tp4": {"tp": 4},
    "tp2.dp2": {"tp": 2, "dp": 2},
    "tp2.pp2": {"tp": 2, "pp": 2},
    "pp2.dp2": {"pp": 2, "dp": 2},
    "dp4": {"dp": 4},
}


def noop(ctx: DeviceContext) -> int:
    return ctx.rank


def all_reduce_one(ctx: DeviceContext) -> float:
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _median_s(fn: Any, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def bench_groups(pool: DevicePool, repeats: int) -> dict[str, float]:
    """Median build time per layout shape, each repeat on a different device order (a fresh key)."""
    out: dict[str, float] = {}
    orders = list(itertools.permutations(range(pool.size)))
    for name, degrees in SHAPES.items():
        samples = []
        for devices in orders[:repeats]:
            layout = Layout(devices=devices, **degrees)
            start = time.perf_counter()
            pool.build_groups(layout)
            samples.append(time.perf_counter() - start)
        out[name] = statistics.median(samples)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    result: dict[str, Any] = {
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads",
        "backend": None,
    }

    pool = DevicePool(args.devices)
    try:
        events = dict(pool.timings)
        result["backend"] = pool.backend
        result[f"start_{args.devices}_s"] = events["start"]
        result[f"world_{args.devices}_s"] = events[f"world {args.devices}"]
        result["build_groups_s"] = bench_groups(pool, args.repeats)
        result["dispatch_s"] = {
            "run_all_noop": _median_s(lambda: pool.run_all(noop), 20),
            "run_all_all_reduce": _median_s(lambda: pool.run_all(all_reduce_one), 20),
        }
    finally:
        start = time.perf_counter()
        pool.close()
        result[f"close_{args.devices}_s"] = time.perf_counter() - start

    half = max(1, args.devices // 2)
    with DevicePool(half) as pool:
        pool.resize(args.devices)
        pool.resize(half)
        pool.resize(args.devices)
        pool.resize(half)
        rebuilds = [(e, s) for e, s in pool.timings if e.startswith("rebuild")]
    result["rebuild_s"] = {e: [s for e2, s in rebuilds if e2 == e] for e, _ in rebuilds}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
