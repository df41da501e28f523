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
from pathlib import Path

import dagster as dg

from eagle_assets.assets.locking import stage_writer
from eagle_assets.assets.resources import PipelineSettings, TargetModel
from eagle_assets.catalog import Thresholds
from eagle_assets.lineage.versions import directory_content_version
from eagle_assets.qc.stage import dataset_qc_stage, length_report_stage, qc_partition_stage
from eagle_assets.qc.status import QC_STATUS_FILE, QcVerdict, checks_verdict, verdict_table
from eagle_assets.qc.thresholds import Outcome, reason_levels
from eagle_assets.storage.shards import Layout
from eagle_assets.structure.segment import DROP_REASONS

# How long length_report waits for another run's length_report to finish writing (it takes seconds) before failing
LENGTH_REPORT_WAIT_S = 300.0


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


def _check_metadata(outcome: Outcome, thresholds: Thresholds, extra: dict | None = None) -> dict:
    lines = ["| figure | value | threshold (warn / error) |", "|---|---|---|"]
    for name, value in outcome.figures.items():
        stem = name.replace("share_", "")
        warn = getattr(thresholds, f"max_share_{stem}_warn", None)
        err = getattr(thresholds, f"max_share_{stem}_error", None)
        if stem in thresholds.max_share_by_reason:
            warn, err = reason_levels(thresholds, stem)
        if name == "median_tokens":
            warn, err = thresholds.min_median_tokens, None
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        lines.append(f"| {name} | {shown} | {warn if warn is not None else '-'} / {err if err is not None else '-'} |")
    meta = {k: float(v) for k, v in outcome.figures.items()}
    meta["figures"] = dg.MetadataValue.md("\n".join(lines))
    meta["level"] = outcome.level
    if extra:
        meta.update(extra)
    return meta


def verdict_metadata(verdict: QcVerdict, layout: Layout, keys: list[str]) -> dict:
    """The QC verdict as the UI shows it on a materialization: ``qc_verdict`` (this partition's verdict, its
    blocking check and finding, kept / dropped) and ``qc_verdicts_as_of_this_run`` (a table of every partition of
    ``keys``, one verdict each, read from their ``qc_status.json`` when this partition's QC finished: ``not run``
    for one without QC yet; a later run of another partition shows in that run's table, not in this one's).

    Why a table: Dagster 1.13 draws a static partition whose data is on disk as "Materialized" whatever its checks
    say, and a check's partition list as Passed / Failed only (a WARN looks like an ERROR there), so the one place a
    user sees passed / warned / failed side by side for every partition is this table: the asset's Overview shows
    the latest materialization's, so the newest run's view of all partitions, and each partition's detail panel
    its own. Why not a failed materialization where a check fails: its files are on disk and are the partition's
    data; Dagster would keep showing an earlier materialization's metadata, and a partition never materialized
    counts as missing, which holds back the automation that trains on the partitions that passed
    (``assets.automation``)."""
    rows = verdict_table(layout, keys)
    names = ("partition", "verdict", "blocking_check", "finding", "kept", "dropped", "rows")
    kinds = {"kept": "int", "dropped": "int", "rows": "int"}
    schema = dg.TableSchema(columns=[dg.TableColumn(n, kinds.get(n, "string")) for n in names])
    table = dg.MetadataValue.table(records=[dg.TableRecord({n: r[n] for n in names}) for r in rows], schema=schema)
    return {"qc_verdict": dg.MetadataValue.text(verdict.text()), "qc_verdicts_as_of_this_run": table}


