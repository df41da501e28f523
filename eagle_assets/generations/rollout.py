"""Turn-by-turn, exactly-once generation of a partition's conversations (prompt policy ``all_turns``).

Rounds over ``generations.run.run_generation`` (its lock, shards, flushes, failures and resume are reused unchanged):
each round replays every conversation through the rows already stored (``tokenized_prompts.walk`` + the reply parser),
renders the next turn of every conversation that goes on, and generates exactly the turns that have no row yet. A
generations row is one turn, keyed ``walk.turn_row_id(sample_id, mode, turn)``; the turn's identity and its prompt
go to ``turns.parquet`` beside the shards (atomically, before the round's requests are sent), and every
conversation's end to ``conversations.parquet``. Since a turn's prompt is a pure function of the dataset
conversation and the stored earlier turns, a run killed at any point resumes at the first turn without a row and
never sends a stored turn again; the turn prompts it writes again are the same ids.

Each stored reply is segmented with ``structure.segment.segment_row`` (QC's rules); a dropped reply ends its
conversation (``qc_dropped`` with the reason); ``qc_shards`` later drops the same row for the same reason.

Files beside the shards: ``turns.parquet`` (``TURN_SCHEMA``) and ``conversations.parquet``
(``CONVERSATION_SCHEMA``). Memory: every conversation's history and the stored rows' output ids (one partition).
"""

from __future__ import annotations

from collections import Counter, abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from eagle_assets.generations.reply import client_message
from eagle_assets.generations.run import (
    FAILURE_SCHEMA,
    FAILURES_FILE,
    GenerationStats,
    exclusive_writer,
    run_generation,
)
from eagle_assets.storage.guard import refuse_symlink
from eagle_assets.storage.shards import read_done_ids, shard_paths, write_parquet_atomic
from eagle_assets.structure.segment import StructureCheck, segment_row
from eagle_assets.tokenized_prompts.walk import (
    NOT_GENERATED,
    QC_DROPPED,
    RENDER_REJECTED,
    REQUEST_FAILED,
    UNPARSEABLE_TOOL_CALL,
    ConversationWalk,
    thinking_modes,
    turn_row_id,
)

TURNS_FILE = "turns.parquet"
CONVERSATIONS_FILE = "conversations.parquet"
TURN_SCHEMA = pa.schema([
    ("row_id", pa.string()),  # = the generations / QC row's sample_id
    ("sample_id", pa.string()),  # the conversation (raw_prompts.sample_id)
    ("thinking", pa.string()),  # walk.thinking_modes name: on / off / default
    ("turn", pa.int32()),  # 1-based
    ("prompt_ids", pa.list_(pa.int32())),
    ("n_prompt_tokens", pa.int32()),
    ("prompt_opens_think", pa.bool_()),
    ("tool_results", pa.int32()),  # recorded tool results spliced in right before this turn
])
CONVERSATION_SCHEMA = pa.schema([
    ("sample_id", pa.string()), ("thinking", pa.string()), ("turns", pa.int32()), ("end_turn", pa.int32()),
    ("end_reason", pa.string()), ("end_detail", pa.string()), ("tool_results", pa.int32()),
    ("parallel_call_turns", pa.int32()),
])
_ROW_COLUMNS = ["sample_id", "output_ids", "finish_reason", "matched_stop", "completion_tokens", "prompt_tokens",
                "sampling_params"]


@dataclass
class RolloutSettings:
    """What a rollout needs besides the prompts and the server.

    Attributes: tokenizer, profile (``FamilyProfile``), tools per sample id (OpenAI schemas or None),
    enable_thinking (the partition's: true / false / null / "both"), max_prompt_tokens, max_turns,
    tool_result_match ("arguments" | "name"), tool_call_in_reasoning, blank_ids, vocab_size, control_ids (as in
    ``segment_row``).
    """

    tokenizer: Any
    profile: Any
    tools: Mapping[str, Any]
    enable_thinking: Any = None
    max_prompt_tokens: int | None = None
    max_turns: int = 8
    tool_result_match: str = "arguments"
    tool_call_in_reasoning: str = "drop"
    blank_ids: frozenset[int] = frozenset()
    vocab_size: int | None = None
    control_ids: frozenset[int] | None = None


