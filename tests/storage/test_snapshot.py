"""The Arrow EMU store (storage/): round trips, partial reads, damage detection, atomic commit."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pyarrow as pa
import pytest
import torch

import storage
import storage.manifest
from nereus_core.config import ModelConfig
from nereus_core.emu import Box, ShardMap, SliceSpec, shard_map
from nereus_core.layout import Layout
from nereus_core.model.weights import init_full_state
from storage import (
    CorruptSnapshotError,
    SnapshotExistsError,
    SnapshotNotFoundError,
    find_snapshot,
    list_snapshots,
    read_full_state,
    read_slices,
    write_snapshot,
)
from storage.ipc import SliceReader

TINY = ModelConfig(
    vocab_size=32,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def _halves(full: torch.Tensor) -> dict[int, dict[str, tuple[torch.Tensor, SliceSpec]]]:
    """Two devices, each holding half of ``w`` along dim 0, and a whole 0-d ``s``."""
    rows = full.shape[0] // 2
    shape = tuple(full.shape)
    out = {}
    for device in (0, 1):
        box = Box((device * rows, 0), ((device + 1) * rows, shape[1]))
        scalar = torch.tensor(3.0, dtype=full.dtype)
        out[device] = {
            "w": (full[box.slices()].clone(), SliceSpec(shape, box)),
            "s": (scalar, SliceSpec((), Box((), ()))),
        }
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bitwise(tmp_path: Path, dtype: torch.dtype) -> None:
    full = torch.randn(6, 5, generator=torch.Generator().manual_seed(0)).to(dtype)
    full[0, 0] = float("nan")  # NaN payloads and signed zeros survive bit for bit
    full[0, 1] = -0.0
    ref = write_snapshot(tmp_path, "actor", 3, _halves(full), layout=Layout.contiguous(dp=2))
    whole, scalar = read_slices(ref, [("w", None), ("s", None)])
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert whole.dtype == dtype and torch.equal(whole.view(bits), full.view(bits))
    assert scalar.shape == () and scalar.item() == 3.0
    assert ref.manifest.layout == Layout.contiguous(dp=2)
    assert [f.path for f in ref.manifest.files] == ["device=0.arrow", "device=1.arrow"]


def test_reads_only_the_batches_that_intersect(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    full = torch.arange(6 * 5, dtype=torch.float32).reshape(6, 5)
    ref = write_snapshot(tmp_path, "actor", 0, _halves(full))
    read: list[tuple[str, str]] = []
    original = SliceReader.view

    def spy(self: SliceReader, entry: storage.SliceEntry) -> torch.Tensor:
        read.append((self.path.name, entry.name))
        return original(self, entry)

    monkeypatch.setattr(SliceReader, "view", spy)
    (top,) = read_slices(ref, [("w", Box((0, 1), (2, 4)))])
    assert torch.equal(top, full[0:2, 1:4]) and read == [("device=0.arrow", "w")]
    read.clear()
    (middle,) = read_slices(ref, [("w", Box((2, 0), (5, 5)))])  # spans both files
    assert torch.equal(middle, full[2:5]) and sorted(read) == [
        ("device=0.arrow", "w"),
        ("device=1.arrow", "w"),
    ]


def test_slice_views_are_zero_copy(tmp_path: Path) -> None:
    full = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    ref = write_snapshot(tmp_path, "actor", 0, _halves(full))
    file = ref.manifest.files[1]
    path = ref.path / file.path
    reader = SliceReader(path, file.size)
    view = reader.view(file.slices[0])
    assert torch.equal(view, full[4:])
    # The view points into the reader's mapping of the file, at the bytes of the slice.
    mapping = reader._map
    mapping.seek(0)
    base = mapping.read_buffer(file.size).address
    offset = view.data_ptr() - base
    assert 0 < offset < file.size
    assert path.read_bytes()[offset : offset + 4 * view.numel()] == full[4:].numpy().tobytes()
    reader.close()


def _data_offset(path: Path, tensor: torch.Tensor) -> int:
    blob = path.read_bytes()
    offset = blob.find(tensor.numpy().tobytes())
    assert offset > 0
    return offset


def test_a_flipped_data_byte_is_refused_naming_file_and_tensor(tmp_path: Path) -> None:
    full = torch.randn(6, 5, generator=torch.Generator().manual_seed(1))
    ref = write_snapshot(tmp_path, "critic", 1, _halves(full))
    path = ref.path / "device=1.arrow"
    offset = _data_offset(path, full[3:])
    with open(path, "r+b") as f:
        f.seek(offset + 7)
        byte = f.read(1)
        f.seek(offset + 7)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CorruptSnapshotError, match=r"device=1\.arrow: tensor w .*crc32"):
        read_slices(ref, [("w", None)])
    # The intact half still reads: only the slices asked for are checked.
    (top,) = read_slices(ref, [("w", Box((0, 0), (3, 5)))])
    assert torch.equal(top, full[:3])


def test_a_truncated_file_is_refused_naming_it(tmp_path: Path) -> None:
    full = torch.randn(6, 5)
    write_snapshot(tmp_path, "actor", 2, _halves(full))
    path = tmp_path / "state" / "actor" / "step=2" / "device=0.arrow"
    os.truncate(path, path.stat().st_size - 40)
    with pytest.raises(CorruptSnapshotError, match=r"device=0\.arrow: .*truncated"):
        read_slices(find_snapshot(tmp_path, "actor"), [("w", None)])


def test_a_truncated_file_with_a_forged_size_is_still_refused(tmp_path: Path) -> None:
    ref = write_snapshot(tmp_path, "actor", 0, _halves(torch.randn(6, 5)))
    path = ref.path / "device=0.arrow"
    os.truncate(path, path.stat().st_size - 40)
    with pytest.raises(CorruptSnapshotError, match=r"device=0\.arrow: not a readable Arrow"):
        SliceReader(path, path.stat().st_size)


def test_a_crash_before_the_manifest_commit_leaves_the_previous_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old, new = torch.zeros(6, 5), torch.ones(6, 5)
    write_snapshot(tmp_path, "actor", 1, {0: {"w": (old, SliceSpec((6, 5), Box.full((6, 5))))}})

    def crash(path: Path, data: bytes) -> None:
        raise OSError("simulated crash before the manifest rename")

    monkeypatch.setattr(storage.manifest, "atomic_write", crash)
    with pytest.raises(OSError, match="simulated crash"):
        write_snapshot(tmp_path, "actor", 2, {0: {"w": (new, SliceSpec((6, 5), Box.full((6, 5))))}})
    monkeypatch.undo()
    assert (
        tmp_path / "state" / "actor" / "step=2" / "device=0.arrow"
    ).is_file()  # data written, not committed
    assert [r.step for r in list_snapshots(tmp_path, "actor")] == [1]
    assert torch.equal(read_full_state(tmp_path, "actor")["w"], old)
    with pytest.raises(SnapshotNotFoundError, match="step 2"):
        read_full_state(tmp_path, "actor", step=2)
    # A retry of the interrupted step commits it; a committed step is never rewritten.
    write_snapshot(tmp_path, "actor", 2, {0: {"w": (new, SliceSpec((6, 5), Box.full((6, 5))))}})
    assert torch.equal(read_full_state(tmp_path, "actor")["w"], new)
    assert torch.equal(read_full_state(tmp_path, "actor", step=1)["w"], old)
    with pytest.raises(SnapshotExistsError):
        write_snapshot(tmp_path, "actor", 2, {0: {"w": (old, SliceSpec((6, 5), Box.full((6, 5))))}})


def _shards_of(smap: ShardMap, state: dict[str, torch.Tensor]) -> dict[int, list]:
    """Each device's pieces, cut from ``state`` (moments: filled with a marker) as the executor would."""
    shards: dict[int, list] = {d: [] for d in smap.layout.devices}
    for spec in smap.tensors:
        for piece in spec.pieces:
            source = state[spec.param] if spec.kind == "param" else torch.full(spec.shape, 7.0)
            tensor = source[piece.box.slices()].clone()
            shards[piece.device].append((spec.name, tensor, spec.slice_spec(piece)))
    return shards


