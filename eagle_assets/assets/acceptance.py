"""The ``acceptance_length`` check of ``drafter_checkpoint``: simulated acceptance on held-out rows (by thinking
mode where a partition has several) and on unseen prompts the target answers greedily."""

import hashlib
import json
import time
from collections import Counter
from pathlib import Path

import dagster as dg
import numpy as np
import pyarrow.parquet as pq

from eagle_assets.assets.resources import PipelineSettings
from eagle_assets.assets.training_rows import target_vocab_size


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


# Fewer held-out test rows than this make the mean tau a figure to read with its CI: the description says so.
THIN_TEST_ROWS = 20


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
    n_parts, n_rows = len(heldout.groups), sum(heldout.rows.values())
    text = (f"mean held-out tau {mean_tau:.3f}{spread} over {n_parts} partition{'s' if n_parts != 1 else ''}, "
            f"{n_rows} test rows, k={t.acceptance_k}")
    if unseen is not None:
        u_ci = f" (95% CI {unseen.tau_ci95[0]:.2f}-{unseen.tau_ci95[1]:.2f})" if unseen.tau_ci95 else ""
        text += f"; unseen-source tau {unseen.tau:.3f}{u_ci} on {unseen.n_rows} rows"
    level = "ERROR" if not passed else "WARN" if warn else "OK"
    text = (f"{level}: {text} (levels, on the held-out mean: error at or under {error_at:g} = 1 + "
            f"training.min_tau_margin, warn under training.tau_warn {warn_under:g})")
    if n_rows < THIN_TEST_ROWS:
        text += (f"; only {n_rows} test rows: read the CI, not the figure (more source rows, or a larger "
                 "training.holdout_fraction / holdout_rows)")
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


def unseen_rows_in_background(settings: PipelineSettings, t, model_dir: Path, out: Path, log):
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
