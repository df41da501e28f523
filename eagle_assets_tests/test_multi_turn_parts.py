"""The pieces of ``all_turns`` around the rollout: catalog fields, the prompt policy on real MT-bench records, the
turn-weighted training mix, the DuckDB figures by turn and mode, and the live monitor's per-turn figures."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle_assets.catalog import CatalogError, LiveSpec, MixSpec, Thresholds, load_catalog
from eagle_assets.drafter.data.mix import MixCandidate, build_mix
from eagle_assets.drafter.data.turn_mix import build_turn_mix, group_name
from eagle_assets.generations.rollout import TURN_SCHEMA, TurnMonitor
from eagle_assets.qc.qc_pass import ROWS_SCHEMA
from eagle_assets.qc.turn_report import format_turn_table, qc_by_turn, turn_length_report
from eagle_assets.tokenized_prompts.walk import ConversationWalk, first_turn_messages, thinking_modes

PART = """
partitions:
  MT:
    sources: [{{path: {src}, format: mtbench}}]
    sampling: {{max_new_tokens: 64}}
{extra}
"""


def _catalog(tmp_path: Path, extra: str, training: str = "") -> Path:
    src = tmp_path / "q.jsonl"
    src.write_text('{"turns": ["a", "b"]}\n')
    p = tmp_path / "cat.yaml"
    p.write_text(PART.format(src=src, extra=extra) + training)
    return p


def test_catalog_all_turns_fields_and_the_both_mode_rule(tmp_path):
    cat = load_catalog(_catalog(tmp_path, "    prompt_policy: all_turns\n    enable_thinking: both\n    max_turns: 4\n"
                                          "    tool_result_match: name\n",
                                "training: {mix: {turn_weights: {2: 2.0, 3: 0}}}\n"))
    spec = cat.partition("MT")
    assert (spec.prompt_policy, spec.enable_thinking, spec.max_turns, spec.tool_result_match) == (
        "all_turns", "both", 4, "name")
    assert cat.training.mix.turn_weights == {2: 2.0, 3: 0.0}
    default = load_catalog(_catalog(tmp_path, ""))
    assert default.partition("MT").prompt_policy == "last_user" and default.partition("MT").max_turns == 8
    with pytest.raises(CatalogError, match="needs prompt_policy all_turns"):
        load_catalog(_catalog(tmp_path, "    enable_thinking: both\n"))
    with pytest.raises(CatalogError, match="weights must be >= 0"):
        load_catalog(_catalog(tmp_path, "", "training: {mix: {turn_weights: {2: -1}}}\n"))
    greeting = [{"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "Q"},
                {"role": "assistant", "content": "A"}]
    assert first_turn_messages(greeting) == greeting[:2]  # a greeting before the first user turn stays
    assert ConversationWalk.start("s", "on", greeting).pos == 2
    assert thinking_modes(None) == [("default", None)] and thinking_modes(False) == [("off", False)]
    with pytest.raises(ValueError, match="enable_thinking"):
        thinking_modes("sometimes")


def test_all_turns_policy_on_real_mt_bench_records(shared_data):
    from eagle_assets.formats import build_prompt, load_records

    recs = [r for r in load_records(shared_data / "fastchat/mt_bench/question.jsonl", "mtbench")
            if hasattr(r, "messages")]
    for rec in recs:
        last, _ = build_prompt(rec, "last_user")
        msgs, ref = build_prompt(rec, "all_turns")
        users = [m for m in msgs if m["role"] == "user"]
        assert len(users) == len(rec.source_record["turns"]) == 2  # both questions, references or not
        assert first_turn_messages(msgs) == [msgs[0]] and msgs[0]["content"] == rec.source_record["turns"][0]
        assert len(last) in (1, 3)  # last_user is unchanged: without references it stays the first turn only
        walk = ConversationWalk.start("s", "default", msgs)
        walk.accept({"role": "assistant", "content": "A1"}, max_turns=8)
        assert walk.history == [msgs[0], {"role": "assistant", "content": "A1"}, users[1]]
        walk.accept({"role": "assistant", "content": "A2"}, max_turns=8)
        assert walk.ended == "complete" and walk.end_turn == 2


def test_turn_weights_split_a_partitions_share_between_its_turns():
    cands = [MixCandidate("MT", f"s{i}:on:{t}", 10) for i in range(40) for t in (1, 2)]
    cands += [MixCandidate("GSM", f"g{i}", 10) for i in range(40)]
    turn_of = {(c.partition, c.sample_id): int(c.sample_id.rsplit(":", 1)[1]) for c in cands if c.partition == "MT"}
    spec = MixSpec(mode="balanced", token_budget=400, seed=0, turn_weights={2: 3.0})
    result = build_turn_mix(cands, spec, ["MT", "GSM"], turn_of)
    tokens = Counter()
    for c in result.selected:
        group = group_name("MT", turn_of[(c.partition, c.sample_id)]) if c.partition == "MT" else c.partition
        tokens[group] += c.tokens
    assert tokens == {"GSM": 200, "MT/turn1": 50, "MT/turn2": 150}  # MT keeps its half, split 1:3
    assert {c.partition for c in result.selected} == {"MT", "GSM"}
    assert set(result.before) == {"MT/turn1", "MT/turn2", "GSM"}
    spec = spec.model_copy(update={"turn_weights": {1: 0}})
    zero = build_turn_mix(cands, spec, ["MT", "GSM"], turn_of)
    assert not [c for c in zero.selected if turn_of.get((c.partition, c.sample_id)) == 1]
    plain = build_turn_mix(cands, spec, ["MT", "GSM"], {})  # no turns: exactly build_mix
    assert plain.selected == build_mix(cands, spec, ["MT", "GSM"]).selected
    with pytest.raises(ValueError, match="turn_weights"):
        build_turn_mix(cands, spec.model_copy(update={"turn_weights": {2: -1.0}}), ["MT", "GSM"], turn_of)


def _write_rows(tmp_path: Path):
    rows, turns = [], []
    for i in range(6):
        for mode in ("on", "off"):
            for t in (1, 2):
                rid = f"s{i}:{mode}:{t}"
                n = 10 * t + (5 if mode == "on" else 0) + i
                dropped = t == 2 and mode == "off" and i == 0
                rows.append({"partition": "MT", "sample_id": rid, "completion_tokens": n,
                             "reasoning_tokens": 5 if mode == "on" else 0,
                             "answer_tokens": n - (5 if mode == "on" else 0), "tool_call_tokens": 0,
                             "finish_reason": "length" if dropped else "stop", "max_new_tokens": 64,
                             "kept": not dropped, "short": False,
                             "drop_reason": "truncated_in_answer" if dropped else None})
                turns.append({"row_id": rid, "sample_id": f"s{i}", "thinking": mode, "turn": t, "prompt_ids": [1, 2],
                              "n_prompt_tokens": 2, "prompt_opens_think": False, "tool_results": 0})
    pq.write_table(pa.Table.from_pylist(rows, schema=ROWS_SCHEMA), tmp_path / "rows.parquet")
    pq.write_table(pa.Table.from_pylist(turns, schema=TURN_SCHEMA), tmp_path / "turns.parquet")
    return rows


def test_length_and_qc_figures_by_turn_and_thinking_mode(tmp_path):
    rows = _write_rows(tmp_path)
    report = turn_length_report([(tmp_path / "rows.parquet", tmp_path / "turns.parquet")], short_tokens=20, threads=1)
    total = {(r["thinking"], r["turn"]): r for r in report if r["span"] == "total"}
    assert set(total) == {("on", 1), ("on", 2), ("off", 1), ("off", 2)}
    on2 = [r["completion_tokens"] for r in rows if r["sample_id"].endswith(":on:2")]
    assert total[("on", 2)]["count"] == 6 and total[("on", 2)]["mean"] == pytest.approx(sum(on2) / 6)
    assert total[("off", 2)]["share_truncated"] == pytest.approx(1 / 6) and total[("off", 2)]["kept"] == 5
    assert total[("off", 1)]["share_under_short"] == 1.0 and total[("on", 2)]["share_under_short"] == 0.0
    assert {r["span"] for r in report} == {"total", "reasoning", "answer"}
    assert "| MT | off | 2 | total | 6 | 5 |" in format_turn_table(report)
    qc = qc_by_turn(tmp_path / "rows.parquet", tmp_path / "turns.parquet", threads=1)
    assert qc["off/2"] == {"rows": 6, "kept": 5, "dropped": 1, "drop_reasons": {"truncated_in_answer": 1},
                           "share_dropped": pytest.approx(1 / 6)}
    assert qc["on/1"]["dropped"] == 0 and len(qc) == 4
    assert turn_length_report([(tmp_path / "none.parquet", tmp_path / "turns.parquet")]) == []


def test_turn_monitor_keeps_figures_per_turn_and_mode_and_decides_like_the_partition_monitor(shared_data):
    from eagle_assets.qc.live import LiveQualityMonitor
    from eagle_assets.target_model import detect_profile, load_tokenizer

    tok = load_tokenizer(shared_data / "tokenizers" / "qwen3-0.6b")
    prof = detect_profile(tok)
    good = tok("<think>\nok\n</think>\n\nFine.<|im_end|>", add_special_tokens=False)["input_ids"]
    cut = tok("<think>\nnever ends", add_special_tokens=False)["input_ids"]
    keys = {f"s{i}:on:{t}": (t, "on") for i in range(8) for t in (1, 2)}
    opens = {k: False for k in keys}
    make = (lambda: LiveQualityMonitor(prof, Thresholds(short_tokens=2), LiveSpec(warmup_rows=4, report_every_rows=4),
                                       prompt_opens_think=opens, partition="MT"))
    mon = TurnMonitor(make, keys)
    seeded = [{"sample_id": f"s{i}:on:1", "output_ids": good, "finish_reason": "stop", "matched_stop": good[-1],
               "completion_tokens": len(good)} for i in range(8)]
    assert mon.seed(seeded) == 8
    for i in range(8):
        mon.observe({"sample_id": f"s{i}:on:2", "output_ids": cut, "finish_reason": "length",
                     "completion_tokens": len(cut)})
    snap = mon.snapshot()
    assert snap["rows"] == 16 and snap["by_turn"]["1"]["dropped"] == 0 and snap["by_turn"]["2"]["dropped"] == 8
    assert snap["by_turn"]["2"]["share_truncated"] == 1.0 and snap["by_thinking"]["on"]["rows"] == 16
    assert mon.evaluate() is not None and mon.stop is not None  # the partition-wide monitor decides the stop


def test_bfcl_multi_turn_later_questions_follow_the_models_replies():
    from eagle_assets.formats import build_prompt, load_records

    data = Path(__file__).resolve().parent / "data" / "bfcl_multi_turn"
    base = [r for r in load_records(data / "BFCL_v4_multi_turn_base.json", "bfcl") if hasattr(r, "messages")]
    assert base and all(len(r.later_turns) == len(r.source_record["question"]) - 1 for r in base)
    msgs, _ = build_prompt(base[0], "all_turns")
    assert [m["content"] for m in msgs if m["role"] == "user"] == [
        q[0]["content"] for q in base[0].source_record["question"]]
    assert build_prompt(base[0], "last_user")[0] == base[0].messages  # the other policies are unchanged
    # a miss_func record's tool set grows at a later turn: no later turns, the first turn only
    miss = [r for r in load_records(data / "BFCL_v4_multi_turn_miss_func.json", "bfcl") if hasattr(r, "messages")]
    assert miss and all(r.later_turns == () for r in miss)
    # the model calls a tool: BFCL holds no execution result, so the conversation ends there, counted
    walk = ConversationWalk.start("s", "default", msgs)
    walk.accept({"role": "assistant", "content": "", "tool_calls": [
        {"id": "c0", "type": "function", "function": {"name": "mv", "arguments": {"source": "q3_summary.txt"}}}]},
        max_turns=8)
    assert (walk.ended, walk.end_turn) == ("tool_result_not_recorded", 1)
