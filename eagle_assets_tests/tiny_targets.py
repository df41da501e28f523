"""Tiny random Qwen3 targets for the drafter tests (each test module picks its vocab, depth and extras)."""

import torch
from transformers import AutoModelForCausalLM, Qwen3Config


def tiny_qwen3(vocab: int, layers: int, **overrides):
    """A seeded random Qwen3 causal LM: hidden 64, 4 heads (2 kv) of dim 16, tied embeddings, 512 positions."""
    torch.manual_seed(0)
    fields = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, max_position_embeddings=512,
    )
    fields.update(overrides)
    return AutoModelForCausalLM.from_config(Qwen3Config(**fields)).eval()
