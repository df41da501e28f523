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


def test_the_comparison_names_the_drafter_the_measurements_support_and_says_when_the_lead_is_noise():
    """``drafter.evaluation.comparison``: the highest mean greedy tau over the columns every drafter was measured on
    (a sampled column and one only some have are left out), the margin to the next, and whether their held-out
    intervals overlap; each column's best in bold."""
    from eagle_assets.drafter.evaluation.comparison import ComparedDrafter, comparison_markdown, supported
    from eagle_assets.drafter.evaluation.suites import EvaluationReport

    def drafter(label, held, ci, words, sampled=None, extra=None):
        records = [{"suite": "heldout", "thinking": "default", "temperature": 0.0, "k": 7, "tau": held,
                    "ci_low": ci[0], "ci_high": ci[1], "rows": 30},
                   {"suite": "words", "thinking": "on", "temperature": 0.0, "k": 7, "tau": words, "ci_low": 1.0,
                    "ci_high": 9.0, "rows": 12},
                   {"suite": "words", "thinking": "on", "temperature": 0.0, "k": 3, "tau": 9.0, "ci_low": 1.0,
                    "ci_high": 9.0, "rows": 12}]
        if sampled is not None:
            records.append({**records[1], "temperature": 1.0, "tau": sampled})
        if extra is not None:
            records.append({**records[1], "suite": "only_here", "tau": extra})
        report = EvaluationReport(records, [], {}, {}, 0)
        return ComparedDrafter(label, f"{label} arch", "Cls", 10, 1.5, "/ckpt", report)

    a = drafter("a", 5.0, (4.8, 5.2), 3.0, sampled=9.0, extra=9.0)
    b = drafter("b", 5.1, (4.9, 5.3), 3.1)
    c = drafter("c", 2.0, (1.9, 2.1), 1.0, sampled=1.0)
    best, why = supported([a, b, c], 7)
    assert best == "b" and why.startswith("b: mean greedy tau 4.100 at k=7 over heldout/default, words/on, +0.100 "
                                          "over a (4.000)") and "intervals overlap" in why
    best, why = supported([a, c], 7)
    assert best == "a" and "+2.500 over c" in why and why.endswith("; their held-out 95% intervals do not overlap")
    md = comparison_markdown([a, b, c], 7)
    # columns: held-out first, then suites by name, greedy before sampled
    assert "| heldout / default / greedy | only_here / on / greedy | words / on / greedy | words / on / T=1 |" in md
    assert "| b | b arch | Cls | 10 | 1.5 | **5.100 (4.90-5.30)** | - | **3.100** | - |" in md
    assert "| a | a arch | Cls | 10 | 1.5 | 5.000 (4.80-5.20) | **9.000** | 3.000 | **9.000** |" in md
    assert supported([], 7) == (None, "no greedy column was measured for every drafter")
