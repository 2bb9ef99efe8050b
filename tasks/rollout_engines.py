"""vLLM rollout engines of actor/generate on the device pool: start, generate, sync, stop.

    start:    one engine per replica of the generate layout, on the replica's first device slot
              (tensor_parallel_size = the layout's tp), all at once -> sync
    sync:     actor/train's replica 0 devices write their slices to shared memory (one file each,
              at once) -> every engine reloads in place from them: the weights pass through
              neither the driver nor the RPC, and no engine restarts
    generate: the batch split by replica as the nereus engine splits it -> ids, lengths, log-probs

Every request to an engine carries its deadline, from ``rollout``'s settings and the work asked: a
fixed budget to start, a floor plus seconds per token a replica may generate, a floor plus seconds
per GiB of weights each engine loads. An engine that misses one is killed on its device and the call
fails in one line naming it, its pid and the deadline.

Boundary: the driver side; the engine process is tasks/runtime/vllm_engine.py's. The hand-over is
a directory on one machine: engines and actor/train's devices whose workers run on another machine
than the driver are refused in one line (``on_this_machine``); a weight-update process group across
machines is not built.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nereus_core.config import ModelConfig
from nereus_core.config.rollout import DEADLINE_FIELDS, RolloutConfig
from nereus_core.engine import dispatch
from nereus_core.engine.sampling import SamplingRequest
from nereus_core.layout import Layout
from tasks.runtime import vllm_engine
from tasks.runtime.cluster import get_address_host, interface_of
from tasks.runtime.device_pool import DevicePool

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
SHARED_MEMORY = Path("/dev/shm")


@dataclass(frozen=True)
class Engines:
    """The engines of one model-stage on one layout, and where their weights are handed over."""

    name: str
    layout: Layout
    config: ModelConfig
    work_dir: str
    settings: RolloutConfig  # the engines' settings, their requests' deadlines among them

    @property
    def devices(self) -> list[int]:
        """The device each replica's engine is held by: its first slot."""
        return [self.layout.device(d, 0, 0) for d in range(self.layout.dp)]


def on_this_machine(pool: DevicePool, devices: list[int] | tuple[int, ...], what: str) -> None:
    """``ValueError`` in one line unless every one of ``devices``' workers runs on the driver's machine:
    the engines' work directory and the weights' hand-over live in its shared memory."""
    hosts = {d: get_address_host(pool.workers[d]) for d in devices}
    away = {d: h for d, h in hosts.items() if not _on_this_machine(h)}
    if away:
        where = ", ".join(f"slot {d} on {h}" for d, h in sorted(away.items()))
        raise ValueError(
            f"rollout.engine=vllm: {what} has {where}, not on the driver's machine; vLLM engines take "
            "their weights through this machine's shared memory, so run actor/generate and actor/train "
            "on workers of the driver's machine, or use rollout.engine: nereus"
        )


@functools.lru_cache(maxsize=64)  # asked at every sync; where an address lives does not change
def _on_this_machine(host: str) -> bool:
    return interface_of(host) is not None


def _work_dir() -> str:
    base = SHARED_MEMORY if SHARED_MEMORY.is_dir() else Path(tempfile.gettempdir())
    return tempfile.mkdtemp(prefix="nereus-vllm-", dir=base)


def _cores(layout: Layout, replica: int) -> str:
    """vLLM's OpenMP binding of one replica (``VLLM_CPU_OMP_THREADS_BIND``): a core per device slot,
    tp ranks split by '|'; ignored on GPUs."""
    count = os.cpu_count() or 1
    return "|".join(str(slot % count) for slot in layout.replica_groups()[replica])


