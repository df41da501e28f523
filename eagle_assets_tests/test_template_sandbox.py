"""The tuned chat-template sandbox (``target_model.template_sandbox``): the same safety verdicts as jinja2's own
``ImmutableSandboxedEnvironment``, the same refusals of unsafe templates, and the same rendered text on the real
Qwen3 and DeepSeek-V3 templates and the demo template, compared with an untuned compile of the same source."""

from __future__ import annotations

import collections
import sys
import types
from pathlib import Path

import pytest
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from transformers.utils.chat_template_utils import _compile_jinja_template

from eagle_assets.target_model import load_tokenizer
from eagle_assets.target_model.template_sandbox import compiled_templates, tune_environment, tune_sandbox

TOK = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "tokenizers"
DEMO_TEMPLATE = Path(__file__).resolve().parents[1] / "eagle_assets" / "demo" / "chat_template.jinja"
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."},
     {"role": "assistant", "content": "7", "reasoning_content": "7 is prime."},
     {"role": "user", "content": "Another?"}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": "{\"temp\": 18}"},
     {"role": "user", "content": "And <tool_response> tags in text?"}],
    [{"role": "user", "content": "a\n\nb"}, {"role": "assistant", "content": "<think>\nx\n</think>\n\ny"},
     {"role": "user", "content": "  spaces  "}],
]


def _fresh(source: str):
    """A compile of ``source`` that bypasses transformers' cache, so tuning one never touches the other."""
    return _compile_jinja_template.__wrapped__(source)


def _generator():
    yield 1


def _probe_objects() -> list:
    frame = sys._getframe()
    return [{}, {"role": "user"}, [], (), set(), frozenset(), "text", b"bytes", 3, 2.5, None, True,
            collections.deque(), collections.OrderedDict(), len, _fresh, str.upper, "x".upper, dict, type,
            _generator(), frame, frame.f_code, types.SimpleNamespace(a=1), ImmutableSandboxedEnvironment()]


PROBE_ATTRIBUTES = ["append", "update", "pop", "items", "get", "keys", "startswith", "format", "format_map",
                    "upper", "split", "strip", "add", "clear", "setdefault", "__class__", "__dict__", "__globals__",
                    "__code__", "__self__", "__func__", "mro", "__subclasses__", "gi_frame", "gi_code", "f_globals",
                    "co_code", "func_globals", "real", "role", "content", "a", "environment", "_private"]


def test_verdicts_equal_jinjas_own_for_safe_and_unsafe_attributes():
    env = ImmutableSandboxedEnvironment()
    reference = ImmutableSandboxedEnvironment()
    assert tune_environment(env) and not tune_environment(env)  # idempotent
    unsafe = 0
    for _ in range(2):  # the second round answers from the memo
        for obj in _probe_objects():
            for attr in PROBE_ATTRIBUTES:
                value = getattr(obj, attr, None)
                expected = reference.is_safe_attribute(obj, attr, value)
                assert env.is_safe_attribute(obj, attr, value) == expected, (type(obj).__name__, attr)
                unsafe += not expected
    assert unsafe > 40  # the probe reaches the refusals, not only the safe attributes


def test_getattr_equals_the_sandboxes_own():
    env, reference = ImmutableSandboxedEnvironment(), ImmutableSandboxedEnvironment()
    tune_environment(env)
    for obj in _probe_objects():
        for attr in PROBE_ATTRIBUTES:
            got, want = env.getattr(obj, attr), reference.getattr(obj, attr)
            assert type(got) is type(want), (type(obj).__name__, attr)
            if not callable(want) and not isinstance(want, types.FrameType):
                assert got == want or (got != got and want != want), (type(obj).__name__, attr)
    message = {"role": "user", "items": "shadowed"}
    # a key named like a dict method: the sandbox returns the method, never the key
    assert env.getattr(message, "items") == reference.getattr(message, "items") == message.items
    assert env.getattr(message, "role") == "user"
    missing = env.getattr(message, "name")
    assert type(missing) is type(reference.getattr(message, "name")) and str(missing) == ""


@pytest.mark.parametrize("source", [
    "{{ messages.append(1) }}",
    "{% set x = {} %}{{ x.update({'a': 1}) }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ messages.pop() }}",
])
def test_unsafe_templates_are_refused_as_before(source):
    reference, tuned = _fresh(source), _fresh(source)
    assert tune_environment(tuned.environment)

    def outcome(template):
        try:
            return "ok", template.render(messages=[1, 2])
        except SecurityError as exc:
            return "SecurityError", str(exc)
        except Exception as exc:  # undefined attributes and the like: compared as they are
            return type(exc).__name__, str(exc)

    got = outcome(tuned)
    assert got == outcome(reference)
    assert got[0] in ("SecurityError", "UndefinedError") or "messages" not in source


def _sources() -> list[tuple[str, str, dict]]:
    out = [("demo", DEMO_TEMPLATE.read_text(), {"bos_token": "", "eos_token": "<|im_end|>"})]
    for name in ("qwen3-0.6b", "deepseek-v3"):
        if (TOK / name).exists():
            tok = load_tokenizer(TOK / name)
            out.append((name, tok.chat_template, dict(tok.special_tokens_map)))
    return out


def test_rendered_text_equals_an_untuned_compile_on_every_family():
    sources = _sources()
    if len(sources) < 3:
        pytest.skip(f"../shared/data is absent: the Qwen3/DeepSeek-V3 tokenizers are not under {TOK}")
    compared = 0
    for name, source, specials in sources:
        reference, tuned = _fresh(source), _fresh(source)
        assert tune_environment(tuned.environment)
        for messages in CONVERSATIONS:
            for tools in (None, WEATHER):
                for gen in (True, False):
                    for extra in ({}, {"enable_thinking": False}):
                        kwargs = dict(messages=messages, tools=tools, add_generation_prompt=gen, **specials, **extra)
                        try:
                            want = reference.render(**kwargs)
                        except Exception as exc:  # a template may refuse a layout: the tuned one must too
                            with pytest.raises(type(exc)):
                                tuned.render(**kwargs)
                            continue
                        assert tuned.render(**kwargs) == want, (name, messages, tools, gen, extra)
                        compared += 1
    assert compared >= 3 * len(CONVERSATIONS) * 4


def test_tune_sandbox_tunes_transformers_compile_of_the_tokenizers_template():
    if not (TOK / "qwen3-0.6b").exists():
        pytest.skip(f"../shared/data is absent: {TOK / 'qwen3-0.6b'} not found")
    tok = load_tokenizer(TOK / "qwen3-0.6b")
    (compiled,) = compiled_templates(tok)
    assert compiled is _compile_jinja_template(tok.chat_template)  # the object apply_chat_template renders with
    tune_sandbox(tok)
    assert tune_sandbox(tok) == 0  # already tuned
    assert "is_safe_attribute" in vars(compiled.environment)
    assert "is_safe_attribute" not in vars(ImmutableSandboxedEnvironment())  # the class is untouched
