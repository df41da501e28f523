"""The synthetic transcript generator and the demo tokenizer / chat template (no model training here)."""

from __future__ import annotations

import json
import re
import statistics

import pytest
from transformers import AutoTokenizer

from eagle_assets.demo.tokenizer import CONTROL_TOKENS, GENERATION_PROMPT, train_demo_tokenizer
from eagle_assets.demo.transcripts import (
    KINDS,
    DONE_LINE,
    completion_text,
    generate_mixture,
    generate_samples,
    tool_call_text,
)


@pytest.fixture(scope="module")
def tokenizer():
    bootstrap = train_demo_tokenizer(["bootstrap text"], vocab_size=512)
    corpus = generate_mixture(40, seed=1)
    texts = [bootstrap.apply_chat_template(s.messages, tools=s.tools, add_generation_prompt=True, tokenize=False)
             + completion_text(s) for s in corpus]
    return train_demo_tokenizer(texts, vocab_size=2048)


def test_generation_is_deterministic_per_seed():
    for kind in KINDS:
        a, b = generate_samples(kind, 5, seed=3), generate_samples(kind, 5, seed=3)
        assert a == b
        assert a != generate_samples(kind, 5, seed=4)
    with pytest.raises(ValueError, match="unknown demo kind"):
        generate_samples("poetry", 1, 0)


@pytest.mark.parametrize("kind", KINDS)
def test_reply_structure_and_counter(kind):
    for s in generate_samples(kind, 30, seed=0):
        text = completion_text(s)
        assert text.startswith("\n") and text.endswith("<|im_end|>")
        assert text.count("</think>") == 1 and "<think>" not in text
        answer = text.split("</think>", 1)[1].removesuffix("<|im_end|>").strip()
        assert answer
        n = s.features["n_items"]
        if kind == "tool":
            assert answer == tool_call_text(s.tool_calls[0])
            call = json.loads(answer.removeprefix("<tool_call>").removesuffix("</tool_call>"))
            assert call["name"] in {t["function"]["name"] for t in s.tools}
            assert len(call["arguments"]) == n
            user = next(m for m in s.messages if m["role"] == "user")["content"]
            assert all(str(v) in user for v in call["arguments"].values())  # arguments are read off the request
        else:
            assert "<tool_call>" not in text and s.tools is None
            # The reply counts down over exactly the n items the prompt announces: "n to go: ..." ... "0 to go, ...".
            counters = re.findall(r"^(\d+) to go[:,]", s.reasoning, flags=re.MULTILINE)
            assert [int(c) for c in counters] == list(range(n, -1, -1))
            assert s.reasoning.splitlines()[-1] == DONE_LINE
            assert f" {n} " in next(m for m in s.messages if m["role"] == "user")["content"]


def test_reply_lengths_differ_by_kind(tokenizer):
    med = {}
    for kind in KINDS:
        lengths = [len(tokenizer(completion_text(s), add_special_tokens=False)["input_ids"])
                   for s in generate_samples(kind, 40, seed=0)]
        med[kind] = statistics.median(lengths)
    assert 20 <= med["tool"] <= 90
    assert med["tool"] < med["code"] < min(med["math"], med["reasoning"])
    assert 200 <= med["math"] <= 500 and 200 <= med["reasoning"] <= 500


def test_control_tokens_are_single_ids(tokenizer):
    for i, tok in enumerate(CONTROL_TOKENS):
        assert tokenizer.convert_tokens_to_ids(tok) == i
        assert tokenizer(f"a {tok} b", add_special_tokens=False)["input_ids"].count(i) == 1
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None


def test_generation_prompt_ends_with_think(tokenizer):
    think = tokenizer.convert_tokens_to_ids("<think>")
    for kind in KINDS:
        s = generate_samples(kind, 1, seed=0)[0]
        text = tokenizer.apply_chat_template(s.messages, tools=s.tools, add_generation_prompt=True, tokenize=False)
        assert text.endswith(GENERATION_PROMPT)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert ids[-1] == think and ids.count(think) == 1


def test_template_renders_tools_history_and_tool_results(tokenizer):
    s = generate_samples("tool", 1, seed=0)[0]
    with_tools = tokenizer.apply_chat_template(s.messages, tools=s.tools, add_generation_prompt=True, tokenize=False)
    without = tokenizer.apply_chat_template(s.messages, add_generation_prompt=True, tokenize=False)
    assert with_tools != without and json.dumps(s.tools[0]) in with_tools
    # A finished turn rendered as history equals prompt + the generated reply (minus the template's trailing "\n").
    history = s.messages + [s.reply_message(), {"role": "tool", "content": '{"ok": true}'}]
    rendered = tokenizer.apply_chat_template(history, tools=s.tools, tokenize=False)
    assert with_tools + completion_text(s) + "\n" in rendered
    assert rendered.endswith('<|im_start|>user\n<tool_response>\n{"ok": true}\n</tool_response><|im_end|>\n')
    no_think = tokenizer.apply_chat_template(s.messages, tools=s.tools, add_generation_prompt=True, tokenize=False,
                                             enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_saved_tokenizer_reloads_with_template(tokenizer, tmp_path):
    from eagle_assets.demo.build import _portable_tokenizer_config

    tokenizer.save_pretrained(tmp_path, save_jinja_files=False)
    _portable_tokenizer_config(tmp_path / "tokenizer_config.json")
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and "<think>" in cfg["chat_template"]
    again = AutoTokenizer.from_pretrained(tmp_path)
    s = generate_samples("math", 1, seed=0)[0]
    a = tokenizer.apply_chat_template(s.messages, add_generation_prompt=True, tokenize=False)
    assert again.apply_chat_template(s.messages, add_generation_prompt=True, tokenize=False) == a
    assert again(a, add_special_tokens=False)["input_ids"] == tokenizer(a, add_special_tokens=False)["input_ids"]


def test_check_reply_rules(tokenizer):
    from eagle_assets.demo.evaluate import check_reply

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    tool = generate_samples("tool", 1, seed=0)[0]
    math = generate_samples("math", 1, seed=0)[0]
    good_tool, good_math = completion_text(tool), completion_text(math)
    assert check_reply(ids(good_tool), tokenizer, expect_tool_call=True).ok
    ok = check_reply(ids(good_math), tokenizer, expect_tool_call=False)
    assert ok.ok and ok.n_tokens == len(ids(good_math)) and 0 < ok.n_reasoning_tokens < ok.n_tokens
    cases = {
        "no_stop": (good_math.removesuffix("<|im_end|>"), False),
        "think_end_count": (good_math.replace("</think>", "</think></think>"), False),
        "think_start": ("<think>" + good_math, False),
        "empty_answer": ("\nreasoning\n</think>\n\n<|im_end|>", False),
        "unexpected_tool_call": (good_tool, False),
        "tool_call_missing": (good_math, True),
        "tool_call_json": (good_tool.replace('"arguments": {', '"arguments": {{'), True),
    }
    for reason, (text, expect_tool) in cases.items():
        verdict = check_reply(ids(text), tokenizer, expect_tool_call=expect_tool)
        assert (verdict.ok, verdict.reason) == (False, reason), text[-120:]
