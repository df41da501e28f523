"""Split one generation's ``output_ids`` into reasoning, answer and tool-call spans, or name why it is dropped.

The rules follow DESIGN.md section 3 and docs/token-structure.md (the per-family table and its sources): the
training row is ``prompt_ids + output_ids`` exactly as the target model produced them; a row is kept only if its
structure is whole. Nothing is repaired: a row is either kept, with its segment lengths, or dropped with exactly one
reason (the first rule it breaks, in the order of ``DROP_REASONS``).

One implementation for every consumer: ``qc_shards`` and the live monitor both call ``segment_row``, and the
protocol rules (ids in the vocab, counts, prompt echo, cap, matched stop id) are the ones the client applies to
every reply (``serving.protocol.reply_defect`` / ``stop_mismatch``), so a shard written by any producer (an older
version, an imported dataset) is held to the same rules as a reply that just arrived. ``segment_output`` is the
per-row Python reference; a vectorised version must reproduce it row for row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Collection, Mapping, Sequence

from eagle_assets.serving.protocol import reply_defect, stop_mismatch

# Order matters: a row is dropped for the first reason it meets.
DROP_REASONS: tuple[str, ...] = (
    "abort",  # the server aborted the request (finish_reason abort, possibly HTTP 200)
    "unknown_finish_reason",  # finish_reason is none of stop / length / abort (or missing)
    "id_out_of_vocab",  # an output id outside [0, target vocab size)
    "length_mismatch",  # len(output_ids) != meta_info.completion_tokens
    "prompt_echo",  # output_ids begin with the prompt's tail, counted or not, or well-formed only without it
    # (protocol.prompt_echo_length; the shape rule with reply_well_formed)
    "too_long",  # more output ids than the request's max_new_tokens
    "prompt_tokens_mismatch",  # meta_info.prompt_tokens != len(prompt_ids): generated from another prompt
    "no_stop_token",  # finish_reason stop, but the last id is not one of the model's stop ids
    "stop_mismatch",  # finish_reason stop matched an id other than the last output id
    "stop_token_mid_output",  # a stop id before the last output id: the model ran past its end of turn
    "truncated_in_reasoning",  # finish_reason length before the reasoning closed
    "truncated_in_answer",  # finish_reason length after the reasoning closed (or with no reasoning block)
    "missing_think_end",  # the reasoning block is open and the output never closes it
    "think_end_without_start",  # a think-end but no block open (families without implicit_think_start)
    "misplaced_think_start",  # a think-start other than the first output id of a prompt that opened no block
    "multiple_think_end",  # more than one think-end token
    "unbalanced_tool_call",  # tool-call start and end markers do not pair up
    "tool_call_in_reasoning",  # a tool-call marker inside the reasoning (dropped under policy "drop")
    "empty_answer",  # nothing but whitespace between the reasoning and the stop token
)

# Counted-but-kept observations (``Segmentation.flags``).
FLAGS: tuple[str, ...] = (
    "tool_call_in_reasoning",  # policy "keep": a tool-call marker inside the reasoning
    "tool_call_ended_reasoning",  # the profile's tool_call_ends_reasoning closed the reasoning (Kimi)
    "implicit_think_start",  # the profile's implicit_think_start opened the reasoning (DeepSeek-R1)
    "stop_at_length_cap",  # finish_reason length, but the last id is a stop id: the turn ended exactly at the cap
)


@dataclass(frozen=True)
class Segmentation:
    """Result of segmenting one output.

    Attributes: token counts (ints, units: tokens) of the reasoning span (the ids between the opening of the block
    and its end, markers excluded), the answer span (after the think-end, or from the tool-call start that closed
    the reasoning, excluding the final stop id; tool-call spans included), and the tool-call spans (markers
    included, outermost pair); ``n_tool_calls`` counts the innermost pair's spans (one per call);
    ``drop_reason`` is None for a kept row, else one of ``DROP_REASONS``; ``flags`` holds ``FLAGS`` seen on the row.
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


