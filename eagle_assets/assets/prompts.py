"""Assets ``raw_prompts`` and ``tokenized_prompts``."""


from collections import Counter
from dataclasses import dataclass

import dagster as dg

from eagle_assets.assets.dataset_runs import materialization_tags
from eagle_assets.assets.inputs import AFTER_OBSERVATIONS
from eagle_assets.assets.locking import stage_writer
from eagle_assets.assets.resources import PipelineSettings, TargetModel
from eagle_assets.lineage.versions import directory_content_version
from eagle_assets.raw_prompts.dataset_parse import dataset_chunk_rows
from eagle_assets.raw_prompts.rows import RAW_SCHEMA, REJECT_SCHEMA  # noqa: F401
from eagle_assets.raw_prompts.write import write_raw_prompts
from eagle_assets.tokenized_prompts.write import TOKENIZED_SCHEMA, tokenize_partition  # noqa: F401

# The storage stage that holds each chunked dataset's one parse, shared by its chunks (raw_prompts.write).
PARSE_STAGE = "raw_prompts_by_dataset"

# RAW_SCHEMA and REJECT_SCHEMA (raw_prompts' prompt and reject rows) live in eagle_assets.raw_prompts.rows.
# TOKENIZED_SCHEMA (tokenized_prompts' rows) lives in eagle_assets.tokenized_prompts.write, which writes them.


def _first_mode(spec):
    # all_turns renders turn 1 here with its first thinking mode; generations.rollout renders every turn and mode
    from eagle_assets.tokenized_prompts.walk import thinking_modes

    return thinking_modes(spec.enable_thinking)[0][1]


def _shown_format(path, fmt: str) -> str:
    """``fmt``, or for ``auto`` the layout detection picks (``formats.detect_format``, which the parse uses too)."""
    if fmt != "auto":
        return fmt
    from eagle_assets.formats import FormatError, detect_format

    try:
        return f"auto (detected: {detect_format(path)})"
    except (FormatError, OSError, ValueError) as exc:
        return f"auto (no layout detected: {exc})"


def _reason_table(counts: Counter) -> dg.MetadataValue:
    rows = "\n".join(f"| {k} | {v} |" for k, v in counts.most_common())
    return dg.MetadataValue.md("| reason | rows |\n|---|---|\n" + (rows or "| (none) | 0 |"))


@dataclass(frozen=True)
class _PartitionDone:
    """What ``raw_prompts`` wrote for one partition: its rows and rejected records, its data version (sha256 hex
    over ``prompts.parquet`` and ``rejects.parquet``), its materialization metadata, and the ``prompts_available``
    check's description."""

    rows: int
    rejected: int
    data_version: str
    metadata: dict
    availability: str


def _raw_prompts_partition(context: dg.AssetExecutionContext, settings: PipelineSettings, key: str) -> _PartitionDone:
    """``raw_prompts`` of partition ``key``: its files written, what its materialization and check record; written
    while holding the partition folder's lock (``assets.locking.stage_writer``).

    Raises:
        dg.Failure: another run writes the partition, or its folder (or the lock file) is a symbolic link.
    """
    with stage_writer(settings.layout(), "raw_prompts", key):  # the whole write and its data version
        return _write_raw_partition(context, settings, key)


