"""Forward and train-step time of the tiny model per layout on the CPU device pool (JSON out).

All layouts run in one pool, one after another, in the same process, so the
figures compare side by side. Each time is the median of 5 after one warm-up.
The physical limit on this machine is its cores: every device slot is a worker
process, and with fewer cores than slots the slots time-share them, so more
parallelism only adds communication here; the figures measure the runtime's
overhead per layout, not a speed-up.

    python -m benchmarks.bench_runtime [--devices 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

from nereus_core.config import ModelConfig
from nereus_core.engine.shard import OptimizerSettings
from nereus_core.layout import Layout
from tasks import model_ops
from tasks.runtime.device_pool import DevicePool

CONFIG = ModelConfig(num_attention_heads=8, num_key_value_heads=4)
LAYOUTS = [(1, 1, 1), (2, 1, 1), (4, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2), (2, 1, 2), (1, 2, 2)]


def median_s(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_layout(pool: DevicePool, layout: Layout, ids: torch.Tensor, repeats: int) -> dict[str, object]:
    start = time.perf_counter()
    pool.build_groups(layout)
    groups_s = time.perf_counter() - start
    model_ops.load_model(pool, layout, name="bench/train", config=CONFIG, optimizer=OptimizerSettings())
    try:
        forward_s = median_s(lambda: model_ops.forward(pool, layout, ids, name="bench/train"), repeats)
        train_s = median_s(lambda: model_ops.train(pool, layout, {"ids": ids}, name="bench/train"), repeats)
    finally:
        model_ops.unload_model(pool, layout, name="bench/train")
    return {"layout": layout.key, "groups_s": groups_s, "forward_s": forward_s, "train_step_s": train_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()
    ids = torch.randint(
        0, CONFIG.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)
    )
    rows = []
    with DevicePool(args.devices) as pool:
        world_s = dict(pool.timings)[f"world {args.devices}"]
        for tp, pp, dp in LAYOUTS:
            layout = Layout.contiguous(tp=tp, pp=pp, dp=dp, micro_batches=2 if pp > 1 else 1)
            rows.append(bench_layout(pool, layout, ids, args.repeats))
        rebuild = {}
        for size in (2, args.devices):
            start = time.perf_counter()
            pool.resize(size)
            rebuild[f"{pool.size}"] = time.perf_counter() - start
    base = rows[0]
    for row in rows:
        row["forward_vs_1x1x1"] = row["forward_s"] / base["forward_s"]
        row["train_vs_1x1x1"] = row["train_step_s"] / base["train_step_s"]
    out = {
        "model": CONFIG.model_dump(),
        "batch": args.batch,
        "seq": args.seq,
        "cpu_cores": os.cpu_count(),
        "devices": args.devices,
        "world_formation_s": world_s,
        "rebuild_world_s": {
            f"{args.devices}->2": rebuild["2"],
            f"2->{args.devices}": rebuild[str(args.devices)],
        },
        "layouts": rows,
        "physical_limit": f"{os.cpu_count()} cores shared by {args.devices} device processes",
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
