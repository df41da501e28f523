"""The length-aware training mix: budget, weights, bucket caps, determinism, and the unbalanced baseline."""

import random

import pytest

from eagle_assets.catalog import MixSpec
from eagle_assets.drafter.data.mix import MixCandidate, bucket_labels, build_mix, mix_png, mix_table_markdown


def _rows(partition: str, n: int, lo: int, hi: int, seed: int) -> list[MixCandidate]:
    rng = random.Random(seed)
    return [MixCandidate(partition, f"{partition}-{i}", rng.randint(lo, hi)) for i in range(n)]


@pytest.fixture
def candidates():
    # A short-answer set with many rows beside two long-reasoning sets: the case that drowns the long chains.
    return _rows("short", 400, 20, 150, 1) + _rows("code", 60, 200, 400, 2) + _rows("reasoning", 40, 600, 1500, 3)


def _short_share(result, bound=300):
    return sum(c.tokens for c in result.selected if c.tokens < bound) / result.tokens


def test_bucket_cap_holds_and_budget_is_respected(candidates):
    spec = MixSpec(token_budget=30_000, bucket_caps=[{"below_tokens": 300, "max_share": 0.3}], seed=0)
    result = build_mix(candidates, spec)
    assert result.tokens <= 30_000
    assert _short_share(result) <= 0.3 + 1e-9
    assert result.share(result.after, bucket="<300") == pytest.approx(_short_share(result))
    # Without the cap, the same weights give the short rows far more than 30%.
    free = build_mix(candidates, MixSpec(token_budget=30_000, seed=0))
    assert _short_share(free) > 0.4


def test_nested_caps_each_hold(candidates):
    spec = MixSpec(token_budget=25_000, bucket_caps=[{"below_tokens": 300, "max_share": 0.4},
                                                     {"below_tokens": 100, "max_share": 0.05}])
    result = build_mix(candidates, spec)
    assert _short_share(result, 300) <= 0.4 + 1e-9
    assert _short_share(result, 100) <= 0.05 + 1e-9
    assert result.buckets == ["<100", "100-299", ">=300"]


def test_weights_set_token_shares():
    rows = _rows("a", 300, 100, 100, 1) + _rows("b", 300, 100, 100, 2)
    result = build_mix(rows, MixSpec(token_budget=12_000, weights={"a": 3.0, "b": 1.0}))
    a = sum(c.tokens for c in result.selected if c.partition == "a")
    assert result.tokens == 12_000 and a == 9_000
    none_b = build_mix(rows, MixSpec(token_budget=12_000, weights={"b": 0}))
    assert {c.partition for c in none_b.selected} == {"a"}
    assert any("b: weight 0" in n for n in none_b.notes)


def test_share_a_partition_cannot_fill_goes_to_others():
    rows = _rows("few", 5, 100, 100, 1) + _rows("many", 500, 100, 100, 2)
    result = build_mix(rows, MixSpec(token_budget=10_000))
    assert result.tokens == 10_000
    assert sum(1 for c in result.selected if c.partition == "few") == 5
    assert not any(n.startswith("few") for n in result.notes)  # all its rows are in: nothing to warn about


def test_deterministic_for_a_seed_whatever_the_row_order(candidates):
    spec = MixSpec(token_budget=20_000, bucket_caps=[{"below_tokens": 300, "max_share": 0.3}], seed=7)
    order = ["short", "code", "reasoning"]
    a = build_mix(candidates, spec, partitions=order)
    b = build_mix(list(reversed(candidates)), spec, partitions=order)
    assert [(c.partition, c.sample_id) for c in a.selected] == [(c.partition, c.sample_id) for c in b.selected]
    other = build_mix(candidates, spec.model_copy(update={"seed": 8}))
    assert {c.sample_id for c in other.selected} != {c.sample_id for c in a.selected}


def test_unbudgeted_cap_is_a_share_of_the_mix_itself(candidates):
    # No budget = every row's tokens; the cap must still hold on what the mix ends up holding.
    result = build_mix(candidates, MixSpec(bucket_caps=[{"below_tokens": 300, "max_share": 0.2}]))
    assert _short_share(result) <= 0.2 + 1e-9
    assert any("of the" in n and "budget" in n for n in result.notes)
    assert any(n.startswith("short:") and "capped bucket" in n for n in result.notes)
    # Every long row is kept: only the capped bucket gives way.
    assert sum(1 for c in result.selected if c.tokens >= 300) == sum(1 for c in candidates if c.tokens >= 300)


