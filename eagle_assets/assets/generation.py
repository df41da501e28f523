"""Asset ``generations``: SGLang ``/generate`` replies for every tokenized prompt, resumable by sample id; for a
partition with prompt policy ``all_turns``, every assistant turn regenerated on-policy (``generations.rollout``).

While it generates, a ``LiveQualityMonitor`` (``qc.live``) keeps the partition's running quality figures:
``live_stats.json`` beside the shards, a summary line in the run log at most every ``live.log_every_s`` seconds,
WARN lines for thresholds broken early, and, with ``live.fail_fast``, an early stop that fails the asset while
keeping every row generated. A partition whose stored rows were generated under other inputs is generated again
into a staging folder, and its stored rows stay until the new run has rows (``generations.staging``).
"""


import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dagster as dg
import pyarrow.parquet as pq

from eagle_assets.assets.locking import refusals_as_failures
from eagle_assets.assets.resources import PipelineSettings, TargetModel
from eagle_assets.assets.server_resource import SGLangServerResource
from eagle_assets.catalog.load import cleartext_key_urls
from eagle_assets.generations.run import FAILURES_FILE, LIVE_STATS_FILE, PartitionBusyError, run_generation
from eagle_assets.generations.staging import (
    NothingGenerated,
    choose_workdir,
    generation_inputs_changed,
    record_generation_inputs,
    settle,
)
from eagle_assets.lineage.versions import directory_content_version, generation_fingerprint
from eagle_assets.storage.guard import StorageRefused
from eagle_assets.storage.shards import read_done_ids
from eagle_assets.tokenized_prompts.prompts_file import PromptsFile

# rows per generations shard: ~1,000-token replies make shards of a few MB (a 1M-row partition: ~1,000 shards);
# the timer still flushes every flush_seconds, so a kill loses at most that much work
FLUSH_ROWS = 1024


class GenerationRunConfig(dg.Config):
    """Run config of ``generations``."""

    regenerate: bool = False  # generate every prompt again; the new rows replace the stored ones once there are some


class _Run:
    """What one ``generations`` step shares between its single-turn and multi-turn bodies: the partition, the
    target's facts, the sampling parameters, the servers (asked for lazily: a finished partition launches none) and
    the live monitors built for it."""

    def __init__(self, context: dg.AssetExecutionContext, settings: PipelineSettings, target: TargetModel,
                 sglang: SGLangServerResource, work: Path, clear: bool):
        from eagle_assets.serving.protocol import SamplingParams

        self.context, self.sglang, self.work, self.clear = context, sglang, work, clear
        self.key = context.partition_key
        self.catalog = settings.catalog()
        self.layout = settings.layout()
        self.spec = self.catalog.partition(self.key)
        self.target = target.setup(self.catalog.target.profile)
        s = self.spec.sampling
        # a sampled partition's rows are drawn from per-row seeds derived from its seed (generations.run.row_seed)
        self.sampling = SamplingParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                                       top_k=s.top_k, stop_token_ids=list(self.target.profile.stop_ids),
                                       skip_special_tokens=False, seed=self.spec.seed if s.temperature > 0 else None)
        self.urls: list[str] = []
        self.monitors: list = []

    def client(self):
        """A client of the partition's servers; every server answers /health and /get_model_info first."""
        server = self.catalog.server
        client, infos = self.sglang.generate_client(str(self.target.model_dir), concurrency=server.concurrency,
                                                    timeout_s=server.timeout_s)
        for url, info in infos.items():
            self.context.log.info(f"{client.redact(url)} serves {info.get('model_path', '(model_path not given)')}")
        for url in cleartext_key_urls(client.urls, client.api_key_env):
            self.context.log.warning(f"{client.redact(url)} is plain http:// to another host: the API key in "
                                     f"${client.api_key_env} crosses the network in clear text (use https://)")
        self.urls.extend(client.redact(u) for u in client.urls)
        return client

    def monitor(self, opens, prompt_ids):
        """A live monitor holding rows to QC's rules (segmentation, thresholds, vocab and control ids)."""
        from eagle_assets.qc.live import LiveQualityMonitor

        t, spec = self.target, self.spec
        m = LiveQualityMonitor(t.profile, spec.thresholds, spec.live, blank_ids=t.blank_ids,
                               tool_call_in_reasoning=spec.tool_call_in_reasoning, prompt_opens_think=opens,
                               partition=self.key, prompt_ids=prompt_ids, vocab_size=t.vocab_size,
                               control_ids=t.control_ids)
        self.monitors.append(m)
        return m


@dataclass
class _Outcome:
    """What a body generated: its stats, the requests it sent, the partition's rows, the (last) live monitor,
    extra metadata, and whether the live figures are read from ``live_stats.json`` instead of the monitor."""

    stats: Any
    requested: int
    rows: int
    monitor: Any
    metadata: dict = field(default_factory=dict)
    live_from_file: bool = False


