"""The vLLM engine process: one per actor/generate replica, started by that replica's device actor.

    device actor ──(multiprocessing.connection: start / generate / reload / close)──> this process
                                                                                       └ vllm.LLM
                                                                                         (in process)

Why a process of its own: vLLM builds its own torch.distributed world and sets process-wide
state (OpenMP binding, its environment), while the device actor already sits in the pool's
world. Inside it the engine runs in process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: 7-9 s to
start instead of about a minute). The process exits when its actor goes (the connection closes
or the parent changes).

Weights: the engine starts with ``load_format="dummy"`` (no weights read) and takes the actor's
weights through ``WeightReload.reload_from``: each train device of the actor's replica 0 wrote
its slices as a safetensors file in shared memory; the engine's workers read them, join the
slices (``engine.dispatch.assemble_full_state``) and reload in place through vLLM's layer-wise
reload (its loader fuses q/k/v and gate/up from the Hugging Face names). The model's own
``load_weights`` after start-up fails on CPU (its linears were repacked for oneDNN); the tied
lm head's packed copy is rebuilt after a reload (else it keeps the old weights); the prefix cache
is reset after every update.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from multiprocessing.connection import Client, Connection
from pathlib import Path
from typing import Any


class WeightReload:
    """vLLM worker extension (``LLM(worker_extension_cls=...)``): runs in each engine worker."""

    def reload_from(self, files: list[str], layout_json: str, config_json: str) -> float:
        """Reload the model in place from the slice files of one train replica; returns seconds."""
        import torch
        from safetensors.torch import load_file

        from nereus_core.config import ModelConfig
        from nereus_core.engine.dispatch import assemble_full_state
        from nereus_core.layout import Layout

        start = time.perf_counter()
        layout = Layout.model_validate_json(layout_json)
        config = ModelConfig.model_validate_json(config_json)
        dtype = self.model_runner.model_config.dtype  # type: ignore[attr-defined]
        shards = [load_file(f) for f in files]
        state = assemble_full_state(layout, config, shards)
        weights = ((name, t.to(dtype)) for name, t in state.items())
        with torch.no_grad():
            self.model_runner.reload_weights(weights_iterator=weights)  # type: ignore[attr-defined]
            _repack_tied_head(self.model_runner.get_model())  # type: ignore[attr-defined]
        return time.perf_counter() - start


def _repack_tied_head(model: Any) -> None:
    """On CPU the embedding that doubles as the lm head keeps a packed copy of its weight for the
    GEMM; a reload updates the weight, not the copy: build it again."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding) and hasattr(module, "cpu_linear"):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)


def _model_dir(settings: dict[str, Any]) -> str:
    """The directory vLLM reads the architecture from: the job's model directory, or a config.json
    written here for a model Nereus seeded (the weights come from the first reload either way)."""
    if settings.get("model_dir"):
        return str(settings["model_dir"])
    from nereus_core.config import ModelConfig
    from nereus_core.model.weights import hf_config

    config = ModelConfig.model_validate_json(settings["config"])
    out = Path(settings["work_dir"]) / "model"
    out.mkdir(parents=True, exist_ok=True)
    hf = hf_config(config)
    hf.architectures = [config.architecture]
    hf.to_json_file(str(out / "config.json"))
    return str(out)


def build(settings: dict[str, Any]) -> Any:
    from vllm import LLM

    return LLM(
        model=_model_dir(settings),
        skip_tokenizer_init=True,
        load_format="dummy",
        dtype=settings["dtype"],
        tensor_parallel_size=settings["tp"],
        max_model_len=settings["max_model_len"],
        max_num_seqs=settings["max_num_seqs"],
        max_num_batched_tokens=max(settings["max_num_batched_tokens"], settings["max_model_len"]),
        gpu_memory_utilization=settings["gpu_memory_utilization"],
        kv_cache_memory_bytes=settings["kv_cache_memory_bytes"],
        enforce_eager=settings["enforce_eager"],
        enable_prefix_caching=settings["enable_prefix_caching"],
        generation_config="vllm",  # the job's sampling settings, not the directory's defaults
        worker_extension_cls=f"{__name__}.WeightReload",
        seed=settings["seed"],
    )


def generate(llm: Any, prompts: list[list[int]], params: list[dict[str, Any]]) -> list[list[Any]]:
    """Each prompt's samples as (ids, log-probs of those ids)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        [SamplingParams(**p) for p in params],
        use_tqdm=False,
    )
    answers = []
    for out in outs:
        samples = []
        for c in out.outputs:
            ids = list(c.token_ids)
            samples.append((ids, [c.logprobs[i][t].logprob for i, t in enumerate(ids)]))
        answers.append(samples)
    return answers


def reload(llm: Any, files: list[str], layout_json: str, config_json: str) -> dict[str, float]:
    start = time.perf_counter()
    workers = llm.collective_rpc("reload_from", args=(files, layout_json, config_json))
    llm.reset_prefix_cache()  # a stale prefix cache answers with the old weights' KV
    return {"seconds": time.perf_counter() - start, "worker_s": max(workers)}


def serve(conn: Connection) -> None:
    llm = None
    # False from the start of a weight reload until it completes: a reload that raised midway leaves
    # some layers new and some old, and no answer may come from such a model (the device actor also
    # stops an engine whose reload failed; this holds if it asks anyway)
    whole = True
    while True:
        try:
            op, kwargs = conn.recv()
        except EOFError:
            return
        try:
            start = time.perf_counter()
            if op == "close":
                conn.send(("ok", None))
                return
            if op == "start":
                llm = build(kwargs)
                answer: Any = {"seconds": time.perf_counter() - start}
            elif op == "generate":
                if not whole:
                    raise RuntimeError("the last weight reload did not complete: no generation on them")
                answer = generate(llm, **kwargs)
            elif op == "reload":
                whole = False
                answer = reload(llm, **kwargs)
                whole = True
            else:
                raise ValueError(f"unknown request {op!r}")
            conn.send(("ok", answer))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _exit_with_parent(parent: int) -> None:
    """The engine dies with its device actor (a killed worker closes no connection)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def main() -> None:
    hello = json.loads(sys.stdin.readline())
    threading.Thread(target=_exit_with_parent, args=(hello["parent"],), daemon=True).start()
    conn = Client(tuple(hello["address"]), authkey=bytes.fromhex(hello["authkey"]))
    try:
        serve(conn)
    finally:
        conn.close()


if __name__ == "__main__":
    main()
