"""Model configs the core tests share: tiny ones for tests that run them (each test's cost grows with
their sizes), and a mid-size one for the planning tests, which only estimate."""

from __future__ import annotations

from nereus_core.config import ModelConfig

# Heads, kv heads, vocab and ffn divisible by tp in {1, 2, 4}; 2 layers for pp in {1, 2} (one each at
# pp=2); small enough to count element by element.
SHARDABLE = ModelConfig(
    vocab_size=32,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
)
# The same with two heads (tp up to 2) and a seed of its own.
TWO_HEADS = SHARDABLE.model_copy(update={"num_attention_heads": 2, "num_key_value_heads": 2, "seed": 4})
# ~1.2B parameters: memory binds on small devices.
MID = ModelConfig(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5504,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=8,
    max_position_embeddings=8192,
)

# A job's model section for vLLM on CPU: head_dim 64 (vLLM's CPU attention needs at least 32) and
# 2 KV heads, so that tp 2 splits them.
VLLM_JOB_MODEL = {
    "vocab_size": 32,
    "hidden_size": 128,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
}
