"""Compare a partition's figures with its catalog thresholds: the logic behind the blocking asset checks.

Each rule yields a ``Finding`` (figure, value, threshold, level). The check fails with ERROR when any ERROR rule is
broken, passes with a WARN finding when only WARN rules are, and passes cleanly otherwise.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from statistics import median
from typing import Mapping, Sequence

from eagle_assets.catalog import Thresholds


@dataclass(frozen=True)
class Finding:
    """One broken threshold: ``figure`` is ``value`` against ``threshold`` at ``level`` ("WARN" or "ERROR")."""

    figure: str
    value: float
    threshold: float
    level: str
    comparison: str  # "<" or ">": the direction that breaks the rule

    def message(self) -> str:
        return f"{self.level}: {self.figure} = {self.value:.4g} {self.comparison} threshold {self.threshold:.4g}"


@dataclass(frozen=True)
class Outcome:
    """Result of one check: ``passed`` is False only for ERROR findings; ``figures`` are the measured values."""

    passed: bool
    level: str  # "OK", "WARN" or "ERROR"
    findings: tuple[Finding, ...]
    figures: dict[str, float]

    def description(self) -> str:
        if not self.findings:
            return "all figures within thresholds"
        text = "; ".join(f.message() for f in self.findings)
        if self.figures.get("count") == 0:  # say it in words: "count = 0" alone reads like a broken check
            return ("the partition is empty: no generated rows to check (see the generations step's failures and "
                    "raw_prompts' prompts_available check "
                    "and its rejects.parquet); " + text)
        return text


def _outcome(figures: dict[str, float], findings: list[Finding]) -> Outcome:
    errors = any(f.level == "ERROR" for f in findings)
    level = "ERROR" if errors else ("WARN" if findings else "OK")
    return Outcome(passed=not errors, level=level, findings=tuple(findings), figures=figures)


def _above(findings: list[Finding], figure: str, value: float, warn: float | None, error: float | None) -> None:
    if error is not None and value > error:
        findings.append(Finding(figure, value, error, "ERROR", ">"))
    elif warn is not None and value > warn:
        findings.append(Finding(figure, value, warn, "WARN", ">"))


def evaluate_response_length(
    completion_tokens: Sequence[int], finish_reasons: Sequence[str], thresholds: Thresholds
) -> Outcome:
    """``response_length``: median, p10, share under ``short_tokens``, share truncated (finish_reason length).

    Args: per-row completion lengths (tokens) and finish reasons of every generated row of the partition;
    ``thresholds`` the partition's catalog ``Thresholds`` (``short_tokens``, ``min_median_tokens``,
    ``max_share_short_warn`` / ``_error``, ``max_share_truncated_warn`` / ``_error``).
    An empty partition is an ERROR (nothing to train on).
    """
    n = len(completion_tokens)
    short = thresholds.short_tokens
    if n == 0:
        return response_length_outcome(0, 0.0, 0.0, 0, 0, thresholds)
    ordered = sorted(completion_tokens)
    under = sum(1 for t in ordered if t < short)
    truncated = sum(1 for r in finish_reasons if r == "length")
    return response_length_outcome(n, float(median(ordered)), float(ordered[int(0.1 * (n - 1))]), under, truncated,
                                   thresholds)


def response_length_outcome(n: int, median_tokens: float, p10_tokens: float, under_short: int, truncated: int,
                            thresholds: Thresholds) -> Outcome:
    """``evaluate_response_length`` from its figures: ``n`` rows, their median and p10 (by the index rule
    ``sorted[int(0.1 * (n - 1))]``), rows under ``short_tokens`` and rows with finish_reason length. Running
    counters (``qc.live``) call this directly, so the live figures are judged by the same rules."""
    short = thresholds.short_tokens
    if n == 0:
        return _outcome({"count": 0}, [Finding("count", 0, 1, "ERROR", "<")])
    figures = {
        "count": float(n),
        "median_tokens": float(median_tokens),
        "p10_tokens": float(p10_tokens),
        "share_under_short": under_short / n,
        "share_truncated": truncated / n,
        "short_tokens": float(short),
    }
    findings: list[Finding] = []
    if figures["median_tokens"] < thresholds.min_median_tokens:
        findings.append(Finding("median_tokens", figures["median_tokens"], thresholds.min_median_tokens, "WARN", "<"))
    _above(findings, "share_under_short", figures["share_under_short"], thresholds.max_share_short_warn,
           thresholds.max_share_short_error)
    _above(findings, "share_truncated", figures["share_truncated"], thresholds.max_share_truncated_warn,
           thresholds.max_share_truncated_error)
    return _outcome(figures, findings)


def reason_levels(thresholds: Thresholds, reason: str) -> tuple[float | None, float | None]:
    """(warn, error) share levels of one drop reason from ``thresholds.max_share_by_reason`` (None = unchecked)."""
    levels = thresholds.max_share_by_reason.get(reason)
    return (None, None) if levels is None else (levels.warn, levels.error)


def evaluate_token_structure(drop_reasons: Sequence[str | None], thresholds: Thresholds) -> Outcome:
    """``token_structure``: share of rows dropped, in total and per drop reason.

    ``drop_reasons`` has one entry per generated row (None for kept rows). ``thresholds`` (catalog ``Thresholds``)
    gives ``max_share_dropped_warn`` / ``max_share_dropped_error`` for the total and, in ``max_share_by_reason``,
    ``{reason: {warn, error}}`` levels for single reasons. Every reason with a level appears in the figures, with
    share 0.0 when no row has it.
    """
    return token_structure_outcome(len(drop_reasons), Counter(r for r in drop_reasons if r), thresholds)


def token_structure_outcome(n: int, counts: Mapping[str, int], thresholds: Thresholds) -> Outcome:
    """``evaluate_token_structure`` from counts: ``n`` rows, ``counts`` drop reason -> dropped rows."""
    if n == 0:
        return _outcome({"count": 0}, [Finding("count", 0, 1, "ERROR", "<")])
    counts = {r: c for r, c in counts.items() if r and c}
    by_reason = thresholds.max_share_by_reason
    figures: dict[str, float] = {"count": float(n), "share_dropped": sum(counts.values()) / n}
    for reason in sorted(set(counts) | set(by_reason)):
        figures[f"share_{reason}"] = counts.get(reason, 0) / n
    findings: list[Finding] = []
    _above(findings, "share_dropped", figures["share_dropped"], thresholds.max_share_dropped_warn,
           thresholds.max_share_dropped_error)
    for reason in sorted(by_reason):
        warn, error = reason_levels(thresholds, reason)
        _above(findings, f"share_{reason}", figures[f"share_{reason}"], warn, error)
    return _outcome(figures, findings)
