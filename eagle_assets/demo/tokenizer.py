"""The demo target's tokenizer: a small byte-level BPE with Qwen3's special tokens and a Qwen3-like chat template.

Token ids 0-8 are the control tokens, in this order: ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``,
``<think>``, ``</think>``, ``<tool_call>``, ``</tool_call>``, ``<tool_response>``, ``</tool_response>``. As in
Qwen3's ``tokenizer_config.json`` the first three are special tokens (dropped by ``skip_special_tokens``) and the
think / tool markers are added tokens that are never split but stay visible in decoded text. ``eos_token`` is
``<|im_end|>`` (the end of an assistant turn), ``pad_token`` is ``<|endoftext|>``; there is no BOS token.
"""

from __future__ import annotations

from collections.abc import Iterable
from importlib import resources

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MARKER_TOKENS: tuple[str, ...] = (
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
)
CONTROL_TOKENS: tuple[str, ...] = SPECIAL_TOKENS + MARKER_TOKENS
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
GENERATION_PROMPT = "<|im_start|>assistant\n<think>"


def chat_template() -> str:
    """The Jinja chat template shipped as ``eagle_assets/demo/chat_template.jinja``."""
    return resources.files("eagle_assets.demo").joinpath("chat_template.jinja").read_text(encoding="utf-8")


def train_demo_tokenizer(texts: Iterable[str], vocab_size: int = 2048) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``texts`` and wrap it as a ``PreTrainedTokenizerFast`` with the chat template.

    Args:
        texts: training text (rendered demo conversations); control-token strings in it are ignored, so the
            merges are learned on plain text only.
        vocab_size: total vocabulary size including the 9 control tokens and the 256 byte symbols.

    Returns:
        A tokenizer whose ``len()`` is at most ``vocab_size``; control tokens have ids 0-8 (see module docstring).

    Raises:
        ValueError: ``vocab_size`` leaves no room for merges (must exceed 256 + 9).
    """
    if vocab_size <= 256 + len(CONTROL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} is too small: the byte alphabet and control tokens take "
                         f"{256 + len(CONTROL_TOKENS)} ids; use 1024 or more")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(CONTROL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def plain(stream: Iterable[str]) -> Iterable[str]:
        for text in stream:
            for token in CONTROL_TOKENS:
                text = text.replace(token, "\n")
            yield text

    tok.train_from_iterator(plain(texts), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKER_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = chat_template()
    return fast
