"""Asset ``drafter_comparison`` (check ``compared_exports``): the drafters of ``training.compare`` trained beside
``training.drafter`` from the same rows and recipe, each export held to its family's contract, and all of them
measured side by side on the same held-out rows and suites (``drafter.evaluation.comparison``), reported in the UI
and under ``<storage root>/<catalog>/drafter_comparison/``."""

import json
from collections.abc import Callable
from typing import Any

import dagster as dg

from eagle_assets.assets.inputs import AFTER_OBSERVATIONS
from eagle_assets.assets.locking import stage_writer
from eagle_assets.assets.provenance import write_provenance
from eagle_assets.assets.resources import PipelineSettings, TargetModel
from eagle_assets.assets.training import torch_threads, train_step, training_inputs
from eagle_assets.catalog import Catalog
from eagle_assets.catalog.training import DRAFTER_LABEL
from eagle_assets.storage.guard import refuse_symlink
from eagle_assets.storage.shards import write_json_atomic


def _local_only(_capture):
    raise dg.Failure(description="training.compare trains with features: local (the catalog refuses served features "
                                 "with compare)")


def _measured(label, checkpoint, train_seconds, target_model, catalog, layout, inputs, log):
    """Load, validate and measure one exported drafter; ``(ComparedDrafter, validation error or None)``."""
    from eagle_assets.drafter.evaluation.comparison import ComparedDrafter
    from eagle_assets.drafter.evaluation.suites import evaluate_suites
    from eagle_assets.drafter.family import family_of_checkpoint

    family = family_of_checkpoint(checkpoint)
    try:
        parameters, problem = family.validate(checkpoint).parameters, None
    except ValueError as exc:  # the family's CheckpointError: measured all the same, the check says what is wrong
        parameters, problem = 0, str(exc)
    drafter, _ = family.load(checkpoint, target_model)
    with torch_threads(catalog.training.threads):
        report = evaluate_suites(catalog, layout, target_model, drafter, inputs.vocab, inputs.keys, log)
    sglang_class = json.loads((checkpoint / "config.json").read_text())["architectures"][0]
    return ComparedDrafter(label, drafter.config.describe(), sglang_class, parameters, train_seconds,
                           str(checkpoint), report), problem


def compare_drafters(context: dg.AssetExecutionContext, settings: PipelineSettings, target: TargetModel,
                     full_asset_graph: Callable[[], Any] | None = None):
    """The body of ``drafter_comparison`` (:func:`build_comparison_assets`): ``training.drafter`` (the
    ``drafter_checkpoint`` export) and each ``training.compare`` entry, trained here from the same rows, mix, draft
    vocab and recipe (each checkpoint with its provenance), all measured on the same rows and reported side by
    side."""
    from transformers import AutoModelForCausalLM

    from eagle_assets.drafter.evaluation.comparison import supported, write_comparison
    from eagle_assets.drafter.features.source import resolve_features
    from eagle_assets.figures.plots import png_markdown

    catalog, layout = settings.catalog(), settings.layout()
    t = catalog.training
    primary = layout.base / "drafter_checkpoint"
    if not (primary / "checkpoint" / "config.json").exists():
        raise dg.Failure(description=f"no drafter checkpoint in {primary / 'checkpoint'}: materialize "
                                     "drafter_checkpoint (training_job) first")
    # one writer of the comparison's folder (checkpoints, training states, features, report) for the whole step
    with stage_writer(layout, "drafter_comparison") as out:
        inputs = training_inputs(layout, catalog)
        model_dir = target.resolve()
        target_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
        metrics = primary / "training_metrics.json"
        seconds = json.loads(metrics.read_text()).get("train_seconds") if metrics.exists() else None
        measured = [_measured(DRAFTER_LABEL, primary / "checkpoint", seconds, target_model, catalog, layout, inputs,
                              context.log.info)]
        for label in t.compare:
            spec, folder = t.for_compared(label), out / label
            for sub in ("checkpoint", "train_state", "train_inputs", "features"):
                refuse_symlink(folder / sub)  # cleared, replaced or rewritten below: never through a link
            context.log.info(f"training.compare.{label}: training {spec.drafter.architecture} on "
                             f"{len(inputs.rows)} rows, the recipe of training.drafter")
            features = resolve_features(spec.features, model_dir, folder / "features", spec.aux_layer_ids,
                                        spec.max_length, _local_only)
            result = train_step(context, spec, model_dir, folder, features, inputs)
            write_provenance(context, settings, result.checkpoint_dir, fallback_graph=full_asset_graph)
            write_json_atomic(result.to_dict(), folder / "training_metrics.json")
            measured.append(_measured(label, result.checkpoint_dir, round(result.train_seconds, 1), target_model,
                                      catalog, layout, inputs, context.log.info))
        drafters = [d for d, _ in measured]
        md, png = write_comparison(drafters, out, t.acceptance_k)
    best, why = supported(drafters, t.acceptance_k)
    context.log.info(f"drafter comparison written to {out}: {why}")
    yield dg.MaterializeResult(metadata={
        "report": dg.MetadataValue.md(md),
        "tau": dg.MetadataValue.md(png_markdown(png, "tau per drafter")),
        "drafters": dg.MetadataValue.json({d.label: d.architecture for d in drafters}),
        "supported": best or "",
        "reason": why,
        "path": dg.MetadataValue.path(str(out / "report.json")),
    })
    broken = {d.label: problem for d, problem in measured if problem}
    yield dg.AssetCheckResult(
        check_name="compared_exports", passed=not broken, severity=dg.AssetCheckSeverity.ERROR,
        description=("; ".join(f"{label}: {why}" for label, why in broken.items()) if broken else
                     f"{len(drafters)} exports hold to their families' SGLang contracts"),
        metadata={"checked": dg.MetadataValue.json({d.label: d.sglang_class for d in drafters})})


def build_comparison_assets(catalog: Catalog, full_asset_graph: Callable[[], Any] | None = None) -> list:
    """The ``drafter_comparison`` asset when ``catalog.training.compare`` names a drafter (else nothing).

    ``full_asset_graph``: the whole asset graph, for each compared checkpoint's provenance in runs that have no
    repository (as ``build_training_assets``)."""
    if not catalog.training.compare:
        return []

    def drafter_comparison(context: dg.AssetExecutionContext, settings: dg.ResourceParam[PipelineSettings],
                           target: dg.ResourceParam[TargetModel]):
        """Every drafter of the catalog side by side: ``training.drafter`` and each ``training.compare`` entry,
        trained from the same rows and recipe; tau per suite x thinking mode x temperature at
        ``training.acceptance_k``, parameters and training seconds, and the drafter the measurements support."""
        yield from compare_drafters(context, settings, target, full_asset_graph)

    check = dg.AssetCheckSpec("compared_exports", asset="drafter_comparison",
                              description="every compared drafter's export passes its family's SGLang contract "
                                          "(tensor names, shapes, config fields)")
    return [dg.asset(group_name="evaluation", deps=["drafter_checkpoint", "qc_shards"],
                     kinds={"pytorch", "json"}, check_specs=[check], op_tags=AFTER_OBSERVATIONS)(drafter_comparison)]
