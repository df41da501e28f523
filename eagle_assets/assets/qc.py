"""Asset ``qc_shards`` with its blocking checks ``token_structure`` and ``response_length``; asset ``length_report``;
for datasets split into chunks, asset ``dataset_qc`` with the same checks over all of a dataset's chunks.

Why ``dataset_qc`` is an asset of its own partitions (one per chunked dataset) fed by ``qc_shards`` through a
``StaticPartitionMapping`` (chunk key -> dataset key): a Dagster asset job has one partitions definition, so the
dataset-level step cannot run in the chunk's ``partition_job`` run (Dagster 1.13 refuses the job: "Failed to resolve
asset job"); and a check of the unpartitioned ``length_report`` would be one result for every dataset at once. As its
own partition, each dataset gets its own check results in the UI, its ``eager`` automation condition requests it
once every chunk is materialized and none is in a run (``~any_deps_missing``, ``~any_deps_in_progress``), and
``dataset_job`` (or ``eagle-assets run``) runs it by hand. Datasets that are not chunked have no ``dataset_qc``
partition: their one ``qc_shards`` partition's checks already are the dataset's.
"""


import warnings
from collections import Counter
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq

from eagle_assets.assets.resources import PipelineSettings, TargetModel
from eagle_assets.assets.versions import directory_content_version
from eagle_assets.qc.dataset_checks import dataset_checks
from eagle_assets.qc.lengths import format_table, length_report as compute_length_report
from eagle_assets.qc.qc_pass import QC_SCHEMA, QC_SKIP_REASONS, ROWS_SCHEMA, qc_partition  # noqa: F401
from eagle_assets.structure.segment import DROP_REASONS, FLAGS
from eagle_assets.qc.thresholds import Outcome, evaluate_token_structure, reason_levels
from eagle_assets.storage.shards import shard_paths, write_json_atomic, write_parquet_atomic

QC_STATUS_FILE = "qc_status.json"
ROWS_FILE = "rows.parquet"


def dataset_rows_files(layout, catalog, dataset: str) -> list[Path]:
    """``rows.parquet`` of every partition of ``dataset`` (its chunks in order, or the dataset's one partition)."""
    return [Path(layout.base) / "qc_shards" / k / ROWS_FILE for k in catalog.dataset_partition_keys(dataset)]


def dataset_shard_paths(settings: PipelineSettings, dataset: str) -> list[Path]:
    """The training shards of ``dataset``: every ``shard-NNNNN.parquet`` of each of its partitions, chunk by chunk.
    Raises ``FileNotFoundError`` naming the first partition without shards."""
    layout = settings.layout()
    paths = []
    for key in settings.catalog().dataset_partition_keys(dataset):
        found = shard_paths(layout.base / "qc_shards" / key)
        if not found:
            raise FileNotFoundError(f"no QC shards in {layout.base / 'qc_shards' / key}: materialize qc_shards for "
                                    f"partition {key} first")
        paths += found
    return paths


def blank_token_ids(tokenizer) -> frozenset[int]:
    """Ids whose decoded text is only whitespace (an answer made of them is empty)."""
    blank = set()
    for tok, idx in tokenizer.get_vocab().items():
        text = tokenizer.convert_tokens_to_string([tok])
        if text.strip() == "" and idx not in tokenizer.all_special_ids:
            blank.add(idx)
    return frozenset(blank)


def _severity(outcome: Outcome) -> dg.AssetCheckSeverity:
    return dg.AssetCheckSeverity.ERROR if outcome.level == "ERROR" else dg.AssetCheckSeverity.WARN


