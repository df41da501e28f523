"""Turn-by-turn history with the real Qwen3, DeepSeek-R1 and Kimi-K2.5 / K2-Thinking tokenizers and templates.

Each test drives ``generations.rollout.render_turn`` / ``take_reply`` (the code the ``all_turns`` generations run)
over replies written in each family's own token structure, and checks that turn k's ``prompt_ids`` are, id for id,
``apply_chat_template(history, tools, add_generation_prompt=True)`` of the history a client of SGLang would send
back: the assistant messages written out here by hand (``reasoning_content`` / ``content`` / ``tool_calls``), the
recorded tool results after them. What each template keeps of earlier reasoning is asserted on the rendered text
(docs/multi_turn.md has the table). The templates come from ``../shared/data`` (skipped when absent); R1's and
K2.5's are built from V3's and K2-Thinking's exactly as ``test_quality_families`` builds them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from test_quality_families import KIMI_THINKING_TEMPLATE, WEATHER_TOOL, _k25_template, _r1_template

from eagle_assets.generations.reply import client_message, reply_spans
from eagle_assets.generations.rollout import RolloutSettings, render_turn, take_reply
from eagle_assets.structure.segment import segment_output
from eagle_assets.target_model import detect_profile, load_kimi_tokenizer, load_tokenizer
from eagle_assets.tokenized_prompts.walk import (
    COMPLETE,
    QC_DROPPED,
    RENDER_REJECTED,
    TOOL_RESULT_NOT_RECORDED,
    UNPARSEABLE_TOOL_CALL,
    ConversationWalk,
    thinking_modes,
    turn_row_id,
)

ROME = {"city": "Rome"}
DATASET = [  # a glaive-style exchange: a call, its recorded result, the answer, a follow-up question
    {"role": "system", "content": "You are a weather assistant."},
    {"role": "user", "content": "Weather in Rome?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": ROME}}]},
    {"role": "tool", "content": '{"sky": "sunny"}'},
    {"role": "assistant", "content": "It is sunny in Rome."},
    {"role": "user", "content": "Thanks. Should I take an umbrella?"},
    {"role": "assistant", "content": "No."},
]


@pytest.fixture(scope="module")
def toks(shared_data: Path):
    t = shared_data / "tokenizers"
    qwen = load_tokenizer(t / "qwen3-0.6b")
    r1 = load_tokenizer(t / "deepseek-v3")
    r1.chat_template = _r1_template(r1.chat_template)
    kimi = load_kimi_tokenizer(t / "kimi-k2.5", KIMI_THINKING_TEMPLATE)  # one build; the tests set its template
    return {"qwen3": qwen, "deepseek-r1": r1, "kimi": kimi, "kimi-k2-thinking": kimi.chat_template,
            "kimi-k2.5": _k25_template(kimi.chat_template)}


def _settings(tok, tools=None, **kw) -> RolloutSettings:
    return RolloutSettings(tokenizer=tok, profile=detect_profile(tok), tools={"s": tools}, **kw)


def _row(tok, text: str) -> dict:
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return {"sample_id": "x", "output_ids": ids, "finish_reason": "stop", "matched_stop": ids[-1],
            "completion_tokens": len(ids)}


def _template_ids(tok, messages, tools, enable_thinking=None) -> list[int]:
    kw = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False, **kw)
    return tok(text, add_special_tokens=False)["input_ids"]


def _drive(tok, replies, tools=None, dataset=DATASET, enable_thinking=None, **kw):
    """Render a turn, take its reply, ... Returns (the walk, the rendered prompt of every turn)."""
    settings = _settings(tok, tools, **kw)
    walk = ConversationWalk.start("s", thinking_modes(enable_thinking)[0][0], dataset)
    prompts = []
    for text in replies:
        rendered = render_turn(walk, settings, enable_thinking)
        assert rendered is not None, walk.end_detail
        prompts.append(rendered)
        take_reply(walk, _row(tok, text), rendered, settings)
        if walk.ended is not None:
            break
    return walk, prompts


def _call(call_id: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": ROME}}


SYSTEM, USER1, RESULT, USER2 = DATASET[0], DATASET[1], DATASET[3], DATASET[5]


def test_qwen3_tool_chain_keeps_reasoning_after_the_last_user_turn_only(toks):
    tok = toks["qwen3"]
    replies = [
        '<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Rome"}}\n</tool_call><|im_end|>',
        "<think>\nThe tool says sunny.\n</think>\n\nIt is sunny in Rome today.<|im_end|>",
        "<think>\nSunny means no rain.\n</think>\n\nNo umbrella needed.<|im_end|>",
    ]
    walk, prompts = _drive(tok, replies, WEATHER_TOOL)
    # SGLang 0.5.23's parsers: reasoning and answer as the model wrote them, only the text before a call stripped
    a1 = {"role": "assistant", "content": "", "reasoning_content": "\nThe user wants the weather.\n",
          "tool_calls": [_call("call_s_1_0")]}
    a2 = {"role": "assistant", "content": "\n\nIt is sunny in Rome today.",
          "reasoning_content": "\nThe tool says sunny.\n"}
    tool = {"role": "tool", "content": RESULT["content"], "tool_call_id": "call_s_1_0"}
    histories = [[SYSTEM, USER1], [SYSTEM, USER1, a1, tool], [SYSTEM, USER1, a1, tool, a2, USER2]]
    for k, (rendered, history) in enumerate(zip(prompts, histories), 1):
        assert rendered.prompt_ids == _template_ids(tok, history, WEATHER_TOOL), f"turn {k}"
    assert walk.history[:6] == [SYSTEM, USER1, a1, tool, a2, USER2]
    assert (walk.ended, walk.end_turn, walk.turn, walk.tool_results) == (COMPLETE, 3, 3, 1)
    # turn 2 follows the tool result of the same user turn: the call's reasoning stays; after the next user turn
    # Qwen3's template drops the reasoning of every earlier turn
    assert "The user wants the weather." in prompts[1].text
    assert "The user wants the weather." not in prompts[2].text and "The tool says sunny." not in prompts[2].text
    assert "It is sunny in Rome today." in prompts[2].text


def test_qwen3_thinking_off_and_on_render_their_own_histories(toks):
    tok = toks["qwen3"]
    dataset = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": ""},
               {"role": "user", "content": "Another one?"}]
    off, on = thinking_modes("both")[1], thinking_modes("both")[0]
    assert (off, on) == (("off", False), ("on", True))
    walk, prompts = _drive(tok, ["Blue.<|im_end|>", "Green.<|im_end|>"], dataset=dataset, enable_thinking=False)
    assert walk.mode == "off" and walk.ended == COMPLETE
    assert prompts[0].text.endswith("<think>\n\n</think>\n\n") and not prompts[0].opens_think
    history = [dataset[0], {"role": "assistant", "content": "Blue."}, dataset[2]]
    assert prompts[1].prompt_ids == _template_ids(tok, history, None, enable_thinking=False)
    walk, prompts = _drive(tok, ["<think>\nPick one.\n</think>\n\nRed.<|im_end|>", "Pink.<|im_end|>"],
                           dataset=dataset, enable_thinking=True)
    history = [dataset[0], {"role": "assistant", "content": "\n\nRed.", "reasoning_content": "\nPick one.\n"},
               dataset[2]]
    assert walk.mode == "on" and prompts[1].prompt_ids == _template_ids(tok, history, None, enable_thinking=True)
    assert turn_row_id("s", "on", 2) == "s:on:2"


def test_deepseek_r1_history_drops_reasoning_and_answers_right_after_tool_outputs(toks):
    tok = toks["deepseek-r1"]
    dataset = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
               {"role": "user", "content": "And times 3?"}]
    walk, prompts = _drive(tok, ["Add them.\n</think>\n\n2+2 is 4.<｜end▁of▁sentence｜>",
                                 "Multiply.\n</think>\n\n12.<｜end▁of▁sentence｜>"], dataset=dataset)
    assert prompts[0].opens_think  # R1's template opens the block: "<｜Assistant｜><think>\n"
    history = [dataset[0], {"role": "assistant", "content": "\n\n2+2 is 4.", "reasoning_content": "Add them.\n"},
               dataset[2]]
    assert prompts[1].prompt_ids == _template_ids(tok, history, None)
    assert "Add them." not in prompts[1].text and "\n\n2+2 is 4.<｜end▁of▁sentence｜>" in prompts[1].text
    assert walk.ended == COMPLETE and walk.turn == 2
    # After tool outputs the DeepSeek template writes no assistant header; SGLang serves its text as is, so the turn
    # after a tool result is the template's text ending at <｜tool▁outputs▁end｜>, and the model's answer follows it
    call = ("Look it up.\n</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
            '```json\n{"city": "Rome"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>')
    replies = [call, "The tool says sunny.\n</think>\n\nIt is sunny in Rome.<｜end▁of▁sentence｜>",
               "Sunny means dry.\n</think>\n\nNo.<｜end▁of▁sentence｜>"]
    walk, prompts = _drive(tok, replies)
    assert len(prompts) == 3 and (walk.ended, walk.end_turn, walk.tool_results) == (COMPLETE, 3, 1)
    a1 = {"role": "assistant", "content": "", "tool_calls": [_call("call_s_1_0")], "reasoning_content": "Look it up.\n"}
    tool = {"role": "tool", "content": RESULT["content"], "tool_call_id": "call_s_1_0"}
    a2 = {"role": "assistant", "content": "\n\nIt is sunny in Rome.", "reasoning_content": "The tool says sunny.\n"}
    assert walk.history[:6] == [SYSTEM, USER1, a1, tool, a2, USER2]
    for k, history in enumerate([[SYSTEM, USER1], [SYSTEM, USER1, a1, tool], [SYSTEM, USER1, a1, tool, a2, USER2]]):
        assert prompts[k].prompt_ids == _template_ids(tok, _deepseek_args(history), None), f"turn {k + 1}"
    outputs_end = tok.convert_tokens_to_ids("<｜tool▁outputs▁end｜>")
    assert prompts[1].prompt_ids[-1] == outputs_end and not prompts[1].opens_think
    assert prompts[1].flags["generation_prompt"] == "" and prompts[1].flags["generation_prompt_tokens"] == 0
    # turn 3's history renders the answer right after the tool outputs: turn 2's prompt, then its answer
    assert "<｜tool▁outputs▁end｜>\n\nIt is sunny in Rome.<｜end▁of▁sentence｜><｜User｜>" in prompts[2].text
    # without the family rule (the catalog override) the turn after the tool result is refused as before
    walk = ConversationWalk.start("s", "default", DATASET)
    settings = _settings(tok)
    settings.profile = detect_profile(tok, {"answer_after_tool_outputs": False})
    take_reply(walk, _row(tok, call), render_turn(walk, settings, None), settings)
    assert walk.history[-2]["tool_calls"] == [_call("call_s_1_0")] and walk.history[-1]["role"] == "tool"
    assert render_turn(walk, settings, None) is None
    assert (walk.ended, walk.end_detail, walk.end_turn) == (RENDER_REJECTED, "missing_generation_prompt", 2)


def _deepseek_args(history: list[dict]) -> list[dict]:
    """``history`` with tool-call arguments as JSON strings, as ``render_prompt`` retries for DeepSeek's template."""
    out = []
    for m in history:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.dumps(
                c["function"]["arguments"], ensure_ascii=False)}} for c in m["tool_calls"]]}
        out.append(m)
    return out


