"""Asset ``generations``: SGLang ``/generate`` replies for every tokenized prompt, resumable by sample id.

While it generates, a ``LiveQualityMonitor`` (``qc.live``) keeps the partition's running quality figures:
``live_stats.json`` beside the shards, a summary line in the run log at most every ``live.log_every_s`` seconds,
WARN lines for thresholds broken early, and, with ``live.fail_fast``, an early stop that fails the asset while
keeping every row generated.
"""



import dagster as dg

from eagle_assets.assets.regeneration import generation_workdir, settle_generation
from eagle_assets.assets.resources import PipelineSettings, TargetModel
from eagle_assets.assets.versions import (directory_content_version, generation_fingerprint,
                                          generation_inputs_changed, record_generation_inputs)
from eagle_assets.generations.run import FAILURES_FILE, LIVE_STATS_FILE, PartitionBusyError, run_generation
from eagle_assets.tokenized_prompts.prompts_file import PromptsFile
from eagle_assets.storage.shards import read_done_ids
from eagle_assets.assets.server_resource import SGLangServerResource
from eagle_assets.assets.live_reporting import live_metadata, stopped_failure


# rows per generations shard: ~1,000-token replies make shards of a few MB (a 1M-row partition: ~1,000 shards);
# the timer still flushes every flush_seconds, so a kill loses at most that much work
FLUSH_ROWS = 1024


class GenerationRunConfig(dg.Config):
    """Run config of ``generations``."""

    regenerate: bool = False  # drop this partition's existing shards and generate everything again


