"""The synthetic transcript generator and the demo tokenizer / chat template (no model training here)."""

from __future__ import annotations

import json
import re
import statistics

import pytest
from transformers import AutoTokenizer

from eagle_assets.demo.tokenizer import CONTROL_TOKENS, GENERATION_PROMPT, train_demo_tokenizer
from eagle_assets.demo.transcripts import (
    DONE_LINE,
    KINDS,
    TURN_KINDS,
    completion_text,
    generate_mixture,
    generate_samples,
    tool_call_text,
    tool_turns,
)


@pytest.fixture(scope="module")
def tokenizer():
    bootstrap = train_demo_tokenizer(["bootstrap text"], vocab_size=512)
    corpus = generate_mixture(40, seed=1)
    texts = [bootstrap.apply_chat_template(s.messages, tools=s.tools, add_generation_prompt=True, tokenize=False)
             + completion_text(s) for s in corpus]
    return train_demo_tokenizer(texts, vocab_size=2048)


def test_generation_is_deterministic_per_seed():
    for kind in KINDS + TURN_KINDS:
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
    from eagle_assets.demo.gate import check_reply

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


def test_tool_conversations_go_on_after_the_call():
    for first in generate_samples("tool", 30, seed=0):
        second, third = tool_turns(first)
        response, final = first.features["function_response"]
        # Turn 2: the call and its recorded result are the history; the answer uses the result.
        assert second.messages[:len(first.messages)] == first.messages
        assert second.messages[-2] == first.reply_message()
        assert second.messages[-1] == {"role": "tool", "content": json.dumps(response)}
        assert json.dumps(response) in second.reasoning and second.content == final
        # Turn 3: a follow-up question about that answer, answered without a tool.
        question, reasoning, answer = first.features["follow_up"]
        assert third.messages[:-2] == second.messages and third.messages[-2] == second.reply_message()
        assert third.messages[-1] == {"role": "user", "content": question}
        assert (third.reasoning, third.content) == (reasoning, answer)
        for later in (second, third):
            text = completion_text(later)
            assert text.count("</think>") == 1 and "<think>" not in text and "<tool_call>" not in text
            assert later.tool_calls is None and later.content.strip() and later.tools == first.tools
    # The turn-kind streams are tool conversations of their own (not the tool stream's).
    assert generate_samples("tool_result", 3, seed=0) != [tool_turns(f)[0] for f in generate_samples("tool", 3, seed=0)]
    assert {s.features["turn"] for s in generate_samples("follow_up", 5, seed=0)} == {3}


def test_template_keeps_reasoning_only_after_the_last_user_turn(tokenizer):
    first = generate_samples("tool", 1, seed=2)[0]
    second, third = tool_turns(first)

    def render(sample):
        return tokenizer.apply_chat_template(sample.messages, tools=sample.tools, add_generation_prompt=True,
                                             tokenize=False)

    # Inside the tool chain (after the last user turn) turn 1's reasoning stays: turn 2's prompt extends turn 1's
    # prompt by exactly the reply the model wrote.
    assert render(second).startswith(render(first) + completion_text(first) + "\n<|im_start|>user\n<tool_response>")
    # Before the follow-up question both earlier replies render without their reasoning (Qwen3's rule).
    turn3 = render(third)
    assert first.reasoning not in turn3 and second.reasoning not in turn3
    assert turn3.count("<think>") == 1 and turn3.endswith("<|im_start|>assistant\n<think>")
    assert "<|im_start|>assistant\n" + tool_call_text(first.tool_calls[0]) + "<|im_end|>" in turn3
    assert "<|im_start|>assistant\n" + second.content + "<|im_end|>" in turn3


def test_a_tool_chain_trains_both_replies_in_one_row(tokenizer):
    import random

    from eagle_assets.demo.recipe import DemoRecipe
    from eagle_assets.demo.rows import encode_sample, encode_tool_chain, training_row

    for second in generate_samples("tool_result", 5, seed=3):
        first = second.features["first"]
        ids, n_prompt, spans = encode_tool_chain(tokenizer, second)
        p1, r1 = encode_sample(tokenizer, first)
        p2, r2 = encode_sample(tokenizer, second)
        assert ids[:n_prompt] == p1 and ids == p2 + r2
        (a0, a1, reply1), (b0, b1, between), (c0, c1, reply2) = spans
        assert (reply1, between, reply2) == (True, False, True)
        assert ids[n_prompt + a0:n_prompt + a1] == r1 and ids[n_prompt + c0:n_prompt + c1] == r2
        assert n_prompt + c1 == len(ids) and ids[:n_prompt + c0] == p2
        recipe = DemoRecipe()
        row_ids, row_prompt, weights, flags = training_row(tokenizer, second, random.Random(0), recipe)
        assert (row_ids, row_prompt) == (ids, n_prompt) and len(weights) == len(flags) == len(ids) - n_prompt
        assert sum(flags) == len(r1) + len(r2)
        assert set(w for w, f in zip(weights, flags) if not f) == {recipe.prompt_loss_weight}