def tool_spans(ids: Sequence[int], starts: Sequence[int], ends: Sequence[int],
                positions: Sequence[int] | None = None) -> tuple[int, int, bool]:
    """(tokens inside outermost tool-call spans incl. markers, spans of the innermost pair, balanced?).

    ``starts[i]`` opens what ``ends[i]`` closes. Balanced means every end closes the most recently opened pair of
    its own kind, no pair is opened inside an open pair of the same kind, and nothing is left open.
    ``positions``: where each of ``ids`` sits (default ``0..len(ids)-1``), so a caller may pass only the marker ids
    of a long answer with their positions (``segment_batch``) and get the same result.
    """
    start_of = {t: i for i, t in enumerate(starts)}
    end_of = {t: i for i, t in enumerate(ends) if t not in start_of}
    innermost = len(starts) - 1
    stack: list[tuple[int, int]] = []  # (pair index, position)
    span_tokens = n_calls = 0
    for pos, tok in (enumerate(ids) if positions is None else zip(positions, ids)):
        pair = start_of.get(tok)
        if pair is not None:
            if any(open_pair == pair for open_pair, _ in stack):
                return span_tokens, n_calls, False
            stack.append((pair, pos))
            continue
        pair = end_of.get(tok)
        if pair is None:
            continue
        if not stack or stack[-1][0] != pair:
            return span_tokens, n_calls, False
        _, opened_at = stack.pop()
        if pair == innermost:
            n_calls += 1
        if not stack:
            span_tokens += pos - opened_at + 1
    return span_tokens, n_calls, not stack


