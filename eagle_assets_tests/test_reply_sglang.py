"""``generations.reply.client_message`` against SGLang 0.5.23's own reasoning and tool-call parsers, and multi-turn
history rebuilt from SGLang's parse over real HTTP.

1. Every reply shape of every family (think / no think, whitespace at either end, text before and after calls,
   parallel calls, truncated, a prompt that opens the block, a call SGLang does not recognise) is written in the real
   tokenizer's ids (``../shared/data/tokenizers``, the embedded demo target's), segmented by QC's rules and parsed
   by ``client_message``; the same ids decoded are parsed by SGLang's ``ReasoningParser`` + ``OpenAIServingChat.
   _process_tool_calls`` with the parsers ``SGLANG_PARSERS`` names (``sglang_parses``: live under an SGLang venv,
   else its recording). The messages must be equal, whitespace included.
2. ``run_conversations`` regenerates conversations over HTTP against a scripted server (the stub server replying
   in the real Qwen3 / Kimi tokenizer's ids, with whitespace at either end, thinking on and off, tool calls, and
   parallel calls from LLaMA-Factory's ``reason_tool_use_demo_50.jsonl``); every stored turn prompt must equal
   ``apply_chat_template`` of the history a client of SGLang sends back: the dataset's messages with each
   assistant turn replaced by SGLang's parse of the stored reply and each recorded result at its call's id.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from sglang_parses import sglang_parses
from test_multi_turn_pipeline import calls_after_users
from test_quality_families import KIMI_THINKING_TEMPLATE, WEATHER_TOOL, _k25_template, _r1_template

from eagle_assets.generations.reply import SGLANG_PARSERS, UNPARSEABLE_TOOL_CALL, client_message
from eagle_assets.structure.segment import segment_output
from eagle_assets.target_model import detect_profile, load_kimi_tokenizer, load_tokenizer

AREA_TOOL = {"type": "function", "function": {
    "name": "circle_area", "description": "Area of a circle",
    "parameters": {"type": "object", "properties": {"radius": {"type": "number"}}, "required": ["radius"]}}}
TOOLS = WEATHER_TOOL + [AREA_TOOL]
ROME = '{"name": "get_weather", "arguments": {"city": "Rome"}}'
OSLO = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
K_ROME = '<|tool_call_begin|>functions.get_weather:{}<|tool_call_argument_begin|>{{"city": "Rome"}}<|tool_call_end|>'
D_ROME = ('<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Rome"}\n```<｜tool▁call▁end｜>')

TRUNCATED = "<think>\nx\n</think>\n\nThe answer is"
# (family, reply text with its stop token, prompt opens the think block, finish reason, history tool calls)
SHAPES = [
    ("qwen3", "<think>\nThe user asks.\n</think>\n\nThe answer is 4 .\n<|im_end|>", False, "stop", 0),
    ("qwen3", "It is 4 .\n<|im_end|>", False, "stop", 0),  # thinking off, an answer ending in whitespace
    ("qwen3", "\n  Leading space answer.<|im_end|>", False, "stop", 0),
    ("qwen3", f"<think>\nNeed weather.\n</think>\n\nLet me check. \n<tool_call>\n{ROME}\n</tool_call><|im_end|>",
     False, "stop", 0),
    ("qwen3", f"<tool_call>\n{ROME}\n</tool_call>\n<tool_call>\n{OSLO}\n</tool_call><|im_end|>", False, "stop", 0),
    ("qwen3", f"  Checking.\n<tool_call>\n{ROME}\n</tool_call>\nDone, I called it. <|im_end|>", False, "stop", 0),
    ("qwen3", TRUNCATED, False, "length", 0),  # cut at max_new_tokens: QC drops it, the conversation ends
    ("qwen3", "<think>\n\n</think>\n\nHi. <|im_end|>", False, "stop", 0),  # an empty block
    ("qwen3", "Reasoning only here.\n</think>\n\n Answer.\n\n<|im_end|>", True, "stop", 0),  # the prompt opened it
    ("qwen3", f"<tool_call>{ROME}</tool_call><|im_end|>", False, "stop", 0),  # not SGLang's call layout
    ("kimi", "Thinking.\n</think>\n\nAnswer with space \n<|im_end|>", True, "stop", 0),
    ("kimi", "Look it up.<|tool_calls_section_begin|>" + K_ROME.format(0) + "<|tool_calls_section_end|><|im_end|>",
     True, "stop", 2),
    ("kimi", " Hmm. </think> Let me call. <|tool_calls_section_begin|>" + K_ROME.format(3) + K_ROME.format(4)
     + "<|tool_calls_section_end|><|im_end|>", True, "stop", 1),
    ("kimi", "<think>Short.</think>\nAnswer.\n<|im_end|>", False, "stop", 0),
    ("kimi", " Plain answer\n<|im_end|>", False, "stop", 0),
    ("deepseek", "Add.\n</think>\n\n4.\n<｜end▁of▁sentence｜>", True, "stop", 0),
    ("deepseek", "Look.\n</think>\n\nCalling now.\n<｜tool▁calls▁begin｜>" + D_ROME
     + "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>", True, "stop", 0),
    ("demo", "A thought.\n</think>\n\nAn answer .\n<|im_end|>", True, "stop", 0),
    ("demo", f"Weather.\n</think>\n\n<tool_call>\n{ROME}\n</tool_call><|im_end|>", True, "stop", 0),
]


@pytest.fixture(scope="module")
def tokenizers(shared_data: Path, demo_target):
    t = shared_data / "tokenizers"
    r1 = load_tokenizer(t / "deepseek-v3")
    r1.chat_template = _r1_template(r1.chat_template)
    kimi = load_kimi_tokenizer(t / "kimi-k2.5", KIMI_THINKING_TEMPLATE)
    kimi.chat_template = _k25_template(kimi.chat_template)
    k2_thinking = load_kimi_tokenizer(t / "kimi-k2.5", KIMI_THINKING_TEMPLATE)  # the model writes <think> itself
    return {"qwen3": load_tokenizer(t / "qwen3-0.6b"), "kimi": kimi, "kimi-k2-thinking": k2_thinking,
            "deepseek": r1, "demo": load_tokenizer(demo_target)}


def ours_and_sglang_case(tok, text: str, opens: bool, finish: str, history: int):
    """(client_message's message or problem, the SGLang case of the same reply, its segmentation)."""
    prof = detect_profile(tok)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    seg = segment_output(ids, finish, prof, prompt_opens_think=opens,
                         matched_stop=ids[-1] if finish == "stop" else None)
    body = ids[:-1] if ids and ids[-1] in prof.stop_ids else ids
    reasoning, tool = SGLANG_PARSERS[prof.name]
    case = {"reasoning_parser": reasoning, "tool_call_parser": tool, "force_reasoning": opens,
            "text": tok.decode(body, skip_special_tokens=False), "tools": TOOLS, "history_tool_calls": history}
    ours = client_message(ids, seg, tok, prof, prompt_opens_think=opens, history_tool_calls=history) \
        if seg.kept else None
    return ours, case, seg


def as_sglang(message: dict, family: str) -> dict:
    """A ``client_message`` message in the shape ``sglang_reply_parse`` reports (Kimi's ids only: SGLang's others are
    random)."""
    calls = message.get("tool_calls")
    return {"reasoning_content": message.get("reasoning_content"), "content": message["content"],
            "tool_calls": [{"id": c["id"] if family == "kimi" else None, "name": c["function"]["name"],
                            "arguments": c["function"]["arguments"]} for c in calls] if calls else None}


def test_every_reply_shape_parses_as_sglang_0_5_23_parses_it(tokenizers):
    rows = [(fam, text, *ours_and_sglang_case(tokenizers[fam], text, opens, finish, hist))
            for fam, text, opens, finish, hist in SHAPES]
    expected, how = sglang_parses([case for *_, case, _seg in rows])
    compared = 0
    for (fam, text, ours, case, seg), theirs in zip(rows, expected):
        if text == TRUNCATED:  # never parsed: a truncated reply ends its conversation (walk: qc_dropped)
            assert (seg.kept, seg.drop_reason, ours) == (False, "truncated_in_answer", None)
            continue
        assert seg.kept, (fam, text, seg.drop_reason)  # every other shape here is one QC keeps
        if ours.problem is not None:  # a call SGLang would not return as a call: the conversation ends instead
            assert ours.problem == UNPARSEABLE_TOOL_CALL and theirs["tool_calls"] is None, (fam, text, theirs)
            continue
        assert as_sglang(ours.message, fam) == theirs, f"{fam} {text!r} ({how} SGLang parse)"
        compared += 1
    assert compared == len(SHAPES) - 2
    # the shapes that decide history whitespace are among them, parsed as the pinned SGLang returns them
    by_text = {text: theirs for (_, text, *_), theirs in zip(rows, expected)}
    assert by_text["It is 4 .\n<|im_end|>"]["content"] == "It is 4 .\n"
    assert by_text[SHAPES[0][1]]["reasoning_content"] == "\nThe user asks.\n"
    assert by_text[SHAPES[11][1]]["tool_calls"][0]["id"] == "functions.get_weather:2"


def test_history_reasoning_none_leaves_reasoning_out_of_the_message(tokenizers):
    tok = tokenizers["qwen3"]
    prof = detect_profile(tok, {"history_reasoning": "none"})
    ids = tok(SHAPES[0][1], add_special_tokens=False)["input_ids"]
    seg = segment_output(ids, "stop", prof, prompt_opens_think=False, matched_stop=ids[-1])
    message = client_message(ids, seg, tok, prof, prompt_opens_think=False).message
    assert message == {"role": "assistant", "content": "\n\nThe answer is 4 .\n"}
    from eagle_assets.target_model.profile import ProfileError

    with pytest.raises(ProfileError, match="history_reasoning"):
        detect_profile(tok, {"history_reasoning": "sometimes"})


# ------------------------------------------------------------------------------------ multi-turn over real HTTP
WEATHER = [  # a glaive-style exchange: a call, its recorded result, the answer, a follow-up question
    {"role": "system", "content": "You are a weather assistant."},
    {"role": "user", "content": "Weather in Rome?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
    {"role": "tool", "content": '{"sky": "sunny"}'},
    {"role": "assistant", "content": "It is sunny in Rome."},
    {"role": "user", "content": "Thanks. Should I take an umbrella?"},
    {"role": "assistant", "content": "No."},
]
COLOURS = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": ""},
           {"role": "user", "content": "Another one?"}, {"role": "assistant", "content": ""},
           {"role": "user", "content": "And a third?"}]
# whitespace a reply's answer starts and ends with, by turn: the shapes a stripped history gets wrong
EDGES = [("", " .\n"), ("\n  ", ""), ("  ", "  \n"), ("", "\n\n")]


def _parallel_conversation(shared_data: Path) -> tuple[list[dict], list[dict]]:
    """The first conversation of LLaMA-Factory's reason_tool_use_demo_50.jsonl with a turn of several calls (its
    results split one per call by ``formats.messages``), and its tools."""
    from eagle_assets.formats import build_prompt, load_records

    for rec in load_records(shared_data / "llama_factory" / "reason_tool_use_demo_50.jsonl", "messages"):
        if not hasattr(rec, "messages"):
            continue
        msgs, _ = build_prompt(rec, "all_turns")
        if any(len(m.get("tool_calls") or []) > 1 for m in msgs):
            return msgs, rec.tools
    raise AssertionError("no parallel-call conversation in reason_tool_use_demo_50.jsonl")


def _canonical(args) -> str:
    return json.dumps(args if not isinstance(args, str) else json.loads(args), sort_keys=True)


class Family:
    """How a scripted model of one family writes a reply, and how its prompts read (turn count, last message)."""

    def __init__(self, name: str):
        self.name = name

    def turn(self, prompt: str) -> int:
        return prompt.count("<|im_start|>assistant" if self.name == "qwen3" else "<|im_assistant|>")

    def last_user(self, prompt: str) -> tuple[str, bool]:
        """(last user text, whether a tool result follows it)."""
        if self.name == "qwen3":
            tail = prompt.rsplit("<|im_start|>user\n", 1)[-1]
            return tail.split("<|im_end|>", 1)[0], tail.startswith("<tool_response>")
        tail = prompt.rsplit("<|im_user|>user<|im_middle|>", 1)[-1]
        return tail.split("<|im_end|>", 1)[0], "## Return of" in tail

    def reply(self, prompt: str, calls: list[dict] | None) -> str:
        turn = self.turn(prompt)
        lead, trail = EDGES[turn % len(EDGES)]
        if self.name == "qwen3":
            think = "" if prompt.endswith("</think>\n\n") else f"<think>\nTurn {turn} reasoning.\n</think>\n\n"
            if calls:  # a parallel turn's calls in the reverse of the dataset's order
                body = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments":
                                                               json.loads(_canonical(c["function"]["arguments"]))})
                                 + "\n</tool_call>" for c in reversed(calls))
                return think + ("Calling now. \n" if turn % 2 else "") + body + "<|im_end|>"
            return think + f"{lead}Answer {turn}{trail}<|im_end|>"
        # K2.5's prompt opens the block; under K2-Thinking's template the model writes <think> itself
        think = ("" if prompt.endswith("<think>") or prompt.endswith("<think>\n") else "<think>") \
            + f"Turn {turn} reasoning.\n</think>"
        if calls:
            body = "".join(f"<|tool_call_begin|>functions.{c['function']['name']}:{i}<|tool_call_argument_begin|>"
                           f"{_canonical(c['function']['arguments'])}<|tool_call_end|>"
                           for i, c in enumerate(reversed(calls)))
            return think + (" Calling now. " if turn % 2 else "") + f"<|tool_calls_section_begin|>{body}" \
                "<|tool_calls_section_end|><|im_end|>"
        return think + f"{lead}Answer {turn}{trail}<|im_end|>"


