"""How a model's decoder layers are spread over pipeline stages: the runtime's rule
(``Layout.stage_layers``), the cost model's busiest stage that reads it, and the simulator world's own
best split, against a brute-force optimum written here."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus_core.config import ModelConfig
from nereus_core.cost.geometry import model_stats, pipeline_split
from nereus_core.layout import Layout, stage_layer_counts
from nereus_core.model.weights import head_layers, stage_layers
from nereus_core.sim import stage_world as sw
from nereus_core.sim.shapes import model_size

# Qwen2.5-7B's config.json shapes (untied 152,064-token head).
QWEN_7B = ModelConfig(
    architecture="Qwen2ForCausalLM",
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    attention_bias=True,
    tie_word_embeddings=False,
)


def optimum(layers: int, pp: int, head: float) -> float:
    """The lightest busiest stage over every split into whole layers, at least one per stage."""
    if pp == 1:
        return layers + head
    return min(max(-(-(layers - last) // (pp - 1)), last + head) for last in range(1, layers - pp + 2))


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 64), st.data(), st.floats(0.0, 12.0))
def test_split_is_whole_contiguous_and_lightest(layers: int, data: st.DataObject, head: float) -> None:
    pp = data.draw(st.integers(1, layers))
    counts = stage_layer_counts(layers, pp, head)
    assert len(counts) == pp and sum(counts) == layers and min(counts) >= 1
    busiest = max(max(counts[:-1], default=0), counts[-1] + head)
    assert busiest == pytest.approx(optimum(layers, pp, head))
    layout = Layout(pp=pp, devices=tuple(range(pp)))
    ranges = [layout.stage_layers(layers, p, head_layers=head) for p in range(pp)]
    assert [r.start for r in ranges] == [0] + [r.stop for r in ranges[:-1]] and ranges[-1].stop == layers


@given(st.integers(1, 64), st.data())
def test_no_head_is_the_even_split_earlier_stages_taking_the_extra(layers: int, data: st.DataObject) -> None:
    pp = data.draw(st.integers(1, layers))
    base, extra = divmod(layers, pp)
    assert stage_layer_counts(layers, pp, 0.0) == tuple(base + (p < extra) for p in range(pp))


def test_a_7b_lm_head_takes_layers_off_the_last_stage() -> None:
    assert head_layers(QWEN_7B) == pytest.approx(152064 * 3584 / 233.4e6, rel=0.01)
    layout = Layout(pp=4, devices=(0, 1, 2, 3))
    assert [len(stage_layers(QWEN_7B, layout, p)) for p in range(4)] == [8, 8, 7, 5]
    value = QWEN_7B.model_copy(update={"head": "value"})
    assert [len(stage_layers(value, layout, p)) for p in range(4)] == [7, 7, 7, 7]
    with pytest.raises(ValueError, match="pp=29 needs 1 <= pp <= layers=28"):
        stage_layer_counts(28, 29, 1.0)


@pytest.mark.parametrize("pp", [2, 4, 8, 14])
def test_cost_model_busiest_stage_is_the_worlds_best_split(pp: int) -> None:
    """The cost model prices the runtime's split, the world (its own formula) the best realisable one:
    for a 7B model their busiest stages hold the same layers and share of the compute, more than 1/pp."""
    stats = model_stats(QWEN_7B)
    busiest_layers, flop_params, _ = pipeline_split(stats, pp, 1)
    share = flop_params / stats.flop_params
    size = model_size(QWEN_7B)
    stages = sw.pipeline_stages(size, pp)
    world_share = max(params for params, _ in stages) / size.params
    assert max(layers for _, layers in stages) == busiest_layers
    assert share > 1.0 / pp and world_share > 1.0 / pp
    # The world spreads the embedding over the layers: 5 % apart where the head's stage is the busiest.
    assert world_share == pytest.approx(share, rel=0.06)
