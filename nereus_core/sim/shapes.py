"""A decoder's shape as the simulated world reads it: parameters, layers, KV bytes per token, width, and
the tensors of its state dict (Llama/Qwen shapes; the world's own count, not the cost model's)."""

from __future__ import annotations

from nereus_core.config import ModelConfig
from nereus_core.sim import stage_world


def model_size(m: ModelConfig) -> stage_world.ModelSize:
    """Parameters, layers, bf16 KV bytes per token and width of a decoder (Llama/Qwen shapes)."""
    h, kv = m.hidden_size, m.num_key_value_heads * m.head_dim
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * m.intermediate_size
    head = 1 if m.head == "value" else m.vocab_size * h
    embed = m.vocab_size * h + (0 if m.tie_word_embeddings else head)
    return stage_world.ModelSize(
        params=float(m.num_hidden_layers * per_layer + embed),
        layers=m.num_hidden_layers,
        kv_bytes_per_token=2.0 * m.num_hidden_layers * kv * 2,
        hidden=h,
        head_params=float(head),
    )


def weight_tensors(m: ModelConfig) -> int:
    """Tensors of a Llama/Qwen decoder's state dict: per layer q, k, v, o, gate, up, down and two norms
    (plus three biases with ``attention_bias``); embeddings, final norm and an untied head."""
    per_layer = 9 + (3 if m.attention_bias else 0)
    return m.num_hidden_layers * per_layer + 2 + (0 if m.tie_word_embeddings else 1)
