"""A tiny random Qwen3 causal LM + word-level tokenizer written to a directory, for serving tests and benchmarks.

Independent of the demo target: no training, builds in about a second. Weights use a large init scale so that
greedy continuations vary with the prompt and over positions (a default 0.02 init mostly repeats one token, which
would make batch-versus-single comparisons trivially equal).
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]


def write_tiny_causal_lm(
    out_dir: str | Path,
    *,
    n_words: int = 120,
    hidden_size: int = 64,
    num_layers: int = 2,
    init_std: float = 0.5,
    seed: int = 0,
    max_position_embeddings: int = 512,
    sliding_window: int | None = None,
) -> Path:
    """Write ``config.json``, ``model.safetensors``, ``generation_config.json`` and tokenizer files to ``out_dir``.

    Vocab: the special tokens above (ids 0-4), ``[UNK]`` (5), then words ``w0 .. w{n_words-1}`` (ids 6..). The
    tokenizer splits on whitespace. ``eos_token_id`` is ``<|im_end|>`` (2). ``sliding_window`` makes every layer a
    sliding-window layer (a cache the engine must serve in static mode).

    Returns ``out_dir`` as a Path.
    """
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, "[UNK]", *(f"w{i}" for i in range(n_words))])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in ("<|im_end|>", "<|endoftext|>")],
    )
    tokenizer.save_pretrained(out)
    extra = {}
    if sliding_window is not None:
        extra = {"use_sliding_window": True, "sliding_window": sliding_window, "max_window_layers": 0,
                 "layer_types": ["sliding_attention"] * num_layers}
    config = Qwen3Config(
        vocab_size=len(vocab),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        initializer_range=init_std,
        eos_token_id=vocab["<|im_end|>"],
        bos_token_id=None,
        pad_token_id=vocab["<|endoftext|>"],
        **extra,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = vocab["<|im_end|>"]
    model.save_pretrained(out)
    (out / "tiny_model.json").write_text(json.dumps({"seed": seed, "init_std": init_std, "n_words": n_words}))
    return out
