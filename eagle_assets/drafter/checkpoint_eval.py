"""A trained checkpoint's acceptance as the pipeline measures it, without Dagster: simulated tau on each passing
partition's held-out test rows, on the same rows by thinking mode, and on rows of a source it never trained on
(``training.unseen_eval``: the target answers its prompts greedily), and the ``acceptance_length`` verdict on them.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from eagle_assets.catalog import Catalog
from eagle_assets.drafter.evaluation import GroupedAcceptance, evaluate_groups
from eagle_assets.target_model.config import config_vocab_size

# A second float32 copy of the target stays in memory while the drafter trains; above this size it is not worth it.
UNSEEN_OVERLAP_MAX_WEIGHT_BYTES = 1 << 30
# Fewer held-out test rows than this make the mean tau a figure to read with its CI: the verdict says so.
THIN_TEST_ROWS = 20


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


def unseen_rows_in_background(catalog: Catalog, model_dir: Path, out: Path, log: Callable[[str], None]):
    """A future of :func:`unseen_eval_rows` (local target) started now on a thread of its own, or None when the
    unseen figure is off, ``training.threads`` is unset (training may then use every core) or the target's weights
    are over :data:`UNSEEN_OVERLAP_MAX_WEIGHT_BYTES` (the thread loads its own copy). Its ``result()`` raises what
    ``unseen_eval_rows`` raised. The thread runs torch with ``training.threads`` threads, as the training does."""
    t = catalog.training
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
        return unseen_eval_rows(catalog, target_model, model_dir, out / "unseen_eval", log)

    pool = ThreadPoolExecutor(1, thread_name_prefix="unseen-eval")
    future = pool.submit(rows)
    pool.shutdown(wait=False)
    return future


def _unseen_prompts(catalog: Catalog, model_dir: Path, log: Callable[[str], None]) -> tuple[list[list[int]], Any]:
    """The ``training.unseen_eval`` prompts rendered with the target's chat template (renderer rejects skipped and
    logged), and the target's family profile."""
    from eagle_assets.raw_prompts.rows import collect_prompt_rows
    from eagle_assets.target_model.render import RenderError, render_prompt
    from eagle_assets.target_model.setup import load_target_setup

    spec = catalog.training.unseen_eval
    kept, rejects = collect_prompt_rows("unseen_eval", spec.resolved_sources(catalog.path), spec.prompt_policy)
    setup = load_target_setup(model_dir, catalog.target.profile or None)
    prompts, skipped = [], Counter(r["reason"] for r in rejects)
    for r in list(kept.values())[: spec.limit]:
        try:
            rendered = render_prompt(setup.tokenizer, json.loads(r["messages"]),
                                     json.loads(r["tools"]) if r["tools"] else None,
                                     enable_thinking=spec.enable_thinking, max_prompt_tokens=spec.max_prompt_tokens,
                                     profile=setup.profile)
        except RenderError as exc:
            skipped[exc.reason] += 1
            continue
        prompts.append(list(rendered.prompt_ids))
    if skipped:
        log(f"unseen_eval: {sum(skipped.values())} prompts skipped ({dict(skipped)})")
    return prompts, setup.profile


