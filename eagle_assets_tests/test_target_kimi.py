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
                "</think>": 163607, "<|tool_calls_section_begin|>": 163595, "[PAD]": 163839,
                "<|reserved_token_163600|>": 163600}
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
    han = [p for p, _ in pieces
           if any("\u4e00" <= ch <= "\u9fff" for ch in bytes(table[c] for c in p).decode("utf-8", "ignore"))]
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


def test_the_built_core_is_cached_on_disk_and_a_damaged_cache_is_rebuilt(kimi, tmp_path, monkeypatch, caplog):
    """A second process (here: the in-memory cache cleared) reads the core from disk instead of replaying 163k
    merges; the cached core is the built one; a damaged file is rebuilt and replaced, a foreign one refused, and an
    unwritable cache directory only means no cache. (Two builds in all: each costs ~4 CPU seconds.)"""
    from tokenizers import Tokenizer
    from tokenizers.models import BPE

    from eagle_assets.target_model import kimi as kimi_module

    monkeypatch.setenv(kimi_module.CACHE_ENV, str(tmp_path / "cache"))
    args = (str((KIMI / "tiktoken.model").resolve()), str((KIMI / "tokenizer_config.json").resolve()))
    built_calls = []
    real_build = kimi_module._build_core
    monkeypatch.setattr(kimi_module, "_build_core", lambda *a: built_calls.append(1) or real_build(*a))

    def fresh_core():
        kimi_module._cached_core.cache_clear()
        return kimi_module._cached_core(*args)

    try:
        built = fresh_core()
        files = list((tmp_path / "cache").glob("*.json"))
        assert len(built_calls) == 1 and len(files) == 1
        assert files[0].stat().st_mode & 0o777 == 0o644
        cached = fresh_core()
        assert len(built_calls) == 1, "the second load rebuilt the merges instead of reading the cache"
        assert cached.to_str() == built.to_str()
        assert cached.encode(TEXT).ids == built.encode(TEXT).ids == kimi.encode(TEXT, add_special_tokens=False)

        good = files[0].read_bytes()
        files[0].write_text('{"version": "1.0", "truncated')
        assert fresh_core().to_str() == built.to_str() and len(built_calls) == 2
        assert "unreadable" in caplog.text
        assert files[0].read_bytes() == good, "the rebuilt core was not written back"

        # A readable tokenizer that is not this vocabulary, under this key: refused (the caller then rebuilds)
        n = kimi.convert_tokens_to_ids("[BOS]")
        specials = kimi_module._specials({}, n)
        Tokenizer(BPE({"a": 0}, [])).save(str(files[0]))
        assert kimi_module._read_cached_core(files[0], n, specials) is None
        assert "does not match" in caplog.text

        blocker = tmp_path / "not-a-dir"
        blocker.write_text("")
        kimi_module._write_cached_core(blocker / "cache" / "core.json", built)  # logs, does not raise
        assert blocker.read_text() == ""
        monkeypatch.setenv(kimi_module.CACHE_ENV, "off")
        assert kimi_module.core_cache_dir() is None
    finally:
        kimi_module._cached_core.cache_clear()


def test_a_loaded_tokenizer_never_shares_the_cached_core(kimi):
    """Tokens added to one loaded tokenizer reach neither the process's cached core nor the next load."""
    from eagle_assets.target_model import kimi as kimi_module

    core = kimi_module._cached_core(str((KIMI / "tiktoken.model").resolve()),
                                    str((KIMI / "tokenizer_config.json").resolve()))
    one = load_kimi_tokenizer(KIMI, TEMPLATE)
    assert one.backend_tokenizer is not core
    one.add_tokens(["<|a_token_only_this_instance_has|>"])
    assert len(one) == 163841
    assert core.token_to_id("<|a_token_only_this_instance_has|>") is None
    assert len(load_kimi_tokenizer(KIMI, TEMPLATE)) == 163840