@pytest.fixture(scope="module")
def rollouts(tokenizers, shared_data, tmp_path_factory):
    """Every conversation regenerated over HTTP for Qwen3 (thinking on and off) and Kimi-K2.5."""
    from eagle_assets.generations.rollout import RolloutSettings, run_conversations
    from eagle_assets.serving.client import GenerateClient
    from eagle_assets.serving.protocol import SamplingParams
    from eagle_assets_tests.servers.stub_server import StubServer, serve_stub_in_thread

    parallel, parallel_tools = _parallel_conversation(shared_data)
    convs = {"weather": (WEATHER, WEATHER_TOOL), "colours": (COLOURS, None), "parallel": (parallel, parallel_tools)}
    recorded: dict[str, list[dict]] = {}  # last user text -> the dataset's calls after it
    for msgs, _ in convs.values():
        calls_after_users(msgs, recorded)

    class Scripted(StubServer):
        def __init__(self, tok, family: Family):
            super().__init__(vocab_size=len(tok))
            self.tok, self.family = tok, family

        def reply(self, body: dict, started: float) -> dict:
            prompt = self.tok.decode(body["input_ids"], skip_special_tokens=False)
            user, after_result = self.family.last_user(prompt)
            text = self.family.reply(prompt, None if after_result else recorded.get(user))
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
            return {"text": "", "output_ids": ids, "meta_info": {
                "id": body.get("rid"), "finish_reason": {"type": "stop", "matched": ids[-1]},
                "prompt_tokens": len(body["input_ids"]), "completion_tokens": len(ids), "cached_tokens": 0,
                "e2e_latency": 0.0}}

    out = {}
    for family, thinking in (("qwen3", "both"), ("kimi", None), ("kimi-k2-thinking", None)):
        tok = tokenizers[family]
        prof = detect_profile(tok)
        settings = RolloutSettings(tokenizer=tok, profile=prof, tools={k: t for k, (_, t) in convs.items()},
                                   enable_thinking=thinking, vocab_size=len(tok), max_turns=8)
        folder = tmp_path_factory.mktemp(f"rollout_{family}")
        with serve_stub_in_thread(Scripted(tok, Family(family))) as running:
            stats = run_conversations([(k, m) for k, (m, _) in convs.items()], folder,
                                      GenerateClient([running.url], concurrency_per_server=4),
                                      SamplingParams(max_new_tokens=256, stop_token_ids=list(prof.stop_ids)),
                                      settings)
        turns = pq.read_table(folder / "turns.parquet").to_pylist()
        replies = {r["sample_id"]: r["output_ids"] for p in sorted(folder.glob("shard-*.parquet"))
                   for r in pq.read_table(p).to_pylist()}
        ends = pq.read_table(folder / "conversations.parquet").to_pylist()
        out[family] = (convs, turns, replies, ends, stats)
    return out


