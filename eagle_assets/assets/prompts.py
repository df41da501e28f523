"""Assets ``raw_prompts`` and ``tokenized_prompts``."""


import hashlib
import json
from collections import Counter

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq

from eagle_assets.assets.resources import PipelineSettings, TargetModel
from eagle_assets.assets.versions import directory_content_version
from eagle_assets.formats.rows import RAW_SCHEMA, REJECT_SCHEMA, collect_prompt_rows
from eagle_assets.storage import write_parquet_atomic

# RAW_SCHEMA and REJECT_SCHEMA (raw_prompts' prompt and reject rows) live in eagle_assets.formats.rows.
TOKENIZED_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("n_prompt_tokens", pa.int32()),
        ("template_hash", pa.string()),
        ("prompt_opens_think", pa.bool_()),
        ("render_flags", pa.string()),
    ]
)


def _sample_order(seed: int, sid: str) -> str:
    # A keyed hash gives a deterministic, seed-dependent sample that is stable when records are added.
    return hashlib.sha256(f"{seed}:{sid}".encode()).hexdigest()


def _reason_table(counts: Counter) -> dg.MetadataValue:
    rows = "\n".join(f"| {k} | {v} |" for k, v in counts.most_common())
    return dg.MetadataValue.md("| reason | rows |\n|---|---|\n" + (rows or "| (none) | 0 |"))


