"""Calibrate the cost model on the real CPU runtime and check its predictions on unseen layouts (JSON out).

Measures the tiny model's generate, forward (log-probs) and train-step time on every
layout of a 4-slot device pool, feeds the timings of two layouts to the controller's
calibration (``controller.observe``: the same code path as a running job), and
predicts the other layouts. Prints the median absolute percentage error of those
predictions, before and after calibration, and the predicted vs actual parameter,
gradient and optimizer bytes per device of every train layout.

``--profile`` instead measures the constants of ``hardware.CPU_WORKERS`` (single-
thread matmul, memory copy, gloo latency and bandwidth, dispatch and per-layer
overhead) and fits its ``term_scales`` to every layout's timings on a *different*
workload (PROFILE_WORKLOAD) than the one the default mode evaluates, and prints them.
The evaluation reports three errors on the layouts not calibrated on: with the
microbenchmark constants alone, with the fitted profile, and after the job's own
calibration on two layouts.

This script measures (its functions run on the pool's workers); the analysis of the timings,
and the model, workloads and layouts they are taken on, are ``calibration_analysis.py``'s.

    python -m benchmarks.bench_calibration [--repeats 7] [--save raw.json | --load raw.json]
    python -m benchmarks.bench_calibration --profile
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from benchmarks.calibration_analysis import (
    CONFIG,
    LAYOUTS,
    PROFILE_WORKLOAD,
    WORKLOAD,
    analyse,
    calibrate,
    layout_of,
)
from nereus_core.config import Workload
from nereus_core.cost.hardware import CPU_WORKERS
from nereus_core.layout import Layout

ROOT = Path(__file__).resolve().parents[1]


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def state_bytes(ctx: Any, *, name: str) -> dict[str, int]:
    """Unique bytes of parameters, gradients and optimizer state held on this device (runs on it)."""
    shard = ctx.resident[name]
    seen: set[int] = set()

    def add(tensors: list[torch.Tensor]) -> int:
        total = 0
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    params = list(shard.stage.parameters())
    out = {"weights": add([p.data for p in params])}
    out["gradients"] = add([p.grad for p in params if p.grad is not None])
    opt = shard.engine.optimizer
    tensors: list[torch.Tensor] = []
    for value in vars(opt).values():
        items = value if isinstance(value, list) else [value]
        tensors += [v for v in items if isinstance(v, torch.Tensor)]
        tensors += [x for v in items if isinstance(v, list) for x in v if isinstance(x, torch.Tensor)]
    inner = getattr(opt, "optimizer", opt)
    for state in inner.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    out["optimizer"] = add(tensors)
    return out


def _load_all(pool: Any, layouts: list[Layout]) -> None:
    from nereus_core.engine.shard import OptimizerSettings
    from tasks import model_ops

    for layout in layouts:
        model_ops.load_model(pool, layout, name=f"infer/{layout.key}", config=CONFIG)
        model_ops.load_model(
            pool, layout, name=f"train/{layout.key}", config=CONFIG, optimizer=OptimizerSettings()
        )


def _time_once(pool: Any, layout: Layout, ids: torch.Tensor, work: Workload) -> dict[str, float]:
    from tasks import model_ops

    forward = getattr(model_ops, "forward", None) or model_ops.logprobs
    prompts, new = ids[:, : work.prompt_len], int(work.response_high)
    calls = {
        "forward": lambda: forward(pool, layout, ids, name=f"infer/{layout.key}"),
        "generate": lambda: model_ops.sample(
            pool, layout, prompts, name=f"infer/{layout.key}", max_new_tokens=new
        ),
        "train": lambda: model_ops.train(pool, layout, {"ids": ids}, name=f"train/{layout.key}"),
    }
    out = {}
    for kind, call in calls.items():
        start = time.perf_counter()
        call()
        out[kind] = time.perf_counter() - start
    return out


def measure(repeats: int, work: Workload) -> dict[str, Any]:
    """All layouts stay loaded; rounds go over every layout in turn, so load from other processes on
    the machine falls on all of them alike. The first round is a warm-up and is dropped."""
    from tasks.runtime.device_pool import DevicePool

    gen = torch.Generator().manual_seed(0)
    seq = work.prompt_len + work.response_high
    ids = torch.randint(0, CONFIG.vocab_size, (work.batch, seq), generator=gen)
    layouts = [layout_of(*x) for x in LAYOUTS]
    rows = [{"layout": list(x), "forward": [], "generate": [], "train": []} for x in LAYOUTS]
    with quiet_stdout(), DevicePool(4) as pool:
        _load_all(pool, layouts)
        for round_ in range(repeats + 1):
            for row, layout in zip(rows, layouts, strict=True):
                for kind, seconds in _time_once(pool, layout, ids, work).items():
                    if round_:
                        row[kind].append(seconds)
            print(f"round {round_} done", file=sys.stderr, flush=True)
        for row, layout in zip(rows, layouts, strict=True):
            row["bytes"] = pool.run(layout, state_bytes, name=f"train/{layout.key}")
    return {"repeats": repeats, "workload": work.model_dump(), "rows": rows}


@contextmanager
def quiet_stdout() -> Iterator[None]:
    """Send fd 1 to stderr while worker processes run (DeepSpeed prints there), so stdout stays JSON."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


# ------------------------------------------------------------------ --profile: CPU_WORKERS constants


def _allreduce_s(ctx: Any, *, layout: Layout, reps: int, numel: int) -> float:
    import torch.distributed as dist

    group, x = ctx.view(layout).tp_group, torch.zeros(numel)
    for _ in range(3):
        dist.all_reduce(x, group=group)
    start = time.perf_counter()
    for _ in range(reps):
        dist.all_reduce(x, group=group)
    return (time.perf_counter() - start) / reps