def expected_prompts(tok, family: str, dataset: list[dict], tools, replies: list[list[int]], thinking):
    """Turn prompt ids from the history a client of SGLang sends back, built here without the pipeline's walk or
    parse: the dataset's messages, each assistant turn replaced by SGLang's parse of the stored reply, each recorded
    result at the id SGLang gave its call (matched by name and arguments), the next user turn after an answer."""
    prof = detect_profile(tok)
    kw = {} if thinking is None else {"enable_thinking": thinking}
    j = next(i for i, m in enumerate(dataset) if m["role"] == "assistant")
    history, prompts = [dict(m) for m in dataset[:j]], []
    for ids in replies:
        text = tok.apply_chat_template(history, tools=tools, add_generation_prompt=True, tokenize=False, **kw)
        prompts.append(tok(text, add_special_tokens=False)["input_ids"])
        body = ids[:-1] if ids[-1] in prof.stop_ids else ids
        reasoning, tool = SGLANG_PARSERS[prof.name]
        case = {"reasoning_parser": reasoning, "tool_call_parser": tool,
                "force_reasoning": text.endswith("<think>") or text.endswith("<think>\n"),
                "text": tok.decode(body, skip_special_tokens=False), "tools": tools or [],
                "history_tool_calls": sum(len(m.get("tool_calls") or []) for m in history if m["role"] == "assistant")}
        [parsed], _ = sglang_parses([case])
        message = {"role": "assistant", "content": parsed["content"]}
        if parsed["reasoning_content"] is not None:
            message["reasoning_content"] = parsed["reasoning_content"]
        history.append(message)
        if parsed["tool_calls"]:
            message["tool_calls"] = [{"id": c["id"] or f"call_{n}", "type": "function",
                                      "function": {"name": c["name"], "arguments": c["arguments"]}}
                                     for n, c in enumerate(parsed["tool_calls"])]
            calls = dataset[j]["tool_calls"]
            results = dataset[j + 1: j + 1 + len(calls)]
            for call in message["tool_calls"]:
                hit = next(i for i, c in enumerate(calls) if c["function"]["name"] == call["function"]["name"]
                           and _canonical(c["function"]["arguments"]) == _canonical(call["function"]["arguments"]))
                result = {"role": "tool", "content": results[hit]["content"], "tool_call_id": call["id"]}
                if results[hit].get("name"):
                    result["name"] = results[hit]["name"]
                history.append(result)
            j += 1 + len(calls)
        else:
            users = [i for i in range(j, len(dataset)) if dataset[i]["role"] == "user"]
            if not users:
                break
            nxt = next((i for i in range(users[0], len(dataset)) if dataset[i]["role"] == "assistant"), len(dataset))
            history.extend(dict(m) for m in dataset[users[0]:nxt])
            j = nxt
    return prompts


