"""Live quality of a partition while it generates: running figures, early alarms and the fail-fast decision.

``LiveQualityMonitor`` is fed one generated row at a time (the dict written to a generations shard). Each row is
segmented exactly as the ``qc_shards`` asset does it (the same ``structure.segment.segment_row`` call, with the same
prompt facts, vocab size and control ids), so the running figures are the figures the
blocking ``token_structure`` and ``response_length`` checks will compute at the end, and they are compared with the
partition's thresholds by the same rules (``qc.thresholds``), only earlier.

Cadence (``LiveSpec``): a report every ``report_every_rows`` rows; from ``warmup_rows`` rows on, each report also
evaluates. An evaluation yields alarms (one per broken threshold, with example sample ids) and, when ``fail_fast``
is set, may decide to stop the partition:

- Stopping figures are the structural ones: ``share_dropped``, ``share_<drop reason>`` at their ERROR level, and
  ``share_truncated`` at its ERROR level (truncated rows are structural drops, ``truncated_in_reasoning`` /
  ``truncated_in_answer``; past that level the blocking ``response_length`` check fails whatever follows). Length
  drift (``median_tokens``, ``share_under_short``) only warns.
- Figures cover the whole partition: rows of earlier runs are fed first (``seed``), as QC will judge them all. A stop
  however judges what the server does now: it also needs ``warmup_rows`` rows of this run and the same ERROR level
  broken over this run's rows alone. So a rerun after a server fix is not stopped by the broken rows of the earlier
  run, and an unfixed rerun stops again after its warm-up.

Cost: constant per row, whatever the partition's size. Rows are queued by ``observe`` and segmented in batches
(``qc.segment_batch.segment_rows``, the vectorised ``segment_row``) when figures are read; the figures are
counters (rows, drops per reason, truncated, under short) and exact histograms of the integer lengths
(``figures.running.LengthHistogram``), judged by ``qc.thresholds``' rules from counts
(``token_structure_outcome`` / ``response_length_outcome``); the example ids are bounded deques and a heap of the
``example_ids`` shortest rows. An evaluation costs O(longest length), not O(rows). A row's ``output_ids`` may be an
int32 array (``generations.run.run_generation`` converts each reply once, for its shard and for this monitor): no Python
ints are walked per row. Measured (issue 16, ``bench/bench_scale.py client``, Qwen3-shaped ~1,040-token replies,
reports every 25 rows): ~110-130 us of CPU per row under load, against ~330 before.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from eagle_assets.catalog import LiveSpec, Thresholds
from eagle_assets.figures.running import LengthHistogram
from eagle_assets.qc.segment_batch import KEPT, BatchSegmentation, segment_rows
from eagle_assets.qc.thresholds import Finding, Outcome, response_length_outcome, token_structure_outcome
from eagle_assets.structure.segment import DROP_REASONS, Segmentation

# rows segmented together when figures are read (the seed of a large partition is segmented in slices of this)
SEGMENT_BATCH_ROWS = 4096

LEVELS = ("OK", "WARN", "ERROR")
# What to do about a broken figure; the stop message quotes it.
_HINTS = {
    "truncated": "replies hit max_new_tokens: raise the partition's sampling.max_new_tokens, or check that the chat "
                 "template lets the model end its reasoning",
    "missing_think_end": "the prompt opens a think block that the output never closes: check the chat template "
                         "(enable_thinking) and the profile's think_end",
    "no_stop_token": "replies end without one of the profile's stop ids: check stop_ids / end_of_turn in the profile "
                     "and that the server keeps special tokens (skip_special_tokens false)",
    "stop_mismatch": "the matched stop id is not the last output id: check the server's stop handling",
    "multiple_think_end": "outputs close the think block twice: check the chat template",
    "unbalanced_tool_call": "tool-call markers do not pair up: check the profile's tool_call_start / tool_call_end",
    "tool_call_in_reasoning": "tool calls inside the reasoning: set tool_call_in_reasoning: keep if they are wanted",
    "empty_answer": "nothing after the reasoning: check the chat template and max_new_tokens",
    "length_mismatch": "completion_tokens disagree with output_ids: check the server version",
    "abort": "the server aborted requests: check its log",
    "unknown_finish_reason": "replies carry a finish_reason other than stop / length / abort: check the server "
                             "speaks SGLang's native /generate",
    "id_out_of_vocab": "output ids outside the target vocab: the server serves another model or tokenizer",
    "prompt_echo": "output_ids begin with the prompt's tail: this SGLang version echoes the detokenization window; "
                   "upgrade it",
    "too_long": "more output ids than max_new_tokens: check the server version",
    "prompt_tokens_mismatch": "rows were generated from other prompt ids: regenerate the partition (run config "
                              "regenerate: true) after re-rendering its prompts",
    "stop_token_mid_output": "a stop id before the end: the model ran past its end of turn; check that the server "
                             "gets the profile's stop_ids and does not set ignore_eos",
    "think_end_without_start": "a think-end without an open reasoning block: check the chat template "
                               "(enable_thinking) or set target.profile.implicit_think_start",
    "misplaced_think_start": "a think-start inside the output: check the chat template and think_start",
}


def _quantiles(hist: LengthHistogram) -> dict[str, float]:
    """p10 / median / p90 (tokens) by the index rule of ``evaluate_response_length``; zeros when empty."""
    return {"p10": hist.index_quantile(0.1), "median": hist.median(), "p90": hist.index_quantile(0.9)}


@dataclass
class _Figures:
    """Running counts of a set of rows (the partition, or this run)."""

    rows: int = 0
    truncated: int = 0
    drops: Counter = field(default_factory=Counter)
    tokens: LengthHistogram = field(default_factory=LengthHistogram)
    reasoning: LengthHistogram = field(default_factory=LengthHistogram)  # kept rows only
    answer: LengthHistogram = field(default_factory=LengthHistogram)  # kept rows only

    def outcomes(self, thresholds: Thresholds, short_tokens: int) -> tuple[Outcome, Outcome]:
        structure = token_structure_outcome(self.rows, self.drops, thresholds)
        length = response_length_outcome(self.rows, self.tokens.median(), self.tokens.index_quantile(0.1),
                                          self.tokens.below(short_tokens), self.truncated, thresholds)
        return structure, length


def _is_stopping(finding: Finding) -> bool:
    return finding.level == "ERROR" and finding.figure.startswith("share_") and finding.figure != "share_under_short"


@dataclass(frozen=True)
class LiveAlarm:
    """One broken threshold in a live evaluation.

    ``figure`` is ``value`` against ``threshold`` (``comparison`` "<" or ">" breaks it) at ``level`` "WARN" or
    "ERROR", over ``rows`` rows of the partition; ``example_ids`` are sample ids of offending rows (the shortest rows
    for length figures, the latest rows with that defect for shares); ``note`` says what happens next, if anything.
    """

    figure: str
    value: float
    threshold: float
    level: str
    comparison: str
    rows: int
    example_ids: tuple[str, ...] = ()
    note: str = ""

    def message(self) -> str:
        """One line, e.g. ``WARN: share_truncated = 0.04 > threshold 0.02 over 75 rows (examples: a, b)``."""
        text = f"{self.level}: {self.figure} = {self.value:.4g} {self.comparison} threshold {self.threshold:.4g} " \
               f"over {self.rows} rows"
        if self.example_ids:
            text += f" (examples: {', '.join(self.example_ids)})"
        return text + (f"; {self.note}" if self.note else "")

    def to_json(self) -> dict[str, Any]:
        return {"figure": self.figure, "value": self.value, "threshold": self.threshold, "level": self.level,
                "comparison": self.comparison, "rows": self.rows, "example_ids": list(self.example_ids),
                "note": self.note, "message": self.message()}


@dataclass(frozen=True)
class StopDecision:
    """Why a partition is stopped early: ``figure`` = ``value`` above its ERROR ``threshold``.

    ``value`` covers the ``rows`` rows of the partition, ``run_value`` the ``run_rows`` rows of this run (the two are
    equal on a fresh partition); ``example_ids`` are offending rows; ``hint`` says what to fix.
    """

    figure: str
    value: float
    threshold: float
    rows: int
    run_value: float
    run_rows: int
    example_ids: tuple[str, ...]
    hint: str

    def message(self) -> str:
        scope = (f"over {self.rows} rows" if self.rows == self.run_rows else
                 f"over {self.rows} rows of the partition ({self.run_value:.4g} over the {self.run_rows} rows of "
                 "this run)")
        text = f"{self.figure} = {self.value:.4g} > ERROR level {self.threshold:.4g} {scope}"
        if self.example_ids:
            text += f"; examples: {', '.join(self.example_ids)}"
        return text + (f"; {self.hint}" if self.hint else "")

    def to_json(self) -> dict[str, Any]:
        return {"figure": self.figure, "value": self.value, "threshold": self.threshold, "rows": self.rows,
                "run_value": self.run_value, "run_rows": self.run_rows, "example_ids": list(self.example_ids),
                "hint": self.hint, "message": self.message()}


@dataclass(frozen=True)
class LiveEvaluation:
    """Result of one evaluation over ``rows`` rows: worst ``level`` ("OK", "WARN", "ERROR"), every current alarm,
    the alarms whose level changed since the previous evaluation (``new_alarms``: what to log), and ``stop`` when
    this evaluation decided to stop the partition (None otherwise, also after an earlier stop)."""

    rows: int
    level: str
    alarms: tuple[LiveAlarm, ...]
    new_alarms: tuple[LiveAlarm, ...]
    stop: StopDecision | None


class LiveQualityMonitor:
    """Running quality figures of one partition, compared with its thresholds as rows arrive.

    Args:
        profile: the target's ``FamilyProfile`` (think, tool-call and stop ids).
        thresholds: the partition's ``Thresholds`` (or a mapping with the same fields).
        live: the partition's ``LiveSpec`` (or a mapping); None = the defaults.
        blank_ids: ids that decode to whitespace only (``target_model.setup.blank_token_ids``).
        tool_call_in_reasoning: the partition's policy, "drop" or "keep".
        prompt_opens_think: sample id -> ``prompt_opens_think`` of ``tokenized_prompts``. Rows of ids missing from it
            are from an older prompt set and are skipped, as QC skips them. None = every prompt opens a think block.
        partition: the partition key, for messages.
        prompt_ids: sample id -> prompt ids (``tokenized_prompts.prompt_ids``: lists or 1-d integer numpy arrays),
            for the prompt-echo and prompt-count rules; None = not checked. A mapping with ``get_many(sids)``
            (``PromptsFile.ids_map(arrays=True)``) is read once per segmented batch instead of once per row.
        vocab_size: the target's vocab size (``target_model.profile.target_vocab_size``); None = not checked.
        control_ids: the target's special and added token ids (``target_model.render.control_token_ids``); None =
            unknown.
    Use: ``seed`` earlier runs' rows once, then ``observe`` each new row; when ``report_due()``, call
    ``evaluate()`` and write ``snapshot()``.
    """

    def __init__(
        self,
        profile,
        thresholds: Thresholds | None = None,
        live: LiveSpec | None = None,
        *,
        blank_ids: frozenset[int] = frozenset(),
        tool_call_in_reasoning: str = "drop",
        prompt_opens_think: Mapping[str, bool] | None = None,
        partition: str = "",
        prompt_ids: Mapping[str, Sequence[int]] | None = None,
        vocab_size: int | None = None,
        control_ids: frozenset[int] | None = None,
    ):
        self.profile = profile
        self.thresholds = thresholds or Thresholds()
        self.live = live or LiveSpec()
        self.blank_ids = frozenset(blank_ids)
        self.tool_call_in_reasoning = tool_call_in_reasoning
        self.prompt_opens_think = prompt_opens_think
        self.partition = partition
        self.prompt_ids = prompt_ids
        self._get_many = getattr(prompt_ids, "get_many", None)
        self.vocab_size = vocab_size
        self.control_ids = None if control_ids is None else frozenset(control_ids)
        self.short_tokens = self.thresholds.short_tokens
        self._all, self._run = _Figures(), _Figures()  # every row; this run's rows (observe) only
        self._pending: list[tuple[Mapping[str, Any], bool, Sequence[int] | None, bool]] = []  # queued rows
        self._n = 0  # rows counted (queued ones included)
        self._k = self.live.example_ids
        self._recent: dict[str, deque] = {}  # "dropped", "truncated" or a drop reason -> latest sample ids
        self._shortest: list[tuple[int, int, str]] = []  # max-heap of (-tokens, -row, sid): the k shortest rows
        self.seeded = 0
        self.stale_rows = 0
        self._last_report = 0
        self._last_eval: int | None = None
        self._announced: dict[str, str] = {}
        self.last: LiveEvaluation | None = None
        self.stop: StopDecision | None = None

    # ------------------------------------------------------------------------------------------------ feeding
    @property
    def rows(self) -> int:
        """Rows counted so far (earlier runs + this run)."""
        return self._n

    @property
    def run_rows(self) -> int:
        """Rows of this run (fed by ``observe``)."""
        return self._n - self.seeded

    @property
    def warmed_up(self) -> bool:
        return self.rows >= self.live.warmup_rows

    def seed(self, rows: Iterable[Mapping[str, Any]]) -> int:
        """Count the rows of earlier runs (read back from the shards); returns how many were counted.

        Raises ``RuntimeError`` once ``observe`` has been called: earlier rows must come first.
        """
        if self.run_rows:
            raise RuntimeError("LiveQualityMonitor.seed must be called before the first observe()")
        before = self.rows
        for row in rows:
            self._queue(row, this_run=False)
            if len(self._pending) >= SEGMENT_BATCH_ROWS:
                self._flush()
        self._flush()
        self.seeded = self.rows
        return self.rows - before

    def observe(self, row: Mapping[str, Any]) -> None:
        """Count one row of this run: O(1) now; it is segmented, with the other queued rows, by ``flush`` (which
        every figure-reading method calls first)."""
        self._queue(row, this_run=True)
        if len(self._pending) >= SEGMENT_BATCH_ROWS:
            self._flush()

    def _queue(self, row: Mapping[str, Any], this_run: bool) -> None:
        sid = str(row["sample_id"])
        if self.prompt_opens_think is not None:
            opens = self.prompt_opens_think.get(sid)
            if opens is None:
                self.stale_rows += 1
                return
        else:
            opens = True
        # a mapping with get_many (PromptsFile.ids_map(arrays=True)) is read once per batch, in _flush
        prompt = self.prompt_ids.get(sid) if self.prompt_ids is not None and self._get_many is None else None
        self._pending.append((row, bool(opens), prompt, this_run))
        self._n += 1

    def flush(self) -> list[Segmentation]:
        """Segment the queued rows in one batch and count them; returns their segmentations, in order."""
        seg = self._flush()
        return [] if seg is None else [seg.row(i) for i in range(len(seg))]

    def _flush(self) -> BatchSegmentation | None:
        """``flush`` without building a ``Segmentation`` per row (what every figure-reading method calls)."""
        if not self._pending:
            return None
        pending, self._pending = self._pending, []
        rows = [p[0] for p in pending]
        if self._get_many is not None:
            prompts = self._get_many([str(r["sample_id"]) for r in rows])
        else:
            prompts = [p[2] for p in pending] if self.prompt_ids is not None else None
        seg = segment_rows(rows, self.profile, prompt_opens_think=[p[1] for p in pending], prompt_ids=prompts,
                           tool_call_in_reasoning=self.tool_call_in_reasoning, blank_ids=self.blank_ids,
                           vocab_size=self.vocab_size, control_ids=self.control_ids)
        first = self._n - len(pending)
        truncated = np.array([r.get("finish_reason") == "length" for r in rows], dtype=bool)
        kept = seg.drop_code == KEPT
        this_run = np.array([p[3] for p in pending], dtype=bool)
        for figures, sel in ((self._all, np.ones(len(rows), dtype=bool)), (self._run, this_run)):
            if not sel.any():
                continue
            figures.rows += int(sel.sum())
            figures.truncated += int((truncated & sel).sum())
            figures.tokens.add_many(seg.completion_tokens[sel])
            figures.reasoning.add_many(seg.reasoning_tokens[sel & kept])
            figures.answer.add_many(seg.answer_tokens[sel & kept])
            for c, k in zip(*np.unique(seg.drop_code[sel & ~kept], return_counts=True)):
                figures.drops[DROP_REASONS[c]] += int(k)
        codes, lengths = seg.drop_code.tolist(), seg.completion_tokens.tolist()
        for i, row in enumerate(rows):
            sid = str(row["sample_id"])
            if codes[i] != KEPT:
                self._remember("dropped", sid)
                self._remember(DROP_REASONS[codes[i]], sid)
            if truncated[i]:
                self._remember("truncated", sid)
            if self._k:
                item = (-lengths[i], -(first + i), sid)
                if len(self._shortest) < self._k:
                    heapq.heappush(self._shortest, item)
                elif item > self._shortest[0]:  # shorter than the longest kept (ties: the earlier row stays)
                    heapq.heapreplace(self._shortest, item)
        return seg

    @property
    def _drop_counts(self) -> Counter:
        return self._all.drops

    def _remember(self, key: str, sid: str) -> None:
        if self._k:
            self._recent.setdefault(key, deque(maxlen=self._k)).append(sid)

    # ---------------------------------------------------------------------------------------------- evaluating
    def report_due(self) -> bool:
        """True when a report is due: ``report_every_rows`` rows since the last one, or the first evaluation point
        (``warmup_rows`` rows) reached."""
        if self.rows - self._last_report >= self.live.report_every_rows:
            return True
        return self.warmed_up and (self._last_eval is None or self.rows - self._last_eval
                                   >= self.live.report_every_rows)

    def outcomes(self, this_run_only: bool = False) -> tuple[Outcome, Outcome]:
        """(token_structure, response_length) outcomes of the rows so far, by the blocking checks' rules."""
        self._flush()
        return (self._run if this_run_only else self._all).outcomes(self.thresholds, self.short_tokens)

    def evaluate(self, final: bool = False) -> LiveEvaluation | None:
        """Compare the running figures with the thresholds; None during the warm-up (fewer than ``warmup_rows``).

        Resets the report cadence either way. Decides a stop (``self.stop``, sticky) when ``fail_fast`` is set and a
        stopping figure breaks its ERROR level over the partition and over this run's rows (see the module doc).
        ``final=True`` is for the last figures of a run that has sent everything: evaluated even during the warm-up
        (when there is at least one row), and no stop is decided.
        """
        self._flush()
        self._last_report = self.rows
        if not (self.warmed_up or (final and self.rows)):
            return None
        self._last_eval = self.rows
        structure, length = self.outcomes()
        findings = [*structure.findings, *length.findings]
        stop = None
        if not final and self.stop is None and any(_is_stopping(f) for f in findings):
            stop = self._stop_decision([f for f in findings if _is_stopping(f)])
            self.stop = stop
        alarms = tuple(self._alarm(f) for f in findings)
        new = tuple(a for a in alarms if self._announced.get(a.figure) != a.level)
        self._announced = {a.figure: a.level for a in alarms}
        level = max((a.level for a in alarms), key=LEVELS.index, default="OK")
        self.last = LiveEvaluation(self.rows, level, alarms, new, stop)
        return self.last

    def _stop_decision(self, errors: list[Finding]) -> StopDecision | None:
        if not self.live.fail_fast or self.run_rows < self.live.warmup_rows:
            return None
        run_figures: dict[str, float] = {}
        if self.seeded:
            run_structure, run_length = self.outcomes(this_run_only=True)
            run_figures = {**run_structure.figures, **run_length.figures}
        for f in errors:
            run_value = run_figures.get(f.figure, 0.0) if self.seeded else f.value
            if run_value > f.threshold:
                return StopDecision(f.figure, f.value, f.threshold, self.rows, run_value, self.run_rows,
                                    self._examples(f.figure), self._hint(f.figure))
        return None

    def _hint(self, figure: str) -> str:
        if figure == "share_truncated" or figure.startswith("share_truncated_"):
            return _HINTS["truncated"]
        if figure == "share_dropped":
            top = self._drop_counts.most_common(1)
            if not top:
                return ""
            reason, count = top[0]
            return f"most dropped rows are {reason} ({count} of {self.rows} rows): {self._hint(f'share_{reason}')}"
        return _HINTS.get(figure.removeprefix("share_"), "")

    def _examples(self, figure: str) -> tuple[str, ...]:
        if not self._k:
            return ()
        if figure in ("median_tokens", "p10_tokens", "share_under_short"):
            # the shortest rows: what drags the length figures down
            return tuple(sid for _, _, sid in sorted(self._shortest, reverse=True))
        key = {"share_dropped": "dropped", "share_truncated": "truncated"}.get(figure, figure.removeprefix("share_"))
        return tuple(self._recent.get(key, ()))

    def _alarm(self, f: Finding) -> LiveAlarm:
        note = ""
        if _is_stopping(f):
            if self.stop is not None and self.stop.figure == f.figure:
                note = "generation stops: no new request is sent, the rows received are kept"
            elif not self.live.fail_fast:
                note = "live.fail_fast is off: generation continues; the blocking QC check will fail at this level"
            elif self.stop is None and self.run_rows < self.live.warmup_rows:
                note = (f"this run has {self.run_rows} of {self.live.warmup_rows} warm-up rows: not judged yet "
                        "(rows of earlier runs count in the figure)")
            elif self.stop is None:
                note = ("this run's own rows are within the ERROR level (rows of earlier runs raise the figure): "
                        "generation continues")
        return LiveAlarm(f.figure, f.value, f.threshold, f.level, f.comparison, self.rows, self._examples(f.figure),
                         note)

    # ------------------------------------------------------------------------------------------------ reporting
    def snapshot(self) -> dict[str, Any]:
        """JSON-able running figures. Token counts are tokens; shares are fractions 0..1 of the rows counted.

        Keys: partition, rows, rows_this_run, rows_earlier_runs, stale_rows_skipped, kept, dropped, warmed_up,
        completion_tokens / reasoning_tokens / answer_tokens ({p10, median, p90}; reasoning and answer over kept
        rows), short_tokens, share_under_short, share_truncated, share_dropped, share_by_reason, drop_reasons
        (counts), level ("WARMUP" before the first evaluation, else the last evaluation's), evaluated_at_rows,
        alarms (the last evaluation's), stopped, stop, live (the LiveSpec), thresholds.
        """
        self._flush()
        n = self.rows
        share = (lambda c: c / n) if n else (lambda c: 0.0)
        dropped = sum(self._drop_counts.values())
        last = self.last
        return {
            "partition": self.partition,
            "rows": n,
            "rows_this_run": self.run_rows,
            "rows_earlier_runs": self.seeded,
            "stale_rows_skipped": self.stale_rows,
            "kept": n - dropped,
            "dropped": dropped,
            "warmed_up": self.warmed_up,
            "completion_tokens": _quantiles(self._all.tokens),
            "reasoning_tokens": _quantiles(self._all.reasoning),
            "answer_tokens": _quantiles(self._all.answer),
            "short_tokens": self.short_tokens,
            "share_under_short": share(self._all.tokens.below(self.short_tokens)),
            "share_truncated": share(self._all.truncated),
            "share_dropped": share(dropped),
            "share_by_reason": {r: share(self._drop_counts[r]) for r in DROP_REASONS if self._drop_counts[r]},
            "drop_reasons": {r: self._drop_counts[r] for r in DROP_REASONS if self._drop_counts[r]},
            "level": last.level if last is not None else "WARMUP",
            "evaluated_at_rows": last.rows if last is not None else None,
            "alarms": [a.to_json() for a in last.alarms] if last is not None else [],
            "stopped": self.stop is not None,
            "stop": self.stop.to_json() if self.stop is not None else None,
            "live": self.live.model_dump(),
            "thresholds": self.thresholds.model_dump(),
        }

    def log_line(self) -> str:
        """One line for the run log: rows, level, completion-token quantiles and the main shares (percent)."""
        snap = self.snapshot()
        q = snap["completion_tokens"]
        reasons = ", ".join(f"{r} {100 * s:.1f}%" for r, s in snap["share_by_reason"].items())
        return (
            f"live quality{f' of {self.partition}' if self.partition else ''}: {snap['rows']} rows "
            f"({snap['rows_this_run']} this run), level {snap['level']}; completion tokens p10/median/p90 "
            f"{q['p10']:.0f}/{q['median']:.0f}/{q['p90']:.0f}; under {self.short_tokens} tokens "
            f"{100 * snap['share_under_short']:.1f}%, truncated {100 * snap['share_truncated']:.1f}%, dropped "
            f"{100 * snap['share_dropped']:.1f}%" + (f" ({reasons})" if reasons else "")
        )
