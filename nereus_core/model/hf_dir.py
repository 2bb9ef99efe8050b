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
from nereus_core.model.weights import param_shapes, shard_slices, stage_param_names


def read_hf_config(path: str | os.PathLike[str]) -> ModelConfig:
    """The ``ModelConfig`` of the model directory ``path`` (from ``path/config.json``)."""
    return validated(ModelConfig, hf_fields(path), Path(path) / "config.json")


def read_value_config(path: str | os.PathLike[str]) -> ModelConfig:
    """The ``ModelConfig`` (``head="value"``) of a one-label sequence- or token-classification directory."""
    return validated(ModelConfig, value_fields(path), Path(path) / "config.json")


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
]