@dataclass
class RolloutStats:
    """What a rollout did: rounds, per-round ``GenerationStats`` summaries, turns generated this run, the totals of
    the stored state (rows per turn, conversations ended per (turn, reason)), and whether the live monitor stopped
    it (``stopped_early``, ``stop_reason``)."""

    rounds: int = 0
    round_summaries: list[dict] = field(default_factory=list)
    succeeded: int = 0
    failed: int = 0
    skipped_done: int = 0
    rows_by_turn: Counter = field(default_factory=Counter)
    ends: Counter = field(default_factory=Counter)  # (end_turn, end_reason, end_detail) -> conversations
    conversations: int = 0
    stopped_early: bool = False
    stop_reason: str | None = None
    not_sent: int = 0
    monitor: Any = None  # the last round's TurnMonitor (its ``stop`` says why a stopped run stopped)

    def summary(self) -> dict[str, Any]:
        """JSON-able figures: rows per turn, turns per conversation, end reasons per turn."""
        by_turn: dict[str, dict[str, int]] = {}
        for (turn, reason, detail), n in sorted(self.ends.items(), key=lambda kv: (kv[0][0] or 0, kv[0][1])):
            name = f"{reason}:{detail}" if reason in (QC_DROPPED, RENDER_REJECTED) and detail else reason
            by_turn.setdefault(str(turn), {})[name] = by_turn.get(str(turn), {}).get(name, 0) + n
        rows = sum(self.rows_by_turn.values())
        return {
            "conversations": self.conversations,
            "turn_rows": rows,
            "rows_by_turn": {str(k): v for k, v in sorted(self.rows_by_turn.items())},
            "turns_per_conversation": round(rows / self.conversations, 3) if self.conversations else 0.0,
            "ends_by_turn": by_turn,
            "rounds": self.rounds,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "skipped_done": self.skipped_done,
            "stopped_early": self.stopped_early,
            "not_sent": self.not_sent,
        }


class TurnMonitor:
    """A ``LiveQualityMonitor`` for ``run_generation`` that also keeps the figures of every turn index and thinking
    mode: the partition-wide monitor decides (alarms, fail-fast stop) exactly as for single-turn partitions; the
    per-turn and per-mode monitors only count, and their main figures go into the snapshot (``live_stats.json``)
    under ``by_turn`` and ``by_thinking``.

    Args: ``make()`` -> a fresh ``LiveQualityMonitor`` of the partition; ``row_key``: row id -> (turn, mode);
    ``this_run``: row ids generated by earlier rounds of the same ``run_conversations`` call: seeded as this run's
    rows (``observe``), so warm-up and fail-fast judge the whole call, not one round.
    """

    _FIGURES = ("rows", "kept", "dropped", "completion_tokens", "reasoning_tokens", "answer_tokens",
                "share_under_short", "share_truncated", "share_dropped", "drop_reasons")

    def __init__(self, make: Callable[[], Any], row_key: Mapping[str, tuple[int, str]],
                 this_run: frozenset[str] | set[str] = frozenset()):
        self.main = make()
        self._make, self._key, self._this_run = make, row_key, this_run
        self.by_turn: dict[int, Any] = {}
        self.by_mode: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:  # stop, rows, live, partition, report_due, evaluate, log_line ...
        return getattr(self.main, name)

    def _subs(self, row: Mapping[str, Any]) -> list[Any]:
        key = self._key.get(str(row["sample_id"]))
        if key is None:
            return []
        turn, mode = key
        return [self.by_turn.setdefault(turn, self._make()), self.by_mode.setdefault(mode, self._make())]

    def seed(self, rows: Iterable[Mapping[str, Any]]) -> int:
        rows = list(rows)
        for row in rows:
            for sub in self._subs(row):
                sub.observe(row)
        earlier = [r for r in rows if str(r["sample_id"]) not in self._this_run]
        counted = self.main.seed(earlier)
        for row in rows:
            if str(row["sample_id"]) in self._this_run:
                self.main.observe(row)
        return counted + len(rows) - len(earlier)

    def observe(self, row: Mapping[str, Any]) -> None:
        self.main.observe(row)
        for sub in self._subs(row):
            sub.observe(row)

    def snapshot(self) -> dict[str, Any]:
        snap = self.main.snapshot()
        pick = (lambda m: {k: v for k, v in m.snapshot().items() if k in self._FIGURES})
        snap["by_turn"] = {str(t): pick(m) for t, m in sorted(self.by_turn.items())}
        snap["by_thinking"] = {mode: pick(m) for mode, m in sorted(self.by_mode.items())}
        return snap


