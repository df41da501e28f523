"""Assets ``speculators_export`` and ``specforge_export``: the training mix's rows for the trainers people run.

One non-partitioned asset per trainer, downstream of ``training_mix``; the formats and the trainers' code they follow
are in :mod:`eagle_assets.exports.formats`, the writer in :mod:`eagle_assets.exports.pretokenized`.
"""

import json

import dagster as dg

from eagle_assets.assets.locking import stage_writer
from eagle_assets.assets.resources import PipelineSettings
from eagle_assets.exports.formats import FORMATS, SPECFORGE, SPECULATORS, TrainerFormat
from eagle_assets.exports.pretokenized import DEFAULT_ROWS_PER_SHARD

_EXACT = ("Exact: `input_ids` are the target's own tokens (the prompt as rendered once by `tokenized_prompts`, then "
          "the `output_ids` SGLang returned), never decoded or tokenized again, so reasoning, tool calls and token "
          "boundaries survive, and `loss_mask` is 1 on exactly the generated tokens (stop token included). Rows a "
          "trainer would refuse or drop are quarantined in `rejects.parquet` with a reason. Every file is read back "
          "and compared row by row before it replaces the previous export.")

DESCRIPTIONS = {
    SPECULATORS.name: (
        "The training mix as speculators' pre-tokenized rows: JSON lines `{input_ids, loss_mask, partition, "
        "sample_id}` in `data/shard-NNNNN.jsonl`, for `speculators prepare-data --data <export>/data` (0.9.0; the "
        f"pass-through of vllm-project/speculators PR 964). {_EXACT} What speculators itself still does: clips "
        "each row to `--seq-length` (default 8192; `rows_over_default_max_length` counts longer rows), drops a "
        "row left without a supervised token, and shuffles (`--seed`); the mix order is not kept."),
    SPECFORGE.name: (
        "The training mix as SpecForge's pre-tokenized prompts: one JSON-lines file `prompts.jsonl` "
        "`{input_ids, loss_mask, partition, sample_id}` for `specforge train ... data.prompts_path=<file>` "
        f"(SpecForge 0.2.0 as on PyPI, and HEAD). {_EXACT} What SpecForge itself still does: clips each row to "
        "`data.max_length` (default 2048; `rows_over_default_max_length` counts longer rows) and skips a row left "
        "with fewer loss tokens than its algorithm needs (EAGLE-3: 1); the file order (the mix order) is kept. "
        "The SpecForge commit that first said 0.2.0 (Dec 2025) read only conversations and cannot take this file."),
}


class TrainerExportConfig(dg.Config):
    """Run config of an export asset."""

    rows_per_shard: int = DEFAULT_ROWS_PER_SHARD  # rows per shard-NNNNN.jsonl (speculators' layout; >= 1)


def build_export_assets() -> list:
    """``speculators_export`` and ``specforge_export``."""
    return [_export_asset(fmt) for fmt in FORMATS.values()]


def _export_asset(fmt: TrainerFormat) -> dg.AssetsDefinition:
    @dg.asset(name=f"{fmt.name}_export", group_name="exports", deps=["training_mix"], kinds={"json"},
              description=DESCRIPTIONS[fmt.name])
    def _export(context: dg.AssetExecutionContext, config: TrainerExportConfig,
                settings: dg.ResourceParam[PipelineSettings]) -> dg.MaterializeResult:
        from eagle_assets.exports.pretokenized import ExportError, export_mixed_rows
        from eagle_assets.qc.status import dataset_shard_paths

        layout = settings.layout()
        mix_dir = layout.base / "training_mix"
        if not (mix_dir / "summary.json").exists():
            raise dg.Failure(description=f"{mix_dir / 'summary.json'} does not exist: materialize training_mix "
                             "first (training_job does)")
        mix_summary = json.loads((mix_dir / "summary.json").read_text())
        keys = list(mix_summary["partitions"])
        catalog = settings.catalog()
        provenance = {"catalog": str(settings.catalog_path), "target_model": str(catalog.target.model),
                      "partitions": keys, "mix_mode": mix_summary.get("mode")}
        try:
            # one writer of the export's folder at a time (a second run would delete the first one's staging)
            with stage_writer(layout, f"{fmt.name}_export") as out:
                report = export_mixed_rows(
                    mix_dir / "mix.parquet",
                    {k: dataset_shard_paths(settings.layout(), settings.catalog(), k) for k in keys},
                    out, fmt, rows_per_shard=config.rows_per_shard, provenance=provenance)
        except (ExportError, ValueError) as exc:
            raise dg.Failure(description=f"{fmt.name}_export: {exc}") from exc
        if report.rejected:
            context.log.warning(f"{fmt.name} export: quarantined {report.rejected} (rejects.parquet says which rows)")
        if report.rows_over_default_max_length:
            context.log.warning(
                f"{fmt.name} export: {report.rows_over_default_max_length} of {report.rows} rows are longer than "
                f"{fmt.name}'s default {fmt.max_length_option} {fmt.default_max_length}; train with "
                f"{fmt.max_length_option} {report.max_tokens} or their tails are clipped")
        command = fmt.train_hint.format(data=report.data_path, max=max(report.max_tokens, 1))
        return dg.MaterializeResult(metadata={
            "dagster/row_count": report.rows,
            "tokens": report.tokens,
            "loss_tokens": report.loss_tokens,
            "max_tokens": report.max_tokens,
            "rows_over_default_max_length": report.rows_over_default_max_length,
            "rows_per_partition": dg.MetadataValue.json(report.rows_per_partition),
            "rejected": dg.MetadataValue.json(report.rejected),
            "files": len(report.files),
            "bytes": sum(f["bytes"] for f in report.files),
            "verified_rows": report.verified_rows,
            "verified_with": fmt.verified_with,
            "train": dg.MetadataValue.md(f"```bash\n{command}\n```"),
            "path": dg.MetadataValue.path(report.data_path),
        })

    return _export
