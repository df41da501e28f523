"""``generations`` of a partition with prompt policy ``all_turns``: every assistant turn regenerated on-policy.

Called by the ``generations`` asset (``assets.generation``) for such partitions; the loop, the turn tables and the
end reasons are ``generations.rollout``'s. The conversations are ``raw_prompts`` rows whose turn 1
``tokenized_prompts`` accepted (its rejects stay rejects); every later turn is rendered, and may be refused, in the
rollout. Metadata: the generation figures plus ``rows_by_turn``, ``turns_per_conversation``, ``ends_by_turn`` (end
reasons per turn) and ``rows_by_thinking``; the live monitor's figures carry ``by_turn`` and ``by_thinking``.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq

from eagle_assets.assets.regeneration import settle_generation
from eagle_assets.assets.versions import directory_content_version, record_generation_inputs
from eagle_assets.generations.run import FAILURES_FILE, LIVE_STATS_FILE, PartitionBusyError


def _conversations(layout, key: str) -> tuple[list[tuple[str, list]], dict[str, object]]:
    accepted = set(pq.read_table(layout.stage_dir("tokenized_prompts", key) / "prompts.parquet",
                                 columns=["sample_id"]).column("sample_id").to_pylist())
    raw = pq.read_table(layout.stage_dir("raw_prompts", key) / "prompts.parquet",
                        columns=["sample_id", "messages", "tools"]).to_pylist()
    convs = [(r["sample_id"], json.loads(r["messages"])) for r in raw if r["sample_id"] in accepted]
    tools = {r["sample_id"]: (json.loads(r["tools"]) if r["tools"] else None) for r in raw if r["sample_id"] in accepted}
    return convs, tools


def conversation_generations(context: dg.AssetExecutionContext, settings, target, sglang, out: Path, work: Path,
                             fingerprint, regenerate: bool) -> dg.MaterializeResult:
    """The ``generations`` materialization of one ``all_turns`` partition (see the module doc).

    ``out`` is the partition's folder, ``work`` the folder this run generates into (``out``, or its staging folder
    while stored rows of other inputs wait to be replaced: ``assets.regeneration``); ``regenerate`` clears ``work``
    first.

    Raises ``dg.Failure`` when a server does not answer, when another run generates the partition, when every
    request failed (the stored rows are kept), or when the live monitor stopped the run (the turns generated are
    kept; rerunning resumes at the next turn).
    """
    from eagle_assets.assets.live_reporting import live_metadata, stopped_failure
    from eagle_assets.assets.qc import blank_token_ids
    from eagle_assets.generations.rollout import CONVERSATIONS_FILE, TURNS_FILE, RolloutSettings, run_conversations
    from eagle_assets.qc.live import LiveQualityMonitor
    from eagle_assets.serving.protocol import SamplingParams
    from eagle_assets.target_model.profile import detect_profile, target_vocab_size
    from eagle_assets.target_model.render import control_token_ids
    from eagle_assets.target_model.tokenizer import load_tokenizer

    key = context.partition_key
    catalog = settings.catalog()
    spec = catalog.partition(key)
    layout = settings.layout()
    convs, tools = _conversations(layout, key)
    model_dir = target.resolve()
    tokenizer = load_tokenizer(model_dir)
    profile = detect_profile(tokenizer, catalog.target.profile or None)
    vocab_size = target_vocab_size(model_dir, tokenizer)
    control = control_token_ids(tokenizer)
    blank = blank_token_ids(tokenizer)
    s = spec.sampling
    sampling = SamplingParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                              top_k=s.top_k, stop_token_ids=list(profile.stop_ids), skip_special_tokens=False)
    shown_urls: list[str] = []

    def client():  # every server answers /health and /get_model_info before a turn is sent
        c, infos = sglang.generate_client(str(model_dir), concurrency=catalog.server.concurrency,
                                          timeout_s=catalog.server.timeout_s)
        for url, info in infos.items():
            context.log.info(f"{c.redact(url)} serves {info.get('model_path', '(model_path not given)')}")
        shown_urls.extend(c.redact(u) for u in c.urls)
        return c

    monitors: list = []

    def make_monitor(opens, prompt_ids):
        m = LiveQualityMonitor(profile, spec.thresholds, spec.live, blank_ids=blank,
                               tool_call_in_reasoning=spec.tool_call_in_reasoning, prompt_opens_think=opens,
                               partition=key, prompt_ids=prompt_ids, vocab_size=vocab_size, control_ids=control)
        monitors.append(m)
        return m

    rollout = RolloutSettings(tokenizer=tokenizer, profile=profile, tools=tools, enable_thinking=spec.enable_thinking,
                              max_prompt_tokens=spec.max_prompt_tokens, max_turns=spec.max_turns,
                              tool_result_match=spec.tool_result_match,
                              tool_call_in_reasoning=spec.tool_call_in_reasoning, blank_ids=blank,
                              vocab_size=vocab_size, control_ids=control)
    context.log.info(f"regenerating every turn of {len(convs)} conversations of {key} "
                     f"(thinking {spec.enable_thinking}, at most {spec.max_turns} turns each)")
    try:
        stats = run_conversations(convs, work, client, sampling, rollout, regenerate=regenerate,
                                  make_monitor=make_monitor, progress=context.log.info, alarm=context.log.warning)
    except PartitionBusyError as exc:
        raise dg.Failure(description=f"{exc}. Another run is generating partition {key}; wait for it or cancel it.",
                         allow_retries=False) from exc
    record_generation_inputs(work, fingerprint)
    if stats.failed:
        context.log.warning(f"{stats.failed} turn requests failed after retries; see {work / FAILURES_FILE}")
    settle_generation(context, out, work, requested=stats.succeeded + stats.failed, succeeded=stats.succeeded)
    live = {}
    if stats.stopped_early:
        raise stopped_failure(key, stats, out, stats.monitor)
    if monitors and (out / LIVE_STATS_FILE).exists():
        live = live_metadata(json.loads((out / LIVE_STATS_FILE).read_text()), out / LIVE_STATS_FILE)
    summary = stats.summary()
    by_thinking = Counter(pq.read_table(out / TURNS_FILE, columns=["thinking"]).column("thinking").to_pylist()) \
        if (out / TURNS_FILE).exists() else Counter()
    return dg.MaterializeResult(
        data_version=dg.DataVersion(directory_content_version(out, ("shard-*.parquet",))),
        metadata={
            "dagster/row_count": summary["turn_rows"],
            **{k: (dg.MetadataValue.json(v) if isinstance(v, dict) else v) for k, v in summary.items()},
            "turn_prompts_by_thinking": dg.MetadataValue.json(dict(by_thinking)),
            "max_new_tokens": s.max_new_tokens,
            "servers": dg.MetadataValue.json(shown_urls),
            "turns_path": dg.MetadataValue.path(str(out / TURNS_FILE)),
            "conversations_path": dg.MetadataValue.path(str(out / CONVERSATIONS_FILE)),
            "path": dg.MetadataValue.path(str(out)),
            **live,
        },
    )
