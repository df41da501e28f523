"""Kimi-K2.5 tokenizer rebuilt from tiktoken.model: ids, profile, tiktoken-equivalent BPE, SpecForge golden ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle_assets.target_model import detect_profile, load_tokenizer, render_prompt
from eagle_assets.target_model.kimi import _bytes_to_unicode, _merge_parts, load_kimi_tokenizer, read_tiktoken_ranks

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
KIMI = SHARED / "tokenizers" / "kimi-k2.5"
TEMPLATE = SHARED / "chat_templates" / "moonshotai-Kimi-K2-Thinking.jinja"
STANDARD = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Who are you?"},
    {"role": "assistant", "content": "My name is Qwen2."},
    {"role": "user", "content": "How old are you?"},
]
TEXT = "Hello, world! 你好世界，今天天气怎么样？ I'm here.\n\n  def f(x):\n\treturn x**2 + 12345  # Ünïcödé ✓ 🚀\r\n"


@pytest.fixture(scope="module")
def kimi():
    if not KIMI.exists() or not TEMPLATE.exists():
        pytest.skip(f"../shared/data is absent: {KIMI} not found")
    return load_kimi_tokenizer(KIMI, TEMPLATE)


def test_ids_and_profile(kimi):
    assert len(kimi) == 163840
    expected = {"[BOS]": 163584, "[EOS]": 163585, "<|im_end|>": 163586, "<|im_middle|>": 163601, "<think>": 163606,
                "</think>": 163607, "<|tool_calls_section_begin|>": 163595, "[PAD]": 163839, "<|reserved_token_163600|>": 163600}
    assert {t: kimi.convert_tokens_to_ids(t) for t in expected} == expected
    assert (kimi.bos_token_id, kimi.eos_token_id) == (163584, 163585)
    p = detect_profile(kimi)
    assert (p.name, p.think_start_id, p.think_end_id, p.end_of_turn_id) == ("kimi", 163606, 163607, 163586)
    assert p.tool_call_start_ids == (163595, 163597) and p.tool_call_end_ids == (163596, 163599)
    assert set(p.stop_ids) == {163586, 163585}
    # SGLang's kimi_k2 reasoning detector: a tool-call section with no </think> ends the reasoning
    assert p.tool_call_ends_reasoning and not p.implicit_think_start
    assert kimi.decode(kimi(TEXT, add_special_tokens=False)["input_ids"]) == TEXT


def test_bpe_matches_tiktoken_algorithm(kimi):
    # tiktoken encodes each pre-token by direct lookup, else by repeatedly merging the lowest-ranked adjacent
    # pair; the rebuilt HF tokenizer must give the same ids for every pre-token.
    ranks = read_tiktoken_ranks(KIMI / "tiktoken.model")
    pieces = kimi.backend_tokenizer.pre_tokenizer.pre_tokenize_str(TEXT)
    assert pieces, "pre-tokenizer produced nothing"
    table = {c: b for b, c in _bytes_to_unicode().items()}
    expected = []
    for piece, _ in pieces:
        raw = bytes(table[c] for c in piece)
        parts = [raw] if raw in ranks else _merge_parts(ranks, raw, len(ranks) + 1)
        expected.extend(ranks[p] for p in parts)
    assert kimi(TEXT, add_special_tokens=False)["input_ids"] == expected
    han = [p for p, _ in pieces if any("\u4e00" <= ch <= "\u9fff" for ch in bytes(table[c] for c in p).decode("utf-8", "ignore"))]
    assert han  # Han runs are split from the surrounding Latin text by the Kimi pattern


def test_golden_ids_kimi_k2_thinking(kimi):
    ref_path = SHARED / "specforge" / "test_references" / "kimi-k2-thinking_standard_ref.json"
    if not ref_path.exists():
        pytest.skip(f"../shared/data is absent: {ref_path} not found")
    ref = json.loads(ref_path.read_text())
    rendered = render_prompt(kimi, STANDARD, profile=detect_profile(kimi))
    n = rendered.n_prompt_tokens
    assert rendered.prompt_ids == ref["input_ids"][:n]
    assert rendered.flags["generation_prompt"] == "<|im_assistant|>assistant<|im_middle|>"
    output = kimi("<think></think>11 years old.<|im_end|>", add_special_tokens=False)["input_ids"]
    assert rendered.prompt_ids + output == ref["input_ids"]
    assert ref["loss_mask"][n - 1] == 0 and all(ref["loss_mask"][n:])


def test_load_tokenizer_dispatches_tiktoken_dirs(kimi):
    tok = load_tokenizer(KIMI)  # no tokenizer.json: built from tiktoken.model (cached, so fast the second time)
    assert len(tok) == 163840 and tok.chat_template is None


def test_k25_generation_prompt_opens_the_block_and_k2_thinking_does_not(kimi):
    prof = detect_profile(kimi)
    msgs = [{"role": "user", "content": "Hi"}]
    thinking = render_prompt(kimi, msgs, profile=prof)
    assert not thinking.opens_think and thinking.flags["ids_after_think_start"] is None
    saved = kimi.chat_template
    try:
        for tail, opens in (("<think>", True), ("<think></think>", False)):  # K2.5 thinking on / off
            kimi.chat_template = saved.replace("<|im_assistant|>assistant<|im_middle|>\n{%- endif -%}",
                                               f"<|im_assistant|>assistant<|im_middle|>{tail}\n{{%- endif -%}}")
            assert kimi.chat_template != saved
            r = render_prompt(kimi, msgs, profile=prof)
            assert r.opens_think is opens and r.flags["generation_prompt"].endswith(tail)
            assert r.flags["ids_after_think_start"] == ([] if opens else None)
    finally:
        kimi.chat_template = saved
