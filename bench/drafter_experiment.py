"""A/B harness for drafter experiments: train one drafter on given rows, measure tau per held-out partition.

Used by ``bench/exp_regeneration.py`` (regenerated vs original responses) and ``bench/exp_training_mix.py``
(balanced vs unbalanced mix). Each arm gets the pipeline's own recipe: a draft vocab built from the arm's own
completion tokens (as ``draft_vocab`` does), :func:`train_drafter` with the catalog's training settings, and
:func:`simulate_acceptance` (k = ``acceptance_k``) on the same held-out rows for every arm.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

Row = tuple[np.ndarray, np.ndarray]


def completion_tokens(rows: Sequence[Row]) -> int:
    """Loss-masked (completion) tokens of ``rows`` (``loss_mask`` 1)."""
    return int(sum(int(np.asarray(mask).sum()) for _ids, mask in rows))


def train_and_measure(
    model_dir: str | Path,
    train_rows: Sequence[Row],
    heldout: Mapping[str, Sequence[Row]],
    training: Any,
    out_dir: str | Path,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Train a drafter on ``train_rows`` and measure simulated acceptance on each held-out partition.

    Args:
        model_dir: the target model directory.
        train_rows: ``(input_ids int32 [T], loss_mask int8 [T])`` training rows of this arm.
        heldout: partition -> held-out rows (target generations), the same for every arm.
        training: a ``catalog.TrainingSpec`` (its recipe fields, see
            ``drafter.training.recipe.config_from_catalog``, and draft_vocab_size, acceptance_k,
            acceptance_max_positions).
        out_dir: this arm's directory (checkpoint under ``checkpoint/``, ``result.json``).
    Returns: ``{"train_rows", "train_tokens", "draft_vocab_coverage", "train_seconds", "final_loss", "tau":
        {partition: tau}, "tau_ci95": {partition: [lo, hi]} (the rows' bootstrap, ``acceptance.bootstrap_tau``),
        "heldout_rows": {partition: rows walked}, "per_position": {partition: [acceptance of draft i]}, "mean_tau"}``;
        tau in tokens per verification step (1.0 = no draft accepted).
    Raises: ValueError from :func:`train_drafter` when no row is usable.
    """
    from transformers import AutoModelForCausalLM

    from eagle_assets.drafter.data.vocab import build_draft_vocab, count_completion_tokens
    from eagle_assets.drafter.eagle3.export import load_drafter
    from eagle_assets.drafter.evaluation.acceptance import simulate_acceptance
    from eagle_assets.drafter.training.loop import train_drafter
    from eagle_assets.drafter.training.recipe import config_from_catalog
    from eagle_assets.target_model.config import config_vocab_size as target_vocab_size

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab_size = target_vocab_size(model_dir)
    counts = count_completion_tokens(train_rows, vocab_size)
    vocab = build_draft_vocab(counts, vocab_size, training.draft_vocab_size)
    config = config_from_catalog(training)
    started = time.monotonic()
    result = train_drafter(model_dir, list(train_rows), vocab, config, out_dir / "checkpoint", log=lambda _l: None)
    seconds = time.monotonic() - started
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    drafter, _ = load_drafter(Path(result.checkpoint_dir), target)
    tau, tau_ci95, heldout_rows, per_position = {}, {}, {}, {}
    for part, rows in heldout.items():
        acc = simulate_acceptance(target, drafter, vocab, list(rows), k=training.acceptance_k,
                                  max_positions=training.acceptance_max_positions)
        tau[part] = round(acc.tau, 4)
        tau_ci95[part] = [round(x, 4) for x in acc.tau_ci95]
        heldout_rows[part] = acc.n_rows
        per_position[part] = [round(a, 4) for a in acc.per_position_acceptance]
    out = {
        "train_rows": len(train_rows),
        "train_tokens": completion_tokens(train_rows),
        "draft_vocab_coverage": float(counts[vocab.t2d].sum() / max(counts.sum(), 1)),
        "train_seconds": round(seconds, 1),
        "final_loss": round(float(np.mean([s.loss for s in result.steps[-3:]])), 4),
        "tau": tau,
        "tau_ci95": tau_ci95,
        "heldout_rows": heldout_rows,
        "per_position": per_position,
        "mean_tau": round(float(np.mean(list(tau.values()))), 4) if tau else 0.0,
    }
    (out_dir / "result.json").write_text(json.dumps(out, indent=2))
    log(f"  {out_dir.name}: {out['train_rows']} rows, {out['train_tokens']} tokens, {seconds:.0f} s, tau {tau}")
    return out
