"""One snapshot data file: an Arrow IPC file (random-access format) with one record batch per tensor slice.

Each batch has one row: ``name`` (string), ``global_shape``, ``start`` and ``shape``
(list<int64>), ``dtype`` (string), ``crc32`` (uint32, zlib over the raw bytes) and ``data``
(large_binary: the slice's raw bytes, C order, native little-endian).

Why ``large_binary``: a one-row binary column keeps the bytes in one contiguous Arrow buffer
(8-byte aligned in the IPC file), with 64-bit offsets so a slice may exceed 2 GiB. Opened
through ``pa.memory_map`` and ``reader.get_batch(i)`` (the file footer locates batch ``i``
without reading the others), that buffer is a pointer into the mapping, and
``torch.frombuffer`` views it as a tensor without copying. A fixed-size list would tie the
column type to one slice's size; a tensor extension type would add metadata for no gain.

Boundary: tensors <-> bytes of one file, with the checks that refuse a damaged file. Which
file and batch to read comes from the manifest (storage/manifest.py).
"""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from nereus_core.emu import SliceSpec
from storage.manifest import CorruptSnapshotError, SliceEntry, replacing

_SHAPE = pa.list_(pa.int64())
SCHEMA = pa.schema(
    [
        ("name", pa.string()),
        ("global_shape", _SHAPE),
        ("start", _SHAPE),
        ("shape", _SHAPE),
        ("dtype", pa.string()),
        ("crc32", pa.uint32()),
        ("data", pa.large_binary()),
    ],
    metadata={b"nereus.format": b"emu-slices/1"},
)
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


def _raw_bytes(name: str, tensor: torch.Tensor) -> np.ndarray:
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise ValueError(f"{name}: dtype {tensor.dtype} cannot be stored; supported: {sorted(DTYPES)}")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else np.zeros(0, dtype=np.uint8)


def encode_slice(
    name: str, tensor: torch.Tensor, spec: SliceSpec, batch: int
) -> tuple[pa.RecordBatch, SliceEntry]:
    """The record batch of one slice and its manifest entry (the data buffer is not copied)."""
    box = spec.box
    if tuple(tensor.shape) != box.shape:
        raise ValueError(f"{name}: tensor shape {tuple(tensor.shape)} differs from its box {box}")
    if len(spec.global_shape) != len(box.start) or not all(
        a >= 0 and b <= s for a, b, s in zip(box.start, box.stop, spec.global_shape, strict=True)
    ):
        raise ValueError(f"{name}: box {box} lies outside the global shape {spec.global_shape}")
    raw = _raw_bytes(name, tensor)
    offsets = pa.py_buffer(np.array([0, raw.nbytes], dtype=np.int64))
    data = pa.Array.from_buffers(pa.large_binary(), 1, [None, offsets, pa.py_buffer(raw)])
    entry = SliceEntry(
        name=name,
        batch=batch,
        global_shape=spec.global_shape,
        start=box.start,
        shape=box.shape,
        dtype=str(tensor.dtype).removeprefix("torch."),
        crc32=zlib.crc32(raw),
        nbytes=raw.nbytes,
    )
    columns = [
        pa.array([name]),
        pa.array([list(entry.global_shape)], type=_SHAPE),
        pa.array([list(entry.start)], type=_SHAPE),
        pa.array([list(entry.shape)], type=_SHAPE),
        pa.array([entry.dtype]),
        pa.array([entry.crc32], type=pa.uint32()),
        data,
    ]
    return pa.record_batch(columns, schema=SCHEMA), entry


def write_slices(path: Path, slices: Sequence[tuple[str, torch.Tensor, SliceSpec]]) -> list[SliceEntry]:
    """Write one data file atomically (temp name, fsync, rename); returns its entries in batch order."""
    entries: list[SliceEntry] = []
    with replacing(path) as tmp, pa.OSFile(str(tmp), "wb") as sink:
        with pa.ipc.new_file(sink, SCHEMA) as writer:
            for i, (name, tensor, spec) in enumerate(slices):
                batch, entry = encode_slice(name, tensor, spec, i)
                writer.write_batch(batch)
                entries.append(entry)
        sink.flush()
    return entries


class SliceReader:
    """A memory-mapped data file; ``view(entry)`` checks one slice and views it without copying."""

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        try:
            actual = path.stat().st_size
        except FileNotFoundError:
            raise CorruptSnapshotError(f"{path}: missing; the manifest lists it") from None
        if actual != size:
            raise CorruptSnapshotError(
                f"{path}: {actual} bytes but the manifest records {size} (truncated or overwritten)"
            )
        try:
            self._map = pa.memory_map(str(path))
            self._reader = pa.ipc.open_file(self._map)
        except (pa.ArrowException, OSError) as err:
            raise CorruptSnapshotError(f"{path}: not a readable Arrow IPC file ({err})") from None

    def close(self) -> None:
        self._map.close()

    def view(self, entry: SliceEntry) -> torch.Tensor:
        """The slice as a read-only tensor over the mapping, after its crc32 is checked."""
        where = f"{self.path}: tensor {entry.name} at {list(entry.start)}"
        try:
            batch = self._reader.get_batch(entry.batch)
            row = {k: batch.column(k)[0].as_py() for k in ("name", "start", "shape", "dtype", "crc32")}
            _, offsets, data = batch.column("data").buffers()
            lo, hi = np.frombuffer(offsets, dtype=np.int64, count=2).tolist()
        except (pa.ArrowException, OSError, IndexError, ValueError) as err:
            raise CorruptSnapshotError(f"{where}: record batch {entry.batch} unreadable ({err})") from None
        expected = {k: getattr(entry, k) for k in ("name", "start", "shape", "dtype", "crc32")}
        if {**row, "start": tuple(row["start"]), "shape": tuple(row["shape"])} != expected:
            raise CorruptSnapshotError(f"{where}: record batch {entry.batch} does not match the manifest")
        dtype = DTYPES[entry.dtype]
        if entry.nbytes == 0:
            return torch.empty(entry.shape, dtype=dtype)
        raw = memoryview(data)[lo:hi] if data is not None else memoryview(b"")
        if len(raw) != entry.nbytes or zlib.crc32(raw) != entry.crc32:
            raise CorruptSnapshotError(f"{where}: crc32 mismatch, the data is corrupted")
        with warnings.catch_warnings():  # the mapping is read-only; callers copy what they keep
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(raw, dtype=dtype).reshape(entry.shape)
