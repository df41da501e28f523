"""Assets ``draft_vocab``, ``training_mix`` and ``drafter_checkpoint`` (checks ``export_contract``,
``acceptance_length``): each asks the drafter stage (``drafter.data.stage``, ``drafter.training.loop``,
``drafter.evaluation.verdict``) and reports its figures."""

import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import dagster as dg
import numpy as np

from eagle_assets.assets.acceptance import acceptance_check
from eagle_assets.assets.inputs import AFTER_OBSERVATIONS
from eagle_assets.assets.locking import stage_writer
from eagle_assets.assets.provenance import write_provenance
from eagle_assets.assets.resources import PipelineSettings, TargetModel
from eagle_assets.assets.server_resource import SGLangServerResource
from eagle_assets.drafter.data.splits import MixError, load_split_rows, mixed_training_rows
from eagle_assets.drafter.data.stage import draft_vocab_stage, stored_draft_vocab, training_mix_stage
from eagle_assets.qc.status import passing_datasets
from eagle_assets.storage.guard import refuse_symlink
from eagle_assets.storage.shards import write_bytes_atomic, write_json_atomic
from eagle_assets.target_model.config import config_vocab_size


def _passing(context: dg.AssetExecutionContext, settings: PipelineSettings) -> tuple[list[str], dict[str, str]]:
    """The datasets that passed QC (the others logged with the reason); a Failure when there is none."""
    keys, excluded = passing_datasets(settings.layout(), settings.catalog())
    for key, why in excluded.items():
        context.log.warning(f"partition {key} excluded from training: {why}")
    if not keys:
        raise dg.Failure(description="no partition has passing QC shards: materialize partition_job for at least one "
                                     "partition and fix its failed checks first",
                         metadata={"excluded": dg.MetadataValue.json(excluded)})
    return keys, excluded


def draft_vocab(context: dg.AssetExecutionContext, settings: dg.ResourceParam[PipelineSettings],
                target: dg.ResourceParam[TargetModel]) -> dg.MaterializeResult:
    """Draft vocab (d2t, t2d) from token counts over loss-masked completion tokens of every passing partition."""
    # one writer of the vocab's folder at a time, taken first: a second run is refused before it counts
    with stage_writer(settings.layout(), "draft_vocab"):
        keys, excluded = _passing(context, settings)
        vocab_size = config_vocab_size(target.resolve())
        r = draft_vocab_stage(settings.layout(), settings.catalog(), keys, excluded, vocab_size)
    return dg.MaterializeResult(metadata={
        "draft_vocab_size": int(r.vocab.d2t.shape[0]),
        "target_vocab_size": vocab_size,
        "distinct_completion_tokens": r.distinct,
        "completion_tokens": sum(r.tokens_per_partition.values()),
        "token_coverage": r.coverage,
        "tokens_per_partition": dg.MetadataValue.json(r.tokens_per_partition),
        "excluded_partitions": dg.MetadataValue.json(excluded),
        "path": dg.MetadataValue.path(str(r.out)),
    })


def training_mix(context: dg.AssetExecutionContext,
                 settings: dg.ResourceParam[PipelineSettings]) -> dg.MaterializeResult:
    """Rows the drafter trains on: a token budget split by partition weights, with caps on short-row buckets."""
    from eagle_assets.drafter.data.mix import mix_table_markdown
    from eagle_assets.figures.plots import png_markdown

    with stage_writer(settings.layout(), "training_mix"):  # one writer of the mix's folder at a time, taken first
        keys, excluded = _passing(context, settings)
        r = training_mix_stage(settings.layout(), settings.catalog(), keys, excluded)
    mix, spec = r.result, settings.catalog().training.mix
    for note in mix.notes:
        context.log.warning(f"training mix: {note}")
    if r.out is None:
        raise dg.Failure(
            description=f"the training mix is empty: no row fits training.mix (token_budget {mix.budget}, weights "
                        f"{dict(spec.weights)}, bucket_caps {[c.model_dump() for c in spec.bucket_caps]}); with only "
                        "short partitions, a cap on short rows leaves nothing -- loosen the caps or add "
                        "long-reasoning partitions",
            metadata={"notes": dg.MetadataValue.json(mix.notes), "before": dg.MetadataValue.json(mix.before)})
    return dg.MaterializeResult(metadata={
        "dagster/row_count": len(mix.selected),
        "mode": spec.mode,
        "token_budget": mix.budget,
        "tokens": mix.tokens,
        **{f"share_tokens_{b}": round(mix.share(mix.after, bucket=b), 4) for b in mix.buckets},
        "mix": dg.MetadataValue.md(mix_table_markdown(mix)),
        "plot": dg.MetadataValue.md(png_markdown(r.png, "training mix before / after")),
        "notes": dg.MetadataValue.json(mix.notes),
        "excluded_partitions": dg.MetadataValue.json(excluded),
        # per partition: its training-split rows (the candidates) and how many of them the mix took, for the CLI
        "rows_by_partition": dg.MetadataValue.json({
            p: {"candidates": sum(b["rows"] for b in mix.before.get(p, {}).values()),
                "mix": sum(b["rows"] for b in mix.after.get(p, {}).values())} for p in sorted(mix.before)}),
        "path": dg.MetadataValue.path(str(r.out)),
    })