def unseen_eval_rows(catalog: Catalog, target_model, model_dir: Path, cache_dir: Path, log: Callable[[str], None],
                     served_client=None) -> list:
    """Rows for the unseen-source figure: the catalog's ``training.unseen_eval`` prompts, rendered with the target's
    chat template and decoded greedily by the local target (:func:`~eagle_assets.drafter.evaluation.greedy_rows`),
    or, with ``served_client`` (a ``GenerateClient`` of the server serving the target: ``training.features:
    served``), by that server's ``/generate`` at temperature 0 (``target_model`` is then not run). Prompts the
    server refuses are skipped and logged.

    Cached in ``cache_dir/rows.parquet`` under a key of (prompt ids, max_new_tokens, stop ids, the target's weight
    files' names, sizes and mtimes): a rerun on the same target and prompts generates nothing, whichever of the two
    decoded them (both are the target's greedy rows; the simulation re-runs the target wherever a draft leaves a
    row, so a near-tie decoded differently does not change what tau measures).
    """
    import pyarrow as pa

    from eagle_assets.drafter.evaluation import greedy_rows, served_greedy_rows
    from eagle_assets.storage.shards import write_parquet_atomic

    spec = catalog.training.unseen_eval
    prompts, profile = _unseen_prompts(catalog, model_dir, log)
    weights = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in Path(model_dir).glob("*.safetensors"))
    key = hashlib.sha256(json.dumps([prompts, spec.max_new_tokens, list(profile.stop_ids), weights]).encode()
                         ).hexdigest()
    cached = cache_dir / "rows.parquet"
    if cached.exists() and (pq.read_schema(cached).metadata or {}).get(b"key", b"").decode() == key:
        t = pq.read_table(cached)
        return [(np.asarray(i, dtype=np.int32), np.asarray(m, dtype=np.int8))
                for i, m in zip(t.column("input_ids").to_pylist(), t.column("loss_mask").to_pylist())]
    started = time.perf_counter()
    if served_client is not None:
        rows, failed = served_greedy_rows(served_client, prompts, spec.max_new_tokens, profile.stop_ids,
                                          vocab_size=config_vocab_size(model_dir))
        if failed:
            log(f"unseen_eval: {sum(failed.values())} prompts got no generation from the server ({dict(failed)})")
        by = f"the server ({', '.join(served_client.urls)})"
    else:
        rows = greedy_rows(target_model, prompts, spec.max_new_tokens, profile.stop_ids)
        by = "the target"
    log(f"unseen_eval: {len(rows)} rows generated greedily by {by} in {time.perf_counter() - started:.1f}s")
    table = pa.Table.from_pylist([{"input_ids": i.tolist(), "loss_mask": m.tolist()} for i, m in rows],
                                 schema=pa.schema([("input_ids", pa.list_(pa.int32())),
                                                   ("loss_mask", pa.list_(pa.int8()))], metadata={"key": key}))
    write_parquet_atomic(table, cached)
    return rows


@dataclass
class AcceptanceVerdict:
    """The ``acceptance_length`` verdict: ``level`` ("OK" | "WARN" | "ERROR") on the mean held-out tau, the levels
    it was judged by (error at or under ``error_at``, warn under ``warn_under``) and the sentence that says so."""

    level: str
    error_at: float
    warn_under: float
    text: str


def acceptance_verdict(t, heldout: GroupedAcceptance, unseen=None, missing: list[str] = (),
                       unseen_note: str | None = None, by_mode: GroupedAcceptance | None = None) -> AcceptanceVerdict:
    """ERROR when the mean held-out tau is at or under ``1 + training.min_tau_margin``, WARN under
    ``training.tau_warn``. The unseen-source tau is reported beside it (it does not set the level: prompts of
    another source are expected to draft worse, and how much worse is the figure to read), and so is the held-out
    tau per thinking mode (``by_mode``) where the rows carry one. ``t``: the catalog's training spec."""
    mean_tau, ci = heldout.mean_tau, heldout.mean_tau_ci95
    error_at, warn_under = 1.0 + t.min_tau_margin, t.tau_warn
    level = "ERROR" if mean_tau <= error_at else "WARN" if mean_tau < warn_under else "OK"
    spread = f" (95% CI {ci[0]:.2f}-{ci[1]:.2f})" if ci else ""
    n_parts, n_rows = len(heldout.groups), sum(heldout.rows.values())
    text = (f"mean held-out tau {mean_tau:.3f}{spread} over {n_parts} partition{'s' if n_parts != 1 else ''}, "
            f"{n_rows} test rows, k={t.acceptance_k}")
    if unseen is not None:
        u_ci = f" (95% CI {unseen.tau_ci95[0]:.2f}-{unseen.tau_ci95[1]:.2f})" if unseen.tau_ci95 else ""
        text += f"; unseen-source tau {unseen.tau:.3f}{u_ci} on {unseen.n_rows} rows"
    text = (f"{level}: {text} (levels, on the held-out mean: error at or under {error_at:g} = 1 + "
            f"training.min_tau_margin, warn under training.tau_warn {warn_under:g})")
    if n_rows < THIN_TEST_ROWS:
        text += (f"; only {n_rows} test rows: read the CI, not the figure (more source rows, or a larger "
                 "training.holdout_fraction / holdout_rows)")
    if missing:
        text += f"; no held-out rows for {list(missing)} (left out of the mean)"
    if unseen_note:
        text += f"; {unseen_note}"
    if by_mode is not None:
        text += "; by thinking mode: " + ", ".join(
            f"{m} {r.tau:.3f}" + (f" ({r.tau_ci95[0]:.2f}-{r.tau_ci95[1]:.2f})" if r.tau_ci95 else "")
            + f" on {by_mode.rows.get(m, r.n_rows)} rows" for m, r in by_mode.groups.items())
    return AcceptanceVerdict(level, error_at, warn_under, text)