def test_concat_baseline_follows_natural_proportions(candidates):
    result = build_mix(candidates, MixSpec(mode="concat", token_budget=30_000, seed=0))
    assert result.tokens <= 30_000
    natural = sum(c.tokens for c in candidates if c.tokens < 300) / sum(c.tokens for c in candidates)
    assert _short_share(result) == pytest.approx(natural, abs=0.1)


def test_before_after_tables_and_plot(candidates):
    result = build_mix(candidates, MixSpec(token_budget=10_000, bucket_caps=[{"below_tokens": 300, "max_share": 0.3}]))
    assert sum(v["rows"] for b in result.before.values() for v in b.values()) == len(candidates)
    assert sum(v["rows"] for b in result.after.values() for v in b.values()) == len(result.selected)
    md = mix_table_markdown(result)
    assert md.count("\n") == 1 + 3 * 2  # header, rule, 3 partitions x 2 buckets
    assert mix_png(result).startswith(b"\x89PNG")
    assert bucket_labels([]) == ["all"]


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="negative token count"):
        build_mix([MixCandidate("a", "x", -1)], MixSpec())
    assert build_mix([], MixSpec()).selected == []


def test_held_out_splits_are_disjoint_capped_per_partition_and_stable():
    from eagle_assets.catalog import TrainingSpec
    from eagle_assets.drafter.data.splits import is_holdout, row_splits

    ids = [f"P-{i:03d}" for i in range(48)]
    capped = TrainingSpec(holdout_fraction=0.8, holdout_rows=34, validation_rows=4, seed=0)
    splits = row_splits(ids, capped)
    counts = [sum(v == s for v in splits.values()) for s in ("train", "validation", "test")]
    assert counts == [14, 4, 30]
    # Held out rows are a subset of the fraction's rows (lowest hash first): training rows are never a guess.
    assert all(is_holdout(s, 0.8, 0) for s, v in splits.items() if v != "train")
    # A small partition keeps its share of training rows; validation takes at most half of the held-out rows.
    small = row_splits(ids[:10], capped)
    assert sum(v == "train" for v in small.values()) == sum(not is_holdout(s, 0.8, 0) for s in ids[:10])
    held = sum(v != "train" for v in small.values())
    assert sum(v == "validation" for v in small.values()) == min(4, held // 2)
    # A row added later moves at most a few rows between splits (ids keep their keyed hash).
    grown = row_splits(ids + ["P-new"], capped)
    assert sum(grown[s] != splits[s] for s in ids) <= 2
    # Without a cap: the training rows are exactly the ids is_holdout leaves out (what the mix may take).
    fraction = TrainingSpec(holdout_fraction=0.25, validation_rows=2, seed=3)
    by_fraction = row_splits(ids, fraction)
    assert {s for s, v in by_fraction.items() if v == "train"} == {s for s in ids if not is_holdout(s, 0.25, 3)}
    assert sum(v == "validation" for v in by_fraction.values()) == 2
    assert row_splits(ids, TrainingSpec(holdout_fraction=0.8, holdout_rows=34, validation_rows=4, seed=1)) != splits


def test_turns_and_thinking_modes_of_one_conversation_share_their_split():
    from eagle_assets.catalog import TrainingSpec
    from eagle_assets.drafter.data.splits import row_splits
    from eagle_assets.tokenized_prompts.walk import conversation_id, turn_row_id

    spec = TrainingSpec(holdout_fraction=0.5, holdout_rows=10, validation_rows=2, seed=0)
    samples = [f"MT:{i:03d}" for i in range(30)]  # ids that contain ':' themselves
    rows = [turn_row_id(s, mode, turn) for s in samples for mode in ("on", "off") for turn in (1, 2, 3)]
    assert {conversation_id(r) for r in rows} == set(samples)
    assert conversation_id("MT:007") == "MT:007" and conversation_id("a:maybe:2") == "a:maybe:2"
    splits = row_splits(rows, spec)
    for s in samples:
        assert len({splits[turn_row_id(s, m, t)] for m in ("on", "off") for t in (1, 2, 3)}) == 1
    by_sample = row_splits(samples, spec)  # the same conversations, one row each: the same split
    assert all(splits[turn_row_id(s, "on", 2)] == by_sample[s] for s in samples)
    assert sum(v != "train" for v in by_sample.values()) == 10  # the cap counts conversations, not turn rows
