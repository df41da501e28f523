"""``segment_row`` over a whole record batch: the same rules, vectorised over flat int32 arrays with offsets.

``structure.segment.segment_output`` is the per-row reference (the rules, their order and their spans are defined
there and in docs/token-structure.md); this module applies exactly those rules to many rows at once, so QC
(``assets.qc``) and the live monitor (``qc.live``) segment at the speed of the data. Tests compare the two on
every drop reason, keep case and fuzzed batch (``test_quality_segment_batch.py``).

How: a generations batch is one flat ``int32`` array of every row's ``output_ids`` plus ``offsets`` (``n_rows + 1``,
Arrow's ``ListArray.values`` / ``.offsets``). Each token class the rules look at (stop ids, think start/end, tool-call
markers, blank ids, out-of-vocab ids) becomes the sorted positions where it occurs (few, except blanks), and every
per-row question ("how many stop ids in the body", "where is the first think-end") is a ``searchsorted`` of those
positions against per-row bounds: a handful of passes over the tokens and O(rows) work after that. Two rules stay
per row, on the few rows that need them, by calling the reference's own functions: the prompt echo
(``protocol.prompt_echo_length``, only for rows whose first id occurs in the prompt's last ``ECHO_WINDOW`` ids or
whose counts disagree; its shape rule, ``segment.reply_well_formed`` as the evidence, only for those of them that
the other rules drop, since a kept row is well-formed as it stands) and the tool-call pairing
(``segment.tool_spans``, only over the marker ids of rows that have markers in their answer).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Collection, Sequence

import numpy as np
import pyarrow as pa

from eagle_assets.serving.protocol import ECHO_WINDOW, prompt_echo_length
from eagle_assets.structure.segment import (
    DROP_REASONS,
    FLAGS,
    Segmentation,
    reply_well_formed,
    row_max_new_tokens,
    tool_spans,
)

KEPT = -1  # drop code of a kept row
_CODE = {r: i for i, r in enumerate(DROP_REASONS)}
FLAG_BIT = {f: 1 << i for i, f in enumerate(FLAGS)}
# the order in which segment_output appends its flags (a Segmentation's flags tuple keeps it)
FLAG_ORDER = ("stop_at_length_cap", "implicit_think_start", "tool_call_ended_reasoning", "tool_call_in_reasoning")
assert set(FLAG_ORDER) == set(FLAGS)
_FINISH_STOP, _FINISH_LENGTH, _FINISH_ABORT, _FINISH_OTHER = 0, 1, 2, 3


@dataclass(frozen=True)
class BatchSegmentation:
    """Per-row results of ``segment_flat`` / ``segment_batch`` (numpy arrays of length ``n_rows``).

    ``drop_code``: int8, ``KEPT`` (-1) or the index of the row's reason in ``DROP_REASONS``; ``reasoning_tokens``,
    ``answer_tokens``, ``tool_call_tokens``, ``n_tool_calls``: int32 token counts as in ``Segmentation`` (zeros where
    the reference gives zeros); ``flags``: uint8 bit mask, bit i = ``FLAGS[i]``; ``completion_tokens``: int32
    ``len(output_ids)`` of each row.
    """

    drop_code: np.ndarray
    reasoning_tokens: np.ndarray
    answer_tokens: np.ndarray
    tool_call_tokens: np.ndarray
    n_tool_calls: np.ndarray
    flags: np.ndarray
    completion_tokens: np.ndarray

    def __len__(self) -> int:
        return len(self.drop_code)

    @property
    def kept(self) -> np.ndarray:
        return self.drop_code == KEPT

    def drop_reasons(self) -> list[str | None]:
        """Drop reason (a ``DROP_REASONS`` name) or None per row."""
        return [None if c < 0 else DROP_REASONS[c] for c in self.drop_code.tolist()]

    def flag_names(self, i: int) -> tuple[str, ...]:
        bits = int(self.flags[i])
        return tuple(f for f in FLAG_ORDER if bits & FLAG_BIT[f])

    def row(self, i: int) -> Segmentation:
        """Row ``i`` as the reference's ``Segmentation``."""
        code = int(self.drop_code[i])
        return Segmentation(int(self.reasoning_tokens[i]), int(self.answer_tokens[i]), int(self.tool_call_tokens[i]),
                            int(self.n_tool_calls[i]), None if code < 0 else DROP_REASONS[code], self.flag_names(i))

    def flag_counts(self) -> dict[str, int]:
        return {f: int(np.count_nonzero(self.flags & FLAG_BIT[f])) for f in FLAGS}


