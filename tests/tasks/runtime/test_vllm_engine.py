"""A vLLM engine process (tasks/runtime/vllm_engine.py) on a tiny random Qwen2 (tied embeddings, q/k/v
biases, head_dim 64: the CPU attention kernel refuses less than 32): its log-prob of every sampled
token equals transformers' teacher-forced one on the same weights, before and after an in-place
weight reload (fp32, and bf16 against transformers in bf16), and GRPO's n samples of one prompt come
back as n rows; a stopped engine fails a request within its deadline, a slow start its budget."""

from __future__ import annotations

import os
import signal
import time
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from safetensors.torch import save_file

from nereus_core.config import ModelConfig, vllm_installed
from nereus_core.engine.sampling import SamplingRequest
from nereus_core.layout import Layout
from tasks.rollout_engines import DTYPES
from tasks.runtime import vllm_engine
from tests.support.hf_models import write_model

pytestmark = pytest.mark.skipif(
    not vllm_installed(), reason="vLLM is not installed (pip install -e '.[vllm]' or make install-vllm)"
)

SIZES = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1}
# fp32 on both sides: vLLM's CPU kernels and transformers' eager attention differ by rounding only.
TOLERANCE = 2e-4
NAME = "actor/generate"
DEADLINE_S = 300.0  # a healthy engine answers these in seconds; the deadlines' own tests are below


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen2")
    write_model("qwen2", path, **SIZES)
    return path


@contextmanager
def _engine(model_dir: Path, work_dir: Path, dtype: str) -> Iterator[Any]:
    """An engine process of ``dtype`` started empty (dummy weights), stopped on leaving."""
    work_dir.mkdir(parents=True, exist_ok=True)
    ctx = types.SimpleNamespace(rank=0, resident={})
    config = ModelConfig(path=str(model_dir), dtype=dtype)
    settings = {
        "model_dir": str(model_dir),
        "config": config.model_dump_json(),
        "work_dir": str(work_dir),
        "dtype": DTYPES[dtype],
        "tp": 1,
        "max_model_len": 64,
        "max_num_seqs": 16,
        "max_num_batched_tokens": 256,
        "gpu_memory_utilization": 0.5,
        "kv_cache_memory_bytes": 16 * 2**20,
        "enforce_eager": True,
        "enable_prefix_caching": True,
        "seed": 0,
    }
    ctx.config = config
    seconds = vllm_engine.start_engine(
        ctx, name=NAME, replica=0, cores="nobind", settings=settings, deadline_s=DEADLINE_S
    )
    print(f"engine process started in {seconds:.1f} s")
    try:
        yield ctx
    finally:
        vllm_engine.stop_engine(ctx, name=NAME)