@pytest.mark.parametrize("family", ["kimi-k2-thinking", "kimi-k2.5"])
def test_kimi_keeps_reasoning_after_the_last_answer_and_writes_call_ids_back(toks, family):
    tok = toks["kimi"]
    tok.chat_template = toks[family]
    k25 = family == "kimi-k2.5"  # K2.5's template opens the block; K2-Thinking's model writes <think> itself
    think = "" if k25 else "<think>"
    replies = [
        f"{think}The user wants the weather.</think><|tool_calls_section_begin|><|tool_call_begin|>"
        'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Rome"}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>",
        f"{think}Sunny.</think>It is sunny in Rome today.<|im_end|>",
        f"{think}No rain.</think>No umbrella needed.<|im_end|>",
    ]
    walk, prompts = _drive(tok, replies, WEATHER_TOOL)
    a1 = {"role": "assistant", "content": "", "reasoning_content": "The user wants the weather.",
          "tool_calls": [_call("functions.get_weather:0")]}
    a2 = {"role": "assistant", "content": "It is sunny in Rome today.", "reasoning_content": "Sunny."}
    tool = {"role": "tool", "content": RESULT["content"], "tool_call_id": "functions.get_weather:0"}
    histories = [[SYSTEM, USER1], [SYSTEM, USER1, a1, tool], [SYSTEM, USER1, a1, tool, a2, USER2]]
    for k, (rendered, history) in enumerate(zip(prompts, histories), 1):
        assert rendered.prompt_ids == _template_ids(tok, history, WEATHER_TOOL), f"{family} turn {k}"
        assert rendered.opens_think == k25
    assert "## Return of functions.get_weather:0" in prompts[1].text
    # the suffix after the last answer keeps its reasoning; everything up to that answer gets an empty block
    assert "<think>The user wants the weather.</think>" in prompts[1].text
    assert "The user wants the weather." not in prompts[2].text and "<think></think>It is sunny" in prompts[2].text
    assert walk.ended == COMPLETE and walk.tool_results == 1