def segment_output(
    output_ids: Sequence[int] | None,
    finish_reason: str | None,
    profile,
    *,
    matched_stop: int | None = None,
    completion_tokens: int | None = None,
    prompt_opens_think: bool = True,
    tool_call_in_reasoning: str = "drop",
    blank_ids: frozenset[int] = frozenset(),
    prompt_ids: Sequence[int] | None = None,
    prompt_tokens: int | None = None,
    vocab_size: int | None = None,
    control_ids: Collection[int] | None = None,
    max_new_tokens: int | None = None,
) -> Segmentation:
    """Segment ``output_ids`` (ints, the target's raw completion incl. its final stop id) by ``profile``.

    Length: the reference every vectorised path is tested against; its rules read top to bottom in the order a
    reply is checked (the first failing rule names the drop reason), so it stays one function.

    Args:
        output_ids: SGLang ``output_ids`` of one request (list of int; None counts as empty).
        finish_reason: ``meta_info.finish_reason.type``: "stop", "length" or "abort".
        profile: a ``FamilyProfile`` (think start/end ids, tool-call marker ids, stop ids, reasoning rules).
        matched_stop: ``finish_reason.matched`` when it is a token id.
        completion_tokens: ``meta_info.completion_tokens``; checked against ``len(output_ids)`` (None = unknown).
        prompt_opens_think: the prompt opened a reasoning block (``tokenized_prompts.prompt_opens_think``, decided
            by ``target_model.render.opens_think_block``), so the output must close it. If False, a block is
            optional and, when present, starts at the first output id (or, with the profile's
            ``implicit_think_start``, is everything before the first think-end).
        tool_call_in_reasoning: "drop" (default) or "keep" (kept and flagged).
        blank_ids: ids that decode to whitespace only; an answer made only of them counts as empty.
        prompt_ids: the request's ``input_ids``, for the prompt-echo rule (None = not checked), with this row's
            structure as evidence too (``reply_well_formed``: well-formed only without a head repeating the
            prompt's tail = ``prompt_echo``).
        prompt_tokens: ``meta_info.prompt_tokens``; checked against ``len(prompt_ids)`` (None = not checked).
        vocab_size: every id must lie in ``[0, vocab_size)`` (``target_model.profile.target_vocab_size``).
        control_ids: the target's special and added token ids (``target_model.render.control_token_ids``), the
            evidence for an echo the server counted in ``completion_tokens`` (None = unknown:
            ``protocol.prompt_echo_length`` then takes 3 or more ids repeating the prompt's end as the evidence).
        max_new_tokens: the request's cap (from the row's ``sampling_params``); None = not checked.
    Returns: a ``Segmentation``; never raises for malformed outputs (that is what drop reasons are for).
    Raises: ``ValueError`` for an unknown ``tool_call_in_reasoning`` policy.
    """
    if tool_call_in_reasoning not in ("drop", "keep"):
        raise ValueError(f"tool_call_in_reasoning must be 'drop' or 'keep', got {tool_call_in_reasoning!r}")
    ids = list(output_ids or ())
    stop_ids = frozenset(profile.stop_ids)
    starts, ends = tuple(profile.tool_call_start_ids), tuple(profile.tool_call_end_ids)
    markers = frozenset(starts) | frozenset(ends)
    think_start, think_end = profile.think_start_id, profile.think_end_id
    flags: list[str] = []

    def drop(reason: str, reasoning: int = 0, answer: int = 0) -> Segmentation:
        return Segmentation(reasoning, answer, 0, 0, reason, tuple(flags))

    # -- the protocol rules, shared with the client
    if finish_reason == "abort":
        return drop("abort")
    if finish_reason not in ("stop", "length"):
        return drop("unknown_finish_reason")
    shape = None
    if prompt_ids is not None:
        def shape(candidate: Sequence[int]) -> bool:
            return reply_well_formed(candidate, finish_reason, profile, prompt_opens_think=prompt_opens_think,
                                     tool_call_in_reasoning=tool_call_in_reasoning, blank_ids=blank_ids)
    defect = reply_defect(ids, completion_tokens=completion_tokens, prompt_ids=prompt_ids, vocab_size=vocab_size,
                          max_new_tokens=max_new_tokens, control_ids=control_ids, well_formed=shape)
    if defect is not None:
        return drop(defect.kind)
    if prompt_ids is not None and prompt_tokens is not None and prompt_tokens != len(prompt_ids):
        return drop("prompt_tokens_mismatch")

    # -- where the turn ends
    if finish_reason == "stop":
        if not ids or ids[-1] not in stop_ids:
            return drop("no_stop_token")
        if stop_mismatch(ids, matched_stop):
            return drop("stop_mismatch")
        complete = True
    else:
        # SGLang tests the length cap before the stop ids, so a stop id sampled exactly at the cap reports
        # "length": that turn is whole.
        complete = bool(ids) and ids[-1] in stop_ids
        if complete:
            flags.append("stop_at_length_cap")
    body = ids[:-1] if complete else ids
    if any(t in stop_ids for t in body):
        return drop("stop_token_mid_output")

    # -- the reasoning block: where it opens and where it ends (no decisions yet)
    has_think = think_start is not None and think_end is not None
    opens = has_think and prompt_opens_think
    if has_think and not opens and body[:1] == [think_start]:
        opens, body = True, body[1:]
    n_end = sum(1 for t in body if t == think_end) if has_think else 0
    if has_think and not opens and n_end and profile.implicit_think_start:
        opens = True
        flags.append("implicit_think_start")
    unclosed = False
    if not opens:
        reasoning, answer = [], body
    elif n_end:
        cut = body.index(think_end)
        reasoning, answer = body[:cut], body[cut + 1:]
    elif profile.tool_call_ends_reasoning and starts and starts[0] in body:
        cut = body.index(starts[0])  # the section start belongs to the answer
        reasoning, answer = body[:cut], body[cut:]
        flags.append("tool_call_ended_reasoning")
    else:
        reasoning, answer, unclosed = body, [], True

    # -- the structural rules, in DROP_REASONS order
    if not complete:
        if unclosed:
            return drop("truncated_in_reasoning", len(reasoning))
        return drop("truncated_in_answer", len(reasoning), len(answer))
    if unclosed:
        return drop("missing_think_end", len(reasoning))
    if n_end and not opens:
        return drop("think_end_without_start", 0, len(answer))
    if has_think and think_start in body:
        return drop("misplaced_think_start", len(reasoning), len(answer))
    if n_end > 1:
        return drop("multiple_think_end", len(reasoning), len(answer))
    tool_tokens, n_calls, balanced = tool_spans(answer, starts, ends)
    if not balanced:
        return drop("unbalanced_tool_call", len(reasoning), len(answer))
    if any(t in markers for t in reasoning):
        if tool_call_in_reasoning == "drop":
            return drop("tool_call_in_reasoning", len(reasoning), len(answer))
        flags.append("tool_call_in_reasoning")
    if all(t in blank_ids for t in answer):
        return drop("empty_answer", len(reasoning), 0)
    return Segmentation(len(reasoning), len(answer), tool_tokens, n_calls, None, tuple(flags))