def _prompt_rows(run: _Run) -> _Outcome:
    """Single-turn generation: one reply per tokenized prompt (read a row group at a time as requests go out)."""
    from eagle_assets.structure.segment import StructureCheck

    prompts = PromptsFile(run.layout.stage_dir("tokenized_prompts", run.key) / "prompts.parquet")
    pending = run.clear or not prompts.index.keys() <= read_done_ids(run.work)
    client = run.client() if pending else None
    t, spec = run.target, run.spec
    opens = prompts.opens_map(t.profile)
    monitor = run.monitor(opens, prompts.ids_map(arrays=True)) if pending else None
    # the client's evidence for an echo only the reply's shape betrays: QC's structure rules, this partition's
    # prompt_opens_think and policy (so the client refuses what QC would name prompt_echo, nothing else)
    shape = StructureCheck(t.profile, prompt_opens_think=opens, tool_call_in_reasoning=spec.tool_call_in_reasoning,
                           blank_ids=t.blank_ids if pending else frozenset())
    run.context.log.info(f"generating {len(prompts)} prompts of {run.key} against {run.urls or 'no server (all done)'}")
    stats = run_generation(prompts, run.work, client, run.sampling, t.vocab_size, progress=run.context.log.info,
                           flush_rows=FLUSH_ROWS, regenerate=run.clear, monitor=monitor, alarm=run.context.log.warning,
                           control_ids=t.control_ids, well_formed=shape)
    return _Outcome(stats, stats.requested - stats.not_sent, stats.succeeded + stats.skipped_done, monitor)


def _conversation_rows(run: _Run) -> _Outcome:
    """``all_turns``: every assistant turn of the conversations whose turn 1 ``tokenized_prompts`` accepted,
    regenerated on-policy; later turns are rendered (and may be refused) in the rollout."""
    from eagle_assets.generations.rollout import CONVERSATIONS_FILE, TURNS_FILE, RolloutSettings, run_conversations

    layout, key, spec, t = run.layout, run.key, run.spec, run.target
    accepted = set(pq.read_table(layout.stage_dir("tokenized_prompts", key) / "prompts.parquet",
                                 columns=["sample_id"]).column("sample_id").to_pylist())
    raw = pq.read_table(layout.stage_dir("raw_prompts", key) / "prompts.parquet",
                        columns=["sample_id", "messages", "tools"]).to_pylist()
    raw = [r for r in raw if r["sample_id"] in accepted]
    rollout = RolloutSettings(tokenizer=t.tokenizer, profile=t.profile,
                              tools={r["sample_id"]: json.loads(r["tools"]) if r["tools"] else None for r in raw},
                              enable_thinking=spec.enable_thinking, max_prompt_tokens=spec.max_prompt_tokens,
                              max_turns=spec.max_turns, tool_result_match=spec.tool_result_match,
                              tool_call_in_reasoning=spec.tool_call_in_reasoning, blank_ids=t.blank_ids,
                              vocab_size=t.vocab_size, control_ids=t.control_ids)
    run.context.log.info(f"regenerating every turn of {len(raw)} conversations of {key} "
                         f"(thinking {spec.enable_thinking}, at most {spec.max_turns} turns each)")
    stats = run_conversations([(r["sample_id"], json.loads(r["messages"])) for r in raw], run.work, run.client,
                              run.sampling, rollout, regenerate=run.clear, make_monitor=run.monitor,
                              progress=run.context.log.info, alarm=run.context.log.warning)
    out = layout.stage_dir("generations", key)
    thinking = Counter(pq.read_table(out / TURNS_FILE, columns=["thinking"]).column("thinking").to_pylist()) \
        if (out / TURNS_FILE).exists() else Counter()
    extra = {"turn_prompts_by_thinking": dg.MetadataValue.json(dict(thinking)),
             "turns_path": dg.MetadataValue.path(str(out / TURNS_FILE)),
             "conversations_path": dg.MetadataValue.path(str(out / CONVERSATIONS_FILE))}
    # one monitor per round: the figures of all rounds are in live_stats.json, read once the rows are settled
    return _Outcome(stats, stats.succeeded + stats.failed, stats.summary()["turn_rows"], stats.monitor, extra,
                    live_from_file=True)


