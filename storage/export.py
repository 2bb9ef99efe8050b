"""Export a model of a run directory in Hugging Face format: config.json + model.safetensors.

A model imported from a directory (``model.path``) takes its tokenizer's files (``model.tokenizer``,
default the model directory) and its generation_config.json along, so that the export is a model
directory as complete as the one it came from.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from safetensors.torch import save_file

from nereus_core.config import parse_config
from nereus_core.model.weights import hf_config
from nereus_core.plan import MODELS, state_stages
from storage.run_dir import RunDir
from storage.snapshot import read_full_state

# What a saved tokenizer consists of (transformers' save_pretrained, fast and slow) and how to generate.
COPIED = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
)
GENERATION_CONFIG = "generation_config.json"

# The lm head is the config's architecture; a value head is its sequence-classification sibling.
HEAD_SUFFIX = {"lm": "ForCausalLM", "value": "ForSequenceClassification"}


def export_hf(
    run_dir: str | os.PathLike[str], *, model: str, step: int | None, out: str | os.PathLike[str]
) -> Path:
    """Write ``model`` at ``step`` (latest snapshot if None) to ``out``; returns ``out``. A missing run,
    step or damaged file is a ``RunDirError`` (``SnapshotNotFoundError`` lists the committed steps)."""
    if model not in MODELS:
        raise ValueError(f"model {model!r} is unknown; valid: {', '.join(MODELS)}")
    run = RunDir(run_dir)
    job = parse_config(run.read_config())  # RunDirError: not a run dir
    held = sorted(state_stages(job.stages))  # the models whose state the run keeps
    if model not in held:
        raise ValueError(
            f"this {job.algorithm.name} run has no {model} model; export one of: {', '.join(held)}"
        )
    config = job.models[model]
    state = read_full_state(run.root, model, step)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    hf = hf_config(config)
    hf.architectures = [config.architecture.removesuffix("ForCausalLM") + HEAD_SUFFIX[config.head]]
    hf.to_json_file(str(out / "config.json"))
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    sources = [(Path(config.tokenizer_dir), COPIED)] if config.tokenizer_dir else []
    if config.path and config.head == "lm":
        sources.append((Path(config.path), (GENERATION_CONFIG,)))
    for folder, names in sources:
        for name in names:
            if (folder / name).is_file():
                shutil.copyfile(folder / name, out / name)
    return out
