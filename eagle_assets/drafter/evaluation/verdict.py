"""A trained checkpoint's acceptance as the pipeline measures it, without Dagster: simulated tau on each passing
partition's held-out test rows and on the same rows by thinking mode, and the ``acceptance_length`` verdict on them.

Prompts the drafter never trained on are measured one way: as evaluation suites (``evaluation.suites``, the
``evaluation`` asset, :mod:`~eagle_assets.drafter.evaluation.suites`), which run through the same stages as
training data. A catalog's legacy ``training.unseen_eval`` becomes such a suite when it loads
(``catalog.load.unseen_eval_as_suite``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from eagle_assets.catalog import Catalog
from eagle_assets.drafter.evaluation.heldout import GroupedAcceptance, evaluate_groups

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


@dataclass
class AcceptanceVerdict:
    """The ``acceptance_length`` verdict: ``level`` ("OK" | "WARN" | "ERROR") on the mean held-out tau, the levels
    it was judged by (error at or under ``error_at``, warn under ``warn_under``) and the sentence that says so."""

    level: str
    error_at: float
    warn_under: float
    text: str


def acceptance_verdict(t, heldout: GroupedAcceptance, missing: list[str] = (),
                       by_mode: GroupedAcceptance | None = None) -> AcceptanceVerdict:
    """ERROR when the mean held-out tau is at or under ``1 + training.min_tau_margin``, WARN under
    ``training.tau_warn``. The held-out tau per thinking mode (``by_mode``) is reported beside it where the rows
    carry one. ``t``: the catalog's training spec."""
    mean_tau, ci = heldout.mean_tau, heldout.mean_tau_ci95
    error_at, warn_under = 1.0 + t.min_tau_margin, t.tau_warn
    level = "ERROR" if mean_tau <= error_at else "WARN" if mean_tau < warn_under else "OK"
    spread = f" (95% CI {ci[0]:.2f}-{ci[1]:.2f})" if ci else ""
    n_parts, n_rows = len(heldout.groups), sum(heldout.rows.values())
    text = (f"mean held-out tau {mean_tau:.3f}{spread} over {n_parts} partition{'s' if n_parts != 1 else ''}, "
            f"{n_rows} test rows, k={t.acceptance_k}")
    text = (f"{level}: {text} (levels, on the held-out mean: error at or under {error_at:g} = 1 + "
            f"training.min_tau_margin, warn under training.tau_warn {warn_under:g})")
    if n_rows < THIN_TEST_ROWS:
        text += (f"; only {n_rows} test rows: read the CI, not the figure (more source rows, or a larger "
                 "training.holdout_fraction / holdout_rows)")
    if missing:
        text += f"; no held-out rows for {list(missing)} (left out of the mean)"
    if by_mode is not None:
        text += "; by thinking mode: " + ", ".join(
            f"{m} {r.tau:.3f}" + (f" ({r.tau_ci95[0]:.2f}-{r.tau_ci95[1]:.2f})" if r.tau_ci95 else "")
            + f" on {by_mode.rows.get(m, r.n_rows)} rows" for m, r in by_mode.groups.items())
    return AcceptanceVerdict(level, error_at, warn_under, text)


@dataclass
class CheckpointAcceptance:
    """What :func:`evaluate_checkpoint` measured: per partition (``heldout``), by thinking mode (``by_mode``, None
    when the rows carry no mode), the partitions without held-out rows, and the seconds it took."""

    heldout: GroupedAcceptance
    by_mode: GroupedAcceptance | None
    missing: list[str]
    seconds: float


def evaluate_checkpoint(catalog: Catalog, target_model, drafter, vocab, held: list, keys: list[str], served=None
                        ) -> CheckpointAcceptance:
    """Simulated acceptance of ``drafter`` on the held-out rows ``held`` (``(sample_id, ids, mask, partition)``) of
    ``keys``, and by thinking mode. ``target_model``: the HF target, or the served features' stand-in
    (``served.target``, a ``ServedFeatures``: every feature and greedy id a request to its server)."""
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
    return CheckpointAcceptance(heldout, by_mode, [k for k, g in groups.items() if not g],
                                time.perf_counter() - started)