@pytest.mark.parametrize("family", ["qwen3", "kimi", "kimi-k2-thinking"])
def test_every_turn_prompt_equals_a_render_of_the_history_sglang_returns(rollouts, tokenizers, family):
    tok = tokenizers[family]
    convs, turns, replies, ends, stats = rollouts[family]
    by_conv: dict[tuple[str, str], list[dict]] = {}
    for t in turns:
        by_conv.setdefault((t["sample_id"], t["thinking"]), []).append(t)
    assert {e["end_reason"] for e in ends} == {"complete"}, ends
    checked = parallel = 0
    for (sid, mode), rows in sorted(by_conv.items()):
        rows.sort(key=lambda r: r["turn"])
        dataset, tools = convs[sid]
        thinking = {"on": True, "off": False}.get(mode)
        want = expected_prompts(tok, family, dataset, tools, [replies[r["row_id"]] for r in rows], thinking)
        assert len(want) == len(rows), (sid, mode)
        for r, ids in zip(rows, want):
            assert r["prompt_ids"] == ids, f"{family} {sid} thinking {mode} turn {r['turn']}"
            checked += 1
        parallel += sum(e["parallel_call_turns"] for e in ends if (e["sample_id"], e["thinking"]) == (sid, mode))
    assert checked >= (20 if family == "qwen3" else 10) and parallel >= (4 if family == "qwen3" else 2), \
        (checked, parallel)
    # the answers do end in whitespace, and that whitespace is in the next turn's prompt
    tails = [tok.decode(replies[t["row_id"]][:-1]) for t in turns]
    assert any(t.endswith(" .\n") for t in tails) and any(t.endswith("\n\n") for t in tails)
