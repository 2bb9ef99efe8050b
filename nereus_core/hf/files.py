"""What a Hugging Face model directory says, read without building a model: its config.json's fields,
its tensors' files, and slices of them.

The boundary: this module reads the directory the caller names (``config.json``,
``model.safetensors`` or the shards listed in ``model.safetensors.index.json``) and
nothing else; it never looks at the environment or decides which slices a device
needs (the shard map in ``nereus_core.model.weights`` does: ``shard_slices``). Tensors are read
through safetensors' memory map, slice by slice (``safe_open(...).get_slice(name)[index]``), so
a device reading its tensor-parallel shard touches only those bytes, never the full model.
It imports no config: the config asks it (``imported_section``) when ``model.path`` is set, and
``nereus_core.model.hf_dir`` builds ``ModelConfig``s from it.

Supported: ``LlamaForCausalLM`` (optionally with Llama 3's ``rope_scaling``) and
``Qwen2ForCausalLM`` (q/k/v biases, full attention), and for a value head their one-label
``*ForSequenceClassification`` / ``*ForTokenClassification`` (``score.weight``; a token
classifier's ``score.bias`` must be zero: Nereus's value head has none). Anything Nereus's decoder
would compute differently (another architecture, an activation other than SiLU, an o_proj or
MLP bias, a sliding window, a head_dim other than hidden/heads, another RoPE type) is
refused in one line rather than run with different numerics.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
from pydantic import BaseModel, ValidationError
from safetensors import safe_open

from nereus_core.hf.safetensors_header import HeaderError, read_header
from nereus_core.hf.tokenizer import tokenizer_error

SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM")
MODEL_TYPES = {"Llama": "llama", "Qwen2": "qwen2"}  # config.json's model_type of each architecture
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_JSON_BYTES = 64 << 20
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
M = TypeVar("M", bound=BaseModel)


class HFDirError(ValueError):
    """A model directory Nereus cannot use; ``str(err)`` is one line naming the file and the reason."""


VALUE_HEADS = tuple(
    f"{base}For{kind}Classification" for base in ("Llama", "Qwen2") for kind in ("Sequence", "Token")
)
SCORE_BIAS = "score.bias"


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise HFDirError(f"{path} not found; a model directory needs config.json and safetensors weights")
    if path.stat().st_size > MAX_JSON_BYTES:
        raise HFDirError(f"{path} is over {MAX_JSON_BYTES:,} bytes; a config or index file is a few KB")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise HFDirError(f"{path} is not readable JSON: {err}") from None
    if not isinstance(data, dict):
        raise HFDirError(f"{path} holds {type(data).__name__}, not a JSON object")
    return data


def _architecture(raw: dict[str, Any], where: Path, supported: tuple[str, ...]) -> str:
    found = raw.get("architectures") or []
    if not isinstance(found, list) or len(found) != 1 or found[0] not in supported:
        named = ", ".join(map(str, found)) if isinstance(found, list) else repr(found)
        raise HFDirError(
            f"{where}: architecture {named or '(none)'} is not supported; supported: {', '.join(supported)}"
        )
    model_type = raw.get("model_type")
    expected = MODEL_TYPES[found[0].partition("For")[0]]
    if model_type is not None and model_type != expected:  # transformers builds by model_type
        raise HFDirError(
            f"{where}: model_type {model_type!r} does not match architecture {found[0]}; supported "
            f"model_type: {', '.join(sorted(set(MODEL_TYPES.values())))}, each with its own architecture"
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


def _fields(root: Path, raw: dict[str, Any], architecture: str) -> dict[str, Any]:
    """``ModelConfig`` fields of ``raw`` (a config.json of ``architecture``'s CausalLM form)."""
    where = root / "config.json"
    missing = [key for key in _REQUIRED if key not in raw]
    if missing:
        raise HFDirError(f"{where} lacks {', '.join(missing)}")
    _refuse_other_numerics(raw, architecture, where)
    return {
        **{key: raw[key] for key in _REQUIRED},
        **_rope(raw, where),
        "architecture": architecture,
        "attention_bias": architecture == "Qwen2ForCausalLM",
        "num_key_value_heads": raw.get("num_key_value_heads") or raw["num_attention_heads"],
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
    }


def validated(model: type[M], fields: dict[str, Any], where: Path) -> M:
    """``model(**fields)``, a ``ValidationError`` turned into one ``HFDirError`` line naming ``where``."""
    try:
        return model(**fields)
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(part) for part in first["loc"])
        msg = first["msg"].removeprefix("Value error, ").replace("Input should be", "must be")
        raise HFDirError(f"{where}: {loc + ': ' if loc else ''}{msg}") from None


def _raw(path: str | os.PathLike[str]) -> tuple[Path, dict[str, Any]]:
    root = Path(path)
    if not root.is_dir():
        raise HFDirError(f"model directory {path} not found")
    config = root / "config.json"
    return root, _read_json(inside(root, config, named_by="a symlink") if config.exists() else config)