def qc_shards(context: dg.AssetExecutionContext, settings: dg.ResourceParam[PipelineSettings],
              target: dg.ResourceParam[TargetModel]):
    """Training rows input_ids = prompt_ids + output_ids with loss_mask; broken rows dropped with a named reason.
    Each materialization starts with its partition's QC verdict (passed / warned / failed, with the blocking check
    and its finding) and a table of every partition's verdict as of that run."""
    from eagle_assets.figures.plots import png_markdown

    key = context.partition_key
    catalog = settings.catalog()
    setup = target.setup(catalog.target.profile)
    with stage_writer(settings.layout(), "qc_shards", key):  # one writer: the whole write and its data version
        r = qc_partition_stage(settings.layout(), catalog, key, setup)
        version = directory_content_version(r.out, ("*.parquet", QC_STATUS_FILE))
    verdict = checks_verdict(key, r.token_structure, r.response_length, r.summary.rows, r.summary.kept)
    shown = verdict_metadata(verdict, settings.layout(), list(catalog.partition_keys))
    histogram = dg.MetadataValue.md(png_markdown(r.png, f"{key} lengths"))
    yield dg.MaterializeResult(
        data_version=dg.DataVersion(version),
        metadata={
            **shown,
            "dagster/row_count": r.summary.kept,
            "generated": r.summary.rows,
            "kept": r.summary.kept,
            "dropped": sum(r.summary.reasons.values()),
            "short_but_well_formed": r.summary.short,
            "shards": len(r.summary.shards),
            "drop_reasons": dg.MetadataValue.md("| reason | rows |\n|---|---|\n" + "\n".join(
                f"| {reason} | {n} |" for reason, n in r.reasons.items())),
            "drop_reason_counts": dg.MetadataValue.json(r.reasons),
            "flags": dg.MetadataValue.json(r.flags),
            "vocab_size": setup.vocab_size,
            "family_profile": dg.MetadataValue.json(setup.profile.to_dict()),
            "median_completion_tokens": r.response_length.figures.get("median_tokens", 0.0),
            "share_truncated": r.response_length.figures.get("share_truncated", 0.0),
            "length_histogram": histogram,
            "path": dg.MetadataValue.path(str(r.out)),
            **({"qc_by_turn": dg.MetadataValue.json(r.by_turn)} if r.by_turn is not None else {}),
        })
    # each check names the partition's verdict too: a check that passed on a partition its other check failed
    # would otherwise read as "this partition is fine"
    partition = {"qc_verdict": shown["qc_verdict"]}
    yield _check_result("token_structure", r.token_structure, metadata=_check_metadata(
        r.token_structure, r.thresholds, {"drop_reasons": dg.MetadataValue.json(r.reasons), **partition}))
    yield _check_result("response_length", r.response_length, metadata=_check_metadata(
        r.response_length, r.thresholds, {"histogram": histogram, **partition}))


def length_report(context: dg.AssetExecutionContext,
                  settings: dg.ResourceParam[PipelineSettings]) -> dg.MaterializeResult:
    """DuckDB length table of every dataset (total, reasoning, answer tokens) with PNG histograms; a chunked
    dataset's line is over the rows of all its chunks materialized so far."""
    from eagle_assets.figures.plots import png_markdown

    # one writer of the report's folder at a time; every partition_job run ends with this step, so runs of other
    # partitions that finish together wait for each other (each rewrites the whole report) instead of failing
    with stage_writer(settings.layout(), "length_report", wait_s=LENGTH_REPORT_WAIT_S):
        r = length_report_stage(settings.layout(), settings.catalog())
    if r.missing:
        context.log.info(f"partitions without QC rows yet: {r.missing}")
    return dg.MaterializeResult(metadata={
        # numbers are what the UI's Plots tab charts over materializations: the rows, not a count of names
        "dagster/row_count": sum(row.count for row in r.rows if row.span == "total"),
        "partitions": dg.MetadataValue.json(r.partitions),
        "missing_partitions": dg.MetadataValue.json(r.missing),
        "incomplete_datasets": dg.MetadataValue.json(r.incomplete),
        "length_table": _length_table(r.rows),
        "report": dg.MetadataValue.md(r.table_md),
        "histogram": dg.MetadataValue.md(png_markdown(r.png, "lengths by partition")),
        "path": dg.MetadataValue.path(str(r.out / "report.md")),
        **({"report_by_turn": dg.MetadataValue.md(r.by_turn_md)} if r.by_turn_md else {}),
    })


