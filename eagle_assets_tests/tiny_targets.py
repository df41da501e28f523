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


def write_deeper_copy(model_dir, out_dir, layers: int = 8):
    """Write a ``layers``-deep variant of a trained Qwen3 directory (its tokenizer, its embeddings, final norm and
    first layers) to ``out_dir``: the extra layers are seeded at the default 0.02 init, small next to the trained
    residual stream, so the model still writes the trained model's kind of text with a real logit spread. For the
    capture-protocol tests, which need SGLang's default ids ``[2, L//2, L-3]`` distinct (L >= 7) and other layer
    sets to choose from; the 4-layer demo target has only ``[1, 2, 3]``. Returns ``out_dir`` as a Path."""
    import shutil
    from pathlib import Path

    src, out = Path(model_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    import copy

    trained = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    config = copy.deepcopy(trained.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [config.layer_types[0]] * layers
    torch.manual_seed(0)
    deeper = AutoModelForCausalLM.from_config(config).eval()
    state = {k: v for k, v in trained.state_dict().items()}
    missing, _ = deeper.load_state_dict(state, strict=False)
    assert all(".layers." in k and int(k.split(".layers.")[1].split(".")[0]) >= trained.config.num_hidden_layers
               for k in missing), missing
    deeper.generation_config = trained.generation_config
    deeper.save_pretrained(out, safe_serialization=True)
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copy(f, out / f.name)
    return out