def build_prompt_assets(partitions_def: dg.PartitionsDefinition) -> list[dg.AssetsDefinition]:
    """``raw_prompts`` and ``tokenized_prompts`` over ``partitions_def`` (one partition per catalog dataset)."""

    @dg.asset(
        partitions_def=partitions_def,
        group_name="prompts",
        kinds={"parquet"},
        check_specs=[dg.AssetCheckSpec(
            "prompts_available", asset="raw_prompts", blocking=False,
            description="the partition has prompts to generate from (an empty partition flows on with zero rows)")],
    )
    def raw_prompts(context: dg.AssetExecutionContext, settings: PipelineSettings):
        """Normalized conversations of one dataset partition; every malformed record goes to rejects.parquet with a
        reason (one bad record, whatever it holds, costs only itself); an empty source gives zero rows."""
        key = context.partition_key
        spec = settings.catalog().partitions[key]
        out = settings.layout().stage_dir("raw_prompts", key)
        sources = spec.resolved_sources()
        for path, fmt in sources:
            context.log.info(f"reading {path} as {fmt}")
        kept, rejects = collect_prompt_rows(key, sources, spec.prompt_policy)
        rows = sorted(kept.values(), key=lambda r: _sample_order(spec.seed, r["sample_id"]))
        if spec.limit is not None:
            rows = rows[: spec.limit]
        rows.sort(key=lambda r: (r["source_file"], r["source_row"]))
        write_parquet_atomic(pa.Table.from_pylist(rows, schema=RAW_SCHEMA), out / "prompts.parquet")
        write_parquet_atomic(pa.Table.from_pylist(rejects, schema=REJECT_SCHEMA), out / "rejects.parquet")
        reasons = Counter(r["reason"] for r in rejects)
        if rejects:
            context.log.warning(f"{len(rejects)} records rejected ({dict(reasons.most_common())}); see {out / 'rejects.parquet'}")
        if rows:
            availability = f"{len(rows)} prompts ({len(kept)} available, {len(rejects)} records rejected)"
        elif rejects:
            availability = (f"partition {key} is empty: all {len(rejects)} records of its sources were rejected "
                            f"({dict(reasons.most_common(5))}); see {out / 'rejects.parquet'} for each reason")
        else:
            availability = f"partition {key} is empty: its sources hold no records ({[str(p) for p, _ in sources]})"
        if not rows:
            context.log.warning(availability + "; zero rows flow on to tokenized_prompts, generations and qc_shards")
        yield dg.MaterializeResult(
            data_version=dg.DataVersion(directory_content_version(out, ("prompts.parquet", "rejects.parquet"))),
            metadata={
                "dagster/row_count": len(rows),
                "available_records": len(kept),
                "rejected": len(rejects),
                "empty": not rows,
                "reject_reasons": _reason_table(reasons),
                "sources": dg.MetadataValue.json([str(p) for p, _ in sources]),
                "path": dg.MetadataValue.path(str(out)),
            }
        )
        yield dg.AssetCheckResult(
            check_name="prompts_available", passed=bool(rows), severity=dg.AssetCheckSeverity.WARN,
            description=availability, metadata={"prompts": len(rows), "rejected": len(rejects)},
        )


    @dg.asset(partitions_def=partitions_def, group_name="prompts", deps=[raw_prompts], kinds={"parquet"})
    def tokenized_prompts(
        context: dg.AssetExecutionContext, settings: PipelineSettings, target: TargetModel
    ) -> dg.MaterializeResult:
        """Prompt token ids from the target's chat template (add_generation_prompt=True), rendered once, never re-tokenized."""
        from eagle_assets.target_model.profile import detect_profile
        from eagle_assets.target_model.render import RenderError, render_prompt
        from eagle_assets.target_model.tokenizer import load_tokenizer

        key = context.partition_key
        catalog = settings.catalog()
        spec = catalog.partitions[key]
        layout = settings.layout()
        raw = pq.read_table(layout.stage_dir("raw_prompts", key) / "prompts.parquet").to_pylist()
        tokenizer = load_tokenizer(target.resolve())
        profile = detect_profile(tokenizer, catalog.target.profile or None)
        rows, rejects = [], []
        for r in raw:
            messages = json.loads(r["messages"])
            tools = json.loads(r["tools"]) if r["tools"] else None
            try:
                rendered = render_prompt(tokenizer, messages, tools, enable_thinking=spec.enable_thinking,
                                         max_prompt_tokens=spec.max_prompt_tokens, profile=profile)
            except RenderError as exc:
                rejects.append({"source_file": r["source_file"], "source_row": r["source_row"],
                                "sample_id": r["sample_id"], "reason": exc.reason, "detail": str(exc)[:1000]})
                continue
            ids = list(rendered.prompt_ids)
            rows.append({
                "sample_id": r["sample_id"],
                "prompt_ids": ids,
                "n_prompt_tokens": len(ids),
                "template_hash": rendered.template_hash,
                # the renderer's rule (render.opens_think_block), never a second one: QC, live quality and the
                # client read this column
                "prompt_opens_think": rendered.opens_think,
                "render_flags": json.dumps(rendered.flags, sort_keys=True, default=str),
            })
        out = layout.stage_dir("tokenized_prompts", key)
        write_parquet_atomic(pa.Table.from_pylist(rows, schema=TOKENIZED_SCHEMA), out / "prompts.parquet")
        write_parquet_atomic(pa.Table.from_pylist(rejects, schema=REJECT_SCHEMA), out / "rejects.parquet")
        lengths = sorted(r["n_prompt_tokens"] for r in rows)
        return dg.MaterializeResult(
            data_version=dg.DataVersion(directory_content_version(out, ("prompts.parquet", "rejects.parquet"))),
            metadata={
                "dagster/row_count": len(rows),
                "rejected": len(rejects),
                "reject_reasons": _reason_table(Counter(r["reason"] for r in rejects)),
                "prompt_tokens_median": lengths[len(lengths) // 2] if lengths else 0,
                "prompt_tokens_max": lengths[-1] if lengths else 0,
                "share_opens_think": (sum(r["prompt_opens_think"] for r in rows) / len(rows)) if rows else 0.0,
                "template_hash": rows[0]["template_hash"] if rows else "",
                "family_profile": profile.name,
                "path": dg.MetadataValue.path(str(out)),
            }
        )

    return [raw_prompts, tokenized_prompts]