def hf_fields(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``ModelConfig`` fields ``path/config.json`` sets (a CausalLM directory), unvalidated."""
    root, raw = _raw(path)
    return _fields(root, raw, _architecture(raw, root / "config.json", SUPPORTED))


def value_fields(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The fields (``head="value"``) of a one-label ``*ForSequenceClassification`` or
    ``*ForTokenClassification`` directory (a critic or reward model: the backbone and ``score.weight``)."""
    root, raw = _raw(path)
    where = root / "config.json"
    architecture = _architecture(raw, where, VALUE_HEADS)
    labels = len(raw.get("id2label") or {}) or raw.get("num_labels", 2)  # HF's default: 2 labels
    if labels != 1:
        raise HFDirError(f"{where}: {labels} labels; a value head has one (num_labels=1)")
    if SCORE_BIAS in weight_files(root):  # *ForTokenClassification's score has a bias; Nereus's has none
        bias = read_slices(root, {SCORE_BIAS: None})[SCORE_BIAS]
        if bias.any():
            raise HFDirError(
                f"{root}: score.bias is {bias.tolist()}, not zero; Nereus's value head has no bias"
            )
    causal = architecture.partition("For")[0] + "ForCausalLM"
    return {**_fields(root, raw, causal), "head": "value"}


# The fields a directory decides; the others stay the config's: head, seed, init_std, path, tokenizer,
# and dtype (the precision the job trains in, as verl's; the file's is only how it is stored: a bf16
# file into fp32 is widened exactly, an fp32 file into bf16 is rounded to nearest).
KEPT = ("head", "seed", "init_std", "path", "tokenizer", "dtype", "gradient_checkpointing")


def imported_section(section: dict[str, Any], model: type[M]) -> dict[str, Any]:
    """The ``model:`` mapping ``section`` with its ``path``'s config.json fields filled in (paths made
    absolute), for the config class ``model``. A field given beside ``path`` must equal the directory's;
    a problem is a ``ValueError`` of one line naming the field (what pydantic shows at config load)."""
    section = dict(section)
    if section.get("tokenizer") is not None:
        section["tokenizer"] = os.path.abspath(str(section["tokenizer"]))
        problem = tokenizer_error(section["tokenizer"])
        if problem:
            raise ValueError(f"model.tokenizer: {problem}")
    if section.get("path") is None:
        return section
    section["path"] = os.path.abspath(str(section["path"]))
    where = Path(section["path"]) / "config.json"
    try:
        imported = validated(model, hf_fields(section["path"]), where)
    except HFDirError as err:
        raise ValueError(f"model.path: {err}") from None
    merged = {**imported.model_dump(), **section}
    given = {k: v for k, v in section.items() if k in model.model_fields and k not in KEPT}
    try:
        beside = model(**{**imported.model_dump(), **given})
    except ValidationError:
        return merged  # a bad value beside path: the section's own validation names it
    for key in given:
        if getattr(beside, key) != getattr(imported, key):
            raise ValueError(
                f"model.{key}={given[key]!r} conflicts with {getattr(imported, key)!r} in {where}; "
                f"remove model.{key} (model.path decides it) or make it equal"
            )
    return merged


def value_model(path: str | os.PathLike[str], ours: M, *, role: str) -> M:
    """The ``role`` model (the critic, or the reward model) of the value-head directory ``path``: its
    own architecture and shapes from that directory's config.json, the job's choices (``KEPT``: the
    value head, dtype, seed) from ``ours`` (the actor's config with the value head). It reads the
    actor's token ids, so its vocabulary size must be the actor's; depth, width and heads may differ.
    A problem is one ``HFDirError`` line."""
    kept = {key: getattr(ours, key) for key in KEPT if key not in ("path", "tokenizer")}
    theirs = validated(type(ours), {**value_fields(path), **kept}, Path(path) / "config.json")
    if theirs.vocab_size != ours.vocab_size:
        raise HFDirError(
            f"{path}: vocab_size={theirs.vocab_size} differs from the actor's {ours.vocab_size}; "
            f"the {role} reads the actor's token ids, so it needs the actor's vocabulary"
        )
    return theirs


def inside(root: Path, file: Path, *, named_by: str) -> Path:
    """``file``, after checking that it (symlinks resolved) lies inside the directory ``root``: a
    model directory is read as it is, and never leads the reader elsewhere."""
    resolved, base = file.resolve(), root.resolve()
    if resolved != base and base not in resolved.parents:
        raise HFDirError(
            f"{file} ({named_by}) leads outside {root}, to {resolved}; not followed: copy the file into "
            "the directory (huggingface-cli download --local-dir writes plain files)"
        )
    return file


def weight_files(path: str | os.PathLike[str]) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (one file, or the shards of the index), each
    inside ``path`` (``inside``)."""
    root = Path(path)
    index = root / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(inside(root, index, named_by="the index")).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise HFDirError(f"{index} has no weight_map object of tensor name -> file name")
        named = f"in {INDEX_FILE}"
        files = {file: inside(root, root / file, named_by=named) for file in set(weight_map.values())}
        return {name: files[file] for name, file in weight_map.items()}
    single = root / SINGLE_FILE
    if not single.is_file():
        raise HFDirError(f"{root} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    inside(root, single, named_by="a symlink")
    try:
        return dict.fromkeys(read_header(single), single)
    except HeaderError as err:
        raise HFDirError(str(err)) from None


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
