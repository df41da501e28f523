"""Walking a dataset conversation with the model's own replies in place of the dataset's (prompt policy ``all_turns``).

The dataset conversation (``raw_prompts.messages`` under ``all_turns``: every message, see
``formats.prompt.build_prompt``) gives the user side: system prompt, user turns and recorded tool results. The
assistant side is the model's: turn 1 is generated from everything before the dataset's first assistant message
(system, tools, user 1); after each reply:

- the reply called tools: each call must match a call the dataset's assistant made at this point (same function
  name, and with ``tool_result_match: arguments`` equal arguments) whose recorded result follows it (a ``tool``
  message; the i-th result answers the i-th recorded call, OpenAI's order). Then the recorded results are spliced
  in as ``tool`` messages, in the model's call order, pointing at the model's call ids, and the model continues
  (the next turn has no new user message). Several calls in one reply (parallel calls) are supported the same way,
  every call must match; a reply with any call that has no recorded result ends the conversation at that turn:
  ``tool_result_not_recorded``. No tool is ever executed.
- the reply has no tool call: the dataset's remaining assistant / tool messages of this exchange are skipped; the
  next user turn (with any system message beside it) is appended and the model answers it; when the dataset has no
  further user turn the conversation is ``complete``.

A reply QC drops (``structure.segment``), a call that does not parse (``generations.reply``), a prompt the
renderer refuses (``target_model.render``, e.g. ``prompt_too_long`` as the history grows) or ``max_turns`` also end
the conversation; each end is one counted record with its turn and reason (``END_REASONS``).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any, Literal

COMPLETE = "complete"
MAX_TURNS = "max_turns"
TOOL_RESULT_NOT_RECORDED = "tool_result_not_recorded"
UNPARSEABLE_TOOL_CALL = "unparseable_tool_call"
QC_DROPPED = "qc_dropped"
RENDER_REJECTED = "render_rejected"
REQUEST_FAILED = "request_failed"
NOT_GENERATED = "not_generated"
# Why a conversation ended (stable strings, stored in conversations.parquet and counted per turn). ``qc_dropped`` and
# ``render_rejected`` carry the QC drop reason / render reason in ``end_detail``; ``request_failed`` (the request
# failed after the client's retries) and ``not_generated`` (the live monitor stopped the run first) are not final:
# the next materialization resumes those conversations at that turn.
END_REASONS: tuple[str, ...] = (COMPLETE, MAX_TURNS, TOOL_RESULT_NOT_RECORDED, UNPARSEABLE_TOOL_CALL, QC_DROPPED,
                                RENDER_REJECTED, REQUEST_FAILED, NOT_GENERATED)

ThinkingSetting = bool | None | Literal["both"]
# mode name -> the enable_thinking value passed to the chat template (None = the template's default)
_MODES = {"default": None, "on": True, "off": False}


def thinking_modes(enable_thinking: ThinkingSetting) -> list[tuple[str, bool | None]]:
    """The thinking modes a partition generates: ``[(mode, enable_thinking passed to the template)]``.

    ``None`` -> ``[("default", None)]`` (the template decides), ``True`` -> ``[("on", True)]``, ``False`` ->
    ``[("off", False)]``, ``"both"`` -> ``[("on", True), ("off", False)]`` (every conversation twice).
    """
    if enable_thinking == "both":
        return [("on", True), ("off", False)]
    for mode, value in _MODES.items():
        if enable_thinking is value:
            return [(mode, value)]
    raise ValueError(f"enable_thinking must be true, false, null or 'both', got {enable_thinking!r}")


def turn_row_id(sample_id: str, mode: str, turn: int) -> str:
    """The generations / QC row key of one turn: ``<sample_id>:<mode>:<turn>`` (turn counts from 1).
    ``turns.parquet`` maps it back to (sample_id, thinking, turn)."""
    return f"{sample_id}:{mode}:{turn}"


def parse_turn_row_id(row_id: str) -> tuple[str, str, int] | None:
    """``(sample_id, mode, turn)`` of a row id :func:`turn_row_id` wrote; None for a single-turn row's id."""
    head, sep, turn = row_id.rpartition(":")
    if sep and turn.isdigit():
        sample_id, sep, mode = head.rpartition(":")
        if sep and mode in _MODES:
            return sample_id, mode, int(turn)
    return None


def conversation_id(row_id: str) -> str:
    """The sample id a generations / QC row belongs to: every turn and both thinking modes of one conversation
    share it (:func:`parse_turn_row_id`); a single-turn row's id is its own."""
    parsed = parse_turn_row_id(row_id)
    return parsed[0] if parsed else row_id