def _write_raw_partition(context: dg.AssetExecutionContext, settings: PipelineSettings, key: str) -> _PartitionDone:
    spec = settings.catalog().partition(key)
    out = settings.layout().stage_dir("raw_prompts", key)
    sources = spec.resolved_sources()
    chunk = (spec.chunk, spec.chunks) if spec.chunk is not None else None
    if chunk is None:  # a chunk logs the sources only when its run parses them (below)
        for path, fmt in sources:
            context.log.info(f"reading {path} as {_shown_format(path, fmt)}")
    # one streaming pass (raw_prompts.write): compact duplicate ids, a bounded sample selection, row groups
    # written as they come, so memory does not grow with the partition
    # a chunk: the dataset's sources are parsed once, by the first run of its chunks to need them, into a
    # directory its chunks share (<catalog>/raw_prompts_by_dataset/<dataset>/); each chunk reads its own rows
    parse_dir = settings.layout().stage_dir(PARSE_STAGE, spec.dataset) if chunk is not None else None
    if chunk is None:
        result = write_raw_prompts(spec.dataset, sources, spec.prompt_policy, out, seed=spec.seed,
                                   limit=spec.limit)
    else:
        result = dataset_chunk_rows(spec.dataset, sources, spec.prompt_policy, out, parse_dir, chunk,
                                    seed=spec.seed, limit=spec.limit)
    rows, available, rejected, reasons = result.rows, result.available, result.rejected, result.reasons
    if rejected:
        context.log.warning(
            f"{rejected} records rejected ({dict(reasons.most_common())}); see {out / 'rejects.parquet'}"
        )
    if chunk is not None and result.parsed:
        # the other chunks read their rows from this parse; their materializations say so in metadata
        # (``parsed_sources``, ``dataset_parse``) instead of a log event per chunk run
        context.log.info(f"chunk {spec.chunk} of {spec.chunks} of dataset {spec.dataset}: {rows} of its rows"
                         + ("" if spec.chunk == 0 else "; its rejects are recorded by chunk 0")
                         + f"; this run parsed the dataset's sources "
                           f"({', '.join(f'{path} as {fmt}' for path, fmt in sources)}) for all its chunks "
                           f"into {parse_dir}")
    if rows:
        availability = f"{rows} prompts ({available} available, {rejected} records rejected)"
    elif chunk is not None and available:
        availability = (f"chunk {key} is empty: none of the rows of dataset {spec.dataset} ({available} "
                        f"available{f', a sample of {spec.limit}' if spec.limit else ''}) falls in chunk "
                        f"{spec.chunk} of {spec.chunks}; give the dataset fewer chunks")
    elif rejected:
        availability = (f"partition {key} is empty: all {rejected} records of its sources were rejected "
                        f"({dict(reasons.most_common(5))}); see {out / 'rejects.parquet'} for each reason")
    else:
        availability = f"partition {key} is empty: its sources hold no records ({[str(p) for p, _ in sources]})"
    if not rows:
        context.log.warning(availability + "; zero rows flow on to tokenized_prompts, generations and qc_shards")
    return _PartitionDone(
        rows=rows, rejected=rejected,
        data_version=directory_content_version(out, ("prompts.parquet", "rejects.parquet")),
        metadata={
            "dagster/row_count": rows,
            "available_records": available,
            "rejected": rejected,
            # what `eagle-assets run` prints, counts that add up: records read = usable + rejected (a chunk other
            # than c00 records no rejects, so it does not know the records read), the sample cut by `limit`
            **({"records_read": available + rejected} if chunk is None or spec.chunk == 0 else {}),
            **({"sample_limit": spec.limit} if spec.limit is not None else {}),
            "reject_reason_counts": dg.MetadataValue.json(dict(reasons.most_common())),
            "empty": not rows,
            "reject_reasons": _reason_table(reasons),
            "sources": dg.MetadataValue.json([str(p) for p, _ in sources]),
            "path": dg.MetadataValue.path(str(out)),
            **({"parsed_sources": result.parsed, "dataset_parse": dg.MetadataValue.path(str(parse_dir))}
               if chunk is not None else {}),
        },
        availability=availability,
    )