@dataclass
class TrainingInputs:
    """What every drafter of a catalog trains and is measured on: the partitions that passed QC (``keys``), the
    draft vocab and its folder, the training mix's rows and the validation and test rows (``(sample_id, input_ids,
    loss_mask, partition)``; validation and test sorted by partition and id: the bootstrap resamples by position)."""

    keys: list[str]
    vocab: Any
    vocab_dir: Any
    rows: list
    validation: list
    held: list


def training_inputs(layout, catalog) -> TrainingInputs:
    """The :class:`TrainingInputs` stored under ``layout`` for ``catalog``.

    Raises:
        dg.Failure: the training mix cannot be read (``MixError``: materialize ``training_mix``).
    """
    keys, vocab, vocab_dir = stored_draft_vocab(layout)
    try:
        rows = mixed_training_rows(layout, catalog, keys)
    except MixError as exc:
        raise dg.Failure(description=str(exc)) from exc
    # Shard order is the order replies came back from the server, which timing decides; the bootstrap intervals
    # resample rows by position, so they are computed over rows in a fixed order.
    validation = sorted(load_split_rows(layout, catalog, keys, "validation"), key=lambda r: (r[3], r[0]))
    held = sorted(load_split_rows(layout, catalog, keys, "test"), key=lambda r: (r[3], r[0]))
    return TrainingInputs(keys, vocab, vocab_dir, rows, validation, held)


def train_step(context, t, model_dir, out, features, inputs: TrainingInputs):
    """Train the drafter of the training section ``t`` (inline, or data-parallel under torchrun through Dagster
    Pipes) on ``t.threads`` threads into ``out/checkpoint``; the ``TrainResult``. The training state lives beside the
    checkpoint (``out/train_state``): a run killed mid-training goes on from its last saved step and ends with the
    weights an unbroken run would have."""
    from eagle_assets.drafter.training.loop import train_drafter
    from eagle_assets.drafter.training.recipe import config_from_catalog

    rows = [(i, m) for _s, i, m, _k in inputs.rows]
    validation = [(i, m) for _s, i, m, _k in inputs.validation]
    vocab, vocab_dir = inputs.vocab, inputs.vocab_dir
    config = config_from_catalog(t)
    with torch_threads(t.threads):
        if t.launcher == "torchrun":
            from eagle_assets.assets.torchrun_launch import train_with_torchrun

            result = train_with_torchrun(context, model_dir, rows, validation, vocab_dir, config, out,
                                         t.nproc_per_node, features=features)
        else:
            result = train_drafter(model_dir, rows, vocab, config, out / "checkpoint",
                                   log=_bounded_log(context.log.info), state_dir=out / "train_state",
                                   validation_rows=validation, features=features)
    for line in result.notes:
        context.log.info(line)
    return result


