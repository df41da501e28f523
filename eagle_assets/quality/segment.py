"""Split one generation's ``output_ids`` into reasoning, answer and tool-call spans, or name why it is dropped.

The rules follow DESIGN.md section 3: the training row is ``prompt_ids + output_ids`` exactly as the target model
produced them; a row is kept only if its structure is whole. Nothing is repaired: a row is either kept, with its
segment lengths, or dropped with exactly one reason (the first rule it breaks, in the order of ``DROP_REASONS``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

# Order matters: a row is dropped for the first reason it meets.
DROP_REASONS: tuple[str, ...] = (
    "abort",  # the server aborted the request (finish_reason abort, possibly HTTP 200)
    "length_mismatch",  # len(output_ids) != meta_info.completion_tokens
    "truncated_in_reasoning",  # finish_reason length before the think-end token
    "truncated_in_answer",  # finish_reason length after the think-end token
    "no_stop_token",  # finish_reason stop, but the last id is not one of the model's stop ids
    "stop_mismatch",  # finish_reason stop matched an id other than the last output id
    "missing_think_end",  # prompt opened a think block; the output never closes it
    "multiple_think_end",  # more than one think-end token
    "unbalanced_tool_call",  # tool-call start and end markers do not pair up
    "tool_call_in_reasoning",  # a tool-call marker inside the reasoning (dropped under policy "drop")
    "empty_answer",  # nothing between think-end and the stop token
)


@dataclass(frozen=True)
class Segmentation:
    """Result of segmenting one output.

    Attributes: token counts (ints, units: tokens) of the reasoning span (before think-end, excluding it), the
    answer span (after think-end, excluding the stop token, including tool-call spans), and the tool-call spans
    (markers included); ``drop_reason`` is None for a kept row, else one of ``DROP_REASONS``; ``flags`` holds
    counted-but-kept observations (e.g. ``tool_call_in_reasoning`` under policy "keep").
    """

    reasoning_tokens: int
    answer_tokens: int
    tool_call_tokens: int
    n_tool_calls: int
    drop_reason: str | None
    flags: tuple[str, ...] = field(default_factory=tuple)

    @property
    def kept(self) -> bool:
        return self.drop_reason is None


def _tool_spans(ids: Sequence[int], starts: frozenset[int], ends: frozenset[int]) -> tuple[int, int, bool]:
    """(tokens inside tool-call spans incl. markers, number of spans, balanced?) for ``ids``."""
    depth, span_tokens, n_spans, span_start = 0, 0, 0, 0
    for i, tok in enumerate(ids):
        if tok in starts:
            if depth == 0:
                span_start = i
            depth += 1
        elif tok in ends:
            if depth == 0:
                return span_tokens, n_spans, False
            depth -= 1
            if depth == 0:
                span_tokens += i - span_start + 1
                n_spans += 1
    return span_tokens, n_spans, depth == 0


def segment_output(
    output_ids: Sequence[int],
    finish_reason: str,
    profile,
    *,
    matched_stop: int | None = None,
    completion_tokens: int | None = None,
    prompt_opens_think: bool = True,
    tool_call_in_reasoning: str = "drop",
    blank_ids: frozenset[int] = frozenset(),
) -> Segmentation:
    """Segment ``output_ids`` (ints, the target's raw completion incl. its final stop id) by ``profile``.

    Args:
        output_ids: SGLang ``output_ids`` of one request (list of int).
        finish_reason: ``meta_info.finish_reason.type``: "stop", "length" or "abort".
        profile: a ``FamilyProfile`` (think start/end ids, tool-call marker ids, stop ids).
        matched_stop: ``finish_reason.matched`` when it is a token id.
        completion_tokens: ``meta_info.completion_tokens``; checked against ``len(output_ids)``.
        prompt_opens_think: the prompt ends with the think-start token (Kimi-K2.5, DeepSeek-R1, the demo target),
            so the output must close the block. If False, a think block is optional and must start the output.
        tool_call_in_reasoning: "drop" (default) or "keep" (kept and flagged).
        blank_ids: ids that decode to whitespace only; an answer made only of them counts as empty.
    Returns: a ``Segmentation``; never raises for malformed outputs (that is what drop reasons are for).
    Raises: ``ValueError`` for an unknown ``tool_call_in_reasoning`` policy.
    """
    if tool_call_in_reasoning not in ("drop", "keep"):
        raise ValueError(f"tool_call_in_reasoning must be 'drop' or 'keep', got {tool_call_in_reasoning!r}")
    ids = list(output_ids)
    stop_ids = frozenset(profile.stop_ids)
    starts = frozenset(profile.tool_call_start_ids)
    ends = frozenset(profile.tool_call_end_ids)
    think_end = profile.think_end_id
    think_start = profile.think_start_id

    def drop(reason: str, reasoning: int = 0, answer: int = 0) -> Segmentation:
        return Segmentation(reasoning, answer, 0, 0, reason)

    if finish_reason == "abort":
        return drop("abort")
    if completion_tokens is not None and completion_tokens != len(ids):
        return drop("length_mismatch")

    body = ids
    if finish_reason == "stop":
        if not ids or ids[-1] not in stop_ids:
            return drop("no_stop_token")
        if matched_stop is not None and matched_stop != ids[-1]:
            return drop("stop_mismatch")
        body = ids[:-1]
    elif finish_reason != "length":
        return drop("abort")

    opens_think = prompt_opens_think and think_end is not None
    if not opens_think and think_start is not None and body[:1] == [think_start]:
        opens_think, body = True, body[1:]
    if opens_think:
        n_end = sum(1 for t in body if t == think_end)
        if n_end == 0:
            reason = "truncated_in_reasoning" if finish_reason == "length" else "missing_think_end"
            return drop(reason, reasoning=len(body))
        cut = body.index(think_end)
        reasoning, answer = body[:cut], body[cut + 1 :]
        if finish_reason == "length":
            return drop("truncated_in_answer", len(reasoning), len(answer))
        if n_end > 1:
            return drop("multiple_think_end", len(reasoning), len(answer))
    else:
        if finish_reason == "length":
            return drop("truncated_in_answer", 0, len(body))
        reasoning, answer = [], body

    tool_tokens, n_calls, balanced = _tool_spans(answer, starts, ends)
    if not balanced:
        return drop("unbalanced_tool_call", len(reasoning), len(answer))
    flags: list[str] = []
    if any(t in starts or t in ends for t in reasoning):
        if tool_call_in_reasoning == "drop":
            return drop("tool_call_in_reasoning", len(reasoning), len(answer))
        flags.append("tool_call_in_reasoning")
    if all(t in blank_ids for t in answer):
        return drop("empty_answer", len(reasoning), 0)
    return Segmentation(len(reasoning), len(answer), tool_tokens, n_calls, None, tuple(flags))