def build_prompt_assets(partitions_def: dg.PartitionsDefinition) -> list[dg.AssetsDefinition]:
    """``raw_prompts`` and ``tokenized_prompts`` over ``partitions_def`` (one partition per catalog dataset)."""

    @dg.asset(
        partitions_def=partitions_def,
        group_name="prompts",
        kinds={"parquet"},
        op_tags=AFTER_OBSERVATIONS,
        # a run over a range of keys (assets.dataset_runs) reports each key's materialization itself, so the output
        # is not required; a run of one key yields it as every run did before
        output_required=False,
        check_specs=[dg.AssetCheckSpec(
            "prompts_available", asset="raw_prompts", blocking=False,
            description="the partition has prompts to generate from (an empty partition flows on with zero rows)")],
    )
    def raw_prompts(context: dg.AssetExecutionContext, settings: dg.ResourceParam[PipelineSettings]):
        """Normalized conversations of one dataset partition; every malformed record goes to rejects.parquet with a
        reason (one bad record, whatever it holds, costs only itself); an empty source gives zero rows. A chunk of a
        dataset keeps the dataset's rows that fall in it (``raw_prompts.write``: its rejects are all in chunk 0); the
        dataset's sources are parsed once for all its chunks (``raw_prompts.dataset_parse.dataset_chunk_rows``).
        A run over a range of chunk keys (``eagle-assets run`` on a chunked dataset, ``assets.dataset_runs``)
        writes every chunk in one step and records one materialization per chunk with its own data version."""
        keys = context.partition_keys
        if len(keys) == 1:
            done = _raw_prompts_partition(context, settings, keys[0])
            yield dg.MaterializeResult(data_version=dg.DataVersion(done.data_version), metadata=done.metadata)
            yield dg.AssetCheckResult(
                check_name="prompts_available", passed=bool(done.rows), severity=dg.AssetCheckSeverity.WARN,
                description=done.availability, metadata={"prompts": done.rows, "rejected": done.rejected},
            )
            return
        # Dagster gives every partition of a ranged run's output one data version (dagster-io/dagster#18649), so
        # each chunk's materialization is reported here, with the tags the output would have had for that chunk
        asset_key = dg.AssetKey("raw_prompts")
        empty, rows, rejected = [], 0, 0
        for key in keys:
            done = _raw_prompts_partition(context, settings, key)
            yield dg.AssetMaterialization(
                asset_key=asset_key, partition=key, metadata=done.metadata,
                tags=materialization_tags(context, asset_key, key, done.data_version))
            rows, rejected = rows + done.rows, rejected + done.rejected
            if not done.rows:
                empty.append(done.availability)
        yield dg.AssetCheckResult(
            check_name="prompts_available", passed=not empty, severity=dg.AssetCheckSeverity.WARN,
            description=(f"{len(keys)} partitions ({keys[0]} .. {keys[-1]}): {rows} prompts, {rejected} records "
                         f"rejected" + (f"; {len(empty)} empty: " + " | ".join(empty) if empty else "")),
            metadata={"prompts": rows, "rejected": rejected, "partitions": len(keys), "empty_partitions": len(empty)},
        )

    @dg.asset(partitions_def=partitions_def, group_name="prompts", deps=[raw_prompts], kinds={"parquet"})
    def tokenized_prompts(
        context: dg.AssetExecutionContext, settings: dg.ResourceParam[PipelineSettings],
        target: dg.ResourceParam[TargetModel],
    ) -> dg.MaterializeResult:
        """Prompt token ids from the target's chat template (add_generation_prompt=True), rendered once, never
        re-tokenized."""
        key = context.partition_key
        catalog = settings.catalog()
        spec = catalog.partition(key)
        layout = settings.layout()
        setup = target.setup(catalog.target.profile)
        # one writer of the partition's folder at a time, for the whole write and its data version
        with stage_writer(layout, "tokenized_prompts", key) as out:
            # record batches in, one row group per batch out (tokenized_prompts.write): memory does not grow with
            # the partition
            result = tokenize_partition(layout.stage_dir("raw_prompts", key) / "prompts.parquet", out,
                                        setup.tokenizer, setup.profile, enable_thinking=_first_mode(spec),
                                        max_prompt_tokens=spec.max_prompt_tokens,
                                        first_turn=spec.prompt_policy == "all_turns")
            version = directory_content_version(out, ("prompts.parquet", "rejects.parquet"))
        return dg.MaterializeResult(
            data_version=dg.DataVersion(version),
            metadata={
                "dagster/row_count": result.rows,
                "rejected": result.rejected,
                "reject_reasons": _reason_table(result.reasons),
                "reject_reason_counts": dg.MetadataValue.json(dict(result.reasons.most_common())),
                "prompt_tokens_median": result.median_tokens,
                "prompt_tokens_max": result.max_tokens,
                "share_opens_think": result.opens_think / result.rows if result.rows else 0.0,
                "template_hash": result.template_hash,
                "render_batches": result.batches,
                "family_profile": setup.profile.name,
                "path": dg.MetadataValue.path(str(out)),
            }
        )

    return [raw_prompts, tokenized_prompts]