def _training_metadata(result, png: bytes, train_rows: int, held_rows: int, keys: list[str]) -> dict:
    from eagle_assets.drafter.training.learning_curve import curve_table
    from eagle_assets.figures.plots import png_markdown

    losses = [s.loss for s in result.steps]
    tenth = max(1, len(losses) // 10)
    return {
        "checkpoint": dg.MetadataValue.path(str(result.checkpoint_dir)),
        "drafter_architecture": result.drafter_config.describe(),
        "sglang_class": result.checkpoint.config["architectures"][0],
        "parameters": result.checkpoint.parameters,
        "train_rows": train_rows,
        "validation_rows": result.validation_rows,
        "heldout_rows": held_rows,
        "steps": len(losses),
        "planned_steps": result.plan.total_steps,
        "epochs": round(len(losses) / result.plan.batches_per_epoch, 2),
        "limited_by": result.plan.limited_by,
        "train_tokens": sum(s.tokens for s in result.steps),
        "stopped_early": result.stopped_early,
        "exported_step": result.best_step if result.best_step >= 0 else len(losses),
        "tokens_per_s": round(result.tokens_per_s, 1),
        "train_seconds": round(result.train_seconds, 1),
        "feature_seconds": round(result.feature_seconds, 1),
        "eval_seconds": round(result.eval_seconds, 1),
        "resumed_from_step": result.resumed_from_step,
        "rows_skipped": dg.MetadataValue.json(result.skip_reasons),
        "loss_first_10pct": float(np.mean(losses[:tenth])),
        "loss_last_10pct": float(np.mean(losses[-tenth:])),
        "val_tau_final": round(result.curve[-1].val_tau, 4) if result.curve else None,
        "learning_curve": dg.MetadataValue.md(png_markdown(png, "learning curve")),
        "learning_curve_table": dg.MetadataValue.md(curve_table(result.curve)),
        "partitions": dg.MetadataValue.json(keys),
    }


def _export_check(checkpoint) -> dg.AssetCheckResult:
    from eagle_assets.drafter.family import family_of_checkpoint

    try:
        report = family_of_checkpoint(checkpoint).validate(checkpoint)
    except ValueError as exc:  # the family's CheckpointError, or no family claims the export
        return dg.AssetCheckResult(check_name="export_contract", passed=False,
                                   severity=dg.AssetCheckSeverity.ERROR, description=str(exc))
    return dg.AssetCheckResult(check_name="export_contract", passed=True,
                               metadata={"report": dg.MetadataValue.json(_jsonable(report))})


def train_and_evaluate(context: dg.AssetExecutionContext, settings: PipelineSettings, target: TargetModel,
                       sglang: SGLangServerResource, full_asset_graph: Callable[[], Any] | None = None):
    """The body of ``drafter_checkpoint``: train on the training mix, export, check the export, simulate
    acceptance on the held-out rows (see :func:`build_training_assets`).

    Raises ``SymlinkRefusedError`` when a folder it writes under ``drafter_checkpoint/`` is a symbolic link
    (``drafter_checkpoint`` runs it inside ``assets.locking.stage_writer``, which makes that a ``dg.Failure``)."""
    from eagle_assets.drafter.evaluation.heldout import acceptance_png
    from eagle_assets.drafter.evaluation.verdict import evaluate_checkpoint
    from eagle_assets.drafter.family import family_for, family_of_checkpoint
    from eagle_assets.drafter.features.source import ServedFeatures, resolve_features
    from eagle_assets.drafter.training.learning_curve import curve_png

    catalog, layout = settings.catalog(), settings.layout()
    t = catalog.training
    inputs = training_inputs(layout, catalog)
    keys, vocab, rows, validation, held = inputs.keys, inputs.vocab, inputs.rows, inputs.validation, inputs.held
    model_dir = target.resolve()
    out = layout.stage_dir("drafter_checkpoint")
    for sub in ("checkpoint", "train_state", "train_inputs", "features"):
        refuse_symlink(out / sub)  # cleared, replaced or rewritten below: never through a link
    context.log.info(f"training on {len(rows)} rows of {keys}; {len(validation)} validation rows steer it, "
                     f"{len(held)} test rows are held out")
    # training.features: local (the target runs here) or served (SGLang in aux-capture mode: the catalog's
    # features.url, else the server resource's, launched with the capture flags)
    features = resolve_features(t.features, model_dir, out / "features", t.aux_layer_ids, t.max_length,
                                lambda capture: sglang.base_urls(str(model_dir), aux_capture=capture),
                                sglang.api_key_env,
                                lambda layers: family_for(t.drafter.architecture).capture_ids(layers, None, t.drafter))
    result = train_step(context, t, model_dir, out, features, inputs)
    write_provenance(context, settings, result.checkpoint_dir, fallback_graph=full_asset_graph)
    write_json_atomic(result.to_dict(), out / "training_metrics.json")
    best = result.best_step if result.best_step >= 0 else (result.curve[-1].step if result.curve else None)
    png = curve_png(result.curve, result.steps, best_step=best)
    write_bytes_atomic(png, out / "learning_curve.png")
    metadata = _training_metadata(result, png, len(rows), len(held), keys)
    if t.drafter.architecture == "auto":  # what auto chose for this target, and why
        from transformers import AutoConfig

        metadata["drafter_choice"] = family_for("auto").auto_reason(AutoConfig.from_pretrained(model_dir))
    yield dg.MaterializeResult(metadata=metadata)
    yield _export_check(result.checkpoint_dir)
    # served: the target does not fit here; its config and embedding only, every feature, greedy id and re-run a
    # request to the features server(s)
    served = ServedFeatures(model_dir, features, context.log.info) if features.source == "served" else None
    if served is None:
        from transformers import AutoModelForCausalLM

        target_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    else:
        target_model = served.target
    drafter, _ = family_of_checkpoint(result.checkpoint_dir).load(result.checkpoint_dir, target_model)
    with torch_threads(t.threads):
        measured = evaluate_checkpoint(catalog, target_model, drafter, vocab, held, keys, served)
    if served is not None and served.source is not None:
        context.log.info(f"acceptance from served features: {served.source.stats.to_dict()}")
    context.log.info(f"acceptance simulated in {measured.seconds:.1f}s")
    yield acceptance_check(t, measured.heldout, measured.missing, acceptance_png, measured.by_mode,
                           drafter=drafter.config.describe())


def build_training_assets(full_asset_graph: Callable[[], Any] | None = None) -> list:
    """``draft_vocab``, ``training_mix``, ``drafter_checkpoint`` and the checkpoint's checks.

    ``full_asset_graph``: returns the whole asset graph these assets are part of, for the checkpoint's provenance
    in runs that have no repository (``execute_in_process``); ``build_definitions`` passes its own."""
    vocab = dg.asset(group_name="drafter", deps=["qc_shards"], kinds={"numpy"}, op_tags=AFTER_OBSERVATIONS)(draft_vocab)
    mix = dg.asset(group_name="drafter", deps=["qc_shards"], kinds={"parquet"}, op_tags=AFTER_OBSERVATIONS)(
        training_mix)

    def drafter_checkpoint(context: dg.AssetExecutionContext, settings: dg.ResourceParam[PipelineSettings],
                           target: dg.ResourceParam[TargetModel], sglang: dg.ResourceParam[SGLangServerResource]):
        """EAGLE-3 drafter trained with TTT on the target's aux hidden states; SGLang-loadable checkpoint directory.

        Metadata: the run's size (rows, steps, epochs, tokens, seconds) and its learning curve (TTT loss and
        simulated tau on the validation rows against training tokens) as a plot and a table."""
        # one writer of drafter_checkpoint/ (checkpoint, training state, features, metrics) for the whole step
        with stage_writer(settings.layout(), "drafter_checkpoint"):
            yield from train_and_evaluate(context, settings, target, sglang, full_asset_graph)

    checks = [
        dg.AssetCheckSpec("export_contract", asset="drafter_checkpoint",
                          description="tensor names, shapes, dtypes and config fields SGLang's EAGLE-3 loader needs"),
        dg.AssetCheckSpec("acceptance_length", asset="drafter_checkpoint",
                          description="simulated chain drafting on held-out test rows: tau per partition with its "
                                      "spread, and on prompts from a source the drafter never trained on"),
    ]
    checkpoint = dg.asset(group_name="drafter", deps=[vocab, mix], kinds={"pytorch", "safetensors"},
                          check_specs=checks)(drafter_checkpoint)
    return [vocab, mix, checkpoint]


def _bounded_log(log, every_s: float = 5.0):
    """Wrap ``log`` so per-step training lines reach the Dagster log at most every ``every_s`` seconds."""
    last = [0.0]

    def emit(line: str) -> None:
        now = time.monotonic()
        if now - last[0] >= every_s or not line.startswith("step"):
            last[0] = now
            log(line)

    return emit


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if hasattr(obj, "__dict__"):
        return _jsonable(vars(obj))
    return obj if isinstance(obj, (int, float, str, bool, type(None))) else str(obj)


@contextmanager
def torch_threads(n: int | None):
    """Run the block with ``n`` torch CPU threads (None = as is), then restore the previous count."""
    import torch

    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
