"""nereus_core.cost.stage_cost: formulas against hand computations, monotonicity,
calibration."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus_core.config import LLAMA_3_8B as LLAMA_8B
from nereus_core.config import ModelConfig, Workload
from nereus_core.cost.calibration import CalibrationSettings, Sample, fit_scales, relative_errors
from nereus_core.cost.geometry import value_bytes
from nereus_core.cost.hardware import CPU_WORKERS, H100_SXM, get_profile
from nereus_core.cost.stage_cost import (
    TERMS,
    Scales,
    bubble_fraction,
    estimate,
    estimate_many,
    layer_activation_bytes,
    model_stats,
    ring_bytes,
)
from nereus_core.cost.transition_cost import (
    TransitionCosts,
    TransitionScales,
    analytic_transition_cost,
    reshard_bytes,
    transition_cost,
    weight_sync_s,
)
from nereus_core.layout import Layout
from nereus_core.plan import MODEL_STAGES, ModelStage
from tests.support.model_configs import MID

TINY = ModelConfig()
IDEAL = H100_SXM.model_copy(
    update={
        "collective_latency_s": 0.0,
        "layer_overhead_s": 0.0,
        "call_overhead_s": 0.0,
        "memory_efficiency": 1.0,
    }
)


def work(batch: int = 8, prompt: int = 16, mean: float = 16, high: int | None = None) -> Workload:
    return Workload(batch=batch, prompt_len=prompt, response_mean=mean, response_high=high or math.ceil(mean))


def test_8b_counts_match_hardware_md() -> None:
    stats = model_stats(LLAMA_8B)
    assert stats.kv_bytes_per_token(2) == 128 * 1024  # "2 * 32 * 8 * 128 * 2 B = 128 KiB per token"
    assert stats.total_params * 2 / 1e9 == pytest.approx(16.1, abs=0.05)  # "Weights 16.1 GB in bf16"


def test_decode_step_of_8b_on_one_h100_is_about_4_8_ms() -> None:
    # One sequence, one token of context: the weights dominate the bytes read per step.
    w = Workload(batch=1, prompt_len=1, response_mean=1, response_high=1)
    raw = estimate("actor/generate", Layout.contiguous(), w, LLAMA_8B, IDEAL).raw
    assert raw["decode"] == pytest.approx(4.8e-3, rel=0.01)  # 8B on one H100: about 4.8 ms
    real = estimate("actor/generate", Layout.contiguous(), w, LLAMA_8B, H100_SXM).raw
    assert real["decode"] == pytest.approx(4.8e-3 / 0.9, rel=0.01)  # calculon's HBM efficiency 0.9
    # tp=2 halves the weight bytes each device reads per step.
    tp2 = estimate("actor/generate", Layout.contiguous(tp=2), w, LLAMA_8B, IDEAL).raw
    assert tp2["decode"] == pytest.approx(raw["decode"] / 2, rel=0.01)


def test_bubble_formula_and_its_share_of_a_pipelined_pass() -> None:
    assert bubble_fraction(1, 8) == 0
    assert bubble_fraction(4, 12) == pytest.approx(3 / 15)
    fast_links = IDEAL.model_copy(update={"intra_node_bandwidth": 1e30, "inter_node_bandwidth": 1e30})
    layout = Layout.contiguous(pp=4, micro_batches=12)
    t = estimate("critic/infer", layout, work(batch=48), LLAMA_8B, fast_links).raw
    busy = t["compute"] + t["tp_comm"] + t["overhead"]
    assert t["pp_comm"] / (busy + t["pp_comm"]) == pytest.approx(bubble_fraction(4, 12))


def test_ring_all_reduce_moves_2_t_minus_1_over_t() -> None:
    assert ring_bytes(100.0, 4) == pytest.approx(150.0)
    assert ring_bytes(100.0, 1) == 0


def test_forward_compute_and_tp_traffic_by_hand() -> None:
    w = work(batch=4, prompt=100, mean=28)
    stats = model_stats(LLAMA_8B)
    seq, h, layers = 128, 4096, 32
    one = estimate("reference/infer", Layout.contiguous(), w, LLAMA_8B, H100_SXM).raw
    flops = 4 * seq * (2 * stats.flop_params + 4 * layers * h * seq)  # forward FLOPs
    assert one["compute"] == pytest.approx(flops / (989.4e12 * 0.47))
    two = estimate("reference/infer", Layout.contiguous(tp=2), w, LLAMA_8B, H100_SXM).raw
    assert two["compute"] == pytest.approx(one["compute"] / 2)
    buffer = 4 * seq * h * 2  # b*s*h bf16 values per all-reduce
    bytes_s = 2 * layers * (2 * 1 / 2) * buffer / (450e9 * 0.6)  # 2 per layer, ring 2(t-1)/t, NVLink
    latency = (2 * layers + 4) * 2 * 1e-6  # + embedding and log-prob all-reduces, 2(t-1) hops each
    assert two["tp_comm"] + two["tp_calls"] == pytest.approx(bytes_s + latency)
    assert two["tp_calls"] == pytest.approx((2 * layers + 4) * 1e-6)  # the first hop of each call
    # The same tp=2 group across two nodes (slots 7 and 8) goes over InfiniBand.
    across = estimate("reference/infer", Layout(tp=2, devices=(7, 8)), w, LLAMA_8B, H100_SXM).raw
    assert across["tp_comm"] + across["tp_calls"] == pytest.approx(
        bytes_s * (450e9 * 0.6) / (50e9 * 0.9) + latency
    )


def test_training_memory_follows_the_16_bytes_rule_and_zero1() -> None:
    p = model_stats(LLAMA_8B).total_params
    one = estimate("actor/train", Layout.contiguous(), work(), LLAMA_8B, H100_SXM).memory
    assert one.weights == pytest.approx(2 * p, rel=1e-6)
    # "Mixed-precision Adam: 16 bytes/param": the 2-byte gradients live only while the stage runs, and
    # its peak holds them beside ZeRO's fp32 bucket, less the activations backward has freed by then
    bucket = 4 * 500_000_000
    assert one.gradients == pytest.approx(bucket + max(0, 2 * p - one.activations), rel=1e-6)
    assert one.persistent == pytest.approx(14 * p, rel=1e-6)
    four = estimate("actor/train", Layout.contiguous(dp=4), work(), LLAMA_8B, H100_SXM).memory
    assert four.optimizer == pytest.approx(12 * p / 4, rel=1e-6)  # ZeRO-1 shards the 12 over dp
    assert four.weights == one.weights
    cpu = estimate("actor/train", Layout.contiguous(), work(), TINY, CPU_WORKERS).memory
    p_tiny = model_stats(TINY).total_params
    assert (cpu.weights, cpu.optimizer) == (4 * p_tiny, 12 * p_tiny)
    assert cpu.gradients == 4 * p_tiny + max(0, 4 * p_tiny - cpu.activations)  # a bucket as large as they


def test_activation_and_kv_memory_by_hand() -> None:
    stats = model_stats(LLAMA_8B)
    b, s = 2, 1024
    # Llama-3-8B's layer in bf16: two norms' fp32 input and bf16 normed values and output (8 bytes
    # each, replicated), q/k/v/SDPA output/its copy (3 x 4096 + 2 x 1024) and 4 x 14336 of MLP (split)
    per_token = 2 * 8 * 4096 + 2 * (3 * 4096 + 2 * 1024 + 4 * 14336)
    assert layer_activation_bytes(stats, b * s, 2, 1) == pytest.approx(b * s * per_token)
    split = 2 * 8 * 4096 + 2 * (3 * 4096 + 2 * 1024 + 4 * 14336) / 4
    assert layer_activation_bytes(stats, b * s, 2, 4) == pytest.approx(b * s * split)
    fp32 = 2 * 12 * 4096 + 4 * (3 * 4096 + 2 * 1024 + 4 * 14336)  # fp32: the norms keep 12 bytes
    assert layer_activation_bytes(stats, b * s, 4, 1) == pytest.approx(b * s * fp32)
    w = work(batch=8, prompt=512, mean=256, high=1536)
    mem = estimate("actor/generate", Layout.contiguous(tp=2), w, LLAMA_8B, H100_SXM).memory
    assert mem.kv_cache == pytest.approx(8 * 2048 * 128 * 1024 / 2, rel=1e-6)  # high quantile, kv heads / tp


@settings(max_examples=60, deadline=None)
@given(
    stage=st.sampled_from(MODEL_STAGES),
    tp=st.sampled_from([1, 2, 4]),
    pp=st.sampled_from([1, 2, 4]),
    dp=st.sampled_from([1, 2, 4]),
    m=st.sampled_from([1, 2]),
    short=st.integers(1, 64),
    extra=st.integers(0, 64),
    profile=st.sampled_from([CPU_WORKERS, H100_SXM]),
)
def test_a_longer_response_never_needs_less_memory_or_time(
    stage, tp, pp, dp, m, short, extra, profile
) -> None:
    layout = Layout.contiguous(tp=tp, pp=pp, dp=dp, micro_batches=m)
    a = estimate(stage, layout, work(batch=8, mean=short), TINY, profile)
    b = estimate(stage, layout, work(batch=8, mean=short + extra), TINY, profile)
    assert b.memory.total >= a.memory.total
    assert b.seconds >= a.seconds > 0
    c = estimate(stage, layout, work(batch=8, mean=short, high=short + extra), TINY, profile)
    assert c.memory.total >= a.memory.total


def test_workload_from_lengths_and_validation() -> None:
    w = Workload.from_lengths(batch=4, prompt_len=8, lengths=[10, 20, 30, 100], quantile=0.9)
    assert w.response_mean == 40 and w.response_high >= 79
    with pytest.raises(ValueError, match="response_high=5 is below response_mean=10"):
        Workload(batch=1, prompt_len=1, response_mean=10, response_high=5)
    with pytest.raises(ValueError, match="unknown hardware profile 'tpu'"):
        get_profile("tpu")


def test_transition_cost_is_the_busiest_port() -> None:
    gb = 10**9
    est = transition_cost([(0, 1, gb), (0, 2, gb), (3, 3, gb)], H100_SXM)
    intra = 450e9 * 0.6
    assert est.wire_s == pytest.approx(2 * gb / intra + 2 * 1e-6)  # slot 0 sends both
    assert est.critical_bytes == 2 * gb and not est.analytic
    across = transition_cost([(0, 8, gb)], H100_SXM)  # slots 0 and 8 are on different nodes
    assert across.wire_s == pytest.approx(gb / (50e9 * 0.9) + 1e-6)
    assert transition_cost([], H100_SXM).seconds == 0


def test_reshard_bytes_follow_hybridflow() -> None:
    m = model_stats(LLAMA_8B).total_params * 2
    train = Layout.contiguous(tp=4, dp=2)
    gen = Layout.contiguous(tp=2, dp=4)
    # (tp - tg*pg)/(tg*pg*tp) * M = M/2 - M/4 on the same devices
    assert reshard_bytes("actor/generate", train, gen, LLAMA_8B, H100_SXM) == pytest.approx(m / 4, rel=1e-6)
    assert reshard_bytes("actor/generate", gen, train, LLAMA_8B, H100_SXM) == 0  # finer shard: drop
    fresh = Layout.contiguous(tp=2, dp=4, first=8)
    assert reshard_bytes("actor/generate", gen, fresh, LLAMA_8B, H100_SXM) == pytest.approx(m / 2, rel=1e-6)
    sync = weight_sync_s(train, gen, LLAMA_8B, H100_SXM, colocated=True)
    assert sync == pytest.approx(m / 4 / (450e9 * 0.6) + 1e-6)
    models = dict.fromkeys(("actor", "critic", "reference", "reward"), LLAMA_8B)
    est = analytic_transition_cost({"actor/generate": gen}, {"actor/generate": fresh}, models, H100_SXM)
    assert est.analytic and est.transfers == 1 and est.critical_bytes == pytest.approx(m / 2, rel=1e-6)


def test_a_durable_switch_costs_its_fixed_costs_even_when_no_layout_changes() -> None:
    """A durable switch (the world is rebuilt) was priced by its changed layouts only: 0 s
    for the demo's grow that keeps the plan. It now pays the profile's transition costs
    (``profile.transitions``, as the executed schedule does): one world, one engine per train stage, and each
    stage's busiest device reading its shard from the checkpoint (weights over tp*pp, optimizer
    state over the whole world); the inference copies (actor/generate, critic/infer) are relinked,
    not read."""
    plan = {s: Layout.contiguous(tp=2, pp=2, dp=2) for s in MODEL_STAGES}
    models = dict.fromkeys(("actor", "critic", "reference", "reward"), LLAMA_8B)
    params = model_stats(LLAMA_8B).total_params
    for profile in (CPU_WORKERS, H100_SXM):
        costs, per = profile.transitions, value_bytes(model_stats(LLAMA_8B), profile)
        live = analytic_transition_cost(plan, plan, models, profile)
        assert live.seconds == 0 and live.durable_s == 0
        est = analytic_transition_cost(plan, plan, models, profile, durable=True)
        trains, infers = 2, 2  # actor and critic train; reference and reward infer
        read = trains * params * (per.weight / 4 + per.optimizer / 8) + infers * params * per.weight / 4
        owners = [s for s in plan if ModelStage(s).owns_state]
        assert read == pytest.approx(sum(reshard_bytes(s, None, plan[s], LLAMA_8B, profile) for s in owners))
        fixed = costs.world_rebuild_s + trains * costs.engine_s
        assert est.durable_s == pytest.approx(fixed + read / costs.store_read_bandwidth)
        assert est.wire_s == 0 and est.ops_s == pytest.approx(
            len(plan) * profile.transitions.transition_op_overhead_s
        )
        # It rehydrates from a checkpoint of its step, written first whatever the job's recovery mode:
        # every owner's whole state (weights, and optimizer state for the train stages) spread over
        # its 8 devices, one device call per stage.
        state = trains * params * (per.weight + per.optimizer) + infers * params * per.weight
        write = len(owners) * costs.call_s + state / 8 / costs.store_write_bandwidth
        assert est.recovery_s == pytest.approx(write) and est.verify_s == 0
        assert est.seconds == pytest.approx(est.durable_s + est.ops_s + est.recovery_s)
        slower = analytic_transition_cost(
            plan, plan, models, profile, TransitionScales(durable=3.0), durable=True
        )
        assert slower.seconds == pytest.approx(3.0 * est.durable_s + est.ops_s + est.recovery_s)
        # what calibration fits
        assert slower.terms == est.terms == (0.0, est.ops_s, est.durable_s, 0.0, est.recovery_s, 0.0)
        small = analytic_transition_cost(plan, plan, dict.fromkeys(models, MID), profile, durable=True)
        assert fixed < small.durable_s < est.durable_s  # the reads grow with the model
    assert H100_SXM.transitions.world_rebuild_s > CPU_WORKERS.transitions.world_rebuild_s  # NCCL, not gloo
    given = TransitionCosts(world_rebuild_s=2.0, engine_s=0.5, store_read_bandwidth=1e9)
    est = analytic_transition_cost(plan, plan, models, H100_SXM, durable=True, costs=given)
    read = 2 * params * (2 / 4 + 12 / 8) + 2 * params * 2 / 4
    assert est.durable_s == pytest.approx(2.0 + 2 * 0.5 + read / 1e9)


# The H100 profile without its per-call fixed costs: at 13.8 s a call they would swamp the small
# synthetic stages below, and a term that is nowhere large cannot be pinned down by any fit.
NO_CALL_COSTS = H100_SXM.model_copy(
    update={"generate_call_s": 0.0, "infer_call_s": 0.0, "train_call_s": 0.0, "decode_step_s": 0.0}
)


def _synthetic(hidden: np.ndarray, noise: float, rng: np.random.Generator) -> tuple[list, list]:
    """Samples from many layouts and workloads of a mid-size model on the H100 profile."""
    model = MID.model_copy(update={"max_position_embeddings": 4096})
    layouts = [
        (t, p, d) for t in (1, 2, 4, 8) for p in (1, 2, 4) for d in (1, 2, 4, 8, 16) if t * p * d <= 64
    ]
    samples, held_out = [], []
    for i, (t, p, d) in enumerate(layouts):
        for stage in ("actor/generate", "critic/infer", "actor/train"):
            for batch, mean in ((64, 128), (128, 512)):
                w = work(batch=batch, prompt=256, mean=mean)
                lay = Layout.contiguous(tp=t, pp=p, dp=d, micro_batches=4 if p > 1 else 1)
                raw = np.array(list(estimate(stage, lay, w, model, NO_CALL_COSTS).raw.values()))
                y = float(raw @ hidden) * float(np.exp(rng.normal(0, noise)))
                (held_out if i % 4 == 0 else samples).append(Sample(tuple(raw), y))
    return samples, held_out


def test_calibration_recovers_hidden_scales_from_noisy_timings() -> None:
    rng = np.random.default_rng(0)
    hidden = Scales(
        compute=1.8,
        decode=0.6,
        tp_comm_generate=2.5,
        tp_comm=2.5,
        pp_comm=1.4,
        dp_comm=0.8,
        optimizer=1.0,
        overhead=3.0,
        dispatch_generate=1.2,
        dispatch_infer=1.2,
        dispatch_train=1.2,
    ).as_array()
    train, held_out = _synthetic(hidden, noise=0.05, rng=rng)
    train[3] = Sample(train[3].terms, train[3].seconds * 5)  # an outlier the Huber loss must shrug off
    fitted = fit_scales(train, CalibrationSettings(prior=0.1))
    # the large terms are pinned down; the others stay near the prior or the truth (generation's
    # decode now trades against its own TP row over these few layouts: only within 30%)
    assert fitted[TERMS.index("decode")] == pytest.approx(hidden[TERMS.index("decode")], rel=0.3)
    for term in ("compute", "tp_comm_generate", "tp_comm", "pp_comm", "overhead"):
        i = TERMS.index(term)
        assert fitted[i] == pytest.approx(hidden[i], rel=0.15), term
    before = np.median(relative_errors(held_out, np.ones(len(TERMS))))
    after = np.median(relative_errors(held_out, fitted))
    assert before > 0.3 and after < 0.06


def test_calibration_without_evidence_stays_at_the_prior() -> None:
    assert list(fit_scales([], start=[1.0, 1.0])) == [1.0, 1.0]
    only_compute = [Sample((1.0, 0.0), 2.0)] * 20
    fitted = fit_scales(only_compute)
    assert fitted[0] == pytest.approx(2.0, rel=0.05) and fitted[1] == pytest.approx(1.0)
    assert Scales.from_array(np.ones(len(TERMS))) == Scales()


def test_estimate_many_matches_estimate_and_profiles_validate_their_scales() -> None:
    layouts = [
        Layout.contiguous(tp=2, dp=2),
        Layout(tp=2, devices=(7, 8)),
        Layout.contiguous(pp=2, micro_batches=2),
    ]
    many = estimate_many("actor/train", layouts, work(), LLAMA_8B, H100_SXM, Scales(compute=2.0))
    one = [estimate("actor/train", lay, work(), LLAMA_8B, H100_SXM, Scales(compute=2.0)) for lay in layouts]
    assert many == one
    with pytest.raises(ValueError, match="unknown term 'network'"):
        H100_SXM.model_copy(update={}).model_validate(
            {**H100_SXM.model_dump(), "term_scales": {"network": 2.0}}
        )
    scaled = H100_SXM.model_validate({**H100_SXM.model_dump(), "term_scales": {"compute": 2.0}})
    base = estimate("actor/train", layouts[0], work(), LLAMA_8B, H100_SXM).raw["compute"]
    assert estimate("actor/train", layouts[0], work(), LLAMA_8B, scaled).raw["compute"] == pytest.approx(
        2 * base
    )


# ------------------------------------------------------------------ what the world shows matters


def test_generation_waits_for_the_longest_response() -> None:
    """Same mean, a longer tail: the slowest replica decodes until the step's longest response ends,
    each extra iteration reading the weights once more."""
    layout = Layout.contiguous(tp=2, dp=4)
    short = Workload(batch=512, prompt_len=512, response_mean=1000, response_high=2000, response_max=2000)
    tail = short.model_copy(update={"response_max": 8000})
    a, b = (estimate("actor/generate", layout, w, LLAMA_8B, H100_SXM) for w in (short, tail))
    weight_read = 16.06e9 / 2 / H100_SXM.hbm  # Llama-3-8B bf16 weights over tp=2, per iteration
    assert b.raw["decode"] - a.raw["decode"] == pytest.approx(6000 * weight_read, rel=0.01)
    assert b.raw["compute"] == a.raw["compute"]  # the tokens generated are the same
    assert b.seconds > a.seconds + 6000 * weight_read
    # Without a max, the high quantile stands in for it.
    assert short.model_copy(update={"response_max": None}).response_longest == 2000


def test_each_stage_call_pays_its_fixed_cost() -> None:
    w = Workload(batch=256, prompt_len=256, response_mean=256, response_high=512)
    bare = H100_SXM.model_copy(
        update={"generate_call_s": 0.0, "infer_call_s": 0.0, "train_call_s": 0.0, "decode_step_s": 0.0}
    )
    layout = Layout.contiguous(dp=8)
    for stage, field, term in (
        ("actor/generate", "generate_call_s", "dispatch_generate"),  # each kind in its own row
        ("critic/infer", "infer_call_s", "dispatch_infer"),
        ("actor/train", "train_call_s", "dispatch_train"),
    ):
        with_costs = estimate(stage, layout, w, LLAMA_8B, H100_SXM).raw
        without = estimate(stage, layout, w, LLAMA_8B, bare).raw
        assert getattr(H100_SXM, field) > 1
        assert with_costs[term] - without[term] == pytest.approx(getattr(H100_SXM, field))
        assert sum(with_costs.values()) - sum(without.values()) == pytest.approx(getattr(H100_SXM, field))
    stepped = bare.model_copy(update={"decode_step_s": 0.01})
    gen = estimate("actor/generate", layout, w, LLAMA_8B, stepped).raw["overhead"]
    assert gen - estimate("actor/generate", layout, w, LLAMA_8B, bare).raw["overhead"] == pytest.approx(5.12)
    # The CPU runtime's profile has none of these: its own calibration stands.
    assert CPU_WORKERS.generate_call_s == CPU_WORKERS.infer_call_s == CPU_WORKERS.train_call_s == 0


def test_workload_keeps_the_longest_response() -> None:
    w = Workload.from_lengths(batch=4, prompt_len=8, lengths=[10, 20, 30, 400])
    assert w.response_max == 400 and w.response_longest == 400 and w.response_high < 400
    with pytest.raises(ValueError, match="response_max=5 is below response_high=9"):
        Workload(batch=1, prompt_len=1, response_mean=4, response_high=9, response_max=5)


def test_a_plan_change_pays_group_setup_and_an_engine_rebuild() -> None:
    """Moves were priced at bytes over links plus 1 ms per op (0.002-0.9 s), while bringing
    up new process groups and a new generation engine takes tens of seconds."""
    from nereus_core.cost.transition_cost import setup_seconds

    models = dict.fromkeys(("actor", "critic", "reference", "reward"), LLAMA_8B)
    old = {s: Layout.contiguous(tp=2, dp=4) for s in MODEL_STAGES}
    retuned = {**old, "actor/train": old["actor/train"].model_copy(update={"micro_batches": 4})}
    train_moved = {**old, "actor/train": Layout.contiguous(tp=4, dp=2)}
    gen_moved = {**old, "actor/generate": Layout.contiguous(tp=8)}
    assert setup_seconds(old, retuned, H100_SXM) == 0  # no state moves: nothing to bring up
    assert setup_seconds(old, train_moved, H100_SXM) == H100_SXM.transitions.group_setup_s > 0
    assert (
        setup_seconds(old, gen_moved, H100_SXM)
        == H100_SXM.transitions.group_setup_s + H100_SXM.transitions.engine_rebuild_s
    )
    est = analytic_transition_cost(old, gen_moved, models, H100_SXM)
    assert est.ops_s == pytest.approx(H100_SXM.transitions.transition_op_overhead_s + 2.0 + 41.62)
    assert est.seconds > 40 and est.terms[1] == est.ops_s  # calibration scales it with the ops
    assert (
        CPU_WORKERS.transitions.group_setup_s == CPU_WORKERS.transitions.engine_rebuild_s == 0
    )  # the CPU runtime's own fit
