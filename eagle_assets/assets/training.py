"""Assets ``draft_vocab``, ``training_mix`` and ``drafter_checkpoint`` (checks ``export_contract``, ``acceptance_length``)."""


import hashlib
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
import pyarrow.parquet as pq

from eagle_assets.assets.qc import dataset_shard_paths, passing_partitions
from eagle_assets.assets.resources import PipelineSettings, TargetModel
from eagle_assets.assets.server_resource import SGLangServerResource
from eagle_assets.assets.provenance import write_provenance
from eagle_assets.storage.shards import write_json_atomic


def _holdout_rank(sample_id: str, seed: int) -> float:
    """Keyed hash of a sample id in [0, 1): the held-out split's order (stable when rows are added)."""
    h = int.from_bytes(hashlib.sha256(f"holdout:{seed}:{sample_id}".encode()).digest()[:8], "big")
    return h / 2**64


def is_holdout(sample_id: str, fraction: float, seed: int) -> bool:
    """Deterministic held-out split by a keyed hash of the sample id (stable when rows are added): the rule of
    ``training.holdout_fraction`` when ``training.holdout_rows`` is null."""
    return _holdout_rank(sample_id, seed) < fraction


#: the three splits of a partition's QC rows: trained on, steering training (learning curve, early stopping),
#: and the acceptance check's held-out test rows.
SPLITS = ("train", "validation", "test")