def _positions(mask: np.ndarray) -> np.ndarray:
    return np.flatnonzero(mask)


def _count(pos: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Occurrences (sorted positions ``pos``) in each ``[lo, hi)``."""
    return np.searchsorted(pos, hi) - np.searchsorted(pos, lo)


def _first(pos: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """First position of ``pos`` in each ``[lo, hi)``, -1 where none."""
    i = np.searchsorted(pos, lo)
    found = np.zeros(len(lo), dtype=bool)
    inside = i < len(pos)
    found[inside] = pos[i[inside]] < hi[inside]
    out = np.full(len(lo), -1, dtype=np.int64)
    out[found] = pos[i[found]]
    return out


OUT_OF_VOCAB_BIT = 128


def _classes(values: np.ndarray, groups: Sequence[Collection[int]], vocab_size: int | None = None) -> np.ndarray:
    """uint8 per token: bit i set when the id is in ``groups[i]`` (at most 7 groups). One gather from a lookup table
    (ids outside every group, negative ones included, land on the sentinel slot): the one dense pass over the tokens.
    With ``vocab_size`` at or above every group id, the table spans the vocab and the sentinel carries
    ``OUT_OF_VOCAB_BIT``, so the vocab rule costs no pass of its own (ids of a group at or above ``vocab_size`` would
    be out of the vocab and drop their row first, so their other bits never matter)."""
    if not len(values):
        return np.zeros(0, dtype=np.uint8)
    table = _class_table(tuple(tuple(g) for g in groups), vocab_size)
    if values.dtype == np.int32:
        index = np.minimum(values.view(np.uint32), len(table) - 1)  # negative ids wrap to huge: the sentinel
    else:
        index = np.where((values < 0) | (values >= len(table)), len(table) - 1, values)
    return table[index]


@functools.lru_cache(maxsize=16)
def _class_table(groups: tuple[tuple[int, ...], ...], vocab_size: int | None) -> np.ndarray:
    """The lookup table of ``_classes`` (read-only), built once per (groups, vocab size): a batch of a few rows (the
    live monitor segments every ``report_every_rows`` rows) would otherwise spend more on building the
    vocab-sized table and walking the blank ids than on its tokens."""
    ids = [t for g in groups for t in g if t >= 0]
    top = max(ids) + 1 if ids else 0
    spans_vocab = vocab_size is not None and vocab_size >= top
    table = np.zeros((vocab_size if spans_vocab else top) + 1, dtype=np.uint8)  # the last slot is the sentinel
    if spans_vocab:
        table[-1] = OUT_OF_VOCAB_BIT
    for bit, group in enumerate(groups):
        for t in group:
            if t >= 0:
                table[t] |= 1 << bit
    table.setflags(write=False)
    return table


@functools.lru_cache(maxsize=16)
def _group_top(groups: tuple[tuple[int, ...], ...]) -> int:
    """1 + the largest id of ``groups`` (0 when none); cached with ``_class_table``, for the same reason."""
    return max((t + 1 for g in groups for t in g if t >= 0), default=0)


_FINISH_CODE = {"stop": _FINISH_STOP, "length": _FINISH_LENGTH, "abort": _FINISH_ABORT}


def _finish_codes(finish: Sequence[Any] | pa.Array) -> np.ndarray:
    if not isinstance(finish, (pa.Array, pa.ChunkedArray)):
        # Python values (the live monitor's few rows): a dict lookup each, cheaper than Arrow compute on tiny arrays
        return np.fromiter((_FINISH_CODE.get(f, _FINISH_OTHER) if isinstance(f, str) else _FINISH_OTHER
                            for f in finish), dtype=np.int8)
    arr = finish
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if not pa.types.is_string(arr.type) and not pa.types.is_large_string(arr.type):
        return np.full(len(arr), _FINISH_OTHER, dtype=np.int8)
    import pyarrow.compute as pc

    codes = np.full(len(arr), _FINISH_OTHER, dtype=np.int8)
    for name, code in (("stop", _FINISH_STOP), ("length", _FINISH_LENGTH), ("abort", _FINISH_ABORT)):
        codes[pc.fill_null(pc.equal(arr, name), False).to_numpy(zero_copy_only=False)] = code
    return codes


def _optional_ints(values: Sequence[Any] | np.ndarray | pa.Array | None, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(int64 values, bool present) of a nullable int column; None = absent everywhere."""
    if values is None:
        return np.zeros(n, dtype=np.int64), np.zeros(n, dtype=bool)
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if isinstance(values, pa.Array):
        if not pa.types.is_integer(values.type):  # another producer's type (strings, bools): the rule is skipped
            return np.zeros(n, dtype=np.int64), np.zeros(n, dtype=bool)
        present = ~values.is_null().to_numpy(zero_copy_only=False)
        return values.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64), present
    if isinstance(values, np.ndarray) and values.dtype.kind in "iu":
        return values.astype(np.int64), np.ones(n, dtype=bool)
    vals = list(values)
    present = np.array([isinstance(v, int) and not isinstance(v, bool) for v in vals], dtype=bool)
    return np.array([v if p else 0 for v, p in zip(vals, present)], dtype=np.int64), present


