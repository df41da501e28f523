"""The drafter's training mix: which QC rows it trains on, under a token budget, balanced on purpose.

A reasoning model's long chains are the rows a drafter most needs, and a short-answer dataset concatenated beside
them drowns them by count. ``build_mix`` picks rows from every partition so that

* the mix holds at most ``token_budget`` completion (loss-masked) tokens,
* each partition's share of tokens follows its weight (``weights``, default 1.0; 0 leaves it out), and a share
  a partition cannot fill (too few rows) goes to the others, and
* for every bucket cap ``(below_tokens, max_share)``, rows with fewer than ``below_tokens`` completion tokens
  hold at most ``max_share`` of the mix's tokens (caps may nest: a row counts toward every cap it falls under).

Mode "concat" is the unbalanced baseline a script would use: every partition's rows concatenated, shuffled and
taken until the budget is spent, so partitions contribute in proportion to the tokens they happen to hold.

Both modes are deterministic for a seed: rows are ordered by a keyed hash of (seed, partition, sample id), so adding
rows to a partition does not reshuffle the others.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from eagle_assets.catalog import MixSpec


@dataclass(frozen=True)
class MixCandidate:
    """One QC row that may enter the mix; ``tokens`` = its completion (loss-masked) token count."""

    partition: str
    sample_id: str
    tokens: int


@dataclass
class MixResult:
    """The chosen rows and the before/after picture.

    Attributes:
        selected: chosen candidates, in training order (partitions interleaved).
        budget: the token budget applied (completion tokens).
        buckets: bucket labels in order (e.g. ``["<300", ">=300"]``).
        before / after: ``{partition: {bucket: {"rows": int, "tokens": int}}}`` of all candidates and of the mix.
        notes: why the mix holds less than the budget or less than a partition's weight asked for.
    """

    selected: list[MixCandidate]
    budget: int
    buckets: list[str]
    before: dict[str, dict[str, dict[str, int]]]
    after: dict[str, dict[str, dict[str, int]]]
    notes: list[str] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(c.tokens for c in self.selected)

    def share(self, table: Mapping[str, Mapping[str, Mapping[str, int]]], bucket: str | None = None,
              partition: str | None = None) -> float:
        """Share of ``table``'s tokens in one bucket and/or partition (0.0 for an empty table)."""
        total = sum(v["tokens"] for b in table.values() for v in b.values())
        part = sum(v["tokens"] for p, b in table.items() if partition in (None, p)
                   for name, v in b.items() if bucket in (None, name))
        return part / total if total else 0.0


def _order_key(seed: int, c: MixCandidate) -> bytes:
    return hashlib.sha256(f"mix:{seed}:{c.partition}:{c.sample_id}".encode()).digest()


def bucket_labels(caps: Sequence[tuple[int, float]]) -> list[str]:
    """Labels of the length buckets the caps' boundaries cut: ``[(300, .3)]`` -> ``["<300", ">=300"]``."""
    bounds = sorted({b for b, _ in caps})
    if not bounds:
        return ["all"]
    labels = [f"<{bounds[0]}"] + [f"{lo}-{hi - 1}" for lo, hi in zip(bounds, bounds[1:])]
    return labels + [f">={bounds[-1]}"]


def _bucket_of(tokens: int, bounds: list[int], labels: list[str]) -> str:
    for bound, label in zip(bounds, labels):
        if tokens < bound:
            return label
    return labels[-1]


def _table(rows: Iterable[MixCandidate], bounds: list[int], labels: list[str],
           partitions: Sequence[str]) -> dict[str, dict[str, dict[str, int]]]:
    table = {p: {b: {"rows": 0, "tokens": 0} for b in labels} for p in partitions}
    for c in rows:
        cell = table.setdefault(c.partition, {b: {"rows": 0, "tokens": 0} for b in labels})[
            _bucket_of(c.tokens, bounds, labels)]
        cell["rows"] += 1
        cell["tokens"] += c.tokens
    return table


def _interleave(by_partition: dict[str, list[MixCandidate]], partitions: Sequence[str]) -> list[MixCandidate]:
    """Round-robin over partitions (each in its own order), so a budget that runs out cuts every partition."""
    out, i = [], 0
    queues = [list(by_partition.get(p, [])) for p in partitions]
    while any(i < len(q) for q in queues):
        out.extend(q[i] for q in queues if i < len(q))
        i += 1
    return out


