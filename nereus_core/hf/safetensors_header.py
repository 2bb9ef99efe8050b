"""What a safetensors file's header promises, checked against the file and against the tensors a
model needs, without reading any tensor's bytes.

The format (huggingface/safetensors, "Format"): 8 bytes, a little-endian u64 ``N``; ``N`` bytes of
JSON mapping each tensor name to ``{dtype, shape, data_offsets: [begin, end]}`` (offsets into the
bytes after the header) and an optional ``__metadata__``; then the tensors' bytes. A file whose
header is cut off, is not JSON, is larger than safetensors itself accepts (100 MB), or promises bytes
past the end of the file is refused in one line naming the file (and the tensor), before any device
memory-maps it. ``tensor_problem`` then compares a tensor's entry with the shape the model needs.

Boundary: reads headers of the files it is given; which tensors a model needs is the caller's.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit (MAX_HEADER_SIZE)
ITEM_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
WEIGHT_DTYPES = ("F32", "BF16", "F16", "F64")  # what Nereus converts to model.dtype when it loads


class HeaderError(ValueError):
    """A safetensors file whose header is damaged; ``str(err)`` is one line naming the file."""


@dataclass(frozen=True)
class Entry:
    """One tensor's header entry."""

    dtype: str
    shape: tuple[int, ...]


def _entry(file: Path, name: str, raw: object, data_bytes: int) -> Entry:
    if not isinstance(raw, dict):
        raise HeaderError(f"{file}: tensor {name!r}: the header entry is not an object")
    dtype, shape, offsets = raw.get("dtype"), raw.get("shape"), raw.get("data_offsets")
    if dtype not in ITEM_BYTES:
        raise HeaderError(f"{file}: tensor {name!r}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise HeaderError(f"{file}: tensor {name!r}: shape {shape!r} is not a list of sizes")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and o >= 0 for o in offsets)
        or offsets[1] < offsets[0]
    ):
        raise HeaderError(f"{file}: tensor {name!r}: data_offsets {offsets!r} is not [begin, end]")
    if offsets[1] - offsets[0] != math.prod(shape) * ITEM_BYTES[dtype]:
        raise HeaderError(
            f"{file}: tensor {name!r}: {offsets[1] - offsets[0]} bytes for shape {shape} of {dtype}"
        )
    if offsets[1] > data_bytes:
        raise HeaderError(
            f"{file} is truncated: tensor {name!r} ends at byte {offsets[1]:,} of the data, which has "
            f"{data_bytes:,}; download or copy the file again"
        )
    return Entry(dtype, tuple(shape))


def read_header(file: Path) -> dict[str, Entry]:
    """The tensor entries of the safetensors ``file``, each checked against the file's size."""
    size = file.stat().st_size
    with file.open("rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise HeaderError(f"{file} is truncated: {size} bytes, not even a safetensors header length")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES:
            raise HeaderError(
                f"{file}: the header claims {length:,} bytes, over safetensors' {MAX_HEADER_BYTES:,}; "
                "the file is damaged or not safetensors"
            )
        if 8 + length > size:
            raise HeaderError(f"{file} is truncated: its {length:,}-byte header runs past the file's end")
        text = handle.read(length)
    try:
        raw = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HeaderError(f"{file}: the header is not JSON ({err}); the file is damaged") from None
    if not isinstance(raw, dict):
        raise HeaderError(f"{file}: the header is not a JSON object; the file is damaged")
    data_bytes = size - 8 - length
    return {
        name: _entry(file, name, entry, data_bytes) for name, entry in raw.items() if name != "__metadata__"
    }


def tensor_problem(file: Path, name: str, entry: Entry, shape: tuple[int, ...]) -> str | None:
    """Why ``entry`` (tensor ``name`` of ``file``) is not the floating tensor of ``shape`` the model
    needs, or None."""
    if entry.shape != shape:
        return f"{file}: tensor {name!r} has shape {list(entry.shape)}, but config.json needs {list(shape)}"
    if entry.dtype not in WEIGHT_DTYPES:
        return f"{file}: tensor {name!r} is {entry.dtype}; weights are one of {', '.join(WEIGHT_DTYPES)}"
    return None


__all__ = ["MAX_HEADER_BYTES", "WEIGHT_DTYPES", "Entry", "HeaderError", "read_header", "tensor_problem"]