def _partition_check(name: str, asset: str, partitions_def: dg.PartitionsDefinition,
                     description: str) -> dg.AssetCheckSpec:
    """A blocking check whose evaluations carry their partition key, so the UI shows each partition's result on
    that partition (``AssetCheckSpec.partitions_def``, a preview feature of the pinned Dagster 1.13)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dg.PreviewWarning)
        return dg.AssetCheckSpec(name, asset=asset, blocking=True, partitions_def=partitions_def,
                                 description=description)


def _check_result(name: str, outcome: Outcome, **kwargs) -> dg.AssetCheckResult:
    """A check's result as the UI should show it: passed only at level OK; a WARN finding is a failed check of
    WARN severity (Dagster's "warning", which blocks nothing: only an ERROR-severity failure of a blocking check
    stops downstream steps, ``dagster/_core/execution/plan/execute_step.py``)."""
    return dg.AssetCheckResult(check_name=name, passed=outcome.level == "OK", severity=_severity(outcome),
                               description=outcome.description(), **kwargs)


def _check_metadata(outcome: Outcome, thresholds: dict, extra: dict | None = None) -> dict:
    lines = ["| figure | value | threshold (warn / error) |", "|---|---|---|"]
    for name, value in outcome.figures.items():
        stem = name.replace("share_", "")
        warn = thresholds.get(f"max_share_{stem}_warn")
        err = thresholds.get(f"max_share_{stem}_error")
        if stem in (thresholds.get("max_share_by_reason") or {}):
            warn, err = reason_levels(thresholds, stem)
        if name == "median_tokens":
            warn, err = thresholds.get("min_median_tokens"), None
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        lines.append(f"| {name} | {shown} | {warn if warn is not None else '-'} / {err if err is not None else '-'} |")
    meta = {k: float(v) for k, v in outcome.figures.items()}
    meta["figures"] = dg.MetadataValue.md("\n".join(lines))
    meta["level"] = outcome.level
    if extra:
        meta.update(extra)
    return meta


def build_qc_assets(partitions_def: dg.PartitionsDefinition) -> list[dg.AssetsDefinition]:
    """``qc_shards`` (partitioned, with blocking checks) and ``length_report`` (all partitions)."""

    @dg.asset(
        partitions_def=partitions_def,
        group_name="quality",
        deps=["generations", "tokenized_prompts"],
        kinds={"parquet"},
        check_specs=[
            _partition_check("token_structure", "qc_shards", partitions_def,
                             "share of generated rows dropped for broken structure, per reason"),
            _partition_check("response_length", "qc_shards", partitions_def,
                             "median, p10, share short and share truncated vs catalog thresholds"),
        ],
    )
    def qc_shards(context: dg.AssetExecutionContext, settings: PipelineSettings, target: TargetModel):
        """Training rows input_ids = prompt_ids + output_ids with loss_mask; broken rows dropped with a named reason."""
        from eagle_assets.tokenized_prompts.prompts_file import PromptsFile
        from eagle_assets.target_model.profile import detect_profile, target_vocab_size
        from eagle_assets.target_model.render import control_token_ids, opens_think_block
        from eagle_assets.target_model.tokenizer import load_tokenizer

        key = context.partition_key
        catalog = settings.catalog()
        spec = catalog.partition(key)
        layout = settings.layout()
        thresholds = spec.thresholds.model_dump() if hasattr(spec.thresholds, "model_dump") else dict(spec.thresholds)
        model_dir = target.resolve()
        tokenizer = load_tokenizer(model_dir)
        profile = detect_profile(tokenizer, catalog.target.profile or None)
        blank = blank_token_ids(tokenizer)
        # QC holds every row to the client's rules itself: shards may come from any producer
        vocab_size = target_vocab_size(model_dir, tokenizer)
        control = control_token_ids(tokenizer)
        # shard by shard and batch by batch (qc.qc_pass): shards of other producers may differ in columns and
        # types (int64 ids, no matched_stop); each row is held to the rules on its own
        # the prompts a row group at a time (tokenized_prompts.prompts_file): their ids never all in memory
        prompts = PromptsFile(layout.stage_dir("tokenized_prompts", key) / "prompts.parquet")
        if spec.prompt_policy == "all_turns":  # one prompt per turn, rendered by generations.rollout
            from eagle_assets.generations.rollout import turn_prompts

            prompts = turn_prompts(layout.stage_dir("generations", key))
        max_new = spec.sampling.max_new_tokens
        out = layout.stage_dir("qc_shards", key)
        # the rows' partition column names the dataset: the length report and the training mix group by it, so a
        # chunked dataset's rows read as the dataset's
        result = qc_partition(
            shard_paths(layout.stage_dir("generations", key)), prompts, out, profile, partition=spec.dataset,
            blank_ids=blank, vocab_size=vocab_size, control_ids=control,
            tool_call_in_reasoning=spec.tool_call_in_reasoning, short_tokens=thresholds.get("short_tokens", 300),
            max_new_tokens=max_new,
        )
        del prompts
        reasons: Counter = result.reasons
        flags_count: Counter = result.flags
        drop_reasons = result.drop_reasons()
        structure = evaluate_token_structure(drop_reasons, thresholds)
        length = result.response_length(thresholds)  # = evaluate_response_length, from counts (no list per row)
        write_json_atomic(
            {"partition": key, "token_structure": structure.level, "response_length": length.level,
             "passed": structure.passed and length.passed, "kept": result.kept, "rows": result.rows,
             "shards": len(result.shards), "dataset": spec.dataset,
             **({"chunk": [spec.chunk, spec.chunks]} if spec.chunk is not None else {})},
            out / QC_STATUS_FILE,
        )
        from eagle_assets.figures.plots import length_histogram_png, png_markdown  # matplotlib: ~0.7 s to import

        png = length_histogram_png(
            {"reasoning": result.reasoning_tokens, "answer": result.answer_tokens, "total": result.completion_tokens},
            f"{key}: response lengths", short_tokens=thresholds.get("short_tokens"), cap=max_new,
        )
        (out / "lengths.png").write_bytes(png)
        # every rule is listed, zeros included: the table shows what was checked, not only what broke
        drop_md = "| reason | rows |\n|---|---|\n" + "\n".join(
            f"| {r} | {reasons.get(r, 0)} |" for r in (*DROP_REASONS, *QC_SKIP_REASONS))
        all_reasons = {r: reasons.get(r, 0) for r in (*DROP_REASONS, *QC_SKIP_REASONS)}
        all_flags = {f: flags_count.get(f, 0) for f in FLAGS}
        yield dg.MaterializeResult(
            data_version=dg.DataVersion(directory_content_version(out, ("*.parquet", QC_STATUS_FILE))),
            metadata={
                "dagster/row_count": result.kept,
                "generated": result.rows,
                "kept": result.kept,
                "dropped": sum(reasons.values()),
                "short_but_well_formed": result.short,
                "shards": len(result.shards),
                "drop_reasons": dg.MetadataValue.md(drop_md),
                "drop_reason_counts": dg.MetadataValue.json(all_reasons),
                "flags": dg.MetadataValue.json(all_flags),
                "vocab_size": vocab_size,
                "family_profile": dg.MetadataValue.json(profile.to_dict()),
                "median_completion_tokens": length.figures.get("median_tokens", 0.0),
                "share_truncated": length.figures.get("share_truncated", 0.0),
                "length_histogram": dg.MetadataValue.md(png_markdown(png, f"{key} lengths")),
                "path": dg.MetadataValue.path(str(out)),
                **_by_turn_metadata(spec, out, layout.stage_dir("generations", key)),
            }
        )
        yield _check_result("token_structure", structure, metadata=_check_metadata(structure, thresholds, {
            "drop_reasons": dg.MetadataValue.json(all_reasons)}))
        yield _check_result("response_length", length, metadata=_check_metadata(length, thresholds, {
            "histogram": dg.MetadataValue.md(png_markdown(png, f"{key} lengths"))}))

    @dg.asset(group_name="quality", deps=[qc_shards], kinds={"duckdb"})
    def length_report(context: dg.AssetExecutionContext, settings: PipelineSettings) -> dg.MaterializeResult:
        """DuckDB length table of every dataset (total, reasoning, answer tokens) with PNG histograms; a chunked
        dataset's line is over the rows of all its chunks materialized so far (the rows' partition column names the
        dataset)."""
        catalog = settings.catalog()
        layout = settings.layout()
        files = [layout.stage_dir("qc_shards", k) / ROWS_FILE for k in catalog.partition_keys]
        present = [f for f in files if f.exists()]
        short = min((p.thresholds.short_tokens for p in catalog.partitions.values()), default=300)  # the plot's line
        rows = compute_length_report(present, short_tokens=catalog.short_tokens())
        out = layout.stage_dir("length_report")
        table_md = format_table(rows)
        (out / "report.md").write_text(table_md + "\n")
        write_parquet_atomic(pa.Table.from_pylist([r.__dict__ for r in rows]), out / "report.parquet")
        series = {}
        for f in present:
            t = pq.read_table(f, columns=["partition", "completion_tokens"])
            if t.num_rows:
                series.setdefault(t.column("partition")[0].as_py(), []).extend(t.column("completion_tokens").to_pylist())
        from eagle_assets.figures.plots import length_histogram_png, png_markdown

        png = length_histogram_png(series, "completion tokens by partition", short_tokens=short)
        (out / "lengths.png").write_bytes(png)
        by_turn = _turn_length_report(catalog, layout, out, short)
        missing = [k for k, f in zip(catalog.partition_keys, files) if not f.exists()]
        if missing:
            context.log.info(f"partitions without QC rows yet: {missing}")
        incomplete = sorted({catalog.resolve(k)[0] for k in missing} & set(catalog.chunked_datasets) & set(series))
        return dg.MaterializeResult(
            metadata={
                # numbers are what the UI's Plots tab charts over materializations: the rows, not a count of names
                "dagster/row_count": sum(r.count for r in rows if r.span == "total"),
                "partitions": dg.MetadataValue.json(sorted(series)),
                "missing_partitions": dg.MetadataValue.json(missing),
                "incomplete_datasets": dg.MetadataValue.json(incomplete),
                "length_table": _length_table(rows),
                "report": dg.MetadataValue.md(table_md),
                "histogram": dg.MetadataValue.md(png_markdown(png, "lengths by partition")),
                "path": dg.MetadataValue.path(str(out / "report.md")),
                **by_turn,
            }
        )

    return [qc_shards, length_report]


def _length_table(rows) -> dg.MetadataValue:
    """The length report as Dagster table metadata (shown inline on the asset, unlike Markdown); lengths in
    tokens, shares in [0, 1]."""
    names = ("partition", "span", "count", "mean", "median", "p10", "p90", "share_under_short", "share_over_long",
             "at_cap", "share_truncated")
    kinds = {"partition": "string", "span": "string", "count": "int", "at_cap": "int"}
    schema = dg.TableSchema(columns=[dg.TableColumn(n, kinds.get(n, "float")) for n in names])
    records = [dg.TableRecord({n: (round(v, 4) if isinstance(v, float) else v)
                               for n, v in ((n, getattr(r, n)) for n in names)}) for r in rows]
    return dg.MetadataValue.table(records=records, schema=schema)


def _by_turn_metadata(spec, qc_dir: Path, generations_dir: Path) -> dict:
    """QC figures by thinking mode and turn of an ``all_turns`` partition (``qc.turn_report``); {} otherwise."""
    if spec.prompt_policy != "all_turns":
        return {}
    from eagle_assets.qc.turn_report import qc_by_turn
    from eagle_assets.generations.rollout import TURNS_FILE

    return {"qc_by_turn": dg.MetadataValue.json(qc_by_turn(qc_dir / "rows.parquet", generations_dir / TURNS_FILE))}


def _turn_length_report(catalog, layout, out: Path, short: int) -> dict:
    """The length table by thinking mode and turn of the ``all_turns`` partitions: ``report_by_turn.md`` beside
    the report, and its metadata entry ({} when no partition has turns)."""
    from eagle_assets.qc.turn_report import format_turn_table, turn_length_report
    from eagle_assets.generations.rollout import TURNS_FILE

    pairs = [(layout.stage_dir("qc_shards", k) / ROWS_FILE, layout.stage_dir("generations", k) / TURNS_FILE)
             for d, p in catalog.partitions.items() if p.prompt_policy == "all_turns"
             for k in catalog.dataset_partition_keys(d)]
    rows = turn_length_report(pairs, short_tokens=short)
    if not rows:
        return {}
    table = format_turn_table(rows)
    (out / "report_by_turn.md").write_text(table + "\n")
    return {"report_by_turn": dg.MetadataValue.md(table)}


def passing_partitions(settings: PipelineSettings) -> tuple[list[str], dict[str, str]]:
    """Datasets whose latest QC passed both blocking checks, and why each other dataset is excluded.

    A dataset that is not chunked passes by its one partition's ``qc_status.json``. A chunked dataset needs QC
    shards of every chunk (each QC'd as the chunk the catalog now names) and passes by the checks over all of its
    chunks' rows (``qc.dataset_checks``: the figures an unchunked run of the dataset would check, so it trains
    exactly when the unchunked dataset would); a single chunk's failed check does not exclude it by itself.
    """
    import json

    layout = settings.layout()
    catalog = settings.catalog()
    ok, excluded = [], {}
    for dataset in catalog.dataset_keys:
        spec = catalog.partitions[dataset]
        keys = catalog.dataset_partition_keys(dataset)
        statuses, missing, stale = {}, [], []
        for key in keys:
            status_file = Path(layout.base) / "qc_shards" / key / QC_STATUS_FILE
            if not status_file.exists():
                missing.append(key)
                continue
            statuses[key] = status = json.loads(status_file.read_text())
            chunk = catalog.resolve(key)[1:]
            if spec.chunks > 1 and status.get("chunk") != list(chunk):
                stale.append(key)
        if missing:
            excluded[dataset] = (f"no QC shards yet for {missing}: materialize the partition first" if spec.chunks == 1
                                 else f"no QC shards yet for chunks {missing}: materialize them first")
            continue
        if stale:
            excluded[dataset] = (f"chunks {stale} were QC'd before the dataset was split into {spec.chunks} chunks: "
                                 "materialize them again")
            continue
        if spec.chunks == 1:
            status = statuses[dataset]
            passed, levels = status.get("passed") and status.get("kept", 0) > 0, status
        else:
            checks = dataset_checks(dataset_rows_files(layout, catalog, dataset), spec.thresholds)
            passed = checks.passed
            levels = {"token_structure": checks.token_structure.level,
                      "response_length": checks.response_length.level}
        if passed:
            ok.append(dataset)
        else:
            where = "" if spec.chunks == 1 else f" over its {spec.chunks} chunks (dataset_qc)"
            excluded[dataset] = (f"QC failed{where} (token_structure {levels.get('token_structure')}, "
                                 f"response_length {levels.get('response_length')}); see the check results")
    return ok, excluded


def build_dataset_assets(catalog, partitions_def: dg.PartitionsDefinition) -> list:
    """``dataset_qc`` over the chunked datasets of ``catalog`` (none when no dataset is chunked): the blocking
    checks over all of a dataset's chunks, fed by the ``qc_shards`` partitions of ``partitions_def`` (module
    docstring: why an asset of its own partitions)."""
    chunked = catalog.chunked_datasets
    if not chunked:
        return []
    datasets_def = dg.StaticPartitionsDefinition(chunked)
    mapping = dg.StaticPartitionMapping({k: d for d in chunked for k in catalog.dataset_partition_keys(d)})

    @dg.asset(
        partitions_def=datasets_def,
        group_name="quality",
        deps=[dg.AssetDep("qc_shards", partition_mapping=mapping)],
        kinds={"parquet"},
        check_specs=[
            _partition_check("token_structure", "dataset_qc", datasets_def,
                             "share of the dataset's generated rows dropped, per reason, over all its chunks"),
            _partition_check("response_length", "dataset_qc", datasets_def,
                             "median, p10, share short and share truncated over all the dataset's chunks vs its "
                             "thresholds"),
        ],
    )
    def dataset_qc(context: dg.AssetExecutionContext, settings: PipelineSettings):
        """A chunked dataset's QC over all its chunks: the blocking checks' figures of its union of QC rows
        (``qc.dataset_checks``), the rows and shards of each chunk, and ``qc_status.json``."""
        dataset = context.partition_key
        catalog = settings.catalog()
        layout = settings.layout()
        spec = catalog.partitions[dataset]
        files = dataset_rows_files(layout, catalog, dataset)
        missing = [f.parent.name for f in files if not f.exists()]
        if missing:
            raise dg.Failure(
                description=f"dataset {dataset}: chunks {missing} have no QC rows yet; materialize them "
                            f"(partition_job on each) before dataset_qc",
                allow_retries=False)
        checks = dataset_checks(files, spec.thresholds)
        thresholds = spec.thresholds.model_dump()
        out = layout.stage_dir("dataset_qc", dataset)
        shards = {f.parent.name: len(shard_paths(f.parent)) for f in files}
        write_json_atomic(
            {"dataset": dataset, "chunks": spec.chunks, "token_structure": checks.token_structure.level,
             "response_length": checks.response_length.level, "passed": checks.passed, "kept": checks.kept,
             "rows": checks.rows, "rows_by_chunk": {Path(f).parent.name: n for f, n in checks.rows_by_file.items()},
             "figures": {**checks.token_structure.figures, **checks.response_length.figures}},
            out / QC_STATUS_FILE)
        all_reasons = {r: checks.reasons.get(r, 0) for r in DROP_REASONS}
        yield dg.MaterializeResult(
            data_version=dg.DataVersion(directory_content_version(out, (QC_STATUS_FILE,))),
            metadata={
                "dagster/row_count": checks.kept,
                "generated": checks.rows,
                "kept": checks.kept,
                "chunks": spec.chunks,
                "rows_by_chunk": dg.MetadataValue.json({Path(f).parent.name: n
                                                        for f, n in checks.rows_by_file.items()}),
                "shards_by_chunk": dg.MetadataValue.json(shards),
                "drop_reason_counts": dg.MetadataValue.json(all_reasons),
                "median_completion_tokens": checks.response_length.figures.get("median_tokens", 0.0),
                "share_truncated": checks.response_length.figures.get("share_truncated", 0.0),
                "path": dg.MetadataValue.path(str(out)),
            })
        yield _check_result("token_structure", checks.token_structure, metadata=_check_metadata(
            checks.token_structure, thresholds, {"drop_reasons": dg.MetadataValue.json(all_reasons)}))
        yield _check_result("response_length", checks.response_length,
                            metadata=_check_metadata(checks.response_length, thresholds))

    return [dataset_qc]
