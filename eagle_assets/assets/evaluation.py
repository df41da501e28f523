"""Asset ``evaluation`` (checks ``tau_<suite>_<mode>``, one per suite x thinking mode): the trained drafter measured
per suite (``drafter.evaluation.suites``), reported in the UI and under ``<storage root>/<catalog>/evaluation/``."""

import dagster as dg

from eagle_assets.assets.inputs import AFTER_OBSERVATIONS
from eagle_assets.assets.locking import stage_writer
from eagle_assets.assets.resources import PipelineSettings, TargetModel
from eagle_assets.assets.training import torch_threads
from eagle_assets.catalog import Catalog


def gate_check_name(suite: str, mode: str) -> str:
    """The asset check of one suite x thinking mode: ``tau_<suite>_<mode>`` (``-`` becomes ``_``)."""
    return f"tau_{suite}_{mode}".replace("-", "_")


def evaluation(context: dg.AssetExecutionContext, settings: dg.ResourceParam[PipelineSettings],
               target: dg.ResourceParam[TargetModel]):
    """Acceptance per suite and thinking mode: tau at each k, greedy and at the suite's temperature, by position."""
    from transformers import AutoModelForCausalLM

    from eagle_assets.drafter.data.stage import stored_draft_vocab
    from eagle_assets.drafter.evaluation.suites import evaluate_suites, write_report
    from eagle_assets.drafter.family import family_of_checkpoint
    from eagle_assets.figures.plots import png_markdown

    catalog, layout = settings.catalog(), settings.layout()
    t = catalog.training
    if t.features.source == "served":
        raise dg.Failure(description="the evaluation runs the target in this process, and training.features: served "
                                     "says it does not fit here: evaluate with features: local on a host that holds "
                                     "the target, or set evaluation: null")
    checkpoint = layout.base / "drafter_checkpoint" / "checkpoint"
    if not (checkpoint / "config.json").exists():
        raise dg.Failure(description=f"no drafter checkpoint in {checkpoint}: materialize drafter_checkpoint "
                                     "(training_job) first")
    # one writer of the report's folder at a time, taken first: a second run is refused before it measures
    with stage_writer(layout, "evaluation") as out:
        keys, vocab, _ = stored_draft_vocab(layout)
        target_model = AutoModelForCausalLM.from_pretrained(target.resolve(), dtype="float32").eval()
        drafter, _ = family_of_checkpoint(checkpoint).load(checkpoint, target_model)
        with torch_threads(t.threads):
            report = evaluate_suites(catalog, layout, target_model, drafter, vocab, keys, context.log.info)
        for suite, why in report.missing.items():
            context.log.warning(f"suite {suite} not measured: {why}")
        ks = catalog.evaluation.ks(t.acceptance_k)
        md, png = write_report(report, out, ks)
    context.log.info(f"evaluation: {len(report.records)} records in {report.seconds:.1f}s, written to {out}")
    yield dg.MaterializeResult(metadata={
        "report": dg.MetadataValue.md(md),
        "tau_vs_k": dg.MetadataValue.md(png_markdown(png, "tau vs k")),
        "records": len(report.records),
        "overlap_rows": dg.MetadataValue.json(report.overlap_rows),
        "suites_not_measured": dg.MetadataValue.json(report.missing),
        # what the figures stand on: each suite's QC verdict (passed / warned / failed, kept / dropped replies)
        "suite_qc": dg.MetadataValue.json(report.qc_json()),
        "heldout_qc": dg.MetadataValue.json({k: v.verdict if v is not None else None
                                             for k, v in report.heldout_qc.items()}),
        "drafter_architecture": drafter.config.describe(),
        "trained_partitions": dg.MetadataValue.json(keys),
        "seconds": round(report.seconds, 1),
        "path": dg.MetadataValue.path(str(out / "report.json")),
    })
    for g in report.gates:
        yield dg.AssetCheckResult(
            check_name=gate_check_name(g.suite, g.thinking), passed=g.level == "OK",
            severity=dg.AssetCheckSeverity.ERROR if g.level == "ERROR" else dg.AssetCheckSeverity.WARN,
            description=g.text + (f"; {report.overlap_rows[g.suite]} rows share prompt ids with training rows"
                                  if report.overlap_rows.get(g.suite) else ""),
            metadata={"tau": round(g.tau, 4), "k": g.k, "rows": g.rows, "tau_error_at_or_under": g.error_at,
                      "tau_warn_under": g.warn_under, "overlap_rows": report.overlap_rows.get(g.suite, 0),
                      "suite_qc": (report.qc[g.suite].text() if report.qc.get(g.suite) is not None
                                   else "not run")})


def build_evaluation_assets(catalog: Catalog) -> list:
    """The ``evaluation`` asset with one check per suite x thinking mode of ``catalog.evaluation`` (every catalog
    has one: ``catalog.load.with_default_evaluation``; nothing when it is null)."""
    if catalog.evaluation is None:
        return []
    checks = [dg.AssetCheckSpec(gate_check_name(name, mode), asset="evaluation",
                                description=f"greedy tau of suite {name}, thinking {mode}, at training.acceptance_k "
                                            "against the suite's tau_warn and min_tau_margin")
              for name, suite in catalog.evaluation.suites.items() for mode in suite.modes]
    return [dg.asset(group_name="evaluation", deps=["drafter_checkpoint", "qc_shards"], kinds={"json"},
                     check_specs=checks, op_tags=AFTER_OBSERVATIONS)(evaluation)]