def test_calls_without_a_recorded_result_end_the_conversation_counted(toks):
    tok = toks["qwen3"]
    paris = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>')
    walk, _ = _drive(tok, [paris], WEATHER_TOOL)
    assert (walk.ended, walk.end_turn) == (TOOL_RESULT_NOT_RECORDED, 1) and "Paris" in walk.end_detail
    # the same call matched by name only (tool_result_match: name) gets the recorded result
    walk, _ = _drive(tok, [paris], WEATHER_TOOL, tool_result_match="name")
    assert walk.ended is None and walk.history[-1] == {"role": "tool", "content": RESULT["content"],
                                                       "tool_call_id": "call_s_1_0"}
    # two calls in one reply (parallel): both must be recorded; the dataset recorded one
    rome = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    walk, _ = _drive(tok, [rome + "\n" + rome + "<|im_end|>"], WEATHER_TOOL)
    assert walk.ended == TOOL_RESULT_NOT_RECORDED and walk.parallel_turns == 1 and "call 1" in walk.end_detail
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call><|im_end|>'
    walk, _ = _drive(tok, [broken], WEATHER_TOOL)
    assert walk.ended == UNPARSEABLE_TOOL_CALL and walk.end_turn == 1


def test_parallel_calls_with_recorded_results_are_spliced_in_call_order(toks):
    tok = toks["qwen3"]
    calls = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": c}}}
             for c in ("Rome", "Oslo")]
    dataset = [{"role": "user", "content": "Rome and Oslo?"}, {"role": "assistant", "content": "", "tool_calls": calls},
               {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "snow"},
               {"role": "assistant", "content": "Sunny and snowy."}]
    text = "".join(f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{c}"}}}}\n</tool_call>\n'
                   for c in ("Oslo", "Rome")).rstrip("\n") + "<|im_end|>"
    walk, prompts = _drive(tok, [text, "Snow in Oslo, sun in Rome.<|im_end|>"], WEATHER_TOOL, dataset=dataset)
    assert [m["content"] for m in walk.history if m["role"] == "tool"] == ["snow", "sunny"]
    assert walk.parallel_turns == 1 and walk.tool_results == 2 and walk.ended == COMPLETE
    a1 = {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"call_s_1_{i}", "type": "function", "function": {"name": "get_weather", "arguments": {"city": c}}}
        for i, c in enumerate(("Oslo", "Rome"))]}
    history = [dataset[0], a1, {"role": "tool", "content": "snow", "tool_call_id": "call_s_1_0"},
               {"role": "tool", "content": "sunny", "tool_call_id": "call_s_1_1"}]
    assert prompts[1].prompt_ids == _template_ids(tok, history, WEATHER_TOOL)


def test_a_reply_qc_drops_ends_its_conversation_and_is_never_parsed(toks):
    tok = toks["qwen3"]
    walk, _ = _drive(tok, ["<think>\nthinking forever<|im_end|>"], WEATHER_TOOL)
    assert (walk.ended, walk.end_detail, walk.end_turn) == (QC_DROPPED, "missing_think_end", 1)
    prof = detect_profile(tok)
    row = _row(tok, "<think>\nx\n</think>\n\nHi.<|im_end|>")
    seg = segment_output(row["output_ids"], "stop", prof, prompt_opens_think=False)
    reasoning, answer = reply_spans(row["output_ids"], seg, prof, False)
    assert tok.decode(reasoning) == "\nx\n" and tok.decode(answer) == "\n\nHi."
    with pytest.raises(ValueError, match="another reply"):  # a segmentation of another reply is refused
        client_message(row["output_ids"], dataclasses.replace(seg, answer_tokens=seg.answer_tokens + 1), tok, prof,
                    prompt_opens_think=False)
