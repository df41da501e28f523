"""Asset ``qc_shards`` with its blocking checks ``token_structure`` and ``response_length``; asset ``length_report``."""


from collections import Counter
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq

from eagle_assets.assets.resources import PipelineSettings, TargetModel
from eagle_assets.assets.versions import directory_content_version
from eagle_assets.quality.lengths import format_table, length_report as compute_length_report
from eagle_assets.quality.qc_pass import QC_SCHEMA, QC_SKIP_REASONS, ROWS_SCHEMA, qc_partition  # noqa: F401
from eagle_assets.quality.segment import DROP_REASONS, FLAGS
from eagle_assets.quality.thresholds import Outcome, evaluate_token_structure, reason_levels
from eagle_assets.storage import shard_paths, write_json_atomic, write_parquet_atomic

QC_STATUS_FILE = "qc_status.json"


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
            dg.AssetCheckSpec("token_structure", asset="qc_shards", blocking=True,
                              description="share of generated rows dropped for broken structure, per reason"),
            dg.AssetCheckSpec("response_length", asset="qc_shards", blocking=True,
                              description="median, p10, share short and share truncated vs catalog thresholds"),
        ],
    )
    def qc_shards(context: dg.AssetExecutionContext, settings: PipelineSettings, target: TargetModel):
        """Training rows input_ids = prompt_ids + output_ids with loss_mask; broken rows dropped with a named reason."""
        from eagle_assets.prompts_file import PromptsFile
        from eagle_assets.target_model.profile import detect_profile, target_vocab_size
        from eagle_assets.target_model.render import control_token_ids, opens_think_block
        from eagle_assets.target_model.tokenizer import load_tokenizer

        key = context.partition_key
        catalog = settings.catalog()
        spec = catalog.partitions[key]
        layout = settings.layout()
        thresholds = spec.thresholds.model_dump() if hasattr(spec.thresholds, "model_dump") else dict(spec.thresholds)
        model_dir = target.resolve()
        tokenizer = load_tokenizer(model_dir)
        profile = detect_profile(tokenizer, catalog.target.profile or None)
        blank = blank_token_ids(tokenizer)
        # QC holds every row to the client's rules itself: shards may come from any producer
        vocab_size = target_vocab_size(model_dir, tokenizer)
        control = control_token_ids(tokenizer)
        # shard by shard and batch by batch (quality.qc_pass): shards of other producers may differ in columns and
        # types (int64 ids, no matched_stop); each row is held to the rules on its own
        # the prompts a row group at a time (prompts_file): their ids never all in memory
        prompts = PromptsFile(layout.stage_dir("tokenized_prompts", key) / "prompts.parquet")
        if spec.prompt_policy == "all_turns":  # one prompt per turn, rendered by conversation.rollout
            from eagle_assets.conversation.rollout import turn_prompts

            prompts = turn_prompts(layout.stage_dir("generations", key))
        max_new = spec.sampling.max_new_tokens
        out = layout.stage_dir("qc_shards", key)
        result = qc_partition(
            shard_paths(layout.stage_dir("generations", key)), prompts, out, profile, partition=key,
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
             "shards": len(result.shards)},
            out / QC_STATUS_FILE,
        )
        from eagle_assets.quality.plots import length_histogram_png, png_markdown  # matplotlib: ~0.7 s to import

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
        yield dg.AssetCheckResult(
            check_name="token_structure", passed=structure.passed, severity=_severity(structure),
            description=structure.description(),
            metadata=_check_metadata(structure, thresholds, {
                "drop_reasons": dg.MetadataValue.json(all_reasons)}),
        )
        yield dg.AssetCheckResult(
            check_name="response_length", passed=length.passed, severity=_severity(length),
            description=length.description(),
            metadata=_check_metadata(length, thresholds, {
                "histogram": dg.MetadataValue.md(png_markdown(png, f"{key} lengths"))}),
        )

    @dg.asset(group_name="quality", deps=[qc_shards], kinds={"duckdb"})
    def length_report(context: dg.AssetExecutionContext, settings: PipelineSettings) -> dg.MaterializeResult:
        """DuckDB length table of every partition (total, reasoning, answer tokens) with PNG histograms."""
        catalog = settings.catalog()
        layout = settings.layout()
        files = [layout.stage_dir("qc_shards", k) / "rows.parquet" for k in catalog.partition_keys]
        present = [f for f in files if f.exists()]
        short = min((p.thresholds.short_tokens for p in catalog.partitions.values()), default=300)
        rows = compute_length_report(present, short_tokens=short)
        out = layout.stage_dir("length_report")
        table_md = format_table(rows)
        (out / "report.md").write_text(table_md + "\n")
        write_parquet_atomic(pa.Table.from_pylist([r.__dict__ for r in rows]), out / "report.parquet")
        series = {}
        for f in present:
            t = pq.read_table(f, columns=["partition", "completion_tokens"])
            if t.num_rows:
                series[t.column("partition")[0].as_py()] = t.column("completion_tokens").to_pylist()
        from eagle_assets.quality.plots import length_histogram_png, png_markdown

        png = length_histogram_png(series, "completion tokens by partition", short_tokens=short)
        (out / "lengths.png").write_bytes(png)
        by_turn = _turn_length_report(catalog, layout, out, short)
        missing = [k for k, f in zip(catalog.partition_keys, files) if not f.exists()]
        if missing:
            context.log.info(f"partitions without QC rows yet: {missing}")
        return dg.MaterializeResult(
            metadata={
                "partitions": len(series),
                "missing_partitions": dg.MetadataValue.json(missing),
                "report": dg.MetadataValue.md(table_md),
                "histogram": dg.MetadataValue.md(png_markdown(png, "lengths by partition")),
                "path": dg.MetadataValue.path(str(out / "report.md")),
                **by_turn,
            }
        )

    return [qc_shards, length_report]