class _Column(abc.Mapping):
    """Row id -> one column of the turn records, read live (the monitor's prompt mappings grow every round)."""

    def __init__(self, records: dict[str, dict[str, Any]], column: str):
        self._records, self._column = records, column

    def __getitem__(self, key: str) -> Any:
        return self._records[key][self._column]

    def __iter__(self):
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)


def _read_rows(paths: Sequence[Path]) -> dict[str, dict]:
    rows: dict[str, dict] = {}
    for path in paths:
        present = set(pq.read_schema(path).names)
        for row in pq.read_table(path, columns=[c for c in _ROW_COLUMNS if c in present]).to_pylist():
            rows.setdefault(row["sample_id"], row)  # the first row of an id wins, as in qc_shards
    return rows


def _turn_record(walk: ConversationWalk, rid: str, rendered) -> dict[str, Any]:
    ids = list(rendered.prompt_ids)
    tool_results = 0  # the recorded results spliced in since the model's last reply end the history
    for m in reversed(walk.history):
        if m.get("role") != "tool":
            break
        tool_results += 1
    return {"row_id": rid, "sample_id": walk.sample_id, "thinking": walk.mode, "turn": walk.next_turn,
            "prompt_ids": ids, "n_prompt_tokens": len(ids), "prompt_opens_think": rendered.opens_think,
            "tool_results": tool_results}


def render_turn(walk: ConversationWalk, settings: RolloutSettings, enable_thinking: bool | None):
    """The prompt of ``walk``'s next turn (``target_model.render.render_prompt`` of its history, its tools and the
    mode's ``enable_thinking``), or None after ending the walk with ``render_rejected`` and the render reason."""
    from eagle_assets.target_model.render import RenderError, render_prompt

    try:
        return render_prompt(settings.tokenizer, walk.history, settings.tools.get(walk.sample_id),
                             enable_thinking=enable_thinking, max_prompt_tokens=settings.max_prompt_tokens,
                             profile=settings.profile)
    except RenderError as exc:
        walk.end(RENDER_REJECTED, exc.reason)
        return None


def take_reply(walk: ConversationWalk, row: Mapping[str, Any], rendered, settings: RolloutSettings) -> None:
    """Take one stored generations ``row`` (``generation.GENERATION_SCHEMA``) as ``walk``'s next turn: QC's
    segmentation (``segment_row``; dropped -> ``qc_dropped``), the client's view of the reply (``client_message``;
    a call that does not parse -> ``unparseable_tool_call``), then ``walk.accept``."""
    seg = segment_row(row, settings.profile, prompt_opens_think=rendered.opens_think, prompt_ids=rendered.prompt_ids,
                      tool_call_in_reasoning=settings.tool_call_in_reasoning, blank_ids=settings.blank_ids,
                      vocab_size=settings.vocab_size, control_ids=settings.control_ids)
    if not seg.kept:
        walk.end(QC_DROPPED, seg.drop_reason)
        return
    parsed = client_message(row["output_ids"], seg, settings.tokenizer, settings.profile,
                         prompt_opens_think=rendered.opens_think,
                         call_id_prefix=f"call_{walk.sample_id}_{walk.next_turn}",
                         history_tool_calls=sum(len(m.get("tool_calls") or []) for m in walk.history
                                                if m.get("role") == "assistant"))
    if parsed.problem is not None:
        walk.end(UNPARSEABLE_TOOL_CALL, parsed.detail)
        return
    walk.accept(parsed.message, max_turns=settings.max_turns, match=settings.tool_result_match)


