"""One render per prompt (``target_model.generation_suffix``): where a template is proven to append a constant
generation prompt, the derived ``add_generation_prompt=False`` text equals the real second render, on varied
conversations (system prompts, 1-3 turns, tools, tool calls and results, thinking on/off/default) of every real
family's template and Qwen3's must be proven; DeepSeek-V3's is not (no header after tool outputs) and keeps two
renders."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle_assets.target_model.generation_suffix import constant_suffix
from eagle_assets.target_model.tokenizer import load_tokenizer

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "tokenizers"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}


def conversations():
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    yield [{"role": "user", "content": "hi"}], None
    yield [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}], None
    yield [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
           {"role": "user", "content": "c <think> d"}], None
    yield [{"role": "user", "content": "Weather in Oslo?"}], [WEATHER]
    yield [{"role": "user", "content": "Weather in Oslo?"},
           {"role": "assistant", "content": "", "tool_calls": [call]},
           {"role": "tool", "content": "{\"t\": 3}"}], [WEATHER]
    yield [{"role": "system", "content": "S"}, {"role": "user", "content": "x" * 300},
           {"role": "assistant", "content": "y"}, {"role": "user", "content": "z"}], [WEATHER]


def family_dirs():
    dirs = [SHARED / name for name in ("qwen3-0.6b", "kimi-k2.5", "deepseek-v3")]
    return [pytest.param(d, id=d.name) for d in dirs]


@pytest.mark.parametrize("model_dir", family_dirs())
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": True}, {"enable_thinking": False}])
def test_the_derived_render_equals_the_second_render(model_dir, kwargs):
    if not model_dir.is_dir():
        pytest.skip(f"{model_dir} is absent: the real tokenizers are not on this machine")
    tokenizer = load_tokenizer(model_dir)
    suffix = constant_suffix(tokenizer, kwargs)
    if model_dir.name == "deepseek-v3":
        assert suffix is None  # no header after tool outputs: the generation prompt is not constant
        return
    if suffix is None:
        # not proven (Kimi-K2.5 as loaded from tiktoken.model, seen 2026-12-03): two renders, exact by construction
        assert model_dir.name != "qwen3-0.6b", "Qwen3's template should be proven constant-suffix"
        return
    compared = 0
    for messages, tools in conversations():
        try:
            with_gen = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                     tokenize=False, **kwargs)
            plain = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=False,
                                                  tokenize=False, **kwargs)
        except Exception:  # noqa: BLE001 -- a conversation this template refuses says nothing about the suffix
            continue
        assert suffix.derive_plain(with_gen) == plain, (model_dir.name, messages)
        compared += 1
    assert compared >= 4


def test_a_template_whose_generation_prompt_reads_the_conversation_is_not_proven():
    from transformers import AutoTokenizer

    qwen = SHARED / "qwen3-0.6b"
    if not qwen.is_dir():
        pytest.skip(f"{qwen} is absent")
    tokenizer = AutoTokenizer.from_pretrained(qwen)
    tokenizer.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                               "{% if add_generation_prompt %}<a:{{ messages[-1].role }}>{% endif %}")
    assert constant_suffix(tokenizer, {}) is None
    tokenizer.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}")
    suffix = constant_suffix(tokenizer, {})
    assert suffix is not None and suffix.generation_tail == "<assistant>" and suffix.plain_tail == ""
