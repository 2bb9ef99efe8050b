"""The memory model's activations of a forward or train pass: padded, a micro-batch holds its rows at
the high quantile's length; packed (``passes.pack``, verl's use_remove_padding), its real tokens;
with a token budget (``passes.max_tokens_per_device``, verl's ppo_max_token_len_per_gpu), at most
the budget. Expected figures are the runtime's layer written out here
(``cost.activations.layer_activation_bytes``: what ``LlamaStage`` keeps for backward, measured by
benchmarks/bench_stage_memory.py)."""

from __future__ import annotations

import math

import pytest

from nereus_core.config import LLAMA_3_8B, Workload, parse_config
from nereus_core.cost.hardware import H100_SXM
from nereus_core.cost.stage_cost import estimate
from nereus_core.cost.terms import layout_geometry, model_stats
from nereus_core.layout import Layout

# Llama-3-8B on the H100 profile, bf16 activations; an lm head's fp32 logits of vocab values per token.
HIDDEN, LAYERS, VOCAB, ACT_BYTES = 4096, 32, 128256, 2
WORK = Workload(batch=1024, prompt_len=512, response_mean=2000, response_high=6000)
SEQ_HIGH, REAL = 512 + 6000, 512 + 2000


def _layer_bytes(tokens: float, tp: int = 1) -> float:
    """A decoder layer's kept bytes: two norms (fp32 input, bf16 normed and output; replicated) and
    q, k, v, SDPA's output and its copy, the MLP's four intermediates (bf16, split over tp)."""
    return tokens * (2 * 8 * HIDDEN + 2 * (3 * 4096 + 2 * 1024 + 4 * 14336) / tp)