class _Rollout:
    """The state of one ``run_conversations`` call: a walk per (conversation, thinking mode), the turn records
    rendered so far (row id -> ``TURN_SCHEMA`` row), the stored generations rows read so far, the row ids generated
    and failed by this call, and the stats."""

    def __init__(self, conversations: Sequence[tuple[str, list[dict[str, Any]]]], out_dir: Path,
                 settings: RolloutSettings):
        self.out_dir, self.settings = out_dir, settings
        modes = thinking_modes(settings.enable_thinking)
        self.walks = [ConversationWalk.start(sid, mode, msgs) for sid, msgs in conversations for mode, _ in modes]
        self.thinking_of = dict(modes)
        self.stats = RolloutStats(conversations=len(self.walks))
        self.turn_records: dict[str, dict[str, Any]] = {}
        self.row_key: dict[str, tuple[int, str]] = {}
        self.stored: dict[str, dict] = {}
        self.read_paths: set[Path] = set()
        self.generated_now: set[str] = set()  # row ids generated by this call's earlier rounds
        self.failed_now: dict[str, dict] = {}  # row id -> failures.parquet row, failed in this call
        self.opens_view = _Column(self.turn_records, "prompt_opens_think")
        self.prompt_view = _Column(self.turn_records, "prompt_ids")
        # the client's evidence for an echo only the reply's shape betrays: take_reply's rules (QC's) on
        # each turn prompt
        self.shape = StructureCheck(settings.profile, prompt_opens_think=self.opens_view,
                                    tool_call_in_reasoning=settings.tool_call_in_reasoning,
                                    blank_ids=settings.blank_ids)

    def read_new_shards(self) -> dict[str, dict]:
        """Read the shards not read yet into ``stored``; return their rows (row id -> row)."""
        new_paths = [p for p in shard_paths(self.out_dir) if p not in self.read_paths]
        fresh = _read_rows(new_paths)
        self.stored.update(fresh)
        self.read_paths.update(new_paths)
        return fresh

    def advance(self, walk: ConversationWalk) -> str | None:
        """Replay ``walk`` through the stored rows; return the row id of its next turn to generate (None = ended)."""
        while walk.ended is None:
            rendered = render_turn(walk, self.settings, self.thinking_of[walk.mode])
            if rendered is None:
                return None
            rid = turn_row_id(walk.sample_id, walk.mode, walk.next_turn)
            self.turn_records[rid] = _turn_record(walk, rid, rendered)
            self.row_key[rid] = (walk.next_turn, walk.mode)
            row = self.stored.get(rid)
            if row is None:
                return rid
            take_reply(walk, row, rendered, self.settings)
        return None

    def pending_turns(self) -> list[str]:
        """Advance every open walk; the row ids of the turns they wait for, in walk order."""
        return [rid for rid in (self.advance(w) for w in self.walks if w.ended is None) if rid is not None]

    def write_turns(self) -> None:
        """Rewrite ``turns.parquet`` with every turn record rendered so far."""
        write_parquet_atomic(pa.Table.from_pylist(list(self.turn_records.values()), schema=TURN_SCHEMA),
                             self.out_dir / TURNS_FILE)

    def generate_round(self, pending: list[str], prompts: list[tuple[str, list[int]]], client, sampling, *,
                       regenerate: bool, make_monitor: Callable[[], Any] | None,
                       progress: Callable[[str], None] | None, alarm: Callable[[str], None] | None,
                       flush_rows: int, flush_seconds: float) -> GenerationStats:
        """One round: ``run_generation`` of ``prompts`` (``pending``: the row ids still without a row) with a fresh
        ``TurnMonitor``; then take this round's failures and figures into ``failed_now`` and ``stats``."""
        stats, row_key = self.stats, self.row_key
        monitor = (TurnMonitor(lambda: make_monitor(self.opens_view, self.prompt_view), row_key, self.generated_now)
                   if make_monitor is not None else None)
        if progress is not None:
            progress(f"conversation round {stats.rounds + 1}: {len(pending)} turns to generate "
                     f"(turns {sorted(Counter(row_key[r][0] for r in pending).items())})")
        stats.monitor = monitor
        round_stats = run_generation(
            prompts, self.out_dir, client, sampling, self.settings.vocab_size, flush_rows=flush_rows,
            flush_seconds=flush_seconds, progress=progress, regenerate=regenerate, monitor=monitor,
            alarm=alarm, control_ids=self.settings.control_ids, well_formed=self.shape)
        if (self.out_dir / FAILURES_FILE).exists():
            self.failed_now.update({f["sample_id"]: f for f in pq.read_table(self.out_dir / FAILURES_FILE).to_pylist()})
        stats.rounds += 1
        stats.round_summaries.append(round_stats.summary())
        stats.succeeded += round_stats.succeeded
        stats.failed += round_stats.failed
        if stats.rounds == 1:
            stats.skipped_done = round_stats.skipped_done
        return round_stats

    def stop_early(self, round_stats: GenerationStats) -> None:
        """The live monitor stopped ``round_stats``'s round: record why, and replay the open walks through the rows
        that round stored."""
        stats = self.stats
        stats.stopped_early, stats.stop_reason = True, round_stats.stop_reason
        stats.not_sent = round_stats.not_sent
        self.read_new_shards()
        for w in self.walks:
            if w.ended is None:
                self.advance(w)

    def finish(self, last_stats: GenerationStats | None) -> RolloutStats:
        """End the walks still open, keep this call's failure rows, write ``turns.parquet`` and
        ``conversations.parquet``; the stats with the stored totals."""
        out_dir, walks, stats, turn_records = self.out_dir, self.walks, self.stats, self.turn_records
        # what is still open has no row: its request failed, or it was never sent (stopped early)
        done = set(self.stored) | read_done_ids(out_dir)
        if self.failed_now:  # rounds after a failure did not pass its row id to run_generation: keep its failure row
            current = {f["sample_id"]: f for f in pq.read_table(out_dir / FAILURES_FILE).to_pylist()} \
                if (out_dir / FAILURES_FILE).exists() else {}
            merged = {**{k: v for k, v in self.failed_now.items() if k not in done}, **current}
            write_parquet_atomic(pa.Table.from_pylist(list(merged.values()), schema=FAILURE_SCHEMA),
                                 out_dir / FAILURES_FILE)
        for w in walks:
            if w.ended is None:
                rid = turn_row_id(w.sample_id, w.mode, w.next_turn)
                w.end(REQUEST_FAILED if (rid in turn_records and last_stats is not None and not stats.stopped_early)
                      else NOT_GENERATED)
        self.write_turns()
        conv_rows = [{"sample_id": w.sample_id, "thinking": w.mode, "turns": w.turn, "end_turn": w.end_turn,
                      "end_reason": w.ended, "end_detail": w.end_detail, "tool_results": w.tool_results,
                      "parallel_call_turns": w.parallel_turns} for w in walks]
        write_parquet_atomic(pa.Table.from_pylist(conv_rows, schema=CONVERSATION_SCHEMA), out_dir / CONVERSATIONS_FILE)
        stats.rows_by_turn = Counter(rec["turn"] for rid, rec in turn_records.items() if rid in done)
        stats.ends = Counter((w.end_turn, w.ended, w.end_detail if w.ended in (QC_DROPPED, RENDER_REJECTED) else "")
                             for w in walks)
        return stats


