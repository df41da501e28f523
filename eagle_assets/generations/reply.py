"""One generated reply as the assistant message a serving stack returns to its client.

A client of SGLang's OpenAI-compatible chat endpoint (``--reasoning-parser`` + ``--tool-call-parser``) gets the
reply back as ``{"reasoning_content", "content", "tool_calls"}`` and sends that message back as history in its next
request; the server renders the next prompt from it with the chat template. To regenerate a conversation turn by
turn on-policy, the pipeline does the same with the target's raw ``output_ids``:

1. the reply is segmented by ``structure.segment.segment_row`` (the one set of token-structure rules QC and the live
   monitor apply); a dropped reply is not parsed at all (the conversation ends there, see ``tokenized_prompts.walk``);
2. the reasoning / answer cut is taken from that segmentation (its ``reasoning_tokens`` and flags; the answer's
   length is checked against its ``answer_tokens``, so the two can never disagree silently);
3. the answer is split at the profile's tool-call marker ids: the text before the first outermost tool-call start
   is ``content``; each innermost marker pair holds one call, parsed by the family's call grammar below.

Text, as SGLang's parsers produce it (``python/sglang/srt/parser/reasoning_parser.py``
``BaseReasoningFormatDetector.detect_and_parse``: the think-start removed, the whole text stripped, the reasoning
is what precedes the think-end, the normal text after it is stripped; ``function_call/*_detector.py``
``detect_and_parse``: ``normal_text`` is the text before the first tool-call start token, stripped). Ids are
decoded with ``skip_special_tokens=False`` span by span, the final stop id excluded.

Call grammars inside one innermost marker pair (SGLang function-call detectors, same files):

- qwen3 / demo / custom (``Qwen25Detector``, hermes style): ``<tool_call>`` ``{"name": str, "arguments": {...}}``
  ``</tool_call>``;
- deepseek (``DeepSeekV3Detector``): ``<｜tool▁call▁begin｜>`` ``function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```
  `` ``<｜tool▁call▁end｜>``;
- kimi (``KimiK2Detector``): ``<|tool_call_begin|>`` ``functions.NAME:IDX<|tool_call_argument_begin|>{...}``
  ``<|tool_call_end|>``; the id ``functions.NAME:IDX`` is the call's ``id`` (the Kimi template writes it back).

Arguments are kept as JSON objects (the project's message convention; ``target_model.render`` turns them into JSON
strings for templates that need them). A call that does not parse is not guessed at: the reply gets the problem
``unparseable_tool_call`` and its conversation ends.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from eagle_assets.structure.segment import Segmentation

UNPARSEABLE_TOOL_CALL = "unparseable_tool_call"

_DEEPSEEK_CALL = re.compile(r"^\s*(?P<type>.*?)<｜tool▁sep｜>(?P<name>.*?)\n```json\n(?P<args>.*)\n```\s*$", re.DOTALL)
_KIMI_CALL = re.compile(r"^\s*(?P<id>[\w.\-]+:\d+)\s*<\|tool_call_argument_begin\|>\s*(?P<args>.*?)\s*$", re.DOTALL)


@dataclass(frozen=True)
class ParsedReply:
    """A reply as the client sees it.

    Attributes:
        message: ``{"role": "assistant", "content": str}`` plus ``reasoning_content`` (str, when the reply has a
            reasoning block) and ``tool_calls`` (``[{"id", "type": "function", "function": {"name", "arguments":
            dict}}]``, when it called tools); None when ``problem`` is set.
        problem: None, or why the reply cannot continue a conversation (``UNPARSEABLE_TOOL_CALL``).
        detail: what was found, for the conversation's end record.
        reasoning_ids / answer_ids: the spans the segmentation cut (ints), the stop id excluded.
    """

    message: dict[str, Any] | None
    problem: str | None = None
    detail: str = ""
    reasoning_ids: list[int] = field(default_factory=list)
    answer_ids: list[int] = field(default_factory=list)


def reply_spans(output_ids: Sequence[int], seg: Segmentation, profile, prompt_opens_think: bool
                ) -> tuple[list[int] | None, list[int]]:
    """(reasoning ids or None when the reply has no reasoning block, answer ids) of a KEPT reply.

    The cut is the segmentation's (``segment_output``): a block opens in the prompt, at a leading think-start, or
    implicitly (flag ``implicit_think_start``); it ends at the think-end, or at the first outermost tool-call start
    (flag ``tool_call_ended_reasoning``, which then belongs to the answer).

    Raises:
        ValueError: ``seg`` is a dropped row, or its counts do not describe ``output_ids`` (a segmentation of
            another reply).
    """
    if not seg.kept:
        raise ValueError(f"reply_spans needs a kept reply; this one is dropped as {seg.drop_reason}")
    ids = list(output_ids)
    body = ids[:-1] if ids and ids[-1] in profile.stop_ids else ids
    start, end = profile.think_start_id, profile.think_end_id
    has_think = start is not None and end is not None
    opens = has_think and prompt_opens_think
    offset = 0
    if has_think and not opens and body[:1] == [start]:
        opens, offset = True, 1
    if "implicit_think_start" in seg.flags:
        opens = True
    if not opens:
        reasoning, answer = None, body
    else:
        cut = offset + seg.reasoning_tokens
        reasoning, rest = body[offset:cut], body[cut:]
        answer = rest[1:] if rest[:1] == [end] else rest
    if len(answer) != seg.answer_tokens:
        raise ValueError(f"the segmentation says {seg.answer_tokens} answer tokens, the cut gives {len(answer)}: "
                         "the segmentation is of another reply or another prompt")
    return reasoning, answer


def _decode(tokenizer, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False) if ids else ""


def _arguments(raw: Any, where: str) -> dict[str, Any]:
    if isinstance(raw, str):
        raw = json.loads(raw) if raw.strip() else {}
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: arguments are a {type(raw).__name__}, not a JSON object")
    return raw


def _parse_call(family: str, text: str, index: int) -> dict[str, Any]:
    """One call body (the text between an innermost marker pair) -> an OpenAI tool call; raises ValueError."""
    if family == "deepseek":
        m = _DEEPSEEK_CALL.match(text)
        if not m:
            raise ValueError(f"call {index}: not 'TYPE<｜tool▁sep｜>NAME\\n```json\\n{{...}}\\n```': {text[:120]!r}")
        name, args, call_id = m.group("name").strip(), _arguments(m.group("args"), f"call {index}"), None
    elif family == "kimi":
        m = _KIMI_CALL.match(text)
        if not m:
            raise ValueError(f"call {index}: not 'functions.NAME:IDX<|tool_call_argument_begin|>{{...}}': {text[:120]!r}")
        call_id = m.group("id")
        name = call_id.rsplit(":", 1)[0].split(".", 1)[-1]
        args = _arguments(m.group("args"), f"call {index}")
    else:
        body = json.loads(text.strip())
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            raise ValueError(f"call {index}: not a JSON object with a 'name': {text[:120]!r}")
        name, call_id = body["name"], None
        args = _arguments(body.get("arguments", body.get("parameters", {})), f"call {index}")
    if not name:
        raise ValueError(f"call {index}: empty function name")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _calls(answer: list[int], profile) -> tuple[list[int], list[list[int]]]:
    """(ids before the first outermost tool-call start, [ids inside each innermost pair]) of an answer whose
    markers balance (the segmentation checked that)."""
    starts, ends = tuple(profile.tool_call_start_ids), tuple(profile.tool_call_end_ids)
    if not starts or starts[0] not in answer:
        return answer, []
    head = answer[:answer.index(starts[0])]
    inner_start, inner_end = starts[-1], ends[-1]
    bodies, current = [], None
    for tok in answer[len(head):]:
        if tok == inner_start:
            current = []
        elif tok == inner_end and current is not None:
            bodies.append(current)
            current = None
        elif current is not None:
            current.append(tok)
    return head, bodies


def parse_reply(output_ids: Sequence[int], seg: Segmentation, tokenizer, profile, *, prompt_opens_think: bool,
                call_id_prefix: str = "call") -> ParsedReply:
    """The assistant message of one KEPT reply (see the module doc for every rule and its source).

    Args:
        output_ids: the reply's ``output_ids`` (ints, the final stop id included).
        seg: its ``segment_row`` / ``segment_output`` result (must be kept).
        tokenizer: the target's tokenizer (decoding only).
        profile: the target's ``FamilyProfile``; ``profile.name`` picks the call grammar.
        prompt_opens_think: the prompt's ``opens_think`` (``render.opens_think_block``).
        call_id_prefix: ids of calls whose grammar carries none are ``<prefix>_<i>`` (not rendered by the Qwen3
            and DeepSeek templates; kept so tool results can point at their call, as OpenAI clients do).
    Returns: a ``ParsedReply``; ``problem`` set (and ``message`` None) when a call does not parse.
    Raises: ``ValueError`` for a dropped ``seg`` (see ``reply_spans``).
    """
    reasoning, answer = reply_spans(output_ids, seg, profile, prompt_opens_think)
    head, bodies = _calls(answer, profile)
    message: dict[str, Any] = {"role": "assistant", "content": _decode(tokenizer, head).strip()}
    if reasoning is not None:
        message["reasoning_content"] = _decode(tokenizer, reasoning).lstrip()
    if bodies:
        calls = []
        for i, body in enumerate(bodies):
            try:
                call = _parse_call(profile.name, _decode(tokenizer, body), i)
            except (ValueError, json.JSONDecodeError) as exc:
                return ParsedReply(None, UNPARSEABLE_TOOL_CALL, str(exc)[:500], reasoning or [], answer)
            call["id"] = call["id"] or f"{call_id_prefix}_{i}"
            calls.append(call)
        message["tool_calls"] = calls
    return ParsedReply(message, None, "", reasoning or [], answer)