def _infer_bytes(tokens: float, tp: int = 1) -> float:
    """No grad: one layer's working set, or the last stage's bf16 logits beside their fp32 copy (or the
    fp32 ones and a log-prob chunk: 1/32 of the rows, at least 4M elements)."""
    width = VOCAB / tp
    logits = tokens * width
    chunk = min(tokens, max(math.ceil(tokens / 32), (1 << 22) // width)) * width * 4
    return max(_layer_bytes(tokens, tp), logits * 4 + max(logits * 2, chunk))


def _train_last_stage(tokens: float, layers: int, in_flight: int) -> float:
    """A train pass's last stage: each micro-batch in flight keeps its layers, the final norm and the
    fp32 logits; backward adds the fp32 logits' gradient."""
    saved = layers * _layer_bytes(tokens) + tokens * 8 * HIDDEN + tokens * VOCAB * 4
    return in_flight * saved + tokens * VOCAB * 4


def _f1b(layout: Layout) -> Layout:
    """The layout's pipeline under 1F1B (``Layout.schedule``)."""
    return layout.model_copy(update={"schedule": "1f1b"})


def _activations(stage: str, layout: Layout, work: Workload) -> int:
    return estimate(stage, layout, work, LLAMA_3_8B, H100_SXM).memory.activations


def _packed(budget: int | None = None) -> Workload:
    return WORK.model_copy(update={"pack": True, "max_tokens_per_device": budget})


def test_padded_passes_hold_rows_at_the_high_length_and_packed_ones_their_real_tokens() -> None:
    layout = Layout.contiguous(dp=4, micro_batches=8)
    rows = math.ceil(1024 / 4 / 8)
    padded = _activations("reference/infer", layout, WORK)
    packed = _activations("reference/infer", layout, _packed())
    assert padded == pytest.approx(_infer_bytes(rows * SEQ_HIGH), rel=1e-9)
    assert packed == pytest.approx(_infer_bytes(rows * REAL), rel=1e-9)
    assert packed / padded == pytest.approx(REAL / SEQ_HIGH, rel=1e-9)


def test_packing_sequences_of_one_length_holds_what_padding_holds() -> None:
    even = WORK.model_copy(update={"response_mean": 6000})
    layout = Layout.contiguous(tp=2, micro_batches=16)
    for stage in ("actor/train", "critic/infer"):
        packed = even.model_copy(update={"pack": True})
        assert _activations(stage, layout, packed) == _activations(stage, layout, even)


@pytest.mark.parametrize("budget", [8192, 16384, 32768])
def test_a_budget_sets_a_micro_batch_s_tokens_whatever_the_layout_s_micro_batches(budget: int) -> None:
    for m in (1, 4):
        layout = Layout.contiguous(tp=2, micro_batches=m)
        got = _activations("reference/infer", layout, _packed(budget))
        assert got == pytest.approx(_infer_bytes(budget, tp=2), rel=1e-9)


def test_the_predicted_activations_scale_with_the_budget() -> None:
    layout = _f1b(Layout.contiguous(tp=1, pp=2, dp=1, micro_batches=1))
    for stage in ("actor/train", "reference/infer"):
        small, large = (_activations(stage, layout, _packed(b)) for b in (16384, 32768))
        assert large / small == pytest.approx(2.0, rel=1e-6)


def test_train_holds_the_budget_s_micro_batches_in_flight_under_1f1b() -> None:
    # 1F1B holds min(m, pp) micro-batches on the first stage and one on the last; a budget far under the
    # replica's tokens makes many.
    layout = _f1b(Layout.contiguous(pp=2, micro_batches=1))
    # the busiest stage's layers as the runtime splits them (the first stage takes the head's share)
    stage_layers = int(layout_geometry(model_stats(LLAMA_3_8B), H100_SXM, layout).stage_layers[0])
    assert stage_layers in (LAYERS // 2, LAYERS // 2 + 1)
    last = LAYERS - stage_layers
    expected = max(2 * stage_layers * _layer_bytes(16384), _train_last_stage(16384, last, 1))
    assert _activations("actor/train", layout, _packed(16384)) == pytest.approx(expected, rel=1e-9)
    # a budget that takes the replica's tokens whole: one micro-batch in flight, at those tokens
    whole = 1024 * REAL
    tokens_one = _activations("actor/train", layout, _packed(4 * whole))
    expected = max(stage_layers * _layer_bytes(whole), _train_last_stage(whole, last, 1))
    assert tokens_one == pytest.approx(expected, rel=1e-9)


def test_a_micro_batch_holds_at_least_one_longest_sequence() -> None:
    layout = Layout.contiguous(dp=1024)  # one row a replica
    assert _activations("reference/infer", layout, _packed()) == pytest.approx(_infer_bytes(SEQ_HIGH))
    small = _packed(1000)  # under the longest sequence: preflight refuses it; the model holds one anyway
    assert _activations("reference/infer", layout, small) == pytest.approx(_infer_bytes(SEQ_HIGH))


def test_the_job_s_workload_carries_the_passes_section_under_verl_s_names() -> None:
    base = {"job": {"batch_size": 8, "prompt_len": 8, "response_len": 8}}
    assert Workload.from_config(parse_config(base)).pack  # packed by default
    assert not Workload.from_config(parse_config({**base, "passes": {"use_remove_padding": False}})).pack
    verl = {**base, "passes": {"use_remove_padding": True, "ppo_max_token_len_per_gpu": 4096}}
    work = Workload.from_config(parse_config(verl))
    assert work.pack and work.max_tokens_per_device == 4096


def test_a_workload_refuses_a_budget_without_packing() -> None:
    with pytest.raises(ValueError, match=r"max_tokens_per_device=64 needs pack=True \(token-budget"):
        Workload(**{**WORK.model_dump(), "max_tokens_per_device": 64})


def test_gpipe_holds_the_replica_s_real_tokens_whatever_the_budget() -> None:
    # GPipe runs every forward before any backward: all the replica's micro-batches are in flight,
    # together its real tokens (rows x mean length), however the budget cuts them.
    gpipe = H100_SXM
    layout = Layout.contiguous(pp=2, dp=4)  # GPipe: the layout's default schedule
    stage_layers = int(layout_geometry(model_stats(LLAMA_3_8B), gpipe, layout).stage_layers[0])
    replica = 1024 // 4 * REAL
    for budget in (16384, 100_000):
        got = estimate("actor/train", layout, _packed(budget), LLAMA_3_8B, gpipe).memory.activations
        in_flight = replica / budget  # micro-batches of the budget's tokens, together the replica's
        last = (
            in_flight * ((LAYERS - stage_layers) * _layer_bytes(budget) + budget * (8 * HIDDEN + VOCAB * 4))
            + budget * VOCAB * 4
        )
        assert got == pytest.approx(max(stage_layers * _layer_bytes(replica), last), rel=1e-9)


def test_a_budget_s_micro_batches_set_the_pass_s_overheads_and_pipeline_bubble() -> None:
    """Time follows the budget's micro-batches too: a replica's real tokens over the budget, whole
    (verl's dynamic batch), whatever the layout's ``micro_batches``; the bubble is (pp - 1) of them."""
    layout = Layout.contiguous(pp=4, micro_batches=2)
    tokens = 1024 * REAL  # one replica's real tokens (dp=1)
    for count in (8, 32):  # budgets whose micro-batches hold whole sequences of the mean length
        got = estimate("actor/train", layout, _packed(tokens // count), LLAMA_3_8B, H100_SXM).terms
        as_layout = layout.model_copy(update={"micro_batches": count})
        assert got == pytest.approx(estimate("actor/train", as_layout, _packed(), LLAMA_3_8B, H100_SXM).terms)
    fine = estimate("actor/train", layout, _packed(tokens // 32), LLAMA_3_8B, H100_SXM).terms
    coarse = estimate("actor/train", layout, _packed(tokens // 8), LLAMA_3_8B, H100_SXM).terms
    assert fine["overhead"] > coarse["overhead"]  # more micro-batches, more launches
    assert fine["pp_comm"] < coarse["pp_comm"]  # smaller micro-batches, a smaller bubble


def test_gradient_checkpointing_keeps_each_layer_s_input_only_in_train_passes() -> None:
    """Full recomputation: each layer's bf16 input held in a train pass, one layer's activations again
    while backward recomputes it, for one more forward (8 x params FLOPs per token instead of 6)."""
    layout = _f1b(Layout.contiguous(pp=2, micro_batches=1))
    stage_layers = int(layout_geometry(model_stats(LLAMA_3_8B), H100_SXM, layout).stage_layers[0])
    checkpointed = LLAMA_3_8B.model_copy(update={"gradient_checkpointing": True})
    work = _packed(16384)

    def act(config, stage: str) -> int:
        return estimate(stage, layout, work, config, H100_SXM).memory.activations

    inputs = 16384 * HIDDEN * ACT_BYTES
    last_saved = (LAYERS - stage_layers) * inputs + 16384 * (8 * HIDDEN + VOCAB * 4)
    last = last_saved + max(16384 * VOCAB * 4, _layer_bytes(16384))
    first = 2 * stage_layers * inputs + _layer_bytes(16384)
    assert act(checkpointed, "actor/train") == pytest.approx(max(first, last), rel=1e-9)
    assert act(checkpointed, "actor/train") < 0.3 * act(LLAMA_3_8B, "actor/train")  # logits stay
    assert act(checkpointed, "reference/infer") == act(LLAMA_3_8B, "reference/infer")  # no backward
    plain, again = (estimate("actor/train", layout, work, c, H100_SXM) for c in (LLAMA_3_8B, checkpointed))
    assert again.seconds > plain.seconds  # the extra forward is priced


def test_without_a_pipeline_one_micro_batch_is_in_flight() -> None:
    # Nereus's runtime (engine/train.py) backpropagates each micro-batch before the next when there is
    # no pipeline: a budget that cuts more micro-batches lowers the peak.
    flat = Layout.contiguous(micro_batches=1)
    small, large = (_activations("actor/train", flat, _packed(b)) for b in (16384, 32768))
    assert large / small == pytest.approx(2.0, rel=0.05)


def test_1f1b_holds_fewer_micro_batches_than_gpipe_on_the_same_pipeline() -> None:
    layout = Layout.contiguous(pp=4, dp=2, micro_batches=16)
    gpipe, f1b = (_activations("actor/train", v, _packed()) for v in (layout, _f1b(layout)))
    assert f1b < gpipe / 3  # the first stage holds 4 of 16 micro-batches, the last 1
    assert _activations("reference/infer", _f1b(layout), _packed()) == _activations(
        "reference/infer", layout, _packed()
    )  # a forward pass has no backward to schedule
