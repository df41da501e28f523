"""Resumable drafter training: a run killed at any step (or inside a save) and resumed ends with bitwise the weights
of an unbroken run; a state written for other inputs is never continued; the learning-rate schedule."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tiny_targets import tiny_qwen3

from eagle_assets.drafter.data.vocab import build_draft_vocab, count_completion_tokens
from eagle_assets.drafter.eagle3.model import canonical_name
from eagle_assets.drafter.training import state as state_mod
from eagle_assets.drafter.training.loop import TrainConfig, TrainState, epoch_order, lr_at, train_drafter

VOCAB, LAYERS, PROMPT, LENGTH = 300, 8, 12, 32
# 10 rows of 32 tokens, 3 rows per 96-token batch: 4 batches per epoch (3, 3, 3, 1 rows), 8 optimizer steps.
# States are written after steps 3, 4 (epoch end), 6 and 8.
CONFIG = TrainConfig(
    lr=1e-2, epochs=2, ttt_steps=3, batch_tokens=96, seed=5, num_threads=1, warmup_steps=2, save_every_steps=3
)
TOTAL = 8


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    pass


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    tiny_qwen3(VOCAB, LAYERS, initializer_range=1.0).save_pretrained(path)
    return path


def random_rows(n, seed):
    gen = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        mask = np.zeros(LENGTH, dtype=np.int8)
        mask[PROMPT:] = 1
        rows.append((gen.integers(0, VOCAB, LENGTH).astype(np.int32), mask))
    return rows


@pytest.fixture(scope="module")
def rows():
    return random_rows(10, seed=7)


@pytest.fixture(scope="module")
def vocab(rows):
    return build_draft_vocab(count_completion_tokens(rows, VOCAB), VOCAB, 200)


@pytest.fixture(scope="module")
def unbroken(target_dir, rows, vocab, tmp_path_factory):
    """Reference run without any state."""
    return train_drafter(target_dir, rows, vocab, CONFIG, tmp_path_factory.mktemp("unbroken") / "ckpt")


class Crash(Exception):
    pass


def crash_at(step, lines):
    """A log callback that records lines and raises when optimizer step ``step`` (1-based) reports."""

    def log(line):
        if line.startswith(f"step {step}/"):
            raise Crash(line)
        lines.append(line)

    return log


def step_lines(lines):
    return [int(line.split()[1].split("/")[0]) for line in lines if line.startswith("step ")]


def assert_same_weights(a, b):
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert set(wa) == set(wb)
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


def assert_same_run(result, reference):
    assert_same_weights(result.checkpoint_dir, reference.checkpoint_dir)
    strip = lambda s: (s.step, s.epoch, s.loss, s.step_loss, s.step_acc, s.supervised, s.lr, s.tokens)  # noqa: E731
    assert [strip(s) for s in result.steps] == [strip(s) for s in reference.steps]
    assert result.epochs == reference.epochs
    assert result.out_of_draft_positions == reference.out_of_draft_positions


def committed_step(state_dir):
    return json.loads((state_dir / "state.json").read_text())["step"]


def test_killed_runs_resume_to_the_unbroken_weights(target_dir, rows, vocab, unbroken, tmp_path):
    state = tmp_path / "state"
    assert len(unbroken.steps) == TOTAL and unbroken.resumed_from_step == 0
    # Killed before the first save: nothing to resume, the next run starts from scratch.
    lines: list[str] = []
    with pytest.raises(Crash):
        train_drafter(target_dir, rows, vocab, CONFIG, tmp_path / "ckpt", log=crash_at(3, lines), state_dir=state)
    assert not (state / "state.json").exists() and step_lines(lines) == [1, 2]
    # Killed at step 7 (mid epoch 2): the state of step 6 is committed.
    lines = []
    with pytest.raises(Crash):
        train_drafter(target_dir, rows, vocab, CONFIG, tmp_path / "ckpt", log=crash_at(7, lines), state_dir=state)
    assert step_lines(lines) == [1, 2, 3, 4, 5, 6] and committed_step(state) == 6
    assert len(list(state.glob("tensors-*.safetensors"))) == 1  # older states are deleted after each commit
    # Resumed: only steps 7 and 8 run, and the run is the unbroken one, weights bit for bit.
    lines = []
    resumed = train_drafter(target_dir, rows, vocab, CONFIG, tmp_path / "ckpt", log=lines.append, state_dir=state)
    assert resumed.resumed_from_step == 6 and step_lines(lines) == [7, 8]
    assert any(line.startswith(f"resuming from {state}: 6/{TOTAL} steps done (epoch 2, batch 2)") for line in lines)
    assert_same_run(resumed, unbroken)
    assert committed_step(state) == TOTAL
    metrics = json.loads((resumed.checkpoint_dir / "training_metrics.json").read_text())
    assert metrics["resumed_from_step"] == 6 and len(metrics["steps"]) == TOTAL
    # The final state holds the unbroken weights too; a rerun on the same inputs only exports them.
    saved = load_file(str(next(state.glob("tensors-*.safetensors"))))
    final = load_file(str(unbroken.checkpoint_dir / "model.safetensors"))
    assert all(torch.equal(saved[f"model.{canonical_name(k)}"], final[k]) for k in final if k not in ("d2t", "t2d"))
    lines = []
    again = train_drafter(target_dir, rows, vocab, CONFIG, tmp_path / "ckpt2", log=lines.append, state_dir=state)
    assert again.resumed_from_step == TOTAL and step_lines(lines) == [] and again.feature_seconds == 0
    assert_same_run(again, unbroken)


def test_a_save_killed_before_its_commit_is_never_loaded(target_dir, rows, vocab, unbroken, tmp_path, monkeypatch):
    state = tmp_path / "state"
    real = state_mod.atomic_write
    commits = []

    def dies_at_the_third_commit(path, write):
        if path.name == "state.json":
            commits.append(path)
            if len(commits) == 3:  # the save of step 6: its tensors file and metrics lines are already written
                raise Crash("killed while committing")
        real(path, write)

    monkeypatch.setattr(state_mod, "atomic_write", dies_at_the_third_commit)
    with pytest.raises(Crash):
        train_drafter(target_dir, rows, vocab, CONFIG, tmp_path / "ckpt", state_dir=state)
    monkeypatch.setattr(state_mod, "atomic_write", real)
    assert committed_step(state) == 4
    assert len((state / "steps.jsonl").read_text().splitlines()) == 6  # lines of the uncommitted save
    assert (state / "tensors-000000006.safetensors").exists()  # written, never named by a commit
    # A torn tensors file from a killed write lies around as well; it is never read.
    (state / ".tensors-000000008.safetensors.tmp-1").write_bytes(b"\x00" * 10)
    lines: list[str] = []
    resumed = train_drafter(target_dir, rows, vocab, CONFIG, tmp_path / "ckpt", log=lines.append, state_dir=state)
    assert resumed.resumed_from_step == 4 and step_lines(lines) == [5, 6, 7, 8]
    assert_same_run(resumed, unbroken)
    assert len((state / "steps.jsonl").read_text().splitlines()) == TOTAL


def test_a_state_for_other_inputs_is_not_continued(target_dir, rows, vocab, tmp_path):
    state = tmp_path / "state"
    with pytest.raises(Crash):
        train_drafter(target_dir, rows, vocab, CONFIG, tmp_path / "ckpt", log=crash_at(5, []), state_dir=state)
    assert committed_step(state) == 4
    other_rows = [(ids.copy(), mask) for ids, mask in rows]
    other_rows[3][0][20] = (other_rows[3][0][20] + 1) % VOCAB
    other_vocab = build_draft_vocab(count_completion_tokens(rows, VOCAB), VOCAB, 150)
    cases = [
        (replace(CONFIG, lr=2e-2), rows, vocab, "config lr 0.01 -> 0.02"),
        (replace(CONFIG, schedule="constant"), rows, vocab, "config schedule 'cosine' -> 'constant'"),
        (CONFIG, other_rows, vocab, "training rows"),
        (CONFIG, rows, other_vocab, "draft vocab"),
    ]
    for config, use_rows, use_vocab, why in cases:
        # put the step-4 state back: each case must meet it
        if committed_step_or_none(state) != 4:
            with pytest.raises(Crash):
                train_drafter(target_dir, rows, vocab, CONFIG, tmp_path / "ckpt", log=crash_at(5, []),
                              state_dir=state)
        lines: list[str] = []
        with pytest.raises(Crash):  # stop early: only the decision is under test
            train_drafter(target_dir, use_rows, use_vocab, config, tmp_path / "ckpt", log=crash_at(2, lines),
                          state_dir=state)
        refusal = [line for line in lines if "not resumed, training from scratch" in line]
        assert len(refusal) == 1 and why in refusal[0], (why, lines)
        assert step_lines(lines) == [1]  # started over
    # A thread count or cache size does not change the trajectory: the state is continued.
    with pytest.raises(Crash):
        train_drafter(target_dir, rows, vocab, CONFIG, tmp_path / "ckpt", log=crash_at(5, []), state_dir=state)
    lines = []
    same = replace(CONFIG, num_threads=2, feature_cache_bytes=0, save_every_steps=1)
    result = train_drafter(target_dir, rows, vocab, same, tmp_path / "ckpt", log=lines.append, state_dir=state)
    assert result.resumed_from_step == 4 and not any("not resumed" in note for note in result.notes)


def committed_step_or_none(state_dir):
    return committed_step(state_dir) if (state_dir / "state.json").exists() else None


def test_a_damaged_state_is_not_loaded(target_dir, rows, vocab, unbroken, tmp_path):
    state = tmp_path / "state"
    with pytest.raises(Crash):
        train_drafter(target_dir, rows, vocab, CONFIG, tmp_path / "ckpt", log=crash_at(5, []), state_dir=state)
    tensors = next(state.glob("tensors-*.safetensors"))
    tensors.write_bytes(tensors.read_bytes()[:-100])  # truncated behind the trainer's back
    lines: list[str] = []
    result = train_drafter(target_dir, rows, vocab, CONFIG, tmp_path / "ckpt", log=lines.append, state_dir=state)
    assert result.resumed_from_step == 0 and step_lines(lines) == list(range(1, TOTAL + 1))
    assert any("bytes, the state records" in note for note in result.notes)
    assert_same_run(result, unbroken)


def test_state_dir_is_locked_and_kept_out_of_the_export(target_dir, rows, vocab, tmp_path):
    state = tmp_path / "state"
    with TrainState(state).lock():
        with pytest.raises(RuntimeError, match="another training run is using the state directory"):
            train_drafter(target_dir, rows, vocab, CONFIG, tmp_path / "ckpt", state_dir=state)
    with pytest.raises(ValueError, match="lies inside out_dir"):
        train_drafter(target_dir, rows, vocab, CONFIG, tmp_path / "ckpt", state_dir=tmp_path / "ckpt" / "state")


def test_learning_rate_schedules_and_config_checks(unbroken):
    lr, floor = 1.0, 0.1
    warm = [lr_at(s, 10, 2, lr, floor) for s in range(10)]
    assert warm[:2] == [0.5, 1.0]
    assert warm[2] == lr and all(a > b for a, b in zip(warm[2:], warm[3:]))
    assert warm[-1] == pytest.approx(floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * 7 / 8)))
    assert [lr_at(s, 10, 0, lr, floor, "constant") for s in range(10)] == [lr] * 10
    assert [lr_at(s, 10, 3, lr, floor, "constant") for s in range(4)] == [1 / 3, 2 / 3, 1.0, 1.0]
    assert [s.lr for s in unbroken.steps] == [lr_at(s, TOTAL, 2, CONFIG.lr, CONFIG.min_lr_ratio) for s in range(8)]
    with pytest.raises(ValueError, match="unknown learning-rate schedule"):
        lr_at(0, 10, 0, lr, floor, "linear")
    # the batch order of an epoch depends on (seed, epoch) only
    assert np.array_equal(epoch_order(5, 1, 40), epoch_order(5, 1, 40))
    assert not np.array_equal(epoch_order(5, 1, 40), epoch_order(6, 0, 40))
    for bad, message in (
        (replace(CONFIG, schedule="linear"), "schedule must be one of"),
        (replace(CONFIG, save_every_steps=-1), "save_every_steps must be >= 0"),
        (replace(CONFIG, seed=-1), "seed must be >= 0"),
        (replace(CONFIG, warmup_steps=-2), "warmup_steps must be >= 0"),
    ):
        with pytest.raises(ValueError, match=message):
            train_drafter("unused", [], None, bad, "unused")


def test_a_run_with_validation_and_early_stopping_resumes_to_the_same_curve_and_weights(
        target_dir, rows, vocab, tmp_path):
    validation = random_rows(3, seed=11)
    # Evaluations every 2 steps (80 tokens per batch on average); a state after every evaluation.
    config = replace(CONFIG, eval_every_tokens=160, patience=2, min_delta=0.0)
    reference = train_drafter(target_dir, rows, vocab, config, tmp_path / "ref", validation_rows=validation)
    assert reference.plan.eval_every_steps == 2 and len(reference.curve) >= 2
    state = tmp_path / "state"
    lines: list[str] = []
    with pytest.raises(Crash):
        train_drafter(target_dir, rows, vocab, config, tmp_path / "ckpt", log=crash_at(5, lines), state_dir=state,
                      validation_rows=validation)
    assert committed_step(state) == 4
    resumed = train_drafter(target_dir, rows, vocab, config, tmp_path / "ckpt", state_dir=state,
                            validation_rows=validation)
    assert resumed.resumed_from_step == 4
    assert_same_run(resumed, reference)
    strip = lambda p: (p.step, p.tokens, p.train_loss, p.val_loss, p.val_tau, p.val_acc)  # noqa: E731
    assert [strip(p) for p in resumed.curve] == [strip(p) for p in reference.curve]
    assert (resumed.best_step, resumed.stopped_early) == (reference.best_step, reference.stopped_early)
    # Other validation rows are other inputs: the state is not continued.
    lines = []
    with pytest.raises(Crash):
        train_drafter(target_dir, rows, vocab, config, tmp_path / "ckpt", log=crash_at(2, lines), state_dir=state,
                      validation_rows=random_rows(3, seed=12))
    assert any("not resumed" in line and "validation rows" in line for line in lines)


def test_a_killed_block_drafter_run_resumes_to_the_unbroken_weights_with_its_anchor_draws(target_dir, rows, vocab,
                                                                                          tmp_path, monkeypatch):
    """A DFlash run whose rows hold more anchors than the cap (lowered to 5: each step draws its blocks from torch's
    global generator), killed at step 7 and resumed from the state of step 6, ends bit for bit as an unbroken run:
    the state carries the generator, so the resumed steps draw the blocks the unbroken run drew."""
    from eagle_assets.drafter.dflash import family as dflash_family
    from eagle_assets.drafter.family import DraftArchitecture

    monkeypatch.setattr(dflash_family, "NUM_ANCHORS", 5)  # 20 completion tokens per row: every step draws
    config = replace(CONFIG, drafter=DraftArchitecture("dflash", block_size=4))
    unbroken = train_drafter(target_dir, rows, vocab, config, tmp_path / "unbroken")
    state, lines = tmp_path / "state", []
    with pytest.raises(Crash):
        train_drafter(target_dir, rows, vocab, config, tmp_path / "ckpt", log=crash_at(7, lines), state_dir=state)
    assert committed_step(state) == 6
    lines = []
    resumed = train_drafter(target_dir, rows, vocab, config, tmp_path / "ckpt", log=lines.append, state_dir=state)
    assert resumed.resumed_from_step == 6 and step_lines(lines) == [7, 8]
    assert_same_run(resumed, unbroken)
    # a run draws from its own seeded stream (the caller's generator changes nothing), and the draws matter: with
    # every anchor trained the steps differ
    torch.manual_seed(123)
    again = train_drafter(target_dir, rows, vocab, config, tmp_path / "again")
    assert [s.loss for s in again.steps] == [s.loss for s in unbroken.steps]
    monkeypatch.setattr(dflash_family, "NUM_ANCHORS", 512)
    every = train_drafter(target_dir, rows, vocab, config, tmp_path / "every")
    assert [s.loss for s in every.steps] != [s.loss for s in unbroken.steps]
