"""Shard maps, reshard plans and memory per device (nereus_core/emu.py), on shapes alone."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nereus_core.box import flat_range_boxes
from nereus_core.config import ModelConfig
from nereus_core.emu import (
    STEP,
    Box,
    ShardMap,
    bytes_per_device,
    min_bytes,
    plan_reshard,
    shard_map,
    split_state_name,
    state_name,
)
from nereus_core.layout import Layout
from nereus_core.model.weights import param_shapes, shard_dim
from tests.support.model_configs import SHARDABLE

SMALL = SHARDABLE
# Heads, kv heads, vocab and ffn divisible by every tp up to 8; 8 layers for pp up to 8.
WIDE = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=8,
)


def _split_and_replicated_elements(config: ModelConfig) -> tuple[int, int]:
    shapes = param_shapes(config)
    split = sum(math.prod(s) for n, s in shapes.items() if shard_dim(n) is not None)
    return split, sum(math.prod(s) for s in shapes.values()) - split


def test_small_config_element_counts() -> None:
    # Per layer: q, k, v, o 16x16 + gate/up 32x16 + down 16x32 = 2560 split elements,
    # two norms of 16. Plus embed 32x16 and lm_head 32x16 (split), final norm 16.
    assert _split_and_replicated_elements(SMALL) == (2 * 2560 + 2 * 512, 2 * 32 + 16)


def test_flat_range_boxes_are_contiguous_and_in_order() -> None:
    shape = (3, 4, 5)
    for lo in range(0, 60, 7):
        for hi in range(lo, 61, 11):
            boxes = flat_range_boxes(shape, lo, hi)
            assert len(boxes) <= 2 * len(shape) - 1
            flat = np.arange(60).reshape(shape)
            got = np.concatenate([flat[b.slices()].reshape(-1) for b in boxes]) if boxes else np.array([])
            assert got.tolist() == list(range(lo, hi))


def test_shard_map_pieces_follow_layout_order() -> None:
    layout = Layout(tp=2, pp=2, dp=1, devices=(5, 3, 9, 1))
    smap = shard_map(SMALL, layout, train=False)
    q0 = smap.tensor("model.layers.0.self_attn.q_proj.weight")
    assert (q0.pp_rank, q0.split_dim) == (0, 0)
    assert [(p.device, p.box) for p in q0.pieces] == [
        (5, Box((0, 0), (8, 16))),
        (3, Box((8, 0), (16, 16))),
    ]
    down1 = smap.tensor("model.layers.1.mlp.down_proj.weight")
    assert [(p.device, p.box) for p in down1.pieces] == [
        (9, Box((0, 0), (16, 16))),
        (1, Box((0, 16), (16, 32))),
    ]
    norm = smap.tensor("model.norm.weight")
    assert [(p.device, p.box) for p in norm.pieces] == [(9, Box((0,), (16,))), (1, Box((0,), (16,)))]
    assert smap.wanted(5)[0] == ("model.embed_tokens.weight", Box((0, 0), (16, 16)))


def test_a_value_head_is_replicated_on_the_last_stage() -> None:
    critic = SMALL.model_copy(update={"head": "value"})
    smap = shard_map(critic, Layout.contiguous(tp=2, pp=2), train=True)
    score = smap.tensor("score.weight")
    assert (score.pp_rank, score.split_dim, score.shape) == (1, None, (1, 16))
    assert [(p.device, p.box) for p in score.pieces] == [(2, Box((0, 0), (1, 16))), (3, Box((0, 0), (1, 16)))]
    assert "lm_head.weight" not in smap.names


def test_state_names_round_trip() -> None:
    name = "model.layers.0.mlp.up_proj.weight"
    for kind in ("param", "exp_avg", "exp_avg_sq"):
        assert split_state_name(state_name(name, kind)) == (name, kind)
    assert split_state_name(STEP) == ("", "step")


def test_bytes_per_device_tp2_pp2_dp2_train() -> None:
    layout = Layout.contiguous(tp=2, pp=2, dp=2)
    got = bytes_per_device(SMALL, layout, train=True)
    # Stage 0, a tp rank: embed/2 (256) + layer 0 split/2 (1280) + two norms (32) = 1568 fp32 elements.
    # Stage 1: layer 1 split/2 (1280) + two norms (32) + final norm (16) + lm_head/2 (256) = 1584.
    # Every shard has an even numel, so ZeRO-1 over dp=2 halves each moment: 2 * n/2, plus the step.
    stage0 = {"params": 1568 * 4, "grads": 1568 * 4, "optimizer": 1568 * 4 + 4}
    stage1 = {"params": 1584 * 4, "grads": 1584 * 4, "optimizer": 1584 * 4 + 4}
    assert got == {0: stage0, 1: stage0, 2: stage1, 3: stage1, 4: stage0, 5: stage0, 6: stage1, 7: stage1}
    infer = bytes_per_device(SMALL, layout, train=False, dtype_bytes=2)
    assert infer[0] == {"params": 1568 * 2, "grads": 0, "optimizer": 0}


def test_bytes_per_device_sums_to_the_model() -> None:
    total = sum(math.prod(s) for s in param_shapes(WIDE).values()) * 4
    layout = Layout.contiguous(tp=4, pp=2, dp=3)
    got = bytes_per_device(WIDE, layout, train=True)
    norms = _split_and_replicated_elements(WIDE)[1] * 4
    # Params: dp copies of the model, norms additionally replicated over tp.
    assert sum(v["params"] for v in got.values()) == 3 * (total + 3 * norms)
    # Moments: ZeRO-1 keeps one copy per (tp, pp) shard set, i.e. no dp replication.
    assert sum(v["optimizer"] for v in got.values()) == 2 * (total + 3 * norms) + 24 * 4


def _plan(old: Layout, new: Layout, *, train: bool = False) -> tuple[ShardMap, ShardMap, object]:
    a, b = shard_map(SMALL, old, train=train), shard_map(SMALL, new, train=train)
    return a, b, plan_reshard(a, b)


def test_tp2_to_tp4_on_the_same_first_devices_moves_three_quarters() -> None:
    split, norms = _split_and_replicated_elements(SMALL)  # 6144, 80
    _, _, plan = _plan(Layout.contiguous(tp=2), Layout.contiguous(tp=4))
    # New rank 0 (device 0) keeps its quarter; rank 1 (device 1) needs [S/4, S/2), held by device 0;
    # devices 2, 3 are new. Norms: devices 0, 1 keep theirs, 2 and 3 receive one copy each.
    assert plan.bytes_moved == (split * 3 // 4 + 2 * norms) * 4 == 19072
    assert plan.bytes_local == (split // 4 + 2 * norms) * 4 == 6784
    q = [t for t in plan.transfers if t.name == "model.layers.0.self_attn.q_proj.weight"]
    assert sorted((t.src, t.dst, t.region) for t in q) == [
        (0, 1, Box((4, 0), (8, 16))),
        (1, 2, Box((8, 0), (12, 16))),
        (1, 3, Box((12, 0), (16, 16))),
    ]
    assert q[0].src_slice == Box((4, 0), (8, 16)) and q[0].dst_slice == Box((0, 0), (4, 16))


def test_tp2_to_tp4_with_interleaved_devices_moves_exactly_half() -> None:
    split, norms = _split_and_replicated_elements(SMALL)
    old, new = Layout.contiguous(tp=2), Layout(tp=4, devices=(0, 2, 1, 3))
    a, b, plan = _plan(old, new)
    # Devices 0 and 1 keep new ranks 0 and 2 (a quarter each, already in place): half of every split
    # tensor moves, plus a copy of the norms to each of devices 2 and 3.
    assert plan.bytes_moved == (split // 2 + 2 * norms) * 4 == 12928 == min_bytes(a, b)
    for name in param_shapes(SMALL):
        moved = sum(t.nbytes for t in plan.transfers if t.name == name)
        size = math.prod(param_shapes(SMALL)[name]) * 4
        assert moved == (size // 2 if shard_dim(name) is not None else 2 * size)


def test_dp1_to_dp2_copies_the_model_and_zero1_moves_half_the_moments() -> None:
    total = sum(math.prod(s) for s in param_shapes(SMALL).values()) * 4
    _, _, plan = _plan(Layout.contiguous(), Layout.contiguous(dp=2))
    assert (plan.bytes_moved, plan.bytes_local) == (total, total)
    # Training, dp2 -> dp1 on device 0: device 0 held all parameters and the first half of every
    # moment (even numels); it receives the other halves of exp_avg and exp_avg_sq from device 1.
    _, _, plan = _plan(Layout.contiguous(dp=2), Layout.contiguous(), train=True)
    assert plan.bytes_moved == total
    assert {t.src for t in plan.transfers} == {1}
    assert plan.bytes_local == total + total + 4  # params, first halves of both moments, step


def test_replicas_share_the_sending() -> None:
    _, _, plan = _plan(Layout.contiguous(dp=2), Layout.contiguous(dp=4))
    sent = plan.sent_bytes()
    biggest = max(math.prod(s) for s in param_shapes(SMALL).values()) * 4
    assert set(sent) == {0, 1} and abs(sent[0] - sent[1]) <= biggest


def test_a_new_tensor_without_old_holders_is_refused() -> None:
    a, b = (
        shard_map(SMALL, Layout.contiguous(), train=False),
        shard_map(SMALL, Layout.contiguous(), train=True),
    )
    with pytest.raises(ValueError, match="exp_avg"):
        plan_reshard(a, b)


# ---- property test: random layout pairs over up to 64 devices ----

_DEGREES = [(t, p) for t in (1, 2, 4, 8) for p in (1, 2, 4, 8)]


@st.composite
def _layout(draw: st.DrawFn, pool: int) -> Layout:
    tp, pp = draw(st.sampled_from([(t, p) for t, p in _DEGREES if t * p <= pool]))
    dp = draw(st.integers(1, pool // (tp * pp)))
    devices = draw(st.permutations(range(pool)))[: tp * pp * dp]
    shard = draw(st.sampled_from(["optimizer", "full"])) if pp == 1 else "optimizer"  # full: ZeRO-3's shares
    return Layout(tp=tp, pp=pp, dp=dp, devices=tuple(devices), shard=shard)


@st.composite
def _layout_pairs(draw: st.DrawFn) -> tuple[Layout, Layout, bool]:
    pool = draw(st.integers(1, 64))
    return draw(_layout(pool)), draw(_layout(pool)), draw(st.booleans())


def _masks(smap: ShardMap) -> dict[tuple[str, int], np.ndarray]:
    """Per (tensor, device): a bool mask of the elements the device holds."""
    out: dict[tuple[str, int], np.ndarray] = {}
    for spec in smap.tensors:
        for piece in spec.pieces:
            mask = out.setdefault((spec.name, piece.device), np.zeros(spec.shape, dtype=bool))
            assert not mask[piece.box.slices()].any(), f"{spec.name}: device {piece.device} holds a box twice"
            mask[piece.box.slices()] = True
    return out


def _check_plan(old: ShardMap, new: ShardMap) -> None:
    plan = plan_reshard(old, new)
    old_masks, new_masks = _masks(old), _masks(new)
    counts = {key: np.zeros(mask.shape, dtype=np.int32) for key, mask in new_masks.items()}
    for move in plan.transfers + plan.local:
        idx = move.region.slices()
        key = (move.name, move.dst)
        assert move.dst_piece.box.contains(move.region) and move.dst_piece.device == move.dst
        counts[key][idx] += 1
        # The source really holds the region in the old placement.
        assert old_masks[(move.name, move.src)][idx].all(), f"{move.name}: device {move.src} lacks it"
        on_dst = old_masks.get(key)
        if move.src == move.dst:
            assert move.nbytes == move.region.numel * new.tensor(move.name).itemsize
        else:
            assert on_dst is None or not on_dst[idx].any(), f"{move.name}: moved onto a holder"
    expected = 0
    for key, mask in new_masks.items():
        # Every destination element covered exactly once, nothing else written.
        assert np.array_equal(counts[key], mask.astype(np.int32)), f"{key}: coverage"
        held = old_masks.get(key, np.zeros_like(mask))
        expected += int((mask & ~held).sum()) * new.tensor(key[0]).itemsize
    assert plan.bytes_moved == expected == min_bytes(old, new)
    assert plan.bytes_moved + plan.bytes_local == sum(
        p.box.numel * t.itemsize for t in new.tensors for p in t.pieces
    )


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_layout_pairs())
def test_reshard_plans_cover_every_destination_byte_once(pair: tuple[Layout, Layout, bool]) -> None:
    old, new, train = pair
    _check_plan(shard_map(WIDE, old, train=train), shard_map(WIDE, new, train=train))