def generations(context: dg.AssetExecutionContext, config: GenerationRunConfig,
                settings: dg.ResourceParam[PipelineSettings], target: dg.ResourceParam[TargetModel],
                sglang: dg.ResourceParam[SGLangServerResource]) -> dg.MaterializeResult:
    """Raw output_ids + finish_reason from SGLang's native /generate; append-only shards, failures recorded."""
    key = context.partition_key
    catalog = settings.catalog()
    with refusals_as_failures():  # a partition folder that is a symbolic link: refused, nothing deleted
        out = settings.layout().stage_dir("generations", key)
    # Shards of other sampling / render settings, tokenizer or weights are generated again, not resumed from.
    fingerprint = generation_fingerprint(catalog, key)
    changed = generation_inputs_changed(out, fingerprint)
    if changed:
        context.log.warning(f"{', '.join(changed)} changed since the shards of {key} were generated: generating "
                            "every prompt again instead of resuming (the stored rows stay the partition's until the "
                            "new generation has rows)")
    if config.regenerate:
        context.log.info(f"regenerate=True: every prompt of {key} is generated again; the new rows replace the "
                         "stored ones once there are some")
    busy = f"Another run is generating partition {key}; wait for it or cancel it."
    try:
        work = choose_workdir(out, fingerprint, config.regenerate or bool(changed), config.regenerate)
        if work.note:
            context.log.info(work.note)
        run = _Run(context, settings, target, sglang, work.path, work.clear)
        body = _conversation_rows if run.spec.prompt_policy == "all_turns" else _prompt_rows
        done = body(run)
    except PartitionBusyError as exc:
        raise dg.Failure(description=f"{exc}. {busy}", allow_retries=False) from exc
    except StorageRefused as exc:  # a symbolically linked folder or lock file: refused before anything was deleted
        raise dg.Failure(description=str(exc), allow_retries=False) from exc
    record_generation_inputs(work.path, fingerprint)
    stats = done.stats
    if stats.failed:
        context.log.warning(f"{stats.failed} requests failed after retries; see {work.path / FAILURES_FILE}")
    try:
        promoted = settle(out, work.path, requested=done.requested, succeeded=stats.succeeded)
    except (NothingGenerated, StorageRefused) as exc:  # promoting the staged rows: busy or linked folders too
        raise dg.Failure(description=str(exc), allow_retries=False) from exc
    if promoted:
        context.log.info(promoted)
    if stats.stopped_early:
        raise stopped_failure(key, stats, out, done.monitor)
    live = {}
    if done.live_from_file and run.monitors and (out / LIVE_STATS_FILE).exists():
        live = live_metadata(json.loads((out / LIVE_STATS_FILE).read_text()), out / LIVE_STATS_FILE)
    elif not done.live_from_file and done.monitor is not None:
        live = live_metadata(done.monitor.snapshot(), out / LIVE_STATS_FILE)
    return dg.MaterializeResult(
        data_version=dg.DataVersion(directory_content_version(out, ("shard-*.parquet",))),
        metadata={
            "dagster/row_count": done.rows,
            **{k: (dg.MetadataValue.json(v) if isinstance(v, dict) else v) for k, v in stats.summary().items()},
            **done.metadata,
            "max_new_tokens": run.spec.sampling.max_new_tokens,
            "servers": dg.MetadataValue.json(run.urls),
            # what this step did, for `eagle-assets run`'s summary: requests sent in this run, and whether any server
            # was asked at all (a partition with nothing pending asks none, so a dead URL goes unnoticed until then)
            "requests_sent": done.requested,
            "server_contacted": bool(run.urls),
            "path": dg.MetadataValue.path(str(out)),
            **live,
        })


def live_metadata(snapshot: dict, path: Path) -> dict:
    """Run metadata of the last live snapshot: level, the main figures (JSON) and the live_stats.json path."""
    keys = ("rows", "rows_this_run", "kept", "dropped", "completion_tokens", "reasoning_tokens", "answer_tokens",
            "share_under_short", "share_truncated", "share_dropped", "share_by_reason", "stopped")
    return {
        "live_level": snapshot["level"],
        "live_figures": dg.MetadataValue.json({k: snapshot[k] for k in keys}),
        "live_alarms": dg.MetadataValue.json([a["message"] for a in snapshot["alarms"]]),
        "live_stats_path": dg.MetadataValue.path(str(path)),
    }


def stopped_failure(key: str, stats, out: Path, monitor) -> dg.Failure:
    """The ``dg.Failure`` of a partition whose live monitor stopped it: which figure broke, what is kept, what to do."""
    description = (
        f"generation of partition {key} was stopped early by live quality monitoring: {monitor.stop.message()}. "
        f"The {stats.succeeded + stats.skipped_done} rows generated so far are kept in {out} and {stats.not_sent} "
        "prompts were not sent. Fix the server, chat template or sampling settings, then materialize again: it "
        "resumes from the kept rows (run config regenerate: true generates every prompt again instead, its rows "
        "replacing these once it has some, since these count in the partition's figures), or set "
        f"partitions.{key}.live.fail_fast: false in the catalog to generate every prompt anyway. Running figures: "
        f"{out / LIVE_STATS_FILE}")
    return dg.Failure(description=description, metadata=live_metadata(monitor.snapshot(), out / LIVE_STATS_FILE),
                      allow_retries=False)


def build_generation_assets(partitions_def: dg.PartitionsDefinition) -> list[dg.AssetsDefinition]:
    """``generations`` over ``partitions_def``; it holds the ``sglang`` concurrency pool while it runs."""
    return [dg.asset(partitions_def=partitions_def, group_name="generation", deps=["tokenized_prompts"], pool="sglang",
                     kinds={"parquet"})(generations)]
