"""nereus_core.engine.state and .exchange: ZeRO-1 <-> canonical moments, piece assembly, P2P exchange."""

from __future__ import annotations

import itertools
import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus_core.config import ModelConfig
from nereus_core.emu import MASTER, MOMENTS, STEP, Box, partitioned_kinds, shard_map
from nereus_core.engine.device import DeviceContext
from nereus_core.engine.dispatch import per_device_batch
from nereus_core.engine.exchange import DIRECT_BYTES, ExchangeError, exchange
from nereus_core.engine.shard import OptimizerSettings, get_shard, load_shard
from nereus_core.engine.state import (
    STEP_BOX,
    assemble_state,
    canonical_range,
    extract_state,
    install_state,
    new_shard,
    zero1_segments,
)
from nereus_core.engine.train import train_step
from nereus_core.layout import Layout
from tests.support.dist_utils import run_world

# hidden 8: every tensor's size is a multiple of 8, rarely of 3, so dp=3 splits them unevenly,
# and the flat buffer (1352 elements) is not a multiple of 2*dp=6: ZeRO pads its last partition.
ZERO_CONFIG = ModelConfig(
    vocab_size=20,
    hidden_size=8,
    intermediate_size=10,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    seed=3,
)
ADAMW = OptimizerSettings(lr=1e-2, eps=1e-6, weight_decay=0.01)


# ----------------------------------------------------------------------------- pure functions