def first_turn_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Turn 1's prompt: the messages before the dataset's first assistant message after its first user turn
    (system, user 1; an assistant greeting before the first user turn stays, as the dataset wrote it)."""
    first_user = next((i for i, m in enumerate(messages) if m.get("role") == "user"), len(messages))
    for i in range(first_user, len(messages)):
        if messages[i].get("role") == "assistant":
            return copy.deepcopy(messages[:i])
    return copy.deepcopy(messages)


def _canonical(args: Any) -> str:
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return args
    return json.dumps(args, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


@dataclass
class ConversationWalk:
    """The state of one conversation in one thinking mode.

    Attributes:
        sample_id, mode: identity (``raw_prompts.sample_id``, a ``thinking_modes`` name).
        dataset: the dataset conversation (``raw_prompts.messages`` under ``all_turns``).
        history: the messages of the next prompt (the model's replies in place of the dataset's).
        pos: index in ``dataset`` of the assistant message the model's next reply stands for (len = none).
        turn: replies accepted so far; the next reply is turn ``turn + 1``.
        ended / end_turn / end_detail: why and at which turn the conversation ended (None while it goes on).
        tool_results: recorded results spliced in so far; parallel_turns: turns whose reply made 2+ calls.
    """

    sample_id: str
    mode: str
    dataset: list[dict[str, Any]]
    history: list[dict[str, Any]] = field(default_factory=list)
    pos: int = 0
    turn: int = 0
    ended: str | None = None
    end_turn: int | None = None
    end_detail: str = ""
    tool_results: int = 0
    parallel_turns: int = 0

    @classmethod
    def start(cls, sample_id: str, mode: str, dataset: list[dict[str, Any]]) -> "ConversationWalk":
        history = first_turn_messages(dataset)
        return cls(sample_id, mode, copy.deepcopy(dataset), history, len(history))

    @property
    def next_turn(self) -> int:
        return self.turn + 1

    def end(self, reason: str, detail: str = "", turn: int | None = None) -> None:
        """End the conversation at ``turn`` (default: the next turn) with ``reason`` (one of ``END_REASONS``)."""
        if reason not in END_REASONS:
            raise ValueError(f"unknown end reason {reason!r}; use one of {END_REASONS}")
        self.ended, self.end_detail = reason, detail[:500]
        self.end_turn = self.next_turn if turn is None else turn

    def _recorded_exchange(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
        """(calls of the dataset's assistant at ``pos``, the tool results right after it, index after them)."""
        if self.pos >= len(self.dataset) or self.dataset[self.pos].get("role") != "assistant":
            return [], [], self.pos
        calls = list(self.dataset[self.pos].get("tool_calls") or [])
        j = self.pos + 1
        results = []
        while j < len(self.dataset) and self.dataset[j].get("role") == "tool":
            results.append(self.dataset[j])
            j += 1
        return calls, results, j

    def accept(self, message: dict[str, Any], *, max_turns: int,
               match: Literal["arguments", "name"] = "arguments") -> None:
        """Take the model's reply (``reply.ParsedReply.message``) as turn ``next_turn`` and move on: splice the
        recorded tool results, append the next user turn, or end the conversation (see the module doc)."""
        self.turn += 1
        self.history.append(copy.deepcopy(message))
        calls = message.get("tool_calls") or []
        if calls:
            if len(calls) > 1:
                self.parallel_turns += 1
            recorded, results, after = self._recorded_exchange()
            answered = {i: results[i] for i in range(min(len(recorded), len(results)))}
            spliced, used = [], set()
            for k, call in enumerate(calls):
                fn = call["function"]
                hit = next((i for i in answered if i not in used
                            and recorded[i]["function"]["name"] == fn["name"]
                            and (match == "name" or _canonical(recorded[i]["function"].get("arguments"))
                                 == _canonical(fn.get("arguments")))), None)
                if hit is None:
                    names = [c["function"]["name"] for c in recorded]
                    self.end(TOOL_RESULT_NOT_RECORDED,
                             f"call {k} {fn['name']}({_canonical(fn.get('arguments'))[:200]}) has no recorded result "
                             f"(the dataset's calls here: {names or 'none'}, {len(results)} results)",
                             turn=self.turn)
                    return
                used.add(hit)
                result = {"role": "tool", "content": answered[hit].get("content", ""), "tool_call_id": call["id"]}
                if answered[hit].get("name"):  # only where the dataset recorded one (Kimi renders it as the role)
                    result["name"] = answered[hit]["name"]
                spliced.append(result)
            self.history.extend(spliced)
            self.tool_results += len(spliced)
            self.pos = after
        else:
            # an answer: skip the rest of this exchange up to the dataset's next user turn
            j = self.pos
            while j < len(self.dataset) and self.dataset[j].get("role") != "user":
                j += 1
            if j >= len(self.dataset):
                self.end(COMPLETE, turn=self.turn)
                return
            k = j
            while k < len(self.dataset) and self.dataset[k].get("role") in ("user", "system"):
                k += 1
            self.history.extend(copy.deepcopy(self.dataset[j:k]))
            self.pos = k
        if self.turn >= max_turns:
            self.end(MAX_TURNS, f"max_turns {max_turns} reached", turn=self.turn)