def _send_s(ctx: Any, *, layout: Layout, reps: int, numel: int) -> float:
    """One-way time of a send between the two stages of a pp=2 layout (ping-pong / 2)."""
    import torch.distributed as dist

    view, x = ctx.view(layout), torch.zeros(numel)
    peer = view.pp_ranks[1 - view.coord.pp]
    start = 0.0
    for i in range(reps + 3):
        start = time.perf_counter() if i == 3 else start
        if view.coord.pp == 0:
            dist.send(x, peer)
            dist.recv(x, peer)
        else:
            dist.recv(x, peer)
            dist.send(x, peer)
    return (time.perf_counter() - start) / reps / 2


def _noop(ctx: Any) -> None:
    return None


def _work_s(ctx: Any, *, iterations: int) -> float:
    """Seconds of a fixed CPU-bound loop (small matmuls, like the tiny model's layers)."""
    a = torch.randn(64, 64)
    start = time.perf_counter()
    for _ in range(iterations):
        a = torch.tanh(a @ a)
    return time.perf_counter() - start


def _sharing(pool: Any) -> dict[str, float]:
    """Effective cores and slowdown exponent from the same loop on 1, 2 and 4 slots at once."""
    times = {}
    for n in (1, 2, 4):
        layout = Layout.contiguous(dp=n)
        times[n] = statistics.median(
            statistics.median(pool.run(layout, _work_s, iterations=2000)) for _ in range(5)
        )
    ratio2, ratio4 = times[2] / times[1], times[4] / times[1]
    # (busy / cores) ** log2(slowdown): pick the cores (1 or 2) that explain both ratios best
    fits = []
    for cores in (1, 2):
        exponent = math.log(ratio4) / math.log(4 / cores)
        predicted2 = max(2 / cores, 1.0) ** exponent
        fits.append((abs(predicted2 - ratio2), cores, 2**exponent))
    _, cores, slowdown = min(fits)
    return {
        "cores_per_node": cores,
        "oversubscribed_slowdown": slowdown,
        "work_ratio_2": ratio2,
        "work_ratio_4": ratio4,
    }


def _host_constants() -> dict[str, float]:
    from nereus_core.model.llama import LlamaStage
    from nereus_core.model.weights import init_full_state

    torch.set_num_threads(1)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    matmul = min(timed(lambda: a @ b, 20))
    x = torch.empty(16 * 2**20)
    y = torch.empty_like(x)
    copy = min(timed(lambda: y.copy_(x), 10))
    stage = LlamaStage(CONFIG, layers=range(CONFIG.num_hidden_layers), first=True, last=True)
    stage.load_full_state(init_full_state(CONFIG))
    ids, pos = torch.zeros((1, 1), dtype=torch.long), torch.arange(1)
    with torch.no_grad():
        step = statistics.median(timed(lambda: stage(ids, pos), 50))
    return {
        "peak_flops": 2 * 512**3 / matmul,
        "memory_bandwidth": 2 * x.numel() * 4 / copy,
        "layer_overhead_s": step / CONFIG.num_hidden_layers,
    }


def measure_profile(repeats: int) -> dict[str, Any]:
    """The constants of ``hardware.CPU_WORKERS`` as measured on this machine, and its term scales."""
    from tasks.runtime.device_pool import DevicePool

    out: dict[str, Any] = _host_constants()
    with quiet_stdout(), DevicePool(4) as pool:
        one, four = Layout.contiguous(), Layout.contiguous(dp=4)
        t1 = statistics.median(timed(lambda: pool.run(one, _noop), 20))
        t4 = statistics.median(timed(lambda: pool.run(four, _noop), 20))
        pair, pipe = Layout.contiguous(tp=2), Layout.contiguous(pp=2)
        for layout in (pair, pipe):
            pool.build_groups(layout)
        alone = statistics.median(pool.run(pair, _allreduce_s, layout=pair, reps=50, numel=1))
        out.update(_sharing(pool))
        small = statistics.median(pool.run(pipe, _send_s, layout=pipe, reps=50, numel=1))
        large = statistics.median(pool.run(pipe, _send_s, layout=pipe, reps=10, numel=2**20))
    per_device = (t4 - t1) / 3
    out.update(
        call_overhead_s=max(t1 - per_device, 0.0),
        dispatch_per_device_s=per_device,
        collective_latency_s=alone / 2,  # a 2-slot ring all-reduce is 2 hops
        intra_node_bandwidth=4 * 2**20 / max(large - small, 1e-9),
        p2p_latency_s=small,
    )
    constants = {k: float(f"{v:.3g}") for k, v in out.items()}
    # Term scales: the calibration fit (weak prior) over every layout of PROFILE_WORKLOAD, on top of
    # the constants just measured.
    fields = {k: v for k, v in constants.items() if k in type(CPU_WORKERS).model_fields}
    measured = CPU_WORKERS.model_copy(update={**fields, "term_scales": {}})
    raw = measure(repeats, PROFILE_WORKLOAD)
    fitted = calibrate(raw, measured, None, prior=0.01).scales
    constants["term_scales"] = {k: float(f"{v:.3g}") for k, v in fitted.model_dump().items()}
    return constants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--save", type=Path, help="also write the raw timings here")
    parser.add_argument("--load", type=Path, help="analyse raw timings saved earlier instead of measuring")
    parser.add_argument("--profile", action="store_true", help="measure the CPU profile's constants instead")
    args = parser.parse_args()
    if args.profile:
        print(json.dumps(measure_profile(args.repeats), indent=2))
        return
    raw = json.loads(args.load.read_text()) if args.load else measure(args.repeats, WORKLOAD)
    if args.save:
        args.save.write_text(json.dumps(raw))
    print(json.dumps(analyse(raw), indent=2))


if __name__ == "__main__":
    main()