@dataclass
class CheckpointAcceptance:
    """What :func:`evaluate_checkpoint` measured: per partition (``heldout``), by thinking mode (``by_mode``, None
    when the rows carry no mode), on the unseen source (``unseen``: an ``AcceptanceResult`` or None, with
    ``unseen_note`` saying why it is missing), the partitions without held-out rows, and the seconds it took."""

    heldout: GroupedAcceptance
    by_mode: GroupedAcceptance | None
    unseen: Any
    unseen_note: str | None
    missing: list[str]
    seconds: float


def evaluate_checkpoint(catalog: Catalog, target_model, drafter, vocab, held: list, keys: list[str], model_dir: Path,
                        cache_dir: Path, log: Callable[[str], None], unseen_early=None, served=None
                        ) -> CheckpointAcceptance:
    """Simulated acceptance of ``drafter`` on the held-out rows ``held`` (``(sample_id, ids, mask, partition)``) of
    ``keys``, by thinking mode, and on the unseen source (``unseen_early``: its rows being decoded already, a
    future of :func:`unseen_rows_in_background`; else decoded here, by the server with ``served``, a
    ``ServedFeatures``). A missing or unreadable unseen source costs that figure only (``unseen_note``).
    ``target_model``: the HF target, or the served features' stand-in (``served.target``)."""
    from eagle_assets.catalog import CatalogError
    from eagle_assets.formats import FormatError

    t = catalog.training
    started = time.perf_counter()
    capture = list(drafter.config.aux_capture_ids)
    acceptance_rows = (lambda rows: served.acceptance_rows(rows, capture, vocab)) if served else None

    def evaluate(groups: dict[str, list]) -> GroupedAcceptance:
        return evaluate_groups(target_model, drafter, vocab, groups, k=t.acceptance_k,
                               max_positions=t.acceptance_max_positions, acceptance_rows=acceptance_rows)

    groups = {key: [(ids, mask) for _s, ids, mask, k in held if k == key] for key in keys}
    heldout = evaluate({k: g for k, g in groups.items() if g})
    # thinking on and off drafted apart: a drafter trained on reasoning can fall short without it
    modes = thinking_mode_groups(held)
    by_mode = evaluate(modes) if modes else None
    unseen, note = None, None
    if t.unseen_eval is not None:
        try:
            if unseen_early is not None:
                unseen_rows = unseen_early.result()
            else:
                client = served.generate_client(capture) if served else None
                unseen_rows = unseen_eval_rows(catalog, target_model, model_dir, cache_dir, log, served_client=client)
        except (CatalogError, FormatError) as exc:
            note = f"unseen-source figure skipped: {exc}"
        else:
            unseen = evaluate({"unseen": unseen_rows}).groups["unseen"]
    return CheckpointAcceptance(heldout, by_mode, unseen, note, [k for k, g in groups.items() if not g],
                                time.perf_counter() - started)
