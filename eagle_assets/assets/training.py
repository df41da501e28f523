"""Assets ``draft_vocab``, ``training_mix`` and ``drafter_checkpoint`` (checks ``export_contract``, ``acceptance_length``)."""


import hashlib
import json
from collections import Counter
from pathlib import Path

import dagster as dg
import numpy as np
import pyarrow.parquet as pq

from eagle_assets.assets.qc import passing_partitions
from eagle_assets.assets.resources import PipelineSettings, TargetModel
from eagle_assets.storage import write_json_atomic


def is_holdout(sample_id: str, fraction: float, seed: int) -> bool:
    """Deterministic held-out split by a keyed hash of the sample id (stable when rows are added)."""
    h = int.from_bytes(hashlib.sha256(f"holdout:{seed}:{sample_id}".encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def load_training_rows(settings: PipelineSettings, keys: list[str], holdout: bool):
    """Rows (sample_id, input_ids int32 [T], loss_mask int8 [T], partition) of ``keys``' QC shards on one split."""
    training = settings.catalog().training
    layout = settings.layout()
    out = []
    for key in keys:
        t = pq.read_table(layout.base / "qc_shards" / key / "shard-00000.parquet",
                          columns=["sample_id", "input_ids", "loss_mask"])
        for sid, ids, mask in zip(t.column("sample_id").to_pylist(), t.column("input_ids").to_pylist(),
                                  t.column("loss_mask").to_pylist()):
            if is_holdout(sid, training.holdout_fraction, training.seed) == holdout:
                out.append((sid, np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.int8), key))
    return out


def mix_candidates(settings: PipelineSettings, keys: list[str]):
    """Every training (non-held-out) QC row of ``keys`` as a ``MixCandidate`` (completion tokens = loss tokens)."""
    import pyarrow.compute as pc

    from eagle_assets.drafter.mix import MixCandidate

    training = settings.catalog().training
    out = []
    for key in keys:
        t = pq.read_table(settings.layout().base / "qc_shards" / key / "shard-00000.parquet",
                          columns=["sample_id", "input_ids", "n_prompt_tokens"])
        lengths = pc.subtract(pc.list_value_length(t.column("input_ids")), t.column("n_prompt_tokens")).to_pylist()
        for sid, n in zip(t.column("sample_id").to_pylist(), lengths):
            if not is_holdout(sid, training.holdout_fraction, training.seed):
                out.append(MixCandidate(key, sid, int(n)))
    return out


def target_vocab_size(model_dir: Path) -> int:
    """``vocab_size`` of a target model directory's config.json (top level or ``text_config``)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return int(cfg.get("vocab_size") or cfg["text_config"]["vocab_size"])


def build_training_assets() -> list:
    """``draft_vocab``, ``drafter_checkpoint`` and the checkpoint's checks."""

    @dg.asset(group_name="drafter", deps=["qc_shards"], kinds={"numpy"})
    def draft_vocab(context: dg.AssetExecutionContext, settings: PipelineSettings,
                    target: TargetModel) -> dg.MaterializeResult:
        """Draft vocab (d2t, t2d) from token counts over loss-masked completion tokens of every passing partition."""
        from eagle_assets.drafter.vocab import build_draft_vocab, count_completion_tokens, validate_draft_vocab

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
        rows = load_training_rows(settings, keys, holdout=False)
        counts = count_completion_tokens([(ids, mask) for _s, ids, mask, _k in rows], vocab_size)
        per_partition = Counter()
        for _sid, _ids, mask, key in rows:
            per_partition[key] += int(mask.sum())
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
        from eagle_assets.quality.plots import png_markdown
        from eagle_assets.storage import write_parquet_atomic

        keys, excluded = passing_partitions(settings)
        if not keys:
            raise dg.Failure(
                description="no partition has passing QC shards: materialize partition_job for at least one "
                "partition and fix its failed checks first",
                metadata={"excluded": dg.MetadataValue.json(excluded)},
            )
        spec = settings.catalog().training.mix
        result = build_mix(mix_candidates(settings, keys), spec, partitions=keys)
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
                              description="simulated chain drafting on held-out rows: tau per partition"),
        ],
    )
    def drafter_checkpoint(context: dg.AssetExecutionContext, settings: PipelineSettings, target: TargetModel):
        """EAGLE-3 drafter trained with TTT on the target's aux hidden states; SGLang-loadable checkpoint directory."""
        from eagle_assets.drafter.acceptance import simulate_acceptance
        from eagle_assets.drafter.export import CheckpointError, load_drafter, validate_checkpoint
        from eagle_assets.drafter.train import TrainConfig, train_drafter
        from eagle_assets.drafter.vocab import draft_vocab_from_arrays
        from eagle_assets.quality.plots import png_markdown
        from transformers import AutoModelForCausalLM

        catalog = settings.catalog()
        t = catalog.training
        keys = json.loads((settings.layout().base / "draft_vocab" / "summary.json").read_text())["partitions"]
        vocab_dir = settings.layout().base / "draft_vocab"
        vocab = draft_vocab_from_arrays(np.load(vocab_dir / "d2t.npy"), np.load(vocab_dir / "t2d.npy"),
                                        np.load(vocab_dir / "token_counts.npy"))
        rows = mixed_training_rows(settings, keys)
        held = load_training_rows(settings, keys, holdout=True)
        model_dir = target.resolve()
        out = settings.layout().stage_dir("drafter_checkpoint")
        config = TrainConfig(lr=t.lr, epochs=t.epochs, max_length=t.max_length, batch_tokens=t.batch_tokens,
                             ttt_steps=t.ttt_steps, seed=t.seed, aux_layer_ids=t.aux_layer_ids,
                             warmup_steps=t.warmup_steps, schedule=t.schedule, save_every_steps=t.save_every_steps)
        context.log.info(f"training on {len(rows)} rows of {keys}; {len(held)} held out")
        # The training state lives beside the checkpoint: a run killed mid-training (a worker lost, a retry) goes on
        # from its last saved step and ends with the weights an unbroken run would have.
        result = train_drafter(model_dir, [(ids, mask) for _s, ids, mask, _k in rows], vocab, config,
                               out / "checkpoint", log=_bounded_log(context.log.info), state_dir=out / "train_state")
        for note in result.notes:
            context.log.info(note)
        ckpt = Path(result.checkpoint_dir)
        losses = [s.loss for s in result.steps]
        write_json_atomic(result.to_dict(), out / "training_metrics.json")
        png = _loss_png(losses)
        (out / "loss.png").write_bytes(png)
        first, last = float(np.mean(losses[: max(1, len(losses) // 10)])), float(np.mean(losses[-max(1, len(losses) // 10):]))
        yield dg.MaterializeResult(metadata={
            "checkpoint": dg.MetadataValue.path(str(ckpt)),
            "train_rows": len(rows),
            "heldout_rows": len(held),
            "steps": len(losses),
            "tokens_per_s": round(result.tokens_per_s, 1),
            "train_seconds": round(result.train_seconds, 1),
            "resumed_from_step": result.resumed_from_step,
            "rows_skipped": dg.MetadataValue.json(result.skip_reasons),
            "loss_first_10pct": first,
            "loss_last_10pct": last,
            "loss_curve": dg.MetadataValue.md(png_markdown(png, "training loss")),
            "partitions": dg.MetadataValue.json(keys),
        })
        try:
            report = validate_checkpoint(ckpt)
            yield dg.AssetCheckResult(check_name="export_contract", passed=True,
                                      metadata={"report": dg.MetadataValue.json(_jsonable(report))})
        except CheckpointError as exc:
            yield dg.AssetCheckResult(check_name="export_contract", passed=False,
                                      severity=dg.AssetCheckSeverity.ERROR, description=str(exc))
        target_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
        drafter, _ = load_drafter(ckpt, target_model)
        per_partition, taus = {}, []
        for key in keys:
            part_rows = [(ids, mask) for _s, ids, mask, k in held if k == key] or \
                        [(ids, mask) for _s, ids, mask, k in rows if k == key][:4]
            acc = simulate_acceptance(target_model, drafter, vocab, part_rows, k=t.ttt_steps,
                                      max_positions=t.acceptance_max_positions)
            per_partition[key] = {"tau": round(acc.tau, 4),
                                  "per_position_acceptance": [round(a, 4) for a in acc.per_position_acceptance]}
            taus.append(acc.tau)
        mean_tau = float(np.mean(taus)) if taus else 0.0
        passed = mean_tau > 1.0 + t.min_tau_margin
        warn = mean_tau < t.tau_warn
        yield dg.AssetCheckResult(
            check_name="acceptance_length",
            passed=passed and not warn,
            severity=dg.AssetCheckSeverity.ERROR if not passed else dg.AssetCheckSeverity.WARN,
            description=f"mean tau {mean_tau:.3f} (error if <= {1.0 + t.min_tau_margin}, warn under {t.tau_warn})",
            metadata={"mean_tau": mean_tau, "per_partition": dg.MetadataValue.json(per_partition),
                      **{f"tau_{k}": v["tau"] for k, v in per_partition.items()}},
        )

    return [draft_vocab, training_mix, drafter_checkpoint]


def mixed_training_rows(settings: PipelineSettings, keys: list[str]):
    """The training rows the ``training_mix`` asset chose, in its order (partitions of ``keys`` only).

    Raises dg.Failure when the mix is missing or names rows the QC shards no longer hold (re-materialize
    ``training_mix``)."""
    mix_file = settings.layout().base / "training_mix" / "mix.parquet"
    if not mix_file.exists():
        raise dg.Failure(description=f"{mix_file} does not exist: materialize training_mix first (training_job does)")
    mix = pq.read_table(mix_file, columns=["partition", "sample_id"]).to_pylist()
    by_id = {(k, sid): (sid, ids, mask, k) for sid, ids, mask, k in load_training_rows(settings, keys, holdout=False)}
    chosen = [(m["partition"], m["sample_id"]) for m in mix if m["partition"] in keys]
    missing = [c for c in chosen if c not in by_id]
    if missing:
        raise dg.Failure(description=f"training_mix names {len(missing)} rows that the QC shards no longer hold "
                         f"(e.g. {missing[:3]}): re-materialize training_mix after qc_shards changed")
    return [by_id[c] for c in chosen]


def _bounded_log(log, every_s: float = 5.0):
    """Wrap ``log`` so per-step training lines reach the Dagster log at most every ``every_s`` seconds."""
    import time

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


def _loss_png(losses: list[float]) -> bytes:
    from eagle_assets.quality.plots import figure_png, plt

    fig, ax = plt.subplots(figsize=(6.4, 3.0), dpi=80)
    ax.plot(losses)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("TTT loss")
    ax.set_title("drafter training loss", fontsize=10)
    return figure_png(fig)