def segment_flat(
    values: np.ndarray,
    offsets: np.ndarray,
    finish_reason: Sequence[str | None] | pa.Array,
    profile,
    *,
    matched_stop: Sequence[Any] | pa.Array | None = None,
    completion_tokens: Sequence[Any] | pa.Array | None = None,
    prompt_opens_think: np.ndarray | Sequence[bool] | bool = True,
    tool_call_in_reasoning: str = "drop",
    blank_ids: Collection[int] = frozenset(),
    prompt_values: np.ndarray | None = None,
    prompt_offsets: np.ndarray | None = None,
    prompt_present: np.ndarray | None = None,
    prompt_tokens: Sequence[Any] | pa.Array | None = None,
    vocab_size: int | None = None,
    control_ids: Collection[int] | None = None,
    max_new_tokens: Sequence[Any] | pa.Array | None = None,
) -> BatchSegmentation:
    """``segment_output`` of every row of a batch, row ``i`` being ``values[offsets[i]:offsets[i + 1]]``.

    Args:
        values: every row's ``output_ids`` concatenated (int32 or int64, shape ``(total_tokens,)``).
        offsets: shape ``(n_rows + 1,)``, non-decreasing, ``offsets[0]`` may be non-zero (a sliced Arrow array).
        finish_reason: one per row ("stop", "length", "abort", anything else or None = unknown).
        matched_stop, completion_tokens, prompt_tokens, max_new_tokens: one per row (nullable ints; None = the rule
            is skipped for every row, a null for that row), as in ``segment_output``.
        prompt_opens_think: one bool per row, or one bool for all.
        prompt_values / prompt_offsets: the rows' prompt ids in the same flat layout (None = no prompt rules);
            ``prompt_present``: bool per row, False where the row has no prompt (the reference's ``prompt_ids=None``).
        tool_call_in_reasoning, blank_ids, vocab_size, control_ids: as in ``segment_output``.
    Returns: a ``BatchSegmentation``; row ``i`` equals ``segment_output`` of that row (tests hold it to that).
    Raises: ``ValueError`` for an unknown ``tool_call_in_reasoning`` policy or offsets that do not fit ``values``.

    Length: one function on purpose. It applies ``segment_output``'s rules in the reference's order, each as a few
    vectorised lines over the flat arrays, and every rule reads the masks the earlier ones left (first drop wins);
    split, a dozen row masks would travel between functions and the order would no longer read top to bottom.
    """
    if tool_call_in_reasoning not in ("drop", "keep"):
        raise ValueError(f"tool_call_in_reasoning must be 'drop' or 'keep', got {tool_call_in_reasoning!r}")
    values = np.asarray(values)
    offsets = np.asarray(offsets, dtype=np.int64)
    n = len(offsets) - 1
    if n < 0 or (n and (offsets[0] < 0 or offsets[-1] > len(values) or np.any(np.diff(offsets) < 0))):
        raise ValueError(f"offsets (length {len(offsets)}) do not describe rows of a values array of length "
                         f"{len(values)}: they must be non-decreasing and within it")
    start, end = offsets[:-1], offsets[1:]
    n_out = end - start
    finish = _finish_codes(finish_reason)
    if len(finish) != n:
        raise ValueError(f"finish_reason has {len(finish)} entries for {n} rows")
    opens_in = np.broadcast_to(np.asarray(prompt_opens_think, dtype=bool), (n,))
    code = np.full(n, KEPT, dtype=np.int8)

    def drop(reason: str, cond: np.ndarray) -> None:
        code[(code == KEPT) & cond] = _CODE[reason]

    # -- the protocol rules (reply_defect and the prompt count), in the reference's order
    drop("abort", finish == _FINISH_ABORT)
    drop("unknown_finish_reason", finish == _FINISH_OTHER)
    think_start, think_end = profile.think_start_id, profile.think_end_id
    has_think = think_start is not None and think_end is not None
    starts, ends = tuple(profile.tool_call_start_ids), tuple(profile.tool_call_end_ids)
    groups = [tuple(profile.stop_ids), (think_start,) if has_think else (), (think_end,) if has_think else (),
              (*starts, *ends), starts[:1], tuple(blank_ids)]
    group_top = _group_top(tuple(tuple(g) for g in groups))
    cls = _classes(values, groups, vocab_size)
    if vocab_size is not None:
        if vocab_size >= group_top:
            bad = _positions(cls & OUT_OF_VOCAB_BIT)
        else:
            bad = _positions((values < 0) | (values >= vocab_size))
        drop("id_out_of_vocab", _count(bad, start, end) > 0)
    ct, has_ct = _optional_ints(completion_tokens, n)
    cap, has_cap = _optional_ints(max_new_tokens, n)
    head_like = np.zeros(0, dtype=np.int64)
    if prompt_values is not None:
        pv = np.asarray(prompt_values)
        po = np.asarray(prompt_offsets, dtype=np.int64)
        p_start, p_end = po[:-1], po[1:]
        p_len = p_end - p_start
        present = np.ones(n, dtype=bool) if prompt_present is None else np.asarray(prompt_present, dtype=bool)
        # an echo needs the first output id among the prompt's last ECHO_WINDOW ids, or counts that disagree
        # (the count and cap evidence of prompt_echo_length); only those rows go through the reference
        maybe = present & (n_out > 0) & (p_len > 0) & (code == KEPT)
        maybe_idx = np.flatnonzero(maybe)
        if len(maybe_idx):
            first_out = values[start[maybe_idx]]
            window = np.minimum(np.minimum(n_out[maybe_idx], p_len[maybe_idx]), ECHO_WINDOW)
            k = np.arange(1, ECHO_WINDOW + 1)
            where = p_end[maybe_idx, None] - k[None, :]
            valid = k[None, :] <= window[:, None]
            tail = pv[np.where(valid, where, 0)] if len(pv) else np.zeros(where.shape, dtype=values.dtype)
            hit = np.any(valid & (tail == first_out[:, None]), axis=1)
            head_like = maybe_idx[hit]  # the rows the shape rule may call an echo (decided at the end)
            hit |= has_ct[maybe_idx] & (n_out[maybe_idx] > ct[maybe_idx])
            hit |= has_cap[maybe_idx] & (n_out[maybe_idx] > cap[maybe_idx])
            control = None if control_ids is None else frozenset(control_ids)
            echo = np.zeros(n, dtype=bool)
            for i in maybe_idx[hit].tolist():
                echo[i] = prompt_echo_length(
                    values[start[i]:end[i]].tolist(), pv[p_start[i]:p_end[i]].tolist(),
                    completion_tokens=int(ct[i]) if has_ct[i] else None, cap=int(cap[i]) if has_cap[i] else None,
                    control_ids=control) > 0
            drop("prompt_echo", echo)
            head_like = head_like[~echo[head_like]]
    drop("length_mismatch", has_ct & (n_out != ct))
    drop("too_long", has_cap & (n_out > cap))
    if prompt_values is not None:
        pt, has_pt = _optional_ints(prompt_tokens, n)
        drop("prompt_tokens_mismatch", present & has_pt & (pt != p_len))

    # -- where the turn ends
    stop_pos = _positions(cls & 1)
    nonempty = n_out > 0
    last_is_stop = np.zeros(n, dtype=bool)
    last_is_stop[nonempty] = _count(stop_pos, end[nonempty] - 1, end[nonempty]) > 0
    is_stop, is_length = finish == _FINISH_STOP, finish == _FINISH_LENGTH
    drop("no_stop_token", is_stop & ~last_is_stop)
    ms, has_ms = _optional_ints(matched_stop, n)
    last = np.zeros(n, dtype=np.int64)
    last[nonempty] = values[end[nonempty] - 1]
    drop("stop_mismatch", is_stop & has_ms & (last != ms))
    complete = last_is_stop  # stop rows without it are dropped above; for length rows it is the cap case
    flags = np.zeros(n, dtype=np.uint8)
    reached = code == KEPT
    flags[reached & is_length & complete] |= FLAG_BIT["stop_at_length_cap"]
    b_start, b_end = start.copy(), end - complete
    drop("stop_token_mid_output", _count(stop_pos, b_start, b_end) > 0)

    # -- the reasoning block
    reached = code == KEPT  # rows past here carry the flags set below, as in the reference
    zeros = np.zeros(n, dtype=np.int64)
    if has_think:
        ts_pos = _positions(cls & 2)
        te_pos = _positions(cls & 4)
        opens = opens_in.copy()
        head = ~opens & (b_end > b_start) & (_count(ts_pos, b_start, b_start + 1) > 0)
        opens |= head
        b_start = b_start + head
        n_end = _count(te_pos, b_start, b_end)
        if profile.implicit_think_start:
            implicit = ~opens & (n_end > 0)
            opens |= implicit
            flags[reached & implicit] |= FLAG_BIT["implicit_think_start"]
        n_start = _count(ts_pos, b_start, b_end)
    else:
        opens, n_end, n_start = np.zeros(n, dtype=bool), zeros, zeros
    b_len = b_end - b_start
    reasoning, answer = zeros.copy(), b_len.copy()
    a_start = b_start.copy()
    unclosed = np.zeros(n, dtype=bool)
    if has_think:
        by_end = opens & (n_end > 0)
        cut = _first(te_pos, b_start, b_end)
        reasoning[by_end] = cut[by_end] - b_start[by_end]
        answer[by_end] = b_end[by_end] - cut[by_end] - 1
        a_start[by_end] = cut[by_end] + 1
        rest = opens & (n_end == 0)
        if profile.tool_call_ends_reasoning and starts:
            tc_cut = _first(_positions(cls & 16), b_start, b_end)
            by_tool = rest & (tc_cut >= 0)
            reasoning[by_tool] = tc_cut[by_tool] - b_start[by_tool]
            answer[by_tool] = b_end[by_tool] - tc_cut[by_tool]
            a_start[by_tool] = tc_cut[by_tool]
            flags[reached & by_tool] |= FLAG_BIT["tool_call_ended_reasoning"]
            rest &= ~by_tool
        unclosed = rest
        reasoning[unclosed] = b_len[unclosed]
        answer[unclosed] = 0
        a_start[unclosed] = b_end[unclosed]
    a_end = a_start + answer

    # -- the structural rules, in DROP_REASONS order
    drop("truncated_in_reasoning", ~complete & unclosed)
    drop("truncated_in_answer", ~complete)
    drop("missing_think_end", unclosed)
    drop("think_end_without_start", (n_end > 0) & ~opens)
    drop("misplaced_think_start", n_start > 0)
    drop("multiple_think_end", n_end > 1)
    tool_tokens = np.zeros(n, dtype=np.int64)
    n_calls = np.zeros(n, dtype=np.int64)
    if starts or ends:
        marker_pos = _positions(cls & 8)
        in_answer = np.flatnonzero((code == KEPT) & (_count(marker_pos, a_start, a_end) > 0))
        unbalanced = np.zeros(n, dtype=bool)
        lo = np.searchsorted(marker_pos, a_start[in_answer])
        hi = np.searchsorted(marker_pos, a_end[in_answer])
        for i, a, b in zip(in_answer.tolist(), lo.tolist(), hi.tolist()):
            pos = marker_pos[a:b]
            span, calls, balanced = tool_spans(values[pos].tolist(), starts, ends, positions=pos.tolist())
            unbalanced[i] = not balanced
            tool_tokens[i], n_calls[i] = span, calls
        drop("unbalanced_tool_call", unbalanced)
        in_reasoning = (code == KEPT) & (_count(marker_pos, b_start, b_start + reasoning) > 0)
        if tool_call_in_reasoning == "drop":
            drop("tool_call_in_reasoning", in_reasoning)
        else:
            flags[in_reasoning] |= FLAG_BIT["tool_call_in_reasoning"]
    blank = _positions(cls & 32) if blank_ids else np.zeros(0, dtype=np.int64)
    empty = _count(blank, a_start, a_end) == answer
    drop("empty_answer", empty)

    # -- the prompt echo's shape rule (reply_defect's, so it outranks every rule after prompt_echo): a row that
    # begins like its prompt's tail and is dropped may be well-formed only without that head
    if len(head_like):
        control = None if control_ids is None else frozenset(control_ids)
        blank_set = frozenset(blank_ids)
        for i in head_like[code[head_like] != KEPT].tolist():
            finish_name = "stop" if finish[i] == _FINISH_STOP else "length"

            def shape(ids, finish_name=finish_name, opens=bool(opens_in[i])) -> bool:
                return reply_well_formed(ids, finish_name, profile, prompt_opens_think=opens,
                                         tool_call_in_reasoning=tool_call_in_reasoning, blank_ids=blank_set)

            if prompt_echo_length(values[start[i]:end[i]].tolist(), pv[p_start[i]:p_end[i]].tolist(),
                                  completion_tokens=int(ct[i]) if has_ct[i] else None,
                                  cap=int(cap[i]) if has_cap[i] else None, control_ids=control, well_formed=shape):
                code[i] = _CODE["prompt_echo"]
                flags[i] = 0

    # spans as the reference reports them: zeros for the protocol and stop drops, no answer for an empty one
    early = (code >= 0) & (code <= _CODE["stop_token_mid_output"])
    reasoning[early] = 0
    answer[early | (code == _CODE["empty_answer"])] = 0
    dropped = code != KEPT
    tool_tokens[dropped] = 0
    n_calls[dropped] = 0
    return BatchSegmentation(code, reasoning.astype(np.int32), answer.astype(np.int32), tool_tokens.astype(np.int32),
                             n_calls.astype(np.int32), flags, n_out.astype(np.int32))