def row_splits(sample_ids: list[str], training) -> dict[str, str]:
    """``sample_id -> "train" | "validation" | "test"`` for one partition's QC rows.

    The unit of the split is the conversation (``tokenized_prompts.walk.conversation_id``): every turn row and both
    thinking modes of one conversation land in the same split, so a held-out turn never has its own prompt or
    earlier turns in the training rows; a single-turn row is its own conversation. Held out (never trained on):
    every conversation :func:`is_holdout` puts under ``training.holdout_fraction``, at most
    ``training.holdout_rows`` of them (lowest keyed hash first; null = no cap). So a large fraction with a cap gives
    the same count in every partition big enough (the default catalog: 34 of 48), and a small partition keeps its
    share of training rows. Of the held-out conversations, the ``validation_rows`` of highest hash (at most half of
    them) steer training; the rest are the acceptance check's test rows. The training rows are exactly those whose
    conversation :func:`is_holdout` leaves out, and validation never overlaps the test rows.
    """
    from eagle_assets.tokenized_prompts.walk import conversation_id

    conversation = {s: conversation_id(s) for s in sample_ids}
    ranked = sorted(set(conversation.values()), key=lambda c: (_holdout_rank(c, training.seed), c))
    held = [c for c in ranked if is_holdout(c, training.holdout_fraction, training.seed)]
    if training.holdout_rows is not None:
        held = held[: training.holdout_rows]
    n_val = min(training.validation_rows, len(held) // 2)
    split = {c: "test" for c in held[: len(held) - n_val]}
    split.update({c: "validation" for c in held[len(held) - n_val:]})
    return {s: split.get(conversation[s], "train") for s in sample_ids}


def _dataset_splits(settings: PipelineSettings, key: str) -> tuple[list[Path], dict[str, str]]:
    """The QC shards of dataset ``key`` (every chunk's, ``assets.qc.dataset_shard_paths``) and the split of its
    rows (:func:`row_splits` over the sample ids of all of them: a chunked dataset splits as the unchunked one)."""
    import pyarrow as pa

    paths = dataset_shard_paths(settings, key)
    sids = pa.concat_tables([pq.read_table(p, columns=["sample_id"]) for p in paths]).column(0).to_pylist()
    return paths, row_splits(sids, settings.catalog().training)


def load_split_rows(settings: PipelineSettings, keys: list[str], split: str):
    """Rows (sample_id, input_ids int32 [T], loss_mask int8 [T], partition) of ``keys``' QC shards on one split
    (one of :data:`SPLITS`), in shard order."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {SPLITS}")
    return list(iter_split_rows(settings, keys, split))


def iter_split_rows(settings: PipelineSettings, keys: list[str], split: str, wanted=None):
    """``load_split_rows`` lazily: shard by shard, one record batch at a time, rows sliced from the batch's flat
    arrays (never a whole partition's ids as Python lists). ``wanted``: a collection of ``(partition, sample_id)``
    to keep (None = every row of the split)."""
    for key in keys:
        paths, splits = _dataset_splits(settings, key)
        for path in paths:
            for batch in pq.ParquetFile(path).iter_batches(batch_size=1024,
                                                           columns=["sample_id", "input_ids", "loss_mask"]):
                ids_col, mask_col = batch.column(1), batch.column(2)
                ids_off, mask_off = ids_col.offsets.to_numpy(), mask_col.offsets.to_numpy()
                ids_flat = ids_col.values.to_numpy().astype(np.int32, copy=False)
                mask_flat = mask_col.values.to_numpy().astype(np.int8, copy=False)
                for i, sid in enumerate(batch.column(0).to_pylist()):
                    if splits[sid] != split or (wanted is not None and (key, sid) not in wanted):
                        continue
                    yield (sid, ids_flat[ids_off[i]:ids_off[i + 1]].copy(),
                           mask_flat[mask_off[i]:mask_off[i + 1]].copy(), key)


def load_training_rows(settings: PipelineSettings, keys: list[str], holdout: bool):
    """Rows (sample_id, input_ids int32 [T], loss_mask int8 [T], partition) of ``keys``' QC shards: the training
    split, or (``holdout``) the held-out test split."""
    return load_split_rows(settings, keys, "test" if holdout else "train")


def mix_candidates(settings: PipelineSettings, keys: list[str]):
    """Every training-split QC row of ``keys`` as a ``MixCandidate`` (completion tokens = loss tokens)."""
    import pyarrow.compute as pc

    from eagle_assets.drafter.mix import MixCandidate

    out = []
    for key in keys:
        paths, splits = _dataset_splits(settings, key)
        for path in paths:  # one shard's ids at a time, only their lengths kept
            t = pq.read_table(path, columns=["sample_id", "input_ids", "n_prompt_tokens"])
            lengths = pc.subtract(pc.list_value_length(t.column("input_ids")), t.column("n_prompt_tokens")).to_pylist()
            for sid, n in zip(t.column("sample_id").to_pylist(), lengths):
                if splits[sid] == "train":
                    out.append(MixCandidate(key, sid, int(n)))
    return out


def target_vocab_size(model_dir: Path) -> int:
    """``vocab_size`` of a target model directory's config.json (top level or ``text_config``)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return int(cfg.get("vocab_size") or cfg["text_config"]["vocab_size"])


def build_training_assets(full_asset_graph: Callable[[], Any] | None = None) -> list:
    """``draft_vocab``, ``drafter_checkpoint`` and the checkpoint's checks.

    ``full_asset_graph``: returns the whole asset graph these assets are part of, for the checkpoint's provenance
    in runs that have no repository (``execute_in_process``); ``build_definitions`` passes its own."""

    @dg.asset(group_name="drafter", deps=["qc_shards"], kinds={"numpy"})
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
            paths, splits = _dataset_splits(settings, key)
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

    @dg.asset(group_name="drafter", deps=["qc_shards"], kinds={"parquet"})
    def training_mix(context: dg.AssetExecutionContext, settings: PipelineSettings) -> dg.MaterializeResult:
        """Rows the drafter trains on: a token budget split by partition weights, with caps on short-row buckets."""
        import pyarrow as pa

        from eagle_assets.drafter.mix import build_mix, mix_png, mix_table_markdown
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
            unseen_early = (_unseen_rows_in_background(settings, t, model_dir, out, unseen_log.append)
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


def mixed_training_rows(settings: PipelineSettings, keys: list[str]):
    """The training rows the ``training_mix`` asset chose, in its order (partitions of ``keys`` only).

    Raises dg.Failure when the mix is missing or names rows the QC shards no longer hold (re-materialize
    ``training_mix``)."""
    mix_file = settings.layout().base / "training_mix" / "mix.parquet"
    if not mix_file.exists():
        raise dg.Failure(description=f"{mix_file} does not exist: materialize training_mix first (training_job does)")
    mix = pq.read_table(mix_file, columns=["partition", "sample_id"]).to_pylist()
    chosen = [(m["partition"], m["sample_id"]) for m in mix if m["partition"] in keys]
    # only the chosen rows are read out of the shards (iter_split_rows), not every training row first
    by_id = {(k, sid): (sid, ids, mask, k)
             for sid, ids, mask, k in iter_split_rows(settings, keys, "train", wanted=set(chosen))}
    missing = [c for c in chosen if c not in by_id]
    if missing:
        raise dg.Failure(description=f"training_mix names {len(missing)} rows that the QC shards no longer hold "
                         f"(e.g. {missing[:3]}): re-materialize training_mix after qc_shards changed")
    return [by_id[c] for c in chosen]


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


def thinking_mode_groups(held) -> dict[str, list]:
    """Held-out ``(input_ids, loss_mask)`` rows by the thinking mode of their turn row id (``all_turns``
    partitions: ``tokenized_prompts.walk.parse_turn_row_id``); empty when no row names a mode other than "default"."""
    from eagle_assets.tokenized_prompts.walk import parse_turn_row_id

    out: dict[str, list] = {}
    for sample_id, ids, mask, _key in held:
        parsed = parse_turn_row_id(sample_id)
        if parsed is not None:
            out.setdefault(parsed[1], []).append((ids, mask))
    return out if set(out) - {"default"} else {}


def acceptance_check(t, heldout, unseen, missing: list[str], png_fn, unseen_note: str | None = None,
                     by_mode=None) -> dg.AssetCheckResult:
    """The ``acceptance_length`` check: ERROR when the mean held-out tau is at or under ``1 + min_tau_margin``,
    WARN under ``tau_warn``; the unseen-source tau is reported beside it (it does not set the level: prompts of
    another source are expected to draft worse, and how much worse is the figure to read), and so is the held-out
    tau per thinking mode (``by_mode``: :class:`~eagle_assets.drafter.evaluation.GroupedAcceptance` by mode) where
    the rows carry one."""
    from eagle_assets.figures.plots import png_markdown

    mean_tau, ci = heldout.mean_tau, heldout.mean_tau_ci95
    error_at, warn_under = 1.0 + t.min_tau_margin, t.tau_warn
    passed = mean_tau > error_at
    warn = mean_tau < warn_under
    spread = f" (95% CI {ci[0]:.2f}-{ci[1]:.2f})" if ci else ""
    text = (f"mean held-out tau {mean_tau:.3f}{spread} over {len(heldout.groups)} partitions, "
            f"{sum(heldout.rows.values())} test rows, k={t.acceptance_k}")
    if unseen is not None:
        u_ci = f" (95% CI {unseen.tau_ci95[0]:.2f}-{unseen.tau_ci95[1]:.2f})" if unseen.tau_ci95 else ""
        text += f"; unseen-source tau {unseen.tau:.3f}{u_ci} on {unseen.n_rows} rows"
    level = "ERROR" if not passed else "WARN" if warn else "OK"
    text = f"{level}: {text} (levels: error at or under {error_at:g}, warn under {warn_under:g})"
    if missing:
        text += f"; no held-out rows for {missing} (left out of the mean)"
    if unseen_note:
        text += f"; {unseen_note}"
    if by_mode is not None:
        text += "; by thinking mode: " + ", ".join(
            f"{m} {r.tau:.3f}" + (f" ({r.tau_ci95[0]:.2f}-{r.tau_ci95[1]:.2f})" if r.tau_ci95 else "")
            + f" on {by_mode.rows.get(m, r.n_rows)} rows" for m, r in by_mode.groups.items())
    curves = dict(heldout.groups)
    if unseen is not None:
        curves["unseen source"] = unseen
    metadata = {
        "mean_tau": mean_tau,
        "mean_tau_ci95": dg.MetadataValue.json(ci),
        "tau_error_at_or_under": error_at,
        "tau_warn_under": warn_under,
        "k": t.acceptance_k,
        "per_partition": dg.MetadataValue.json(heldout.summary()),
        **{f"tau_{k}": round(r.tau, 4) for k, r in heldout.groups.items()},
        "per_position_acceptance": dg.MetadataValue.md(png_markdown(png_fn(curves), "per-position acceptance")),
        "partitions_without_heldout_rows": dg.MetadataValue.json(missing),
    }
    if by_mode is not None:
        metadata["tau_by_thinking"] = dg.MetadataValue.json(by_mode.summary())
    if unseen is not None:
        metadata.update({
            "unseen_tau": round(unseen.tau, 4),
            "unseen_tau_ci95": dg.MetadataValue.json([round(x, 4) for x in unseen.tau_ci95]),
            "unseen": dg.MetadataValue.json({
                "rows": unseen.n_rows, "verifications": unseen.n_verifications,
                "tau_row_sd": round(unseen.tau_row_sd, 4),
                "per_position_acceptance": [round(a, 4) for a in unseen.per_position_acceptance]}),
        })
    return dg.AssetCheckResult(
        check_name="acceptance_length",
        passed=passed and not warn,
        severity=dg.AssetCheckSeverity.ERROR if not passed else dg.AssetCheckSeverity.WARN,
        description=text,
        metadata=metadata,
    )


# A second float32 copy of the target stays in memory while the drafter trains; above this size it is not worth it.
UNSEEN_OVERLAP_MAX_WEIGHT_BYTES = 1 << 30


def _unseen_rows_in_background(settings: PipelineSettings, t, model_dir: Path, out: Path, log):
    """A future of :func:`unseen_eval_rows` (local target) started now on a thread of its own, or None when the
    unseen figure is off, ``training.threads`` is unset (training may then use every core) or the target's weights
    are over :data:`UNSEEN_OVERLAP_MAX_WEIGHT_BYTES` (the thread loads its own copy). Its ``result()`` raises what
    ``unseen_eval_rows`` raised. The thread runs torch with ``training.threads`` threads, as the training does."""
    if t.unseen_eval is None or not t.threads:
        return None
    if sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors")) > UNSEEN_OVERLAP_MAX_WEIGHT_BYTES:
        return None
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from transformers import AutoModelForCausalLM

    # loaded here, not on the thread: from_pretrained patches torch's init functions process-wide while it builds a
    # model, which breaks a model built at the same time on another thread (the trainer's target)
    target_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()

    def rows():
        torch.set_num_threads(t.threads)  # the training's count (set in this thread too, whatever torch's backend)
        return unseen_eval_rows(settings, target_model, model_dir, out / "unseen_eval", log)

    pool = ThreadPoolExecutor(1, thread_name_prefix="unseen-eval")
    future = pool.submit(rows)
    pool.shutdown(wait=False)
    return future


def unseen_eval_rows(settings: PipelineSettings, target_model, model_dir: Path, cache_dir: Path, log,
                     served_client=None) -> list:
    """Rows for the unseen-source figure: the catalog's ``training.unseen_eval`` prompts, rendered with the target's
    chat template and decoded greedily by the local target (:func:`~eagle_assets.drafter.evaluation.greedy_rows`),
    or, with ``served_client`` (a ``GenerateClient`` of the server serving the target: ``training.features:
    served``), by that server's ``/generate`` at temperature 0 (:func:`~eagle_assets.drafter.evaluation.
    served_greedy_rows`; ``target_model`` is then not run). Prompts the server refuses are skipped and logged.

    Cached in ``cache_dir/rows.parquet`` under a key of (prompt ids, max_new_tokens, stop ids, the target's weight
    files' names, sizes and mtimes): a rerun on the same target and prompts generates nothing, whichever of the two
    decoded them (both are the target's greedy rows; the simulation re-runs the target wherever a draft leaves a
    row, so a near-tie decoded differently does not change what tau measures). Prompts the renderer rejects are
    skipped and logged.
    """
    import pyarrow as pa

    from eagle_assets.drafter.evaluation import greedy_rows
    from eagle_assets.raw_prompts.rows import collect_prompt_rows
    from eagle_assets.storage.shards import write_parquet_atomic
    from eagle_assets.target_model.profile import detect_profile
    from eagle_assets.target_model.render import RenderError, render_prompt
    from eagle_assets.target_model.tokenizer import load_tokenizer

    catalog = settings.catalog()
    spec = catalog.training.unseen_eval
    kept, rejects = collect_prompt_rows("unseen_eval", spec.resolved_sources(catalog.path), spec.prompt_policy)
    tokenizer = load_tokenizer(model_dir)
    profile = detect_profile(tokenizer, catalog.target.profile or None)
    prompts, skipped = [], Counter(r["reason"] for r in rejects)
    for r in list(kept.values())[: spec.limit]:
        try:
            rendered = render_prompt(tokenizer, json.loads(r["messages"]),
                                     json.loads(r["tools"]) if r["tools"] else None,
                                     enable_thinking=spec.enable_thinking, max_prompt_tokens=spec.max_prompt_tokens,
                                     profile=profile)
        except RenderError as exc:
            skipped[exc.reason] += 1
            continue
        prompts.append(list(rendered.prompt_ids))
    if skipped:
        log(f"unseen_eval: {sum(skipped.values())} prompts skipped ({dict(skipped)})")
    weights = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in Path(model_dir).glob("*.safetensors"))
    key = hashlib.sha256(json.dumps([prompts, spec.max_new_tokens, list(profile.stop_ids), weights]).encode()).hexdigest()
    cached = cache_dir / "rows.parquet"
    if cached.exists() and (pq.read_schema(cached).metadata or {}).get(b"key", b"").decode() == key:
        t = pq.read_table(cached)
        return [(np.asarray(i, dtype=np.int32), np.asarray(m, dtype=np.int8))
                for i, m in zip(t.column("input_ids").to_pylist(), t.column("loss_mask").to_pylist())]
    started = time.perf_counter()
    if served_client is not None:
        from eagle_assets.drafter.evaluation import served_greedy_rows

        rows, failed = served_greedy_rows(served_client, prompts, spec.max_new_tokens, profile.stop_ids,
                                          vocab_size=target_vocab_size(model_dir))
        if failed:
            log(f"unseen_eval: {sum(failed.values())} prompts got no generation from the server ({dict(failed)})")
        by = f"the server ({', '.join(served_client.urls)})"
    else:
        rows = greedy_rows(target_model, prompts, spec.max_new_tokens, profile.stop_ids)
        by = "the target"
    log(f"unseen_eval: {len(rows)} rows generated greedily by {by} in {time.perf_counter() - started:.1f}s")
    cache_dir.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist([{"input_ids": i.tolist(), "loss_mask": m.tolist()} for i, m in rows],
                                 schema=pa.schema([("input_ids", pa.list_(pa.int32())),
                                                   ("loss_mask", pa.list_(pa.int8()))], metadata={"key": key}))
    write_parquet_atomic(table, cached)
    return rows
