"""A Hugging Face model directory as Nereus's model: its ``ModelConfig``, and the slices one pipeline
stage on one tensor-parallel rank holds.

What the directory says (config.json's fields, its tensors' files, slices read memory-mapped) is
``nereus_core.hf.files``'s; this module adds what needs the model's config and shard map.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from nereus_core.config import ModelConfig
from nereus_core.hf.files import (
    INDEX_FILE,
    SINGLE_FILE,
    SUPPORTED,
    VALUE_HEADS,
    HFDirError,
    hf_fields,
    read_slices,
    validated,
    value_fields,
    weight_files,
)
from nereus_core.hf.safetensors_header import HeaderError, read_header, tensor_problem
from nereus_core.model.weights import param_shapes, shard_slices, stage_param_names


def read_hf_config(path: str | os.PathLike[str]) -> ModelConfig:
    """The ``ModelConfig`` of the model directory ``path`` (from ``path/config.json``)."""
    return validated(ModelConfig, hf_fields(path), Path(path) / "config.json")


def read_value_config(path: str | os.PathLike[str]) -> ModelConfig:
    """The ``ModelConfig`` (``head="value"``) of a one-label sequence- or token-classification directory."""
    return validated(ModelConfig, value_fields(path), Path(path) / "config.json")


def weights_problem(path: str | os.PathLike[str], config: ModelConfig) -> str | None:
    """Why the safetensors of the directory ``path`` cannot give ``config``'s parameters (a file that
    is truncated, has a damaged or oversized header, lies outside the directory, lacks a tensor or
    holds one of another shape or a non-float dtype), as one line naming the file and the tensor; or
    None. Reads the headers only, so that a bad directory is refused before any device loads it."""
    try:
        files = weight_files(path)
        root = Path(path)
        by_file: dict[Path, list[str]] = {}
        needed = param_shapes(config)
        for name in needed:
            if name not in files:
                where = root / (INDEX_FILE if (root / INDEX_FILE).is_file() else SINGLE_FILE)
                return f"{where} lacks tensor {name!r}, which config.json's model needs"
            by_file.setdefault(files[name], []).append(name)
        for file, names in by_file.items():
            if not file.is_file():
                return f"{file} (listed in {INDEX_FILE}) not found"
            header = read_header(file)
            for name in names:
                if name not in header:
                    return f"{file} lacks tensor {name!r} ({INDEX_FILE} places it there)"
                problem = tensor_problem(file, name, header[name], needed[name])
                if problem:
                    return problem
    except (HFDirError, HeaderError) as err:
        return str(err)
    except OSError as err:
        return f"{path}: a weights file cannot be read: {err.strerror or err}"
    return None


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


__all__ = [
    "INDEX_FILE",
    "SINGLE_FILE",
    "SUPPORTED",
    "VALUE_HEADS",
    "HFDirError",
    "read_hf_config",
    "read_slices",
    "read_stage_shards",
    "read_value_config",
    "weight_files",
    "weights_problem",
]