def start(
    pool: DevicePool,
    layout: Layout,
    *,
    name: str,
    config: ModelConfig,
    settings: RolloutConfig,
    max_model_len: int,
    seed: int,
) -> tuple[Engines, list[float]]:
    """Start ``name``'s engines on ``layout`` (empty weights; ``sync`` gives them the actor's); returns
    them and each engine's start seconds."""
    if layout.pp > 1:
        raise ValueError(f"{name} on {layout.key}: vLLM engines generate without pipeline stages (pp=1)")
    on_this_machine(pool, layout.devices, name)
    engines = Engines(name, layout, config, _work_dir(), settings)
    common = {
        "model_dir": config.path,
        "config": config.model_dump_json(),
        "work_dir": engines.work_dir,
        "dtype": DTYPES[config.dtype],
        "tp": layout.tp,
        "max_model_len": max_model_len,
        "seed": seed,
        **settings.model_dump(exclude={"engine", *DEADLINE_FIELDS}),
    }
    args = [(d, _cores(layout, d)) for d in range(layout.dp)]
    try:
        seconds = pool.run_on(
            engines.devices,
            _start_one,
            args,
            name=name,
            settings=common,
            deadline_s=settings.start_timeout_s,
        )
    except Exception:
        with contextlib.suppress(Exception):  # the engines that did start go too; the failure is the news
            stop(pool, engines)
        raise
    return engines, seconds


def _start_one(
    ctx: Any, replica: int, cores: str, *, name: str, settings: dict[str, Any], deadline_s: float
) -> float:
    return vllm_engine.start_engine(
        ctx, name=name, replica=replica, cores=cores, settings=settings, deadline_s=deadline_s
    )


def sync(pool: DevicePool, engines: Engines, train_layout: Layout, *, source: str) -> dict[str, float]:
    """Replace every engine's weights with ``source``'s (on ``train_layout``) in place; returns the
    seconds of the whole sync, of writing the slices and of the engines' reloads."""
    start = time.perf_counter()
    replica0 = Layout(
        tp=train_layout.tp,
        pp=train_layout.pp,
        dp=1,
        devices=train_layout.replica_groups()[0],
        micro_batches=train_layout.micro_batches,
    )
    on_this_machine(pool, replica0.devices, source)
    directory = str(Path(engines.work_dir) / "weights")
    files = pool.run_on(replica0.devices, vllm_engine.write_slices, name=source, directory=directory)
    written = time.perf_counter()
    size = sum(Path(f).stat().st_size for f in files)
    try:
        reloads = pool.run_on(
            engines.devices,
            vllm_engine.reload_engine,
            name=engines.name,
            files=files,
            layout_json=replica0.model_dump_json(),
            config_json=engines.config.model_dump_json(),
            deadline_s=engines.settings.sync_deadline_s(size),  # each engine reads every file
        )
    finally:
        for f in files:
            Path(f).unlink(missing_ok=True)
    done = time.perf_counter()
    return {
        "seconds": done - start,
        "write_s": written - start,
        "reload_s": done - written,
        "engine_reload_s": max(r["seconds"] for r in reloads),
        "bytes": float(size),
    }


def generate(
    pool: DevicePool,
    engines: Engines,
    prompts_bs: torch.Tensor,
    *,
    request: SamplingRequest,
    prompt_mask: torch.Tensor | None = None,
    group: int = 1,
    pad_id: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Responses ``[b, T]`` (right-padded with ``pad_id``) and the engines' log-probs of them."""
    layout = Layout(dp=engines.layout.dp, devices=tuple(engines.devices))
    rows = dispatch.replica_rows(layout, prompts_bs.shape[0])
    args = dispatch.per_device_args(layout, prompts_bs, prompt_mask)
    tokens = (prompts_bs.shape[0] // layout.dp) * request.max_new_tokens  # at most, per engine
    out = pool.run_on(
        engines.devices,
        _generate_one,
        [(*a, r.start) for a, r in zip(args, rows, strict=True)],
        name=engines.name,
        request=request,
        group=group,
        pad_id=pad_id,
        deadline_s=engines.settings.generate_deadline_s(tokens),
    )
    return torch.cat([o[0] for o in out]), torch.cat([o[1] for o in out])


def _generate_one(
    ctx: Any, prompts: torch.Tensor, mask: torch.Tensor | None, row_offset: int, **kw: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    return vllm_engine.engine_generate(ctx, prompts, mask, row_offset=row_offset, **kw)


def stop(pool: DevicePool, engines: Engines) -> None:
    """Every engine process exits; the shared-memory hand-over folder goes."""
    try:
        pool.run_on(engines.devices, vllm_engine.stop_engine, name=engines.name)
    finally:
        shutil.rmtree(engines.work_dir, ignore_errors=True)