@settings(max_examples=200, deadline=None)
@given(
    numels=st.lists(st.integers(1, 50), min_size=1, max_size=8),
    dp=st.integers(1, 5),
    pad=st.integers(0, 7),
)
def test_zero1_segments_partition_every_parameter(numels: list[int], dp: int, pad: int) -> None:
    offsets, total = [], 0
    for n in numels:
        offsets.append(total)
        total += n
    size = -(-(total + pad) // dp)  # DeepSpeed: equal partitions of the padded flat buffer
    segments = zero1_segments(numels, offsets, size, dp)
    for p, n in enumerate(numels):
        mine = [s for s in segments if s.param == p]
        assert [(s.lo, s.hi) for s in mine] == sorted((s.lo, s.hi) for s in mine)
        assert mine[0].lo == 0 and mine[-1].hi == n
        assert all(a.hi == b.lo for a, b in itertools.pairwise(mine))
        for s in mine:
            lo, hi = canonical_range(n, dp, s.dp)
            assert lo <= s.lo < s.hi <= hi
            # inside one ZeRO partition
            assert s.part * size <= offsets[p] + s.lo and offsets[p] + s.hi <= (s.part + 1) * size


def test_zero1_segments_refuse_a_buffer_they_do_not_cover() -> None:
    with pytest.raises(ValueError, match="do not cover"):
        zero1_segments([10], [0], 4, 2)


def test_canonical_range_matches_the_shard_map() -> None:
    layout = Layout.contiguous(tp=2, dp=3)
    smap = shard_map(ZERO_CONFIG, layout, train=True)
    for spec in smap.tensors:
        if spec.kind not in MOMENTS:
            continue
        for device in layout.devices:
            pieces = [p for p in spec.pieces if p.device == device]
            coord = layout.coord_of_device(device)
            shard_numel = next(p for p in smap.tensor(spec.param).pieces if p.device == device).box.numel
            lo, hi = canonical_range(shard_numel, 3, coord.dp)
            assert sum(p.box.numel for p in pieces) == hi - lo
            assert [p.offset for p in pieces] == [
                sum(q.box.numel for q in pieces[:i]) for i in range(len(pieces))
            ]


def test_assemble_state_rebuilds_full_tensors_and_checks_replicas() -> None:
    layout = Layout.contiguous(tp=2, dp=2)
    smap = shard_map(ZERO_CONFIG, layout, train=True)
    full = {
        s.name: torch.randn(s.shape, generator=torch.Generator().manual_seed(i))
        for i, s in enumerate(smap.tensors)
    }
    pieces = [
        (p.device, s.name, p.box, full[s.name][p.box.slices()].clone())
        for s in smap.tensors
        for p in s.pieces
    ]
    got = assemble_state(smap, pieces)
    assert all(torch.equal(got[k], full[k]) for k in full)
    name = "model.norm.weight"
    first = next(i for i, p in enumerate(pieces) if p[1] == name)
    bad = [*pieces[:first], (*pieces[first][:3], pieces[first][3] + 1), *pieces[first + 1 :]]
    with pytest.raises(ValueError, match="differ"):
        assemble_state(smap, bad)
    with pytest.raises(ValueError, match="cover"):
        assemble_state(smap, [p for p in pieces if p[1] != STEP])


# ------------------------------------------------------------------------- exchange (gloo)


def _source(rank: int) -> torch.Tensor:
    """Rank ``rank``'s 2-d source tensor: large enough that some segments travel alone."""
    return torch.arange(600 * 300, dtype=torch.float32).view(600, 300) + 1e6 * rank


def _segments(src: int, dst: int) -> list[tuple[slice, slice]]:
    """Regions src sends to dst: small and large, contiguous (row runs) and not (column runs)."""
    k = 7 * src + dst
    return [
        (slice(k, k + 2), slice(None)),  # small, contiguous
        (slice(0, 50), slice(k, k + 3)),  # small, strided
        (slice(100, 100 + DIRECT_BYTES // (4 * 300) + 5), slice(None)),  # large, contiguous
        (slice(300, 600), slice(10 + k, 260 + k // 2)),  # large, strided
        (slice(5, 5), slice(None)),  # empty
    ]


def _exchange_world(rank: int, world: int) -> bool:
    src = _source(rank)
    out = {peer: [torch.zeros(600, 300)[r] for r in _segments(peer, rank)] for peer in range(world)}
    outgoing = {peer: [src[r] for r in _segments(rank, peer)] for peer in range(world) if peer != rank}
    incoming = {peer: out[peer] for peer in range(world) if peer != rank}
    stats = exchange(outgoing, incoming, tag=11, timeout_s=60)
    ok = stats.messages > 0
    for peer in incoming:
        expected = [_source(peer)[r] for r in _segments(peer, rank)]
        ok &= all(torch.equal(a, b) for a, b in zip(out[peer], expected, strict=True))
    return ok


def test_exchange_moves_mixed_segments_between_three_ranks() -> None:
    assert run_world(3, _exchange_world) == [True, True, True]


def _silent_peer_world(rank: int, world: int) -> tuple[str, float]:
    # A group of its own: gloo closes the timed-out pair, and the world's must survive for teardown.
    group = dist.new_group([0, 1])
    if rank == 1:
        return "silent", 0.0  # never posts its side
    start = time.monotonic()
    try:
        exchange({}, {1: [torch.empty(10)]}, timeout_s=1.0, group=group)
    except ExchangeError as exc:
        return str(exc), time.monotonic() - start
    return "no error", time.monotonic() - start


def test_exchange_with_a_silent_peer_raises_within_its_timeout() -> None:
    (message, seconds), _ = run_world(2, _silent_peer_world)
    assert "exchange with ranks [1] failed within 1s" in message
    assert seconds < 10


# ------------------------------------------------------ DeepSpeed ZeRO-1 <-> canonical (gloo)


def _ds_full_moments(shard: Any) -> tuple[dict[str, dict[str, torch.Tensor]], torch.Tensor]:
    """The full local moments (and fp32 masters) of every parameter, all-gathered from DeepSpeed's
    partitions."""
    opt = shard.engine.optimizer
    part = opt.single_partition_of_fp32_groups[0]
    state = {**opt.optimizer.state[part], MASTER: part.detach()}
    group = opt.real_dp_process_group[0]
    names = {id(p): n for n, p in shard.stage.named_parameters()}
    kinds = partitioned_kinds(shard.config)
    out: dict[str, dict[str, torch.Tensor]] = {kind: {} for kind in kinds}
    for kind in kinds:
        chunks = [torch.empty_like(part) for _ in range(dist.get_world_size(group))]
        dist.all_gather(chunks, state[kind], group=group)
        flat = torch.cat(chunks)
        for p, offset in zip(opt.round_robin_bit16_groups[0], opt.round_robin_bit16_offsets[0], strict=True):
            out[kind][names[id(p)]] = flat[offset : offset + p.numel()].view(p.shape).clone()
    return out, state["step"].clone()


def _zero_world(rank: int, world: int, adamw: OptimizerSettings, config: ModelConfig) -> dict[str, Any]:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="1")  # DeepSpeed reads them; the world exists
    ctx = DeviceContext(rank=rank, world_size=world, backend="gloo", device=torch.device("cpu"))
    layout = Layout.contiguous(dp=world)
    ctx.build_groups(layout)
    load_shard(ctx, name="old", layout=layout, config=config, optimizer=adamw)
    gen = torch.Generator().manual_seed(5)
    batches = [{"ids": torch.randint(0, config.vocab_size, (3, 6), generator=gen)} for _ in range(3)]
    for batch in batches[:2]:
        train_step(ctx, per_device_batch(layout, batch)[rank], name="old")
    old = get_shard(ctx, "old")
    smap = shard_map(config, layout, train=True)
    state = extract_state(ctx, old, smap)
    pieces = [(rank, n, box, t.clone()) for (n, box), t in state.pieces.items()]  # views of live state
    expected, step = _ds_full_moments(old)
    # Install the pieces into a fresh engine of the same layout: its ZeRO state must be identical.
    new, target = new_shard(ctx, name="new", smap=smap, optimizer=adamw)
    for key, tensor in state.pieces.items():
        target.pieces[key].copy_(tensor)
    install_state(ctx, new, target)
    old_opt, new_opt = old.engine.optimizer, new.engine.optimizer
    old_part, new_part = (
        old_opt.single_partition_of_fp32_groups[0],
        new_opt.single_partition_of_fp32_groups[0],
    )
    same = torch.equal(old_part, new_part) and all(
        torch.equal(old_opt.optimizer.state[old_part][k], new_opt.optimizer.state[new_part][k])
        for k in ("exp_avg", "exp_avg_sq", "step")
    )
    for name in ("old", "new"):
        train_step(ctx, per_device_batch(layout, batches[2])[rank], name=name)
    pairs = zip(old.local_state().values(), new.local_state().values(), strict=True)
    stepped = all(torch.equal(a, b) for a, b in pairs) and torch.equal(old_part, new_part)
    return {"pieces": pieces, "expected": expected, "step": step, "same": same, "stepped": stepped}


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("zero_stage", "dtype"),
    [
        pytest.param(1, "fp32", marks=pytest.mark.slow),  # stage 2 fp32 and stage 1 bf16 cover it by default
        (2, "fp32"),
        (1, "bf16"),
        pytest.param(2, "bf16", marks=pytest.mark.slow),
    ],
)
def test_zero_moments_round_trip_through_the_canonical_partition(zero_stage: int, dtype: str) -> None:
    # bf16: the fp32 masters are a partitioned kind too; installed as read, the whole ZeRO partition
    # (masters included) must equal the original's, and so must the next step.
    world = 3
    config = ZERO_CONFIG.model_copy(update={"dtype": dtype})
    adamw = ADAMW.model_copy(update={"zero_stage": zero_stage})
    results = run_world(world, _zero_world, adamw, config, timeout_s=200)
    smap = shard_map(config, Layout.contiguous(dp=world), train=True)
    full = assemble_state(smap, [p for r in results for p in r["pieces"]])
    for kind in partitioned_kinds(config):
        for param, tensor in results[0]["expected"][kind].items():
            assert torch.equal(full[f"{param}:{kind}"], tensor), f"{param}:{kind}"
    assert full[STEP].item() == 2.0 and torch.equal(full[STEP], results[0]["step"])
    assert any(t.abs().max() > 0 for t in results[0]["expected"]["exp_avg"].values())
    if dtype == "bf16":  # the masters hold bits the weights do not: rebuilding them would show
        assert any(
            not torch.equal(full[f"{p}:master"], full[p].float()) for p in results[0]["expected"][MASTER]
        )
    assert all(r["same"] for r in results), "the installed ZeRO state differs from the original"
    assert all(r["stepped"] for r in results), "one more step (weights, masters) differs after the round trip"


def test_piece_keys_include_the_step_box() -> None:
    smap = shard_map(ZERO_CONFIG, Layout.contiguous(), train=True)
    assert (STEP, STEP_BOX) in smap.wanted(0)
    assert Box((), ()) == STEP_BOX