def test_read_full_state_unshards_tp2_pp2(tmp_path: Path) -> None:
    state = init_full_state(TINY)
    layout = Layout(tp=2, pp=2, dp=1, devices=(3, 0, 2, 1))
    smap = shard_map(TINY, layout, train=True)
    write_snapshot(tmp_path, "actor", 5, _shards_of(smap, state), layout=layout, meta={"plan_id": "p1"})
    got = read_full_state(tmp_path, "actor")
    assert list(got) == list(state)  # parameters only, HF names, HF order
    for name, tensor in state.items():
        assert torch.equal(got[name], tensor), name
    ref = find_snapshot(tmp_path, "actor", 5)
    assert ref.manifest.meta == {"plan_id": "p1"}
    # A new rank's pieces under another layout, straight from the store.
    new = shard_map(TINY, Layout(tp=1, pp=2, dp=2, devices=(0, 1, 2, 3)), train=True)
    wanted = new.wanted(2)
    for (name, box), tensor in zip(wanted, read_slices(ref, wanted), strict=True):
        expected = state[name][box.slices()] if ":" not in name else torch.full(box.shape, 7.0)
        assert torch.equal(tensor, expected), name


def test_state_files_are_arrow_and_json_never_pickle(tmp_path: Path) -> None:
    state = init_full_state(TINY)
    smap = shard_map(TINY, Layout.contiguous(tp=2), train=True)
    write_snapshot(tmp_path, "actor", 0, _shards_of(smap, state))
    files = [p for p in (tmp_path / "state").rglob("*") if p.is_file()]
    assert sorted(p.name for p in files) == ["device=0.arrow", "device=1.arrow", "manifest.json"]
    for path in files:
        blob = path.read_bytes()
        for marker in (b"_rebuild_tensor", b"torch._utils", b"cbuiltins", b"ccopy_reg", b"__reduce__"):
            assert marker not in blob, f"{path} contains a pickle marker {marker!r}"
        if path.suffix == ".arrow":
            assert blob[:6] == b"ARROW1" and blob[-6:] == b"ARROW1"
            schema = pa.ipc.open_file(pa.py_buffer(blob)).schema
            assert schema.names == ["name", "global_shape", "start", "shape", "dtype", "crc32", "data"]
            assert set(schema.metadata) == {b"nereus.format"}
        else:
            assert json.loads(blob)["format"] == "nereus-emu-snapshot"
    for source in Path(storage.__file__).parent.glob("*.py"):
        used = re.findall(
            r"import c?pickle|from c?pickle|torch\.(?:save|load)\(|numpy\.load|allow_pickle",
            source.read_text(),
        )
        assert not used, f"{source} serializes with pickle: {used}"


