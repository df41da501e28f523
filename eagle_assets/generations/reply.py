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

The text follows SGLang **0.5.23** (the version this project pins) exactly, whitespace included; each family is
served with the parsers named in :data:`SGLANG_PARSERS`, and ``eagle_assets_tests/test_reply_sglang.py`` compares
this function with those classes on every reply shape:

- reasoning (``python/sglang/srt/parser/reasoning_parser.py``, ``BaseReasoningFormatDetector._detect_and_parse_impl``,
  used by ``Qwen3Detector``, ``DeepSeekR1Detector``, ``KimiK2Detector``): leading think-starts removed, the
  reasoning is the text up to the first think-end and the normal text what follows it, **neither stripped**; a
  reply without a reasoning block is returned unchanged as normal text. ``reasoning_content`` is that reasoning
  text as is.
- content (``python/sglang/srt/function_call/*_detector.py``, ``detect_and_parse``): without a tool call, the
  normal text as is (a thinking-off answer ending in ``" .\\n"`` keeps its newline); with one, the text before
  the first call marker: **stripped** by ``Qwen25Detector`` (qwen3, demo, custom) and ``DeepSeekV3Detector``
  (deepseek), **kept as is** by ``KimiK2Detector`` (kimi).
- call ids (``serving_chat._process_tool_call_id``): Kimi's are ``functions.NAME:N`` with ``N`` the number of tool
  calls in the history the client sent plus the call's index in this reply (the model's own ``:IDX`` is read for
  the name only, as SGLang does); other families get a random id from SGLang, ``<call_id_prefix>_<i>`` here (their
  templates do not render it).

Ids are decoded with ``skip_special_tokens=False`` span by span, the final stop id excluded. Older SGLang releases
stripped the text around the think split; 0.5.23 does not, so a profile of another SGLang version would need its
own rules (the test above fails for them).

Call grammars inside one innermost marker pair (SGLang 0.5.23's function-call detectors, same files):

- qwen3 / demo / custom (``Qwen25Detector``, hermes style): ``<tool_call>`` ``\\n{"name": str, "arguments":
  {...}}\\n`` ``</tool_call>`` (SGLang only sees a call where the markers are followed / preceded by a newline);
- deepseek (``DeepSeekV3Detector``): ``<｜tool▁call▁begin｜>`` ``TYPE<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```
  `` ``<｜tool▁call▁end｜>``;
- kimi (``KimiK2Detector``): ``<|tool_call_begin|>`` ``[functions.]NAME:IDX<|tool_call_argument_begin|>{...}``
  ``<|tool_call_end|>``.

Arguments are kept as JSON objects (the project's message convention, and what SGLang 0.5.23 hands the template:
``serving_chat.normalize_assistant_tool_call_arguments`` parses a history call's JSON-string arguments back into an
object before rendering). A call that does not parse the way SGLang's detector would parse it is not guessed at:
the reply gets the problem ``unparseable_tool_call`` and its conversation ends (SGLang would skip such a call, or
return the markup as text; either continuation is a history no served client builds on purpose).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from eagle_assets.structure.segment import Segmentation

UNPARSEABLE_TOOL_CALL = "unparseable_tool_call"

# The serving stack whose client view these rules reproduce: part of an all_turns partition's generation inputs
# (lineage.versions.generation_fingerprint), since later turn prompts are rendered from it.
HISTORY_RULES = "sglang-0.5.23"

# SGLang 0.5.23's --reasoning-parser and --tool-call-parser of each family: the classes this module's text rules
# follow (sglang.srt.parser.reasoning_parser.ReasoningParser / sglang.srt.function_call.function_call_parser).
SGLANG_PARSERS: dict[str, tuple[str, str]] = {
    "qwen3": ("qwen3", "qwen25"),
    "demo": ("qwen3", "qwen25"),
    "custom": ("qwen3", "qwen25"),
    "deepseek": ("deepseek-r1", "deepseekv3"),
    "kimi": ("kimi_k2", "kimi_k2"),
}
# families whose tool-call detector strips the text before the first call (Qwen25Detector, DeepSeekV3Detector:
# ``text[:idx].strip()``); KimiK2Detector keeps it as is
_STRIPS_HEAD = {"qwen3", "demo", "custom", "deepseek"}

# DeepSeekV3Detector.func_detail_regex on one call's body (the text between its markers)
_DEEPSEEK_CALL = re.compile(r"^(?P<type>.*)<｜tool▁sep｜>(?P<name>.*)\n```json\n(?P<args>.*)\n```$", re.DOTALL)
# KimiK2Detector.tool_call_regex on one call's body, then its tool_call_id_regex on the id
_KIMI_CALL = re.compile(r"^\s*(?P<id>[^\s<|]+)\s*<\|tool_call_argument_begin\|>\s*(?P<args>\{.*?\})\s*$", re.DOTALL)
_KIMI_ID = re.compile(r"^(?:functions\.)?(?P<name>[\w.\-]+):(?P<index>\d+)$")


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


def _parse_call(family: str, text: str, index: int, history_tool_calls: int) -> dict[str, Any]:
    """One call body (the text between an innermost marker pair) -> an OpenAI tool call; raises ValueError."""
    if family == "deepseek":
        m = _DEEPSEEK_CALL.match(text)
        if not m:
            raise ValueError(f"call {index}: not 'TYPE<｜tool▁sep｜>NAME\\n```json\\n{{...}}\\n```': {text[:120]!r}")
        name, args, call_id = m.group("name"), _arguments(m.group("args"), f"call {index}"), None
    elif family == "kimi":
        m = _KIMI_CALL.match(text)
        ident = _KIMI_ID.match(m.group("id")) if m else None
        if not ident:
            raise ValueError(f"call {index}: not '[functions.]NAME:IDX<|tool_call_argument_begin|>{{...}}': "
                             f"{text[:120]!r}")
        name = ident.group("name")
        args = _arguments(m.group("args"), f"call {index}")
        call_id = f"functions.{name}:{history_tool_calls + index}"  # serving_chat._process_tool_call_id (kimi_k2)
    else:
        if not (text.startswith("\n") and text.endswith("\n")):
            raise ValueError(f"call {index}: not '<tool_call>\\n{{...}}\\n</tool_call>' (SGLang's Qwen25Detector "
                             f"returns such markup as text): {text[:120]!r}")
        body = json.loads(text.strip())
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            raise ValueError(f"call {index}: not a JSON object with a 'name': {text[:120]!r}")
        name, call_id = body["name"], None
        args = _arguments(body.get("parameters") or body.get("arguments", {}), f"call {index}")
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


def client_message(output_ids: Sequence[int], seg: Segmentation, tokenizer, profile, *, prompt_opens_think: bool,
                call_id_prefix: str = "call", history_tool_calls: int = 0) -> ParsedReply:
    """The assistant message of one KEPT reply (see the module doc for every rule and its source).

    Args:
        output_ids: the reply's ``output_ids`` (ints, the final stop id included).
        seg: its ``segment_row`` / ``segment_output`` result (must be kept).
        tokenizer: the target's tokenizer (decoding only).
        profile: the target's ``FamilyProfile``; ``profile.name`` picks the call grammar and the whitespace rule,
            ``profile.history_reasoning`` whether ``reasoning_content`` is part of the message the client sends back.
        prompt_opens_think: the prompt's ``opens_think`` (``render.opens_think_block``).
        call_id_prefix: ids of calls whose grammar carries none are ``<prefix>_<i>`` (not rendered by the Qwen3
            and DeepSeek templates; kept so tool results can point at their call, as OpenAI clients do).
        history_tool_calls: tool calls in the assistant messages of the history the client sent with this turn's
            request (Kimi call ids count from there).
    Returns: a ``ParsedReply``; ``problem`` set (and ``message`` None) when a call does not parse.
    Raises: ``ValueError`` for a dropped ``seg`` (see ``reply_spans``).
    """
    reasoning, answer = reply_spans(output_ids, seg, profile, prompt_opens_think)
    head, bodies = _calls(answer, profile)
    content = _decode(tokenizer, head)
    if bodies and profile.name in _STRIPS_HEAD:
        content = content.strip()
    message: dict[str, Any] = {"role": "assistant", "content": content}
    reasoning_text = _decode(tokenizer, reasoning) if reasoning is not None else ""
    if reasoning_text and profile.history_reasoning == "reasoning_content":  # SGLang sends "" back as None
        message["reasoning_content"] = reasoning_text
    if bodies:
        calls = []
        for i, body in enumerate(bodies):
            try:
                call = _parse_call(profile.name, _decode(tokenizer, body), i, history_tool_calls)
            except (ValueError, json.JSONDecodeError) as exc:
                return ParsedReply(None, UNPARSEABLE_TOOL_CALL, str(exc)[:500], reasoning or [], answer)
            call["id"] = call["id"] or f"{call_id_prefix}_{i}"
            calls.append(call)
        message["tool_calls"] = calls
    return ParsedReply(message, None, "", reasoning or [], answer)