def dataset_qc(context: dg.AssetExecutionContext, settings: dg.ResourceParam[PipelineSettings]):
    """A chunked dataset's QC over all its chunks: the blocking checks' figures of its union of QC rows, the rows
    and shards of each chunk, and ``qc_status.json``."""
    dataset = context.partition_key
    spec = settings.catalog().partitions[dataset]
    with stage_writer(settings.layout(), "dataset_qc", dataset):  # one writer: the write and its data version
        r = dataset_qc_stage(settings.layout(), settings.catalog(), dataset)
        version = None if r.missing else directory_content_version(r.out, (QC_STATUS_FILE,))
    if r.missing:
        raise dg.Failure(description=f"dataset {dataset}: chunks {r.missing} have no QC rows yet; materialize them "
                                     "(partition_job on each) before dataset_qc", allow_retries=False)
    checks, thresholds = r.checks, spec.thresholds
    reasons = dg.MetadataValue.json({reason: checks.reasons.get(reason, 0) for reason in DROP_REASONS})
    verdict = checks_verdict(dataset, checks.token_structure, checks.response_length, checks.rows, checks.kept)
    partition = {"qc_verdict": dg.MetadataValue.text(verdict.text())}
    yield dg.MaterializeResult(
        data_version=dg.DataVersion(version),
        metadata={
            **partition,
            "dagster/row_count": checks.kept,
            "generated": checks.rows,
            "kept": checks.kept,
            "chunks": spec.chunks,
            "rows_by_chunk": dg.MetadataValue.json({Path(f).parent.name: n for f, n in checks.rows_by_file.items()}),
            "shards_by_chunk": dg.MetadataValue.json(r.shards_by_chunk),
            "drop_reason_counts": reasons,
            "median_completion_tokens": checks.response_length.figures.get("median_tokens", 0.0),
            "share_truncated": checks.response_length.figures.get("share_truncated", 0.0),
            "path": dg.MetadataValue.path(str(r.out)),
        })
    yield _check_result("token_structure", checks.token_structure, metadata=_check_metadata(
        checks.token_structure, thresholds, {"drop_reasons": reasons, **partition}))
    yield _check_result("response_length", checks.response_length,
                        metadata=_check_metadata(checks.response_length, thresholds, partition))


def build_qc_assets(partitions_def: dg.PartitionsDefinition) -> list[dg.AssetsDefinition]:
    """``qc_shards`` (partitioned, with blocking checks) and ``length_report`` (all partitions)."""
    checks = [
        _partition_check("token_structure", "qc_shards", partitions_def,
                         "share of generated rows dropped for broken structure, per reason"),
        _partition_check("response_length", "qc_shards", partitions_def,
                         "median, p10, share short and share truncated vs catalog thresholds"),
    ]
    shards = dg.asset(partitions_def=partitions_def, group_name="quality", deps=["generations", "tokenized_prompts"],
                      kinds={"parquet"}, check_specs=checks)(qc_shards)
    report = dg.asset(group_name="quality", deps=[shards], kinds={"duckdb"})(length_report)
    return [shards, report]


def build_dataset_assets(catalog, partitions_def: dg.PartitionsDefinition) -> list:
    """``dataset_qc`` over the chunked datasets of ``catalog`` (none when no dataset is chunked): the blocking
    checks over all of a dataset's chunks, fed by the ``qc_shards`` partitions of ``partitions_def`` (module
    docstring: why an asset of its own partitions)."""
    chunked = catalog.chunked_datasets
    if not chunked:
        return []
    datasets_def = dg.StaticPartitionsDefinition(chunked)
    mapping = dg.StaticPartitionMapping({k: d for d in chunked for k in catalog.dataset_partition_keys(d)})
    checks = [
        _partition_check("token_structure", "dataset_qc", datasets_def,
                         "share of the dataset's generated rows dropped, per reason, over all its chunks"),
        _partition_check("response_length", "dataset_qc", datasets_def,
                         "median, p10, share short and share truncated over all the dataset's chunks vs its "
                         "thresholds"),
    ]
    return [dg.asset(partitions_def=datasets_def, group_name="quality", kinds={"parquet"}, check_specs=checks,
                     deps=[dg.AssetDep("qc_shards", partition_mapping=mapping)])(dataset_qc)]


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