def test_bad_requests_are_refused(tmp_path: Path) -> None:
    ref = write_snapshot(tmp_path, "actor", 0, _halves(torch.randn(6, 5)))
    with pytest.raises(storage.SnapshotError, match="no tensor 'x'"):
        read_slices(ref, [("x", None)])
    with pytest.raises(storage.SnapshotError, match="outside"):
        read_slices(ref, [("w", Box((0, 0), (7, 5)))])
    with pytest.raises(ValueError, match="plain name"):
        list_snapshots(tmp_path, "actor/train")
    with pytest.raises(ValueError, match="differs from its box"):
        write_snapshot(
            tmp_path, "actor", 1, {0: {"w": (torch.zeros(2, 2), SliceSpec((4, 4), Box.full((3, 2))))}}
        )
    assert list_snapshots(tmp_path, "critic") == []


def test_a_damaged_manifest_is_refused_naming_it(tmp_path: Path) -> None:
    ref = write_snapshot(tmp_path, "actor", 0, _halves(torch.randn(6, 5)))
    (ref.path / "manifest.json").write_text('{"format": "nereus-emu-snapshot", "model": "actor"}')
    with pytest.raises(CorruptSnapshotError, match=r"step=0/manifest\.json: not a valid manifest"):
        list_snapshots(tmp_path, "actor")


def _random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Every bit pattern is possible (NaN payloads, infinities, subnormals, signed zeros)."""
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    info = torch.iinfo(bits)
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(info.min, info.max, shape, dtype=bits, generator=gen).view(dtype)


def test_a_bf16_train_stage_snapshot_keeps_weights_and_fp32_masters_bitwise(tmp_path: Path) -> None:
    config = TINY.model_copy(update={"dtype": "bf16"})
    layout = Layout(tp=2, pp=1, dp=2, devices=(2, 0, 3, 1))
    smap = shard_map(config, layout, train=True)
    full = {}
    for i, spec in enumerate(smap.tensors):
        full[spec.name] = _random_bits(
            spec.shape, torch.bfloat16 if spec.kind == "param" else torch.float32, i
        )
    shards: dict[int, list] = {d: [] for d in layout.devices}
    for spec in smap.tensors:
        for piece in spec.pieces:
            tensor = full[spec.name][piece.box.slices()].clone()
            shards[piece.device].append((spec.name, tensor, spec.slice_spec(piece)))
    ref = write_snapshot(tmp_path, "actor-train", 4, shards, layout=layout)
    stored = {s.name: s.dtype for f in ref.manifest.files for s in f.slices}
    assert stored["model.norm.weight"] == "bfloat16" and stored["model.norm.weight:master"] == "float32"
    got = read_full_state(tmp_path, "actor-train", optimizer=True)
    assert set(got) == set(full) and any(n.endswith(":master") for n in got)

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        bits = torch.int16 if b.dtype == torch.bfloat16 else torch.int32
        return a.dtype == b.dtype and torch.equal(a.view(bits), b.view(bits))

    assert all(same(got[name], tensor) for name, tensor in full.items())
    # A device of another layout reads exactly its boxes, masters among them.
    new = shard_map(config, Layout.contiguous(pp=2, dp=2), train=True)
    wanted = new.wanted(3)
    assert any(name.endswith(":master") for name, _ in wanted)
    for (name, box), tensor in zip(wanted, read_slices(ref, wanted), strict=True):
        assert same(tensor, full[name][box.slices()]), name