def build_generation_assets(partitions_def: dg.PartitionsDefinition) -> list[dg.AssetsDefinition]:
    """``generations`` over ``partitions_def``; it holds the ``sglang`` concurrency pool while it runs."""

    @dg.asset(
        partitions_def=partitions_def,
        group_name="generation",
        deps=["tokenized_prompts"],
        pool="sglang",
        kinds={"parquet"},
    )
    def generations(
        context: dg.AssetExecutionContext,
        config: GenerationRunConfig,
        settings: PipelineSettings,
        target: TargetModel,
        sglang: SGLangServerResource,
    ) -> dg.MaterializeResult:
        """Raw output_ids + finish_reason from SGLang's native /generate; append-only shards, failures recorded."""
        from eagle_assets.assets.qc import blank_token_ids
        from eagle_assets.qc.live import LiveQualityMonitor
        from eagle_assets.structure.segment import StructureCheck
        from eagle_assets.serving.protocol import SamplingParams
        from eagle_assets.target_model.profile import detect_profile, target_vocab_size
        from eagle_assets.target_model.render import control_token_ids
        from eagle_assets.target_model.tokenizer import load_tokenizer

        key = context.partition_key
        catalog = settings.catalog()
        spec = catalog.partition(key)
        layout = settings.layout()
        out = layout.stage_dir("generations", key)
        # Shards of other sampling / render settings, tokenizer or weights are generated again, not resumed from.
        fingerprint = generation_fingerprint(catalog, key)
        changed = generation_inputs_changed(out, fingerprint)
        regenerate = config.regenerate or bool(changed)
        if changed:
            context.log.warning(f"{', '.join(changed)} changed since the shards of {key} were generated: "
                                "generating every prompt again instead of resuming (the stored rows stay the "
                                "partition's until the new generation has rows)")
        if config.regenerate:
            context.log.info(f"regenerate=True: every prompt of {key} is generated again; the new rows replace the "
                             "stored ones once there are some")
        work, clear = generation_workdir(context, out, fingerprint, regenerate, config.regenerate)
        if spec.prompt_policy == "all_turns":  # every assistant turn regenerated on-policy (eagle_assets.generations.rollout)
            from eagle_assets.assets.conversations import conversation_generations

            return conversation_generations(context, settings, target, sglang, out, work, fingerprint, clear)
        # read lazily (tokenized_prompts.prompts_file): sample ids up front, prompt ids a row group at a time as requests go out
        prompts = PromptsFile(layout.stage_dir("tokenized_prompts", key) / "prompts.parquet")
        model_dir = target.resolve()
        tokenizer = load_tokenizer(model_dir)
        profile = detect_profile(tokenizer, catalog.target.profile or None)
        # the same vocab size and control ids as qc_shards: the client refuses what QC would drop
        vocab_size = target_vocab_size(model_dir, tokenizer)
        control = control_token_ids(tokenizer)
        s = spec.sampling
        sampling = SamplingParams(
            max_new_tokens=s.max_new_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            stop_token_ids=list(profile.stop_ids),
            skip_special_tokens=False,
        )
        # A finished partition needs no server: do not launch one just to send nothing.
        pending = clear or not prompts.index.keys() <= read_done_ids(work)
        client = None
        if pending:  # every server answers /health and /get_model_info before a request is sent
            client, infos = sglang.generate_client(str(model_dir), concurrency=catalog.server.concurrency,
                                                   timeout_s=catalog.server.timeout_s)
            for url, info in infos.items():
                context.log.info(f"{client.redact(url)} serves {info.get('model_path', '(model_path not given)')}")
        shown_urls = [client.redact(u) for u in client.urls] if client else []
        # The same segmentation and thresholds as qc_shards, applied as rows arrive; a finished partition has no
        # rows arriving, so it skips the (vocab-sized) blank-id scan.
        blank = blank_token_ids(tokenizer) if pending else frozenset()
        opens = prompts.opens_map(profile)
        monitor = LiveQualityMonitor(
            profile, spec.thresholds, spec.live, blank_ids=blank,
            tool_call_in_reasoning=spec.tool_call_in_reasoning, prompt_opens_think=opens,
            partition=key, prompt_ids=prompts.ids_map(arrays=True), vocab_size=vocab_size, control_ids=control,
        ) if pending else None
        # the client's evidence for an echo only the reply's shape betrays: QC's structure rules, this partition's
        # prompt_opens_think and policy (so the client refuses what QC would name prompt_echo, nothing else)
        shape = StructureCheck(profile, prompt_opens_think=opens, tool_call_in_reasoning=spec.tool_call_in_reasoning,
                               blank_ids=blank)
        context.log.info(f"generating {len(prompts)} prompts of {key} against {shown_urls or 'no server (all done)'}")
        try:
            stats = run_generation(
                prompts, work, client, sampling, vocab_size, progress=context.log.info, flush_rows=FLUSH_ROWS,
                regenerate=clear, monitor=monitor, alarm=context.log.warning, control_ids=control,
                well_formed=shape,
            )
        except PartitionBusyError as exc:
            raise dg.Failure(
                description=f"{exc}. Another run is generating partition {key}; wait for it or cancel it.",
                allow_retries=False,
            ) from exc
        record_generation_inputs(work, fingerprint)
        summary = stats.summary()
        if stats.failed:
            context.log.warning(f"{stats.failed} requests failed after retries; see {work / FAILURES_FILE}")
        settle_generation(context, out, work, requested=stats.requested - stats.not_sent, succeeded=stats.succeeded)
        if stats.stopped_early:
            raise stopped_failure(key, stats, out, monitor)
        live = live_metadata(monitor.snapshot(), out / LIVE_STATS_FILE) if monitor is not None else {}
        return dg.MaterializeResult(
            data_version=dg.DataVersion(directory_content_version(out, ("shard-*.parquet",))),
            metadata={
                "dagster/row_count": stats.succeeded + stats.skipped_done,
                **{k: (dg.MetadataValue.json(v) if isinstance(v, dict) else v) for k, v in summary.items()},
                "max_new_tokens": s.max_new_tokens,
                "servers": dg.MetadataValue.json(shown_urls),
                "path": dg.MetadataValue.path(str(out)),
                **live,
            }
        )

    return [generations]
