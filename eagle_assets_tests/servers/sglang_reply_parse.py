"""Parse decoded replies with SGLang's own chat-endpoint parsers; run with the Python of an SGLang venv.

    <sglang venv>/bin/python eagle_assets_tests/servers/sglang_reply_parse.py < cases.jsonl > parses.jsonl

Input: one JSON list of cases per line (each answered with one line, flushed, so one process serves a whole test
session: importing SGLang takes ~10 s); a case is ``{"reasoning_parser", "tool_call_parser", "force_reasoning": bool,
"text": str, "tools": [{"type": "function", "function": {...}}], "history_tool_calls": int}``; output: one JSON object
per case,
``{"reasoning_content", "content", "tool_calls": [{"id", "name", "arguments"}] | null}``, built the way
``OpenAIServingChat._build_chat_response`` builds the non-streaming message: ``ReasoningParser.parse_non_stream``,
then ``OpenAIServingChat._process_tool_calls`` (called on a stand-in ``self`` that carries only the attributes it
reads), ``reasoning_content`` None when empty, ``content`` "" when empty. Non-Kimi call ids are SGLang's random
``call_<uuid>`` and come back as None; arguments are parsed from the JSON string SGLang returns.

Not part of the package: the tests (``test_reply_sglang.py``) start it in a subprocess, since SGLang's venv and the
project's differ (SGLang 0.5.23 pins transformers 5.19).
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace


def parse(case: dict) -> dict:
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    parser = ReasoningParser(model_type=case["reasoning_parser"], stream_reasoning=False,
                             force_reasoning=case["force_reasoning"])
    reasoning_text, text = parser.parse_non_stream(case["text"])
    tools = [Tool(**t) for t in case["tools"]]
    calls = None
    if tools:
        chat = SimpleNamespace(tool_call_parser=case["tool_call_parser"],
                               tokenizer_manager=SimpleNamespace(tokenizer=None))
        chat._process_tool_call_id = lambda item, cnt: OpenAIServingChat._process_tool_call_id(chat, item, cnt)
        result = OpenAIServingChat._process_tool_calls(chat, text, tools, {"type": "stop", "matched": 0}, "auto",
                                                       case["history_tool_calls"])
        tool_calls, text = result[0], result[1]
        if tool_calls:
            calls = [{"id": c.id if case["tool_call_parser"] == "kimi_k2" else None, "name": c.function.name,
                      "arguments": json.loads(c.function.arguments)} for c in tool_calls]
    return {"reasoning_content": reasoning_text if reasoning_text else None, "content": text if text else "",
            "tool_calls": calls}


def main() -> None:
    for line in sys.stdin:
        if line.strip():
            sys.stdout.write(json.dumps([parse(c) for c in json.loads(line)]) + "\n")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