def _by_turn_metadata(spec, qc_dir: Path, generations_dir: Path) -> dict:
    """QC figures by thinking mode and turn of an ``all_turns`` partition (``conversation.report``); {} otherwise."""
    if spec.prompt_policy != "all_turns":
        return {}
    from eagle_assets.conversation.report import qc_by_turn
    from eagle_assets.conversation.rollout import TURNS_FILE

    return {"qc_by_turn": dg.MetadataValue.json(qc_by_turn(qc_dir / "rows.parquet", generations_dir / TURNS_FILE))}


def _turn_length_report(catalog, layout, out: Path, short: int) -> dict:
    """The length table by thinking mode and turn of the ``all_turns`` partitions: ``report_by_turn.md`` beside
    the report, and its metadata entry ({} when no partition has turns)."""
    from eagle_assets.conversation.report import format_turn_table, turn_length_report
    from eagle_assets.conversation.rollout import TURNS_FILE

    pairs = [(layout.stage_dir("qc_shards", k) / "rows.parquet", layout.stage_dir("generations", k) / TURNS_FILE)
             for k, p in catalog.partitions.items() if p.prompt_policy == "all_turns"]
    rows = turn_length_report(pairs, short_tokens=short)
    if not rows:
        return {}
    table = format_turn_table(rows)
    (out / "report_by_turn.md").write_text(table + "\n")
    return {"report_by_turn": dg.MetadataValue.md(table)}


def passing_partitions(settings: PipelineSettings) -> tuple[list[str], dict[str, str]]:
    """Partitions whose latest QC passed both blocking checks, and why each other partition is excluded."""
    import json

    layout = settings.layout()
    ok, excluded = [], {}
    for key in settings.catalog().partition_keys:
        status_file = Path(layout.base) / "qc_shards" / key / QC_STATUS_FILE
        if not status_file.exists():
            excluded[key] = "no QC shards yet: materialize the partition first"
            continue
        status = json.loads(status_file.read_text())
        if status.get("passed") and status.get("kept", 0) > 0:
            ok.append(key)
        else:
            excluded[key] = (f"QC failed (token_structure {status.get('token_structure')}, "
                             f"response_length {status.get('response_length')}); see the check results")
    return ok, excluded
