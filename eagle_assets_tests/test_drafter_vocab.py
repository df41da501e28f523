"""Draft vocab: selection by frequency, d2t/t2d encoding as SGLang and SpecForge read it, filling and refusals."""

from __future__ import annotations

import numpy as np
import pytest

from eagle_assets.drafter.data.vocab import (
    build_draft_vocab,
    count_completion_tokens,
    draft_vocab_from_arrays,
    validate_draft_vocab,
)


def sglang_hot_token_ids(d2t: np.ndarray) -> np.ndarray:
    # LlamaForCausalLMEagle3.load_weights: hot_token_id = d2t + arange(d2t.shape[0])
    return d2t + np.arange(d2t.shape[0])


def test_most_frequent_ids_are_chosen_and_stored_in_ascending_id_order():
    vocab = build_draft_vocab({7: 10, 5: 10, 3: 5, 9: 1, 1: 2}, target_vocab_size=12, draft_vocab_size=3)
    assert sglang_hot_token_ids(vocab.d2t).tolist() == [3, 5, 7]
    assert vocab.d2t.dtype == np.int64 and vocab.t2d.dtype == np.bool_
    assert vocab.d2t.tolist() == [3, 4, 5]
    assert np.flatnonzero(vocab.t2d).tolist() == [3, 5, 7]
    assert vocab.notes == ()


def test_ties_are_broken_by_lower_id():
    vocab = build_draft_vocab({8: 4, 2: 4, 1: 4}, target_vocab_size=10, draft_vocab_size=2)
    assert vocab.draft_token_ids.tolist() == [1, 2]


def test_fewer_distinct_tokens_than_the_draft_size_are_filled_with_lowest_unused_ids():
    vocab = build_draft_vocab({10: 3, 1: 1}, target_vocab_size=20, draft_vocab_size=5)
    assert vocab.draft_token_ids.tolist() == [0, 1, 2, 3, 10]
    assert len(vocab.notes) == 1 and "filled 3 slots" in vocab.notes[0]
    validate_draft_vocab(vocab.d2t, vocab.t2d, 20)


def test_nothing_counted_gives_the_lowest_ids():
    vocab = build_draft_vocab({}, target_vocab_size=6, draft_vocab_size=3)
    assert vocab.draft_token_ids.tolist() == [0, 1, 2]
    assert vocab.coverage() == 1.0


def test_draft_size_larger_than_the_vocab_is_clamped_with_a_note():
    vocab = build_draft_vocab({0: 1, 3: 2}, target_vocab_size=5, draft_vocab_size=32000)
    assert vocab.draft_vocab_size == 5
    assert vocab.d2t.tolist() == [0, 0, 0, 0, 0]
    assert vocab.t2d.all()
    assert any("clamped to 5" in note for note in vocab.notes)


def test_array_and_mapping_counts_agree_and_coverage_is_reported():
    counts = np.array([0, 5, 0, 1, 4], dtype=np.int64)
    a = build_draft_vocab(counts, 5, 2)
    b = build_draft_vocab({1: 5, 3: 1, 4: 4}, 5, 2)
    assert np.array_equal(a.d2t, b.d2t) and np.array_equal(a.t2d, b.t2d)
    assert a.draft_token_ids.tolist() == [1, 4]
    assert a.coverage() == pytest.approx(9 / 10)


@pytest.mark.parametrize(
    "counts, message",
    [
        ({12: 1}, "outside the target vocab"),
        ({-1: 1}, "outside the target vocab"),
        ({2: -3}, "non-negative"),
        (np.zeros(11, dtype=np.int64), "one entry per target id"),
        (np.zeros(12, dtype=np.float32), "integers"),
    ],
)
def test_bad_counts_are_refused_with_a_reason(counts, message):
    with pytest.raises(ValueError, match=message):
        build_draft_vocab(counts, target_vocab_size=12, draft_vocab_size=4)


def test_count_completion_tokens_counts_only_loss_masked_tokens():
    rows = [
        (np.array([1, 2, 3, 3], dtype=np.int32), np.array([0, 0, 1, 1], dtype=np.int8)),
        (np.array([2, 4], dtype=np.int32), np.array([0, 1], dtype=np.int8)),
    ]
    counts = count_completion_tokens(rows, 6)
    assert counts.tolist() == [0, 0, 0, 2, 1, 0]
    with pytest.raises(ValueError, match="row 0"):
        count_completion_tokens([(np.array([1, 2]), np.array([1]))], 6)


def good_pair():
    vocab = build_draft_vocab({1: 3, 4: 2, 6: 1}, 8, 3)
    return vocab.d2t.copy(), vocab.t2d.copy()


def test_validate_accepts_a_built_vocab_and_reads_back_from_arrays():
    d2t, t2d = good_pair()
    validate_draft_vocab(d2t, t2d, 8)
    assert draft_vocab_from_arrays(d2t, t2d).draft_token_ids.tolist() == [1, 4, 6]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d, t: (d.astype(np.int32), t), "int64"),
        (lambda d, t: (d, t.astype(np.int64)), "bool"),
        (lambda d, t: (d, t[:-1]), "length 7"),
        # target ids stored where offsets belong: 6 + 2 = 8 is past the vocab
        (lambda d, t: (d + np.arange(3), t), "offsets"),
        (lambda d, t: (np.array([1, 2, 1]), t), "unique and ascending"),
        (lambda d, t: (d, np.roll(t, 1)), "disagree"),
        (lambda d, t: (np.zeros(0, dtype=np.int64), np.zeros(8, dtype=bool)), "empty"),
    ],
)
def test_validate_names_what_is_wrong(mutate, message):
    d2t, t2d = mutate(*good_pair())
    with pytest.raises(ValueError, match=message):
        validate_draft_vocab(d2t, t2d, 8)