# What a reply cut at its cap may still break only because it was cut: closing it there (its end-of-turn id appended)
# leaves the reasoning open, a tool call open, or no answer yet.
_CUT_SHORT = (None, "missing_think_end", "unbalanced_tool_call", "empty_answer")


def reply_well_formed(
    output_ids: Sequence[int],
    finish_reason: str | None,
    profile,
    *,
    prompt_opens_think: bool = True,
    tool_call_in_reasoning: str = "drop",
    blank_ids: frozenset[int] = frozenset(),
) -> bool:
    """Whether ``output_ids`` have the structure of a whole reply of ``profile``'s family: the structural rules of
    ``segment_output`` (stop ids, the reasoning block, tool calls, a non-empty answer), none of the protocol rules
    (counts, cap, vocab, echo, which judge the server, not the shape).

    A reply that finished by ``length`` without a stop id is judged as far as it goes: it is well-formed when
    ending it right there (the family's end-of-turn id appended) breaks nothing but what more tokens would mend
    (``_CUT_SHORT``: the reasoning or a tool call still open, no answer yet).

    Args: ``output_ids`` (ints), ``finish_reason`` ("stop" / "length"; anything else is never well-formed),
    ``profile`` (``FamilyProfile``), ``prompt_opens_think`` (``tokenized_prompts.prompt_opens_think``),
    ``tool_call_in_reasoning``, ``blank_ids``: as in ``segment_output``.
    Returns: a bool. Raises: ``ValueError`` for an unknown policy.

    This is the evidence ``serving.protocol.prompt_echo_length`` (rule 4) takes for an echo that neither the counts
    nor control ids betray: the reply is not well-formed, but is without the ids that repeat the prompt's tail.
    """
    ids = list(output_ids)
    kw = dict(prompt_opens_think=prompt_opens_think, tool_call_in_reasoning=tool_call_in_reasoning,
              blank_ids=blank_ids)
    if finish_reason == "length" and not (ids and ids[-1] in profile.stop_ids):
        closed = segment_output(ids + [profile.end_of_turn_id], "stop", profile, **kw)
        return closed.drop_reason in _CUT_SHORT
    return segment_output(ids, finish_reason, profile, **kw).kept