def build_mix(candidates: Sequence[MixCandidate], spec: MixSpec, partitions: Sequence[str] | None = None) -> MixResult:
    """Choose the training rows from ``candidates`` according to ``spec`` (the catalog's ``training.mix``:
    ``mode``, ``token_budget``, ``weights``, ``bucket_caps`` [{below_tokens, max_share}], ``seed``).

    Args:
        candidates: every training (non-held-out) row of every partition that passed QC.
        partitions: partition order for reporting and interleaving (default: order of first appearance).
    Returns: ``MixResult``; its ``after`` table satisfies every bucket cap relative to the mix's own tokens, and
        ``tokens <= budget``.
    Raises:
        ValueError: a candidate has a negative token count, or the mode is unknown.
    """
    partitions = list(partitions or dict.fromkeys(c.partition for c in candidates))
    mode, seed = spec.mode, spec.seed
    caps = [(c.below_tokens, c.max_share) for c in spec.bucket_caps]
    bounds = sorted({b for b, _ in caps})
    labels = bucket_labels(caps)
    if any(c.tokens < 0 for c in candidates):
        raise ValueError("a mix candidate has a negative token count; QC rows must have completion tokens >= 0")
    total = sum(c.tokens for c in candidates)
    budget = spec.token_budget or total
    ordered = sorted(candidates, key=lambda c: _order_key(seed, c))
    before = _table(candidates, bounds, labels, partitions)
    notes: list[str] = []
    if mode == "concat":
        selected, used = [], 0
        for c in ordered:  # one shuffled concatenation, cut at the budget
            if used + c.tokens > budget:
                break
            selected.append(c)
            used += c.tokens
        return MixResult(selected, budget, labels, before, _table(selected, bounds, labels, partitions), notes)
    if mode != "balanced":
        raise ValueError(f"unknown mix mode {mode!r}; use 'balanced' or 'concat'")

    weights = {p: float(spec.weights.get(p, 1.0)) for p in partitions}
    by_partition: dict[str, list[MixCandidate]] = defaultdict(list)
    for c in ordered:
        if weights.get(c.partition, 1.0) > 0:
            by_partition[c.partition].append(c)
    for p in partitions:
        if weights[p] == 0:
            notes.append(f"{p}: weight 0, left out")
    live = [p for p in partitions if weights[p] > 0 and by_partition.get(p)]
    weight_sum = sum(weights[p] for p in live) or 1.0
    quota = {p: budget * weights[p] / weight_sum for p in live}
    cap_limit = [(bound, share * budget) for bound, share in caps]
    cap_used = [0] * len(caps)
    part_used: dict[str, int] = defaultdict(int)
    chosen: list[MixCandidate] = []
    taken: set[tuple[str, str]] = set()
    used = 0

    def fits(c: MixCandidate, respect_quota: bool) -> bool:
        if used + c.tokens > budget:
            return False
        if respect_quota and part_used[c.partition] + c.tokens > quota[c.partition]:
            return False
        return all(c.tokens >= bound or cap_used[i] + c.tokens <= limit for i, (bound, limit) in enumerate(cap_limit))

    # Pass 1 honours each partition's weighted quota; pass 2 gives what a partition could not fill to the others.
    for respect_quota in (True, False):
        for c in _interleave(by_partition, live):
            if (c.partition, c.sample_id) in taken or not fits(c, respect_quota):
                continue
            chosen.append(c)
            taken.add((c.partition, c.sample_id))
            used += c.tokens
            part_used[c.partition] += c.tokens
            for i, (bound, _limit) in enumerate(cap_limit):
                if c.tokens < bound:
                    cap_used[i] += c.tokens
    # Caps are shares of the mix itself: when the budget was not filled, drop the last short rows until they hold.
    for bound, share in sorted(caps):
        mix_tokens = sum(c.tokens for c in chosen)
        excess = sum(c.tokens for c in chosen if c.tokens < bound) - share * mix_tokens
        if excess <= 1e-9:
            continue
        # dropping r short tokens leaves S - r <= share * (M - r), i.e. r >= excess / (1 - share)
        need = excess / (1.0 - share) if share < 1.0 else 0.0
        drop: set[int] = set()
        for i in range(len(chosen) - 1, -1, -1):
            if need <= 1e-9:
                break
            if chosen[i].tokens < bound:
                drop.add(i)
                need -= chosen[i].tokens
        chosen = [c for i, c in enumerate(chosen) if i not in drop]
    used = sum(c.tokens for c in chosen)
    if used < budget:
        notes.append(f"mix holds {used} of the {budget}-token budget: too few rows fit the weights and bucket caps")
    for p in live:
        got = sum(c.tokens for c in chosen if c.partition == p)
        left_out = sum(c.tokens for c in by_partition[p]) - got
        want = used * weights[p] / weight_sum
        # A partition whose every row is in the mix simply holds fewer tokens than its share: nothing to warn about.
        if got < 0.95 * want and left_out > 0:
            notes.append(f"{p}: {got} tokens, under its weighted share of the mix ({want:.0f}) although "
                         f"{left_out} of its tokens were left out: its rows fall in a capped bucket")
    return MixResult(chosen, budget, labels, before, _table(chosen, bounds, labels, partitions), notes)


def mix_table_markdown(result: MixResult) -> str:
    """Rows and tokens per partition and bucket, before -> after, as a Markdown table for the Dagster UI."""
    head = "| partition | bucket | rows before | rows after | tokens before | tokens after | token share after |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    total_after = result.tokens or 1
    for p, buckets in result.before.items():
        for b in result.buckets:
            pre = buckets.get(b, {"rows": 0, "tokens": 0})
            post = result.after.get(p, {}).get(b, {"rows": 0, "tokens": 0})
            lines.append(f"| {p} | {b} | {pre['rows']} | {post['rows']} | {pre['tokens']} | {post['tokens']} "
                         f"| {post['tokens'] / total_after:.1%} |")
    return "\n".join(lines)


def mix_png(result: MixResult) -> bytes:
    """Stacked bars of tokens per partition and bucket, before and after (PNG bytes, matplotlib Agg)."""
    from eagle_assets.figures.plots import figure_png, plt

    parts = list(result.before)
    fig, axes = plt.subplots(1, 2, figsize=(8.0, 3.2), dpi=80, sharey=True)
    for ax, (title, table) in zip(axes, (("all QC rows", result.before), ("training mix", result.after))):
        bottom = [0] * len(parts)
        for b in result.buckets:
            vals = [table.get(p, {}).get(b, {"tokens": 0})["tokens"] for p in parts]
            ax.bar(range(len(parts)), vals, bottom=bottom, label=b)
            bottom = [x + y for x, y in zip(bottom, vals)]
        ax.set_xticks(range(len(parts)), parts, rotation=20, fontsize=7, ha="right")
        ax.set_title(title, fontsize=10)
    axes[0].set_ylabel("completion tokens")
    axes[1].legend(title="completion length", fontsize=7)
    return figure_png(fig)
