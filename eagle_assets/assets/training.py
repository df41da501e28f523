"""Assets ``draft_vocab``, ``training_mix`` and ``drafter_checkpoint`` (checks ``export_contract``, ``acceptance_length``)."""


import json
import time
from collections import Counter
from concurrent.futures import wait as futures_wait
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import dagster as dg
import numpy as np

from eagle_assets.assets.inputs import AFTER_OBSERVATIONS
from eagle_assets.assets.qc import passing_partitions
from eagle_assets.assets.resources import PipelineSettings, TargetModel
from eagle_assets.assets.server_resource import SGLangServerResource
from eagle_assets.assets.provenance import write_provenance
from eagle_assets.assets.acceptance import (
    acceptance_check,
    thinking_mode_groups,
    unseen_eval_rows,
    unseen_rows_in_background,
)
from eagle_assets.assets.training_rows import (
    dataset_splits,
    load_split_rows,
    mix_candidates,
    mixed_training_rows,
    target_vocab_size,
)
from eagle_assets.storage.shards import write_json_atomic


def build_training_assets(full_asset_graph: Callable[[], Any] | None = None) -> list:
    """``draft_vocab``, ``drafter_checkpoint`` and the checkpoint's checks.

    ``full_asset_graph``: returns the whole asset graph these assets are part of, for the checkpoint's provenance
    in runs that have no repository (``execute_in_process``); ``build_definitions`` passes its own."""

    @dg.asset(group_name="drafter", deps=["qc_shards"], kinds={"numpy"}, op_tags=AFTER_OBSERVATIONS)
    def draft_vocab(context: dg.AssetExecutionContext, settings: PipelineSettings,
                    target: TargetModel) -> dg.MaterializeResult:
        """Draft vocab (d2t, t2d) from token counts over loss-masked completion tokens of every passing partition."""
        from eagle_assets.drafter.vocab import (build_draft_vocab, count_completion_tokens_in_shards,
                                                validate_draft_vocab)

        keys, excluded = passing_partitions(settings)
        for key, why in excluded.items():
            context.log.warning(f"partition {key} excluded from training: {why}")
        if not keys:
            raise dg.Failure(
                description="no partition has passing QC shards: materialize partition_job for at least one "
                "partition and fix its failed checks first",
                metadata={"excluded": dg.MetadataValue.json(excluded)},
            )
        vocab_size = target_vocab_size(target.resolve())
        # a streaming pass over the shards (record batches, flat arrays): memory does not grow with the partition
        counts = np.zeros(vocab_size, dtype=np.int64)
        per_partition = Counter()
        for key in keys:
            paths, splits = dataset_splits(settings, key)
            part, _ = count_completion_tokens_in_shards(
                paths, vocab_size, include=lambda sids, sp=splits: np.array([sp[s] == "train" for s in sids], bool))
            counts += part
            per_partition[key] += int(part.sum())
        size = settings.catalog().training.draft_vocab_size
        vocab = build_draft_vocab(counts, vocab_size, size)
        validate_draft_vocab(vocab.d2t, vocab.t2d, vocab_size)
        out = settings.layout().stage_dir("draft_vocab")
        np.save(out / "d2t.npy", vocab.d2t)
        np.save(out / "t2d.npy", vocab.t2d)
        np.save(out / "token_counts.npy", counts)
        distinct = int((counts > 0).sum())
        covered = float(counts[vocab.t2d].sum() / max(counts.sum(), 1))
        write_json_atomic({"partitions": keys, "excluded": excluded, "draft_vocab_size": int(vocab.d2t.shape[0]),
                           "distinct_tokens": distinct, "coverage": covered}, out / "summary.json")
        return dg.MaterializeResult(metadata={
            "draft_vocab_size": int(vocab.d2t.shape[0]),
            "target_vocab_size": vocab_size,
            "distinct_completion_tokens": distinct,
            "completion_tokens": int(counts.sum()),
            "token_coverage": covered,
            "tokens_per_partition": dg.MetadataValue.json(dict(per_partition)),
            "excluded_partitions": dg.MetadataValue.json(excluded),
            "path": dg.MetadataValue.path(str(out)),
        })

    @dg.asset(group_name="drafter", deps=["qc_shards"], kinds={"parquet"}, op_tags=AFTER_OBSERVATIONS)
    def training_mix(context: dg.AssetExecutionContext, settings: PipelineSettings) -> dg.MaterializeResult:
        """Rows the drafter trains on: a token budget split by partition weights, with caps on short-row buckets."""
        import pyarrow as pa

        from eagle_assets.drafter.mix import mix_png, mix_table_markdown
        from eagle_assets.figures.plots import png_markdown
        from eagle_assets.storage.shards import write_parquet_atomic

        keys, excluded = passing_partitions(settings)
        if not keys:
            raise dg.Failure(
                description="no partition has passing QC shards: materialize partition_job for at least one "
                "partition and fix its failed checks first",
                metadata={"excluded": dg.MetadataValue.json(excluded)},
            )
        spec = settings.catalog().training.mix
        from eagle_assets.drafter.turn_mix import build_turn_mix
        from eagle_assets.generations.rollout import turn_numbers

        # all_turns partitions are mixed by turn (training.mix.turn_weights); the others exactly as build_mix does
        turn_of = {(k, rid): t for k in keys for part in settings.catalog().dataset_partition_keys(k)
                   for rid, t in turn_numbers(settings.layout().base / "generations" / part).items()}
        result = build_turn_mix(mix_candidates(settings, keys), spec, keys, turn_of)
        for note in result.notes:
            context.log.warning(f"training mix: {note}")
        if not result.selected:
            raise dg.Failure(
                description="the training mix is empty: no row fits training.mix (token_budget "
                f"{result.budget}, weights {dict(spec.weights)}, bucket_caps "
                f"{[c.model_dump() for c in spec.bucket_caps]}); with only short partitions, a cap on short rows "
                "leaves nothing -- loosen the caps or add long-reasoning partitions",
                metadata={"notes": dg.MetadataValue.json(result.notes), "before": dg.MetadataValue.json(result.before)},
            )
        out = settings.layout().stage_dir("training_mix")
        write_parquet_atomic(pa.Table.from_pylist(
            [{"order": i, "partition": c.partition, "sample_id": c.sample_id, "tokens": c.tokens}
             for i, c in enumerate(result.selected)],
            schema=pa.schema([("order", pa.int32()), ("partition", pa.string()), ("sample_id", pa.string()),
                              ("tokens", pa.int32())])), out / "mix.parquet")
        summary = {"mode": spec.mode, "budget": result.budget, "tokens": result.tokens, "rows": len(result.selected),
                   "partitions": keys, "excluded": excluded, "buckets": result.buckets, "before": result.before,
                   "after": result.after, "notes": result.notes}
        write_json_atomic(summary, out / "summary.json")
        png = mix_png(result)
        (out / "mix.png").write_bytes(png)
        return dg.MaterializeResult(metadata={
            "dagster/row_count": len(result.selected),
            "mode": spec.mode,
            "token_budget": result.budget,
            "tokens": result.tokens,
            **{f"share_tokens_{b}": round(result.share(result.after, bucket=b), 4) for b in result.buckets},
            "mix": dg.MetadataValue.md(mix_table_markdown(result)),
            "plot": dg.MetadataValue.md(png_markdown(png, "training mix before / after")),
            "notes": dg.MetadataValue.json(result.notes),
            "excluded_partitions": dg.MetadataValue.json(excluded),
            "path": dg.MetadataValue.path(str(out)),
        })

    @dg.asset(
        group_name="drafter",
        deps=[draft_vocab, training_mix],
        kinds={"pytorch", "safetensors"},
        check_specs=[
            dg.AssetCheckSpec("export_contract", asset="drafter_checkpoint",
                              description="tensor names, shapes, dtypes and config fields SGLang's EAGLE-3 loader needs"),
            dg.AssetCheckSpec("acceptance_length", asset="drafter_checkpoint",
                              description="simulated chain drafting on held-out test rows: tau per partition with "
                              "its spread, and on prompts from a source the drafter never trained on"),
        ],
    )
    def drafter_checkpoint(context: dg.AssetExecutionContext, settings: PipelineSettings, target: TargetModel,
                           sglang: SGLangServerResource):
        """EAGLE-3 drafter trained with TTT on the target's aux hidden states; SGLang-loadable checkpoint directory.

        Metadata: the run's size (rows, steps, epochs, tokens, seconds) and its learning curve (TTT loss and
        simulated tau on the validation rows against training tokens) as a plot and a table."""
        from eagle_assets.drafter.evaluation import acceptance_png, evaluate_groups
        from eagle_assets.drafter.export import CheckpointError, load_drafter, validate_checkpoint
        from eagle_assets.drafter.learning_curve import curve_png, curve_table
        from eagle_assets.drafter.recipe import config_from_catalog
        from eagle_assets.drafter.train import train_drafter
        from eagle_assets.catalog import CatalogError
        from eagle_assets.drafter.vocab import draft_vocab_from_arrays
        from eagle_assets.formats import FormatError
        from eagle_assets.figures.plots import png_markdown
        from transformers import AutoModelForCausalLM

        catalog = settings.catalog()
        t = catalog.training
        keys = json.loads((settings.layout().base / "draft_vocab" / "summary.json").read_text())["partitions"]
        vocab_dir = settings.layout().base / "draft_vocab"
        vocab = draft_vocab_from_arrays(np.load(vocab_dir / "d2t.npy"), np.load(vocab_dir / "t2d.npy"),
                                        np.load(vocab_dir / "token_counts.npy"))
        rows = mixed_training_rows(settings, keys)
        # Shard order is the order replies came back from the server, which timing decides; the bootstrap
        # intervals resample rows by position, so they are computed over rows in a fixed order.
        validation = sorted(load_split_rows(settings, keys, "validation"), key=lambda r: (r[3], r[0]))
        held = sorted(load_split_rows(settings, keys, "test"), key=lambda r: (r[3], r[0]))
        model_dir = target.resolve()
        out = settings.layout().stage_dir("drafter_checkpoint")
        config = config_from_catalog(t)
        context.log.info(f"training on {len(rows)} rows of {keys}; {len(validation)} validation rows steer it, "
                         f"{len(held)} test rows are held out")
        # The training state lives beside the checkpoint: a run killed mid-training (a worker lost, a retry) goes on
        # from its last saved step and ends with the weights an unbroken run would have.
        train_rows = [(ids, mask) for _s, ids, mask, _k in rows]
        val_rows = [(ids, mask) for _s, ids, mask, _k in validation]
        # training.features: local (the target runs here) or served (SGLang in aux-capture mode: the catalog's
        # features.url, else the server resource's, launched with the capture flags; shards cached beside us)
        from eagle_assets.drafter.feature_source import resolve_features

        features = resolve_features(t.features, model_dir, out / "features", t.aux_layer_ids, t.max_length,
                                    lambda capture: sglang.base_urls(str(model_dir), aux_capture=capture),
                                    sglang.api_key_env)
        # The unseen-source rows are decoded while the drafter trains when both fit beside each other: the tiny
        # drafter trains on one thread (training.threads), leaving a core to the target's greedy decoding. The
        # thread count stays at training.threads until that decoding is done (train_drafter restores the count it
        # found), so the rows do not depend on which of the two finishes first.
        unseen_log: list[str] = []
        with torch_threads(t.threads):
            unseen_early = (unseen_rows_in_background(settings, t, model_dir, out, unseen_log.append)
                            if features.source != "served" else None)
            if t.launcher == "torchrun":  # data-parallel processes through Dagster Pipes (torchrun_launch.py)
                from eagle_assets.assets.torchrun_launch import train_with_torchrun

                result = train_with_torchrun(context, model_dir, train_rows, val_rows, vocab_dir, config, out,
                                             t.nproc_per_node, features=features)
            else:
                result = train_drafter(model_dir, train_rows, vocab, config, out / "checkpoint",
                                       log=_bounded_log(context.log.info), state_dir=out / "train_state",
                                       validation_rows=val_rows, features=features)
            if unseen_early is not None:
                futures_wait([unseen_early])  # its result (or error) is read where the figure is computed
        for line in unseen_log:  # logged here: the Dagster log belongs to the step's thread
            context.log.info(line)
        for note in result.notes:
            context.log.info(note)
        ckpt = Path(result.checkpoint_dir)
        write_provenance(context, settings, ckpt, fallback_graph=full_asset_graph)  # provenance.json: code, packages, catalog, inputs' versions, run
        losses = [s.loss for s in result.steps]
        write_json_atomic(result.to_dict(), out / "training_metrics.json")
        png = curve_png(result.curve, result.steps, best_step=result.best_step if result.best_step >= 0 else
                        (result.curve[-1].step if result.curve else None))
        (out / "learning_curve.png").write_bytes(png)
        tenth = max(1, len(losses) // 10)
        first, last = float(np.mean(losses[:tenth])), float(np.mean(losses[-tenth:]))
        plan = result.plan
        yield dg.MaterializeResult(metadata={
            "checkpoint": dg.MetadataValue.path(str(ckpt)),
            "train_rows": len(rows),
            "validation_rows": result.validation_rows,
            "heldout_rows": len(held),
            "steps": len(losses),
            "planned_steps": plan.total_steps,
            "epochs": round(len(losses) / plan.batches_per_epoch, 2),
            "limited_by": plan.limited_by,
            "train_tokens": sum(s.tokens for s in result.steps),
            "stopped_early": result.stopped_early,
            "exported_step": result.best_step if result.best_step >= 0 else len(losses),
            "tokens_per_s": round(result.tokens_per_s, 1),
            "train_seconds": round(result.train_seconds, 1),
            "feature_seconds": round(result.feature_seconds, 1),
            "eval_seconds": round(result.eval_seconds, 1),
            "resumed_from_step": result.resumed_from_step,
            "rows_skipped": dg.MetadataValue.json(result.skip_reasons),
            "loss_first_10pct": first,
            "loss_last_10pct": last,
            "val_tau_final": round(result.curve[-1].val_tau, 4) if result.curve else None,
            "learning_curve": dg.MetadataValue.md(png_markdown(png, "learning curve")),
            "learning_curve_table": dg.MetadataValue.md(curve_table(result.curve)),
            "partitions": dg.MetadataValue.json(keys),
        })
        try:
            report = validate_checkpoint(ckpt)
            yield dg.AssetCheckResult(check_name="export_contract", passed=True,
                                      metadata={"report": dg.MetadataValue.json(_jsonable(report))})
        except CheckpointError as exc:
            yield dg.AssetCheckResult(check_name="export_contract", passed=False,
                                      severity=dg.AssetCheckSeverity.ERROR, description=str(exc))
        served = None
        if features.source == "served":
            # the target does not fit here: its config and embedding only; every feature, greedy id, re-run and
            # unseen-source generation is a request to the features server(s)
            from eagle_assets.drafter.feature_source import ServedFeatures

            served = ServedFeatures(model_dir, features, context.log.info)
            target_model = served.target
        else:
            target_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
        drafter, _ = load_drafter(ckpt, target_model)
        capture = list(drafter.config.aux_capture_ids)
        acceptance_rows = (lambda rows: served.acceptance_rows(rows, capture, vocab)) if served else None
        groups = {key: [(ids, mask) for _s, ids, mask, k in held if k == key] for key in keys}
        missing = [k for k, g in groups.items() if not g]
        started = time.perf_counter()
        with torch_threads(t.threads):
            heldout = evaluate_groups(target_model, drafter, vocab, {k: g for k, g in groups.items() if g},
                                      k=t.acceptance_k, max_positions=t.acceptance_max_positions,
                                      acceptance_rows=acceptance_rows)
            # thinking on and off drafted apart: a drafter trained on reasoning can fall short without it
            modes = thinking_mode_groups(held)
            by_mode = evaluate_groups(target_model, drafter, vocab, modes, k=t.acceptance_k,
                                      max_positions=t.acceptance_max_positions,
                                      acceptance_rows=acceptance_rows) if modes else None
            unseen, unseen_note = None, None
            if t.unseen_eval is not None:
                try:
                    if unseen_early is not None:
                        unseen_rows = unseen_early.result()
                    else:
                        client = served.generate_client(capture) if served else None
                        unseen_rows = unseen_eval_rows(settings, target_model, model_dir, out / "unseen_eval",
                                                       context.log.info, served_client=client)
                except (CatalogError, FormatError) as exc:
                    # A missing or unreadable eval source costs the second figure, never the checkpoint.
                    unseen_note = f"unseen-source figure skipped: {exc}"
                    context.log.warning(unseen_note)
                else:
                    unseen = evaluate_groups(target_model, drafter, vocab, {"unseen": unseen_rows},
                                             k=t.acceptance_k, max_positions=t.acceptance_max_positions,
                                             acceptance_rows=acceptance_rows)
                    unseen = unseen.groups["unseen"]
        if served is not None and served.source is not None:
            context.log.info(f"acceptance from served features: {served.source.stats.to_dict()}")
        context.log.info(f"acceptance simulated in {time.perf_counter() - started:.1f}s")
        yield acceptance_check(t, heldout, unseen, missing, acceptance_png, unseen_note, by_mode)

    return [draft_vocab, training_mix, drafter_checkpoint]


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