class StructureCheck:
    """The client's structure check (``serving.protocol.WellFormed``) for one target: ``check(prompt_ids,
    output_ids, finish_type, rid)`` is ``reply_well_formed`` with this family's profile and the partition's policy.

    Args:
        profile: the target's ``FamilyProfile``.
        prompt_opens_think: request id -> ``tokenized_prompts.prompt_opens_think`` (a Mapping, e.g.
            ``PromptsFile.opens_map``, or the turn table's column); for an id it does not hold (or None), the
            renderer's rule ``target_model.render.opens_think_block`` over the prompt ids decides.
        tool_call_in_reasoning, blank_ids: as in ``segment_output`` (the partition's, so the client refuses what QC
            would call an echo, and nothing else).
    """

    def __init__(self, profile, *, prompt_opens_think: Mapping[str, bool] | None = None,
                 tool_call_in_reasoning: str = "drop", blank_ids: Collection[int] = frozenset()):
        if tool_call_in_reasoning not in ("drop", "keep"):
            raise ValueError(f"tool_call_in_reasoning must be 'drop' or 'keep', got {tool_call_in_reasoning!r}")
        self.profile = profile
        self.prompt_opens_think = prompt_opens_think
        self.tool_call_in_reasoning = tool_call_in_reasoning
        self.blank_ids = frozenset(blank_ids)

    def opens(self, prompt_ids: Sequence[int], rid: str | None) -> bool:
        """``prompt_opens_think`` of request ``rid`` (the mapping's value, else the renderer's rule)."""
        known = None
        if self.prompt_opens_think is not None and rid is not None:
            known = self.prompt_opens_think.get(rid)
        if known is not None:
            return bool(known)
        from eagle_assets.target_model.render import opens_think_block

        return opens_think_block(prompt_ids, self.profile)

    def __call__(self, prompt_ids: Sequence[int], output_ids: Sequence[int], finish_type: str,
                 rid: str | None = None) -> bool:
        return reply_well_formed(output_ids, finish_type, self.profile, prompt_opens_think=self.opens(prompt_ids, rid),
                                 tool_call_in_reasoning=self.tool_call_in_reasoning, blank_ids=self.blank_ids)

    def __repr__(self) -> str:
        return f"StructureCheck(profile={self.profile.name!r}, tool_call_in_reasoning={self.tool_call_in_reasoning!r})"


def row_max_new_tokens(row: Mapping[str, Any]) -> int | None:
    """``max_new_tokens`` of the request that produced a generations row (its ``sampling_params`` JSON), or None
    when the row does not say (an imported dataset, a malformed value)."""
    raw = row.get("sampling_params")
    if not raw:
        return None
    try:
        value = (json.loads(raw) if isinstance(raw, (str, bytes)) else dict(raw)).get("max_new_tokens")
    except (ValueError, TypeError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def segment_row(
    row: Mapping[str, Any],
    profile,
    *,
    prompt_opens_think: bool = True,
    prompt_ids: Sequence[int] | None = None,
    tool_call_in_reasoning: str = "drop",
    blank_ids: frozenset[int] = frozenset(),
    vocab_size: int | None = None,
    control_ids: Collection[int] | None = None,
) -> Segmentation:
    """Segment one generations row: the one call ``qc_shards`` and the live monitor both make.

    Args:
        row: a generations row (``generation.GENERATION_SCHEMA``): ``output_ids`` (list of int), ``finish_reason``
            ("stop", "length", "abort"), and when present ``matched_stop``, ``completion_tokens``,
            ``prompt_tokens`` and ``sampling_params`` (JSON; its ``max_new_tokens`` is the cap). Missing columns
            (shards of another producer) skip their rule, never crash.
        profile: the target's ``FamilyProfile``.
        prompt_opens_think: ``tokenized_prompts.prompt_opens_think`` of the row's prompt.
        prompt_ids: the row's prompt ids (``tokenized_prompts.prompt_ids``), for the echo and prompt-count rules.
        tool_call_in_reasoning, blank_ids, vocab_size, control_ids: as in ``segment_output``.
    Returns: the ``Segmentation``. Raises ``ValueError`` for an unknown policy.
    """
    matched = row.get("matched_stop")
    return segment_output(
        row.get("output_ids"), row.get("finish_reason"), profile,
        matched_stop=matched if isinstance(matched, int) else None,
        completion_tokens=row.get("completion_tokens"),
        prompt_opens_think=prompt_opens_think, tool_call_in_reasoning=tool_call_in_reasoning, blank_ids=blank_ids,
        prompt_ids=prompt_ids, prompt_tokens=row.get("prompt_tokens"), vocab_size=vocab_size,
        control_ids=control_ids, max_new_tokens=row_max_new_tokens(row),
    )
