"""Asset ``generations``: SGLang ``/generate`` replies for every tokenized prompt, resumable by sample id."""


import json
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq

from eagle_assets.assets.resources import PipelineSettings, TargetModel
from eagle_assets.generation import FAILURES_FILE, PartitionBusyError, run_generation
from eagle_assets.storage import read_done_ids
from eagle_assets.serving.resource import SGLangServerResource


class GenerationRunConfig(dg.Config):
    """Run config of ``generations``."""

    regenerate: bool = False  # drop this partition's existing shards and generate everything again


def _target_vocab_size(model_dir: Path) -> int | None:
    cfg = Path(model_dir) / "config.json"
    if not cfg.exists():
        return None
    data = json.loads(cfg.read_text())
    return data.get("vocab_size") or data.get("text_config", {}).get("vocab_size")


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
        from eagle_assets.serving.client import GenerateClient
        from eagle_assets.serving.protocol import SamplingParams
        from eagle_assets.target.profile import detect_profile
        from eagle_assets.target.tokenizer import load_tokenizer

        key = context.partition_key
        catalog = settings.catalog()
        spec = catalog.partitions[key]
        layout = settings.layout()
        out = layout.stage_dir("generations", key)
        if config.regenerate:
            context.log.info(f"regenerate=True: existing shards of {key} are removed and generated again")
        table = pq.read_table(layout.stage_dir("tokenized_prompts", key) / "prompts.parquet",
                              columns=["sample_id", "prompt_ids"])
        prompts = list(zip(table.column("sample_id").to_pylist(), table.column("prompt_ids").to_pylist()))
        model_dir = target.resolve()
        profile = detect_profile(load_tokenizer(model_dir), catalog.target.profile or None)
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
        pending = config.regenerate or not {sid for sid, _ in prompts} <= read_done_ids(out)
        urls = sglang.base_urls(str(model_dir)) if pending else []
        client = GenerateClient(
            urls,
            concurrency_per_server=catalog.server.concurrency,
            timeout_s=catalog.server.timeout_s,
            api_key_env=sglang.api_key_env,
        ) if pending else None
        shown_urls = [client.redact(u) for u in urls] if client else []
        context.log.info(f"generating {len(prompts)} prompts of {key} against {shown_urls or 'no server (all done)'}")
        try:
            stats = run_generation(
                prompts, out, client, sampling, _target_vocab_size(model_dir), progress=context.log.info,
                regenerate=config.regenerate,
            )
        except PartitionBusyError as exc:
            raise dg.Failure(
                description=f"{exc}. Another run is generating partition {key}; wait for it or cancel it.",
                allow_retries=False,
            ) from exc
        summary = stats.summary()
        if stats.failed:
            context.log.warning(f"{stats.failed} requests failed after retries; see {out / FAILURES_FILE}")
        return dg.MaterializeResult(
            metadata={
                "dagster/row_count": stats.succeeded + stats.skipped_done,
                **{k: (dg.MetadataValue.json(v) if isinstance(v, dict) else v) for k, v in summary.items()},
                "max_new_tokens": s.max_new_tokens,
                "servers": dg.MetadataValue.json(shown_urls),
                "path": dg.MetadataValue.path(str(out)),
            }
        )

    return [generations]