@pytest.fixture(scope="module")
def ctx(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with _engine(model_dir, tmp_path_factory.mktemp("engine"), "fp32") as ctx:
        yield ctx


def reload(ctx: Any, state: dict[str, torch.Tensor], where: Path) -> float:
    path = where / "slices.safetensors"
    state = {k: v for k, v in state.items() if k != "lm_head.weight"}  # tied: the embedding is the head
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    got = vllm_engine.reload_engine(
        ctx,
        name=NAME,
        files=[str(path)],
        layout_json=Layout.contiguous().model_dump_json(),
        config_json=ctx.config.model_dump_json(),
        deadline_s=DEADLINE_S,
    )
    return got["seconds"]


def teacher_forced(model: Any, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    rows = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
    return logp[rows, torch.tensor(response)]


PROMPTS = torch.tensor([[0, 0, 5, 9, 17], [3, 4, 5, 6, 7], [0, 11, 12, 13, 14]])


def gaps(ctx: Any, model: Any, prompts: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    request = SamplingRequest(max_new_tokens=8, temperature=1.0, seed=3)
    ids, logp = vllm_engine.engine_generate(
        ctx, prompts, mask, name=NAME, request=request, group=1, row_offset=0, pad_id=0, deadline_s=DEADLINE_S
    )
    assert ids.shape == logp.shape == (prompts.shape[0], 8)
    out = []
    for row in range(prompts.shape[0]):
        prompt = prompts[row][mask[row].bool()].tolist()
        out.append((teacher_forced(model, prompt, ids[row].tolist()) - logp[row]).abs())
    return torch.cat(out)


def test_logprobs_match_transformers_before_and_after_a_reload(
    ctx: Any, model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    prompts = PROMPTS
    mask = (prompts != 0).long()
    mask[1] = 1
    # the engine started empty (dummy weights): the first reload installs the model's
    reload(ctx, dict(model.state_dict()), tmp_path)
    before = gaps(ctx, model, prompts, mask)
    with torch.no_grad():  # a training step's worth of change, the tied embedding included
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    seconds = reload(ctx, dict(model.state_dict()), tmp_path)
    after = gaps(ctx, model, prompts, mask)
    print(
        f"max |diff| before {before.max():.2e} after {after.max():.2e}; mean {after.mean():.2e}; "
        f"reload {seconds:.2f} s"
    )
    assert before.max() < TOLERANCE and after.max() < TOLERANCE


# bf16 on both sides: each rounds to 8 bits of mantissa in its own order (measured: max 0.032, mean
# 0.010 nats on log-probs near -4.3); a stale or misnamed weight is off by far more (0.76 on average).
BF16_MAX, BF16_MEAN = 0.1, 0.03


def test_bf16_logprobs_match_transformers_in_bf16_after_a_reload(model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="eager")
    with torch.no_grad():  # weights the engine did not start from, the tied embedding included
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    mask = (PROMPTS != 0).long()
    with _engine(model_dir, tmp_path / "engine", "bf16") as ctx:
        reload(ctx, dict(model.state_dict()), tmp_path)
        gap = gaps(ctx, model, PROMPTS, mask)
    print(f"bf16: max |diff| {gap.max():.3f}, mean {gap.mean():.3f}")
    assert gap.max() < BF16_MAX and gap.mean() < BF16_MEAN


def test_a_group_of_copies_is_asked_once_with_n_samples(ctx: Any) -> None:
    prompts = torch.tensor([[5, 6, 7]] * 4 + [[8, 9, 10]] * 4)
    request = SamplingRequest(max_new_tokens=6, temperature=1.0, seed=1)
    ids, logp = vllm_engine.engine_generate(
        ctx, prompts, None, name=NAME, request=request, group=4, row_offset=0, pad_id=0, deadline_s=DEADLINE_S
    )
    assert ids.shape == (8, 6) and bool((logp <= 0).all())
    assert len({tuple(r) for r in ids[:4].tolist()}) > 1  # the copies draw their own tokens
    greedy = SamplingRequest(max_new_tokens=6, temperature=0.0)
    again, _ = vllm_engine.engine_generate(
        ctx, prompts, None, name=NAME, request=greedy, group=4, row_offset=0, pad_id=0, deadline_s=DEADLINE_S
    )
    assert torch.equal(again[0], again[3])  # greedy: every copy the same


def test_stop_ids_end_a_response_and_pads_follow(ctx: Any) -> None:
    prompts = torch.tensor([[5, 6, 7], [8, 9, 10]])
    greedy = SamplingRequest(max_new_tokens=8, temperature=0.0)
    free, _ = vllm_engine.engine_generate(
        ctx, prompts, None, name=NAME, request=greedy, group=1, row_offset=0, pad_id=0, deadline_s=DEADLINE_S
    )
    stop = int(free[0, 2])
    stopped = SamplingRequest(max_new_tokens=8, temperature=0.0, stop_ids=(stop,))
    ids, logp = vllm_engine.engine_generate(
        ctx,
        prompts,
        None,
        name=NAME,
        request=stopped,
        group=1,
        row_offset=0,
        pad_id=127,
        deadline_s=DEADLINE_S,
    )
    first = free[0].tolist().index(stop)
    assert ids[0, : first + 1].tolist() == free[0, : first + 1].tolist()  # the stop id is kept
    assert bool((ids[0, first + 1 :] == 127).all()) and bool((logp[0, first + 1 :] == 0).all())


def test_a_dead_engine_fails_in_one_line_naming_it(ctx: Any, model_dir: Path, tmp_path: Path) -> None:
    other = types.SimpleNamespace(rank=1, resident={})
    proc = vllm_engine.EngineProcess(
        "vLLM engine of actor/generate replica 1 (device 1)", "nobind", tmp_path / "engine.log", deadline_s=60
    )
    other.resident["vllm/" + NAME] = proc
    proc.proc.kill()
    proc.proc.wait()
    with pytest.raises(vllm_engine.EngineDied, match=r"replica 1 \(device 1\) \(pid \d+\) (exited|lost)"):
        vllm_engine.engine_generate(
            other,
            torch.tensor([[1, 2]]),
            None,
            name=NAME,
            request=SamplingRequest(max_new_tokens=2),
            group=1,
            row_offset=0,
            pad_id=0,
            deadline_s=DEADLINE_S,
        )
    vllm_engine.stop_engine(other, name=NAME)


def test_a_started_engine_stopped_fails_a_generate_within_its_deadline(
    model_dir: Path, tmp_path: Path
) -> None:
    """A started vLLM engine stopped (SIGSTOP: alive and silent, as a deadlocked kernel) fails the
    request in one line naming it, its pid and the deadline, within the deadline; it is killed."""
    deadline_s = 3.0
    with _engine(model_dir, tmp_path / "engine", "fp32") as ctx:
        proc = vllm_engine.engine(ctx, NAME).proc
        os.kill(proc.pid, signal.SIGSTOP)
        start = time.monotonic()
        try:
            with pytest.raises(vllm_engine.EngineTimeout) as failed:
                vllm_engine.engine_generate(
                    ctx,
                    PROMPTS,
                    None,
                    name=NAME,
                    request=SamplingRequest(max_new_tokens=8),
                    group=1,
                    row_offset=0,
                    pad_id=0,
                    deadline_s=deadline_s,
                )
            took = time.monotonic() - start
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
    line = str(failed.value)
    print(f"failed after {took:.1f} s: {line}")
    assert f"vLLM engine of {NAME} replica 0 (device 0) (pid {proc.pid}) gave no answer to generate" in line
    assert f"deadline of {deadline_s:.1f} s" in line and "\n" not in line, line
    assert deadline_s <= took < deadline_s + 10, took  # polled every 0.5 s; a loaded machine adds seconds
    assert proc.returncode == -signal.SIGKILL


def test_an_engine_start_past_its_deadline_is_killed(model_dir: Path, tmp_path: Path) -> None:
    """vLLM's build takes seconds (its import alone): a 1 s start budget fails in one line, and the
    process is gone."""
    ctx = types.SimpleNamespace(rank=0, resident={})
    settings = {"model_dir": str(model_dir), "work_dir": str(tmp_path)}
    start = time.monotonic()
    with pytest.raises(
        vllm_engine.EngineTimeout, match=r"\(pid \d+\) gave no answer to start within"
    ) as failed:
        vllm_engine.start_engine(ctx, name=NAME, replica=0, cores="nobind", settings=settings, deadline_s=1.0)
    assert time.monotonic() - start < 10
    pid = int(str(failed.value).split("(pid ")[1].split(")")[0])
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert isinstance(ctx.resident["vllm/" + NAME], vllm_engine.EngineDied)  # never asked again
