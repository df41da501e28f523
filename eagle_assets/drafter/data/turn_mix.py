"""Weighting the drafter's training mix by turn index (``training.mix.turn_weights``) for ``all_turns`` partitions.

``drafter.data.mix.build_mix`` balances partitions by weight; here each ``all_turns`` partition is split into one group
per turn index before it runs, so a partition's token share (its weight, as before) is divided between its turns
in proportion to ``turn_weights`` (turn -> relative weight, unlisted turns 1.0, 0 leaves that turn out), and a share
one turn cannot fill goes to the other groups, exactly as ``build_mix`` does for partitions. Rows of partitions
without turns are one group, as before. The chosen rows keep their real partition; the result's ``before`` /
``after`` tables are by group (``<partition>/turn<k>``), which is the by-turn picture the metadata shows.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Mapping, Sequence

from eagle_assets.catalog import MixSpec
from eagle_assets.drafter.data.mix import MixCandidate, MixResult, build_mix


def group_name(partition: str, turn: int) -> str:
    """The mix group of one turn of a partition: ``<partition>/turn<turn>``."""
    return f"{partition}/turn{turn}"


def build_turn_mix(candidates: Sequence[MixCandidate], spec: MixSpec, partitions: Sequence[str],
                   turn_of: Mapping[tuple[str, str], int]) -> MixResult:
    """``build_mix`` with every partition that has turns split into turn groups (see the module doc).

    Args:
        candidates, spec, partitions: as in ``build_mix``; ``spec.turn_weights``: {turn: weight} (may be empty).
        turn_of: (partition, sample_id) -> turn index, for the rows of ``all_turns`` partitions
            (``generations.rollout.turn_numbers``).
    Returns: ``MixResult`` whose ``selected`` carry their real partition, in training order.
    Raises: ``ValueError`` for a negative turn weight, and whatever ``build_mix`` raises.
    """
    turn_weights = {int(k): float(v) for k, v in spec.turn_weights.items()}
    if any(w < 0 for w in turn_weights.values()):
        raise ValueError(f"training.mix.turn_weights must be >= 0, got {turn_weights}")
    if not any((c.partition, c.sample_id) in turn_of for c in candidates):
        return build_mix(candidates, spec, partitions)
    weights = {p: float(spec.weights.get(p, 1.0)) for p in partitions}
    turns: dict[str, set[int]] = defaultdict(set)
    for c in candidates:
        t = turn_of.get((c.partition, c.sample_id))
        if t is not None:
            turns[c.partition].add(t)
    groups, group_weights, real = [], {}, {}
    for p in partitions:
        if not turns.get(p):
            groups.append(p)
            group_weights[p] = weights[p]
            continue
        total = sum(turn_weights.get(t, 1.0) for t in turns[p]) or 1.0
        for t in sorted(turns[p]):
            g = group_name(p, t)
            groups.append(g)
            group_weights[g] = weights[p] * turn_weights.get(t, 1.0) / total
    virtual = []
    for c in candidates:
        t = turn_of.get((c.partition, c.sample_id))
        g = c.partition if t is None else group_name(c.partition, t)
        real[(g, c.sample_id)] = c
        virtual.append(MixCandidate(g, c.sample_id, c.tokens))
    result = build_mix(virtual, spec.model_copy(update={"weights": group_weights}), groups)
    result.selected = [real[(c.partition, c.sample_id)] for c in result.selected]
    return result