def run_conversations(
    conversations: Sequence[tuple[str, list[dict[str, Any]]]],
    out_dir: Path,
    client,
    sampling,
    settings: RolloutSettings,
    *,
    regenerate: bool = False,
    make_monitor: Callable[[], Any] | None = None,
    progress: Callable[[str], None] | None = None,
    alarm: Callable[[str], None] | None = None,
    flush_rows: int = 64,
    flush_seconds: float = 10.0,
) -> RolloutStats:
    """Regenerate every turn of ``conversations`` into ``out_dir`` (see the module doc).

    Args:
        conversations: ``[(sample_id, messages)]``: ``raw_prompts`` rows under ``all_turns`` (the whole dataset
            conversation), only those whose first turn ``tokenized_prompts`` accepted.
        out_dir: the partition's generations directory.
        client, sampling: as in ``run_generation`` (``sampling.max_new_tokens`` is every turn's cap); ``client``
            may be a zero-argument factory, called only when some turn has to be sent.
        settings: ``RolloutSettings``.
        regenerate: drop the stored shards, failures and turn tables first.
        make_monitor: ``(prompt_opens_think, prompt_ids) -> LiveQualityMonitor``, called with row id -> value
            mappings of the turn prompts (they grow as turns are rendered); None = no live monitoring.
        progress, alarm: as in ``run_generation``; progress also gets one line per round.
    Returns: ``RolloutStats``.
    Raises: ``generation.PartitionBusyError`` (another writer), ``SymlinkRefusedError`` (``out_dir`` or its lock
    file is a symbolic link), whatever the client raises.
    """
    out_dir = refuse_symlink(Path(out_dir))  # every round writes here: no link followed
    if regenerate:
        with exclusive_writer(out_dir):  # never delete another writer's turn tables
            for name in (TURNS_FILE, CONVERSATIONS_FILE):
                (out_dir / name).unlink(missing_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    rollout = _Rollout(conversations, out_dir, settings)
    first_round = True
    last_stats = None
    while True:
        fresh = {} if first_round and regenerate else rollout.read_new_shards()
        if not first_round:
            rollout.generated_now.update(fresh)
        pending = rollout.pending_turns()
        if not pending or (last_stats is not None and last_stats.succeeded == 0):
            break
        rollout.write_turns()
        # a turn that failed after the client's retries in an earlier round of this call is not sent again (the
        # next materialization retries it); its failure row is carried to the end (see _Rollout.finish)
        failed_now = rollout.failed_now
        prompts = [(rid, rec["prompt_ids"]) for rid, rec in rollout.turn_records.items() if rid not in failed_now]
        if not any(rid not in failed_now for rid in pending):
            break
        if not hasattr(client, "generate_many"):
            client = client()  # a factory: the server is started only when a turn must be sent
        last_stats = rollout.generate_round(
            pending, prompts, client, sampling, regenerate=regenerate and first_round, make_monitor=make_monitor,
            progress=progress, alarm=alarm, flush_rows=flush_rows, flush_seconds=flush_seconds)
        first_round = False
        if last_stats.stopped_early:
            rollout.stop_early(last_stats)
            break
    return rollout.finish(last_stats)


def turn_prompts(out_dir: Path) -> pa.Table:
    """The turn prompts of a partition as ``qc_shards`` reads prompts: ``sample_id`` (= the row id),
    ``prompt_ids``, ``prompt_opens_think`` (an empty table when nothing was generated yet)."""
    path = Path(out_dir) / TURNS_FILE
    if not path.exists():
        return pa.table({"sample_id": pa.array([], pa.string()), "prompt_ids": pa.array([], pa.list_(pa.int32())),
                         "prompt_opens_think": pa.array([], pa.bool_())})
    t = pq.read_table(path, columns=["row_id", "prompt_ids", "prompt_opens_think"])
    return t.rename_columns(["sample_id", "prompt_ids", "prompt_opens_think"])


def turn_numbers(out_dir: Path) -> dict[str, int]:
    """Row id -> turn index of a partition's turn table (empty when it has none: not an ``all_turns`` partition)."""
    path = Path(out_dir) / TURNS_FILE
    if not path.exists():
        return {}
    t = pq.read_table(path, columns=["row_id", "turn"])
    return dict(zip(t.column("row_id").to_pylist(), t.column("turn").to_pylist()))