def list_parts(arr: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(flat values, offsets, present) of a list column; nulls become empty rows with present False."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    present = ~arr.is_null().to_numpy(zero_copy_only=False)
    if arr.null_count:
        arr = arr.fill_null(pa.scalar([], type=arr.type))
    offsets = arr.offsets.to_numpy().astype(np.int64)
    # a sliced array's .values is the whole parent buffer: keep only this slice's ids (rebased offsets), so the
    # per-token passes cost this batch, not the array it was cut from
    lo, hi = (int(offsets[0]), int(offsets[-1])) if len(offsets) else (0, 0)
    values = arr.values.slice(lo, hi - lo).to_numpy(zero_copy_only=False) if hi > lo else np.zeros(0, dtype=np.int32)
    offsets -= lo
    if values.dtype.kind not in "iu":  # a column of non-int lists (another producer): empty and checked as such
        values = values.astype(np.int64)
    return values, offsets, present


def _int_list_parts(lists: Sequence[Sequence[int] | None]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``list_parts`` of Python lists of ints (None = a missing list) without an Arrow array in between: numpy
    converts Python ints ~15x faster than ``pa.array`` (measured here: ~100 vs ~1,800 us per 1,040-id list).
    Stricter than ``pa.array(..., pa.list_(pa.int64()))``: raises ``TypeError`` for any element that is not an
    ``int`` (bools and integral floats included), ``OverflowError`` beyond int64, and the caller hands such rows
    to the reference. A 1-d numpy array of a signed (or narrower than 64-bit unsigned) integer dtype is taken as it
    is, with no conversion or check."""
    n = len(lists)
    present = np.fromiter((x is not None for x in lists), dtype=bool, count=n)
    parts = []
    for x in lists:
        if x is None:
            parts.append(_EMPTY_IDS)
            continue
        if isinstance(x, np.ndarray) and x.ndim == 1 and (x.dtype.kind == "i" or (x.dtype.kind == "u"
                                                                                   and x.dtype.itemsize < 8)):
            parts.append(x)  # already converted (the client's replies, as generation.py hands them over)
            continue
        if not set(map(type, x)) <= _INT_ONLY:  # ~2x faster than issuperset(map(...)) on 1,000 ids
            raise TypeError("ids of another type than int")
        parts.append(np.array(x, dtype=np.int64))
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum([len(a) for a in parts], out=offsets[1:])
    values = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return values, offsets, present


_INT_ONLY = frozenset({int})
_EMPTY_IDS = np.zeros(0, dtype=np.int64)


def _column(batch: pa.RecordBatch | pa.Table, name: str):
    return batch.column(name) if name in batch.schema.names else None


def row_caps(sampling_params: pa.Array | pa.ChunkedArray | Sequence[Any] | None, n: int) -> list[int | None]:
    """``row_max_new_tokens`` of each row's ``sampling_params`` (parsed once per distinct value)."""
    if sampling_params is None:
        return [None] * n
    raw = sampling_params.to_pylist() if isinstance(sampling_params, (pa.Array, pa.ChunkedArray)) else \
        list(sampling_params)
    seen: dict[Any, int | None] = {}
    out = []
    for v in raw:
        key = v if isinstance(v, (str, bytes)) or v is None else None
        if key is None and v is not None:
            out.append(row_max_new_tokens({"sampling_params": v}))
            continue
        if key not in seen:
            seen[key] = row_max_new_tokens({"sampling_params": v})
        out.append(seen[key])
    return out


def _typed_as_generated(batch: pa.RecordBatch | pa.Table) -> bool:
    """True when every column the rules read has the type ``GENERATION_SCHEMA`` gives it (ints, lists of ints,
    strings); a shard of another producer with other types goes through the reference row by row instead."""
    types = {f.name: f.type for f in batch.schema}
    ids = types.get("output_ids")
    if ids is not None and not ((pa.types.is_list(ids) or pa.types.is_large_list(ids))
                                and pa.types.is_integer(ids.value_type)):
        return False
    for name in ("completion_tokens", "prompt_tokens"):  # the reference compares these values as they are
        if name in types and not (pa.types.is_integer(types[name]) or pa.types.is_null(types[name])):
            return False
    return True


def _reference_batch(batch, profile, *, prompt_opens_think, prompt_ids, **kw) -> BatchSegmentation:
    from eagle_assets.structure.segment import segment_row

    n = batch.num_rows
    opens = np.broadcast_to(np.asarray(prompt_opens_think, dtype=bool), (n,))
    prompts = prompt_ids.to_pylist() if prompt_ids is not None else [None] * n
    segs = [segment_row(row, profile, prompt_opens_think=bool(o), prompt_ids=p, **kw)
            for row, o, p in zip(batch.to_pylist(), opens.tolist(), prompts)]
    lens = [len(r or ()) for r in (batch.column("output_ids").to_pylist() if "output_ids" in batch.schema.names
                                   else [None] * n)]
    return _pack(segs, lens)


def segment_batch(
    batch: pa.RecordBatch | pa.Table,
    profile,
    *,
    prompt_opens_think: np.ndarray | Sequence[bool] | bool = True,
    prompt_ids: pa.Array | pa.ChunkedArray | None = None,
    tool_call_in_reasoning: str = "drop",
    blank_ids: Collection[int] = frozenset(),
    vocab_size: int | None = None,
    control_ids: Collection[int] | None = None,
) -> BatchSegmentation:
    """``segment_row`` of every row of a generations batch (``generation.GENERATION_SCHEMA`` columns).

    Args:
        batch: ``output_ids`` (list of int) and ``finish_reason`` (string), and when present ``matched_stop``,
            ``completion_tokens``, ``prompt_tokens`` and ``sampling_params``; missing columns or columns of other
            types skip their rule, as ``segment_row`` does.
        prompt_ids: a list column aligned with the batch (the rows' ``tokenized_prompts.prompt_ids``), None = no
            prompt rules; a null entry skips them for that row.
        prompt_opens_think, tool_call_in_reasoning, blank_ids, vocab_size, control_ids: as in ``segment_flat``.
    Returns: a ``BatchSegmentation`` equal, row for row, to ``segment_row``.
    """
    n = batch.num_rows
    if not _typed_as_generated(batch):
        return _reference_batch(batch, profile, prompt_opens_think=prompt_opens_think, prompt_ids=prompt_ids,
                                tool_call_in_reasoning=tool_call_in_reasoning, blank_ids=blank_ids,
                                vocab_size=vocab_size, control_ids=control_ids)
    out_col = _column(batch, "output_ids")
    if out_col is None:
        values, offsets = np.zeros(0, dtype=np.int32), np.zeros(n + 1, dtype=np.int64)
    else:
        values, offsets, _ = list_parts(out_col)
    finish = _column(batch, "finish_reason")
    kw: dict[str, Any] = {}
    if prompt_ids is not None:
        kw["prompt_values"], kw["prompt_offsets"], kw["prompt_present"] = list_parts(prompt_ids)
    return segment_flat(
        values, offsets, finish if finish is not None else pa.nulls(n, pa.string()), profile,
        matched_stop=_column(batch, "matched_stop"), completion_tokens=_column(batch, "completion_tokens"),
        prompt_opens_think=prompt_opens_think, tool_call_in_reasoning=tool_call_in_reasoning, blank_ids=blank_ids,
        prompt_tokens=_column(batch, "prompt_tokens"), vocab_size=vocab_size, control_ids=control_ids,
        max_new_tokens=row_caps(_column(batch, "sampling_params"), n), **kw,
    )


def _is_count(v: Any) -> bool:
    return v is None or (isinstance(v, int) and not isinstance(v, bool))


def segment_rows(
    rows: Sequence[Any],
    profile,
    *,
    prompt_opens_think: Sequence[bool] | bool = True,
    prompt_ids: Sequence[Sequence[int] | None] | None = None,
    tool_call_in_reasoning: str = "drop",
    blank_ids: Collection[int] = frozenset(),
    vocab_size: int | None = None,
    control_ids: Collection[int] | None = None,
) -> BatchSegmentation:
    """``segment_row`` of many row dicts (as the client writes them, or read back from shards) in one batch: the
    live monitor's call. ``prompt_ids``: one entry per row (None = no prompt rules for it), or None for all.
    Rows whose values are not of the generated types (string counts, non-int ids) go through the reference.
    ``output_ids`` (and ``prompt_ids`` entries) may be lists of ints or 1-d integer numpy arrays."""
    n = len(rows)
    opens = np.broadcast_to(np.asarray(prompt_opens_think, dtype=bool), (n,))
    prompts = list(prompt_ids) if prompt_ids is not None else [None] * n
    kw = dict(tool_call_in_reasoning=tool_call_in_reasoning, blank_ids=blank_ids, vocab_size=vocab_size,
              control_ids=control_ids)
    try:
        if not all(_is_count(r.get("completion_tokens")) and _is_count(r.get("prompt_tokens")) for r in rows):
            raise TypeError("counts of another type")
        values, offsets, _ = _int_list_parts([_ids_or_empty(r.get("output_ids")) for r in rows])
        flat: dict[str, Any] = {}
        if prompt_ids is not None:
            flat["prompt_values"], flat["prompt_offsets"], flat["prompt_present"] = _int_list_parts(
                [p if p is None or isinstance(p, (list, np.ndarray)) else list(p) for p in prompts])
        finish = [f if isinstance(f, str) else (None if f is None else "\0") for f in
                  (r.get("finish_reason") for r in rows)]
        matched = [m if isinstance(m, int) and not isinstance(m, bool) else None
                   for m in (r.get("matched_stop") for r in rows)]
        return segment_flat(
            values, offsets, finish, profile, matched_stop=matched,
            completion_tokens=[r.get("completion_tokens") for r in rows], prompt_opens_think=opens,
            prompt_tokens=[r.get("prompt_tokens") for r in rows],
            max_new_tokens=row_caps([r.get("sampling_params") for r in rows], n), **flat, **kw)
    except (TypeError, ValueError, OverflowError, pa.ArrowInvalid, pa.ArrowTypeError):
        pass  # not the generated types: the reference, row by row, decides
    from eagle_assets.structure.segment import segment_row

    rows = [dict(r, output_ids=r["output_ids"].tolist()) if isinstance(r.get("output_ids"), np.ndarray) else r
            for r in rows]
    prompts = [p.tolist() if isinstance(p, np.ndarray) else p for p in prompts]
    segs = [segment_row(r, profile, prompt_opens_think=bool(o), prompt_ids=p, **kw)
            for r, o, p in zip(rows, opens.tolist(), prompts)]
    return _pack(segs, [len(r.get("output_ids") or ()) for r in rows])


def _ids_or_empty(ids: Any) -> Any:
    """A row's ids, [] for a missing or empty value (``or []`` would raise on a numpy array)."""
    if ids is None:
        return []
    return ids if isinstance(ids, np.ndarray) else (ids or [])


def _pack(segs: Sequence[Segmentation], lengths: Sequence[int]) -> BatchSegmentation:
    return BatchSegmentation(
        np.array([KEPT if s.kept else _CODE[s.drop_reason] for s in segs], dtype=np.int8),
        np.array([s.reasoning_tokens for s in segs], dtype=np.int32),
        np.array([s.answer_tokens for s in segs], dtype=np.int32),
        np.array([s.tool_call_tokens for s in segs], dtype=np.int32),
        np.array([s.n_tool_calls for s in segs], dtype=np.int32),
        np.array([sum(FLAG_BIT[f] for f in s.flags) for s in segs], dtype=np.uint8),
        np.array(lengths, dtype=np.int32),
    )
