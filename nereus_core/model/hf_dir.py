"""A Hugging Face model directory: its ``config.json`` as a ``ModelConfig``, and slices of its tensors.

The boundary: this module reads the directory the caller names (``config.json``,
``model.safetensors`` or the shards listed in ``model.safetensors.index.json``) and
nothing else; it never looks at the environment or decides which slices a device
needs (the shard map in ``weights`` does: ``shard_slices``). Tensors are read through
safetensors' memory map, slice by slice (``safe_open(...).get_slice(name)[index]``), so
a device reading its tensor-parallel shard touches only those bytes, never the full model.

Supported: ``LlamaForCausalLM`` (optionally with Llama 3's ``rope_scaling``) and
``Qwen2ForCausalLM`` (q/k/v biases, full attention). Anything Nereus's decoder would
compute differently (another architecture, an activation other than SiLU, an o_proj or
MLP bias, a sliding window, a head_dim other than hidden/heads, another RoPE type) is
refused in one line rather than run with different numerics.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from safetensors import safe_open

from nereus_core.config import ModelConfig
from nereus_core.model.weights import param_shapes, shard_slices, stage_param_names

SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
    "rms_norm_eps",
)
# A tensor index: one slice per dim, or None for the whole tensor.
Index = tuple[slice, ...] | None


class HFDirError(ValueError):
    """A model directory Nereus cannot use; ``str(err)`` is one line naming the file and the reason."""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise HFDirError(f"{path} not found; a model directory needs config.json and safetensors weights")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise HFDirError(f"{path} is not readable JSON: {err}") from None
    if not isinstance(data, dict):
        raise HFDirError(f"{path} holds {type(data).__name__}, not a JSON object")
    return data


def _architecture(raw: dict[str, Any], where: Path) -> str:
    found = raw.get("architectures") or []
    if len(found) != 1 or found[0] not in SUPPORTED:
        raise HFDirError(
            f"{where}: architecture {', '.join(map(str, found)) or '(none)'} is not supported; "
            f"supported: {', '.join(SUPPORTED)}"
        )
    return found[0]


def _rope(raw: dict[str, Any], where: Path) -> dict[str, Any]:
    """``rope_theta`` and ``rope_scaling`` from either config format (``rope_parameters``, or the
    older top-level ``rope_theta`` with ``rope_scaling``)."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.pop("rope_theta", raw.get("rope_theta", 10000.0))  # HF's default for both
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type == "default":
        return {"rope_theta": theta}
    if rope_type != "llama3":
        raise HFDirError(f"{where}: rope_type {rope_type!r} is not supported; supported: default, llama3")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return {"rope_theta": theta, "rope_scaling": {k: params.get(k) for k in keys}}


def _refuse_other_numerics(raw: dict[str, Any], architecture: str, where: Path) -> None:
    problems = []
    if raw.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={raw['hidden_act']!r} (only silu)")
    if architecture == "LlamaForCausalLM" and raw.get("attention_bias"):
        problems.append("attention_bias=true (Llama's adds an o_proj bias)")
    if raw.get("mlp_bias"):
        problems.append("mlp_bias=true")
    if raw.get("use_sliding_window"):
        problems.append("use_sliding_window=true (only full attention)")
    head_dim = raw.get("head_dim")
    if head_dim is not None and head_dim * raw["num_attention_heads"] != raw["hidden_size"]:
        problems.append(f"head_dim={head_dim} != hidden_size/num_attention_heads")
    if problems:
        raise HFDirError(f"{where}: not supported: {'; '.join(problems)}")


def read_hf_config(path: str | os.PathLike[str]) -> ModelConfig:
    """The ``ModelConfig`` of the model directory ``path`` (from ``path/config.json``)."""
    where = Path(path) / "config.json"
    if not Path(path).is_dir():
        raise HFDirError(f"model directory {path} not found")
    raw = _read_json(where)
    architecture = _architecture(raw, where)
    missing = [key for key in _REQUIRED if key not in raw]
    if missing:
        raise HFDirError(f"{where} lacks {', '.join(missing)}")
    _refuse_other_numerics(raw, architecture, where)
    fields = {key: raw[key] for key in _REQUIRED}
    try:
        return ModelConfig(
            **fields,
            **_rope(raw, where),
            architecture=architecture,
            attention_bias=architecture == "Qwen2ForCausalLM",
            num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        )
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(part) for part in first["loc"])
        raise HFDirError(f"{where}: {loc + ': ' if loc else ''}{first['msg']}") from None


def weight_files(path: str | os.PathLike[str]) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (one file, or the shards of the index)."""
    root = Path(path)
    index = root / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise HFDirError(f"{index} has no weight_map object")
        return {name: root / file for name, file in weight_map.items()}
    single = root / SINGLE_FILE
    if not single.is_file():
        raise HFDirError(f"{root} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    with safe_open(str(single), framework="pt") as handle:
        return dict.fromkeys(handle.keys(), single)


def read_slices(path: str | os.PathLike[str], wanted: Mapping[str, Index]) -> dict[str, torch.Tensor]:
    """``{name: tensor[index]}`` for each wanted name (``None``: the whole tensor), read memory-mapped.

    Each file is opened once; only the wanted slices are copied out, in the file's dtype.
    """
    files = weight_files(path)
    absent = [name for name in wanted if name not in files]
    if absent:
        raise HFDirError(f"{path} lacks {len(absent)} wanted tensors, e.g. {absent[0]!r}")
    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        by_file.setdefault(files[name], []).append(name)
    out: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        if not file.is_file():
            raise HFDirError(f"{file} (listed in {INDEX_FILE}) not found")
        with safe_open(str(file), framework="pt") as handle:
            for name in names:
                piece = handle.get_slice(name)
                index = wanted[name]
                out[name] = piece[:] if index is None else piece[index]
    return {name: out[name] for name in wanted}


def read_stage_shards(
    path: str | os.PathLike[str],
    config: ModelConfig,
    *,
    layers: range,
    first: bool,
    last: bool,
    tp_rank: int,
    tp: int,
) -> dict[str, torch.Tensor]:
    """The tensors one pipeline stage holds on tp rank ``tp_rank``, each read as its shard only
    (for ``LlamaStage.load_local_state``)."""
    shapes = param_shapes(config)
    names = stage_param_names(config, layers, first, last)
    return read_slices(path, {name: shard_slices(name, shapes[name], tp_rank, tp) for name in names})
