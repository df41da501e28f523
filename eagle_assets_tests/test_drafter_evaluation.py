"""Honest evaluation of the drafter: the acceptance check's levels, spread and thinking-mode split."""

import dagster as dg
import numpy as np

from eagle_assets.assets.acceptance import acceptance_check
from eagle_assets.catalog import TrainingSpec
from eagle_assets.drafter.evaluation.acceptance import AcceptanceResult, mean_tau_over_groups
from eagle_assets.drafter.evaluation.heldout import GroupedAcceptance

VOCAB = 97


def _result(tau_rows: list[tuple[int, int]], k: int = 7) -> AcceptanceResult:
    verifications = [v for v, _ in tau_rows]
    tokens = [t for _, t in tau_rows]
    mean, ci = mean_tau_over_groups({"g": (verifications, tokens)})
    return AcceptanceResult(tau=sum(tokens) / sum(verifications), per_position_acceptance=[0.5] * k,
                            conditional_acceptance=[0.5] * k, accept_length_histogram=[0] * (k + 1),
                            n_verifications=sum(verifications), n_tokens=sum(tokens), n_rows=len(tau_rows),
                            exact_reruns=0, k=k, row_verifications=verifications, row_tokens=tokens, tau_ci95=ci)


def _heldout(tau_rows):
    groups = {"P1": _result(tau_rows), "P2": _result(tau_rows)}
    mean, ci = mean_tau_over_groups({n: (r.row_verifications, r.row_tokens) for n, r in groups.items()})
    return GroupedAcceptance(groups, mean, ci, {n: r.n_rows for n, r in groups.items()})


def _png(curves) -> bytes:
    from eagle_assets.drafter.evaluation.heldout import acceptance_png

    return acceptance_png(curves)


def test_acceptance_check_levels_and_spread():
    t = TrainingSpec(min_tau_margin=1.0, tau_warn=4.0, acceptance_k=7)
    good = [(10, 55), (10, 60), (12, 62), (9, 50)]  # per-row tau 5.5, 6.0, 5.2, 5.6
    ok = acceptance_check(t, _heldout(good), [], _png)
    assert isinstance(ok, dg.AssetCheckResult) and ok.passed
    assert ok.description.startswith("OK: mean held-out tau 5.5")
    assert "95% CI" in ok.description and "unseen" not in ok.description
    lo, hi = ok.metadata["mean_tau_ci95"].value
    assert lo < ok.metadata["mean_tau"].value < hi

    middling = [(10, 30), (10, 32)]  # tau 3.1: over the error level, under the warn level
    warn = acceptance_check(t, _heldout(middling), ["P3"], _png)
    assert not warn.passed and warn.severity == dg.AssetCheckSeverity.WARN
    assert warn.description.startswith("WARN:") and "no held-out rows for ['P3']" in warn.description

    # a frequency guesser (tau 1.3) is an ERROR
    bad = acceptance_check(t, _heldout([(10, 13), (10, 13)]), [], _png)
    assert not bad.passed and bad.severity == dg.AssetCheckSeverity.ERROR
    assert bad.description.startswith("ERROR:")


def test_thinking_modes_of_turn_rows_are_grouped_and_reported_beside_the_mean():
    from eagle_assets.drafter.evaluation.verdict import thinking_mode_groups
    from eagle_assets.tokenized_prompts.walk import turn_row_id

    ids, mask = np.arange(5, dtype=np.int32), np.array([0, 0, 1, 1, 1], dtype=np.int8)
    held = [(turn_row_id("MT:1", "on", 1), ids, mask, "M1"), (turn_row_id("MT:1", "off", 2), ids, mask, "M1"),
            (turn_row_id("MT:2", "off", 1), ids, mask, "M2")]
    groups = thinking_mode_groups(held)
    assert {m: len(rows) for m, rows in groups.items()} == {"on": 1, "off": 2}
    # single-turn rows, or turn rows of the template's default mode only: nothing to split
    assert thinking_mode_groups([("B1-007", ids, mask, "B1")]) == {}
    assert thinking_mode_groups([(turn_row_id("x", "default", 1), ids, mask, "B1")]) == {}

    on, off = _result([(10, 60), (10, 58)]), _result([(10, 30), (10, 32)])
    mean, ci = mean_tau_over_groups({n: (r.row_verifications, r.row_tokens) for n, r in {"on": on, "off": off}.items()})
    by_mode = GroupedAcceptance({"on": on, "off": off}, mean, ci, {"on": 2, "off": 2})
    t = TrainingSpec(min_tau_margin=1.0, tau_warn=4.0, acceptance_k=7)
    check = acceptance_check(t, _heldout([(10, 55), (10, 60)]), [], _png, by_mode=by_mode)
    assert check.passed  # the level is the mean held-out tau's; the split is reported beside it
    assert "by thinking mode: on 5.900" in check.description and "off 3.100" in check.description
    assert check.metadata["tau_by_thinking"].value["off"]["tau"] == 3.1
