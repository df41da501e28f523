"""Drafter training end to end on a tiny Qwen3 target: falling loss, determinism, row handling, simulated tau."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tiny_targets import tiny_qwen3
from transformers import AutoModelForCausalLM

from eagle_assets.drafter.data.rows import completion_segments
from eagle_assets.drafter.data.vocab import build_draft_vocab, count_completion_tokens
from eagle_assets.drafter.eagle3.export import load_drafter, validate_checkpoint
from eagle_assets.drafter.evaluation.acceptance import simulate_acceptance
from eagle_assets.drafter.training.loop import TrainConfig, train_drafter

VOCAB, LAYERS, PROMPT = 300, 8, 12


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    pass


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    # initializer_range 1.0: peaked next-token distributions, something for the drafter to learn
    tiny_qwen3(VOCAB, LAYERS, initializer_range=1.0).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def target(target_dir):
    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


def make_rows(target, n, new_tokens, seed, sample=False):
    """prompt_ids + output_ids from the target itself (greedy, or sampled at temperature 1); the prompts depend on
    ``seed`` only, so a sampled call with the training seed continues the training prompts off the greedy path."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, VOCAB, (n, PROMPT), generator=gen)
    torch.manual_seed(seed + 1000)
    with torch.no_grad():
        out = target.generate(
            prompts, max_new_tokens=new_tokens, do_sample=sample, temperature=1.0 if sample else None,
            top_k=0 if sample else None, top_p=None, pad_token_id=0, eos_token_id=None,
        )
    rows = []
    for r in out:
        mask = np.zeros(r.numel(), dtype=np.int8)
        mask[PROMPT:] = 1
        rows.append((r.numpy().astype(np.int32), mask))
    return rows


@pytest.fixture(scope="module")
def rows(target):
    return make_rows(target, 12, 40, seed=1)


@pytest.fixture(scope="module")
def vocab(rows):
    return build_draft_vocab(count_completion_tokens(rows, VOCAB), VOCAB, 200)


FAST = TrainConfig(lr=2e-2, epochs=30, ttt_steps=3, batch_tokens=416, seed=0, num_threads=1)


@pytest.fixture(scope="module")
def trained(target_dir, rows, vocab, tmp_path_factory):
    lines: list[str] = []
    out = tmp_path_factory.mktemp("drafter") / "ckpt"
    result = train_drafter(target_dir, rows, vocab, FAST, out, log=lines.append)
    return result, lines


def test_loss_falls_and_accuracy_rises(trained):
    result, lines = trained
    first, last = result.epochs[0], result.epochs[-1]
    assert last["loss"] < 0.85 * first["loss"]
    assert last["step_acc"][0] > first["step_acc"][0] + 0.5
    assert last["step_acc"][2] > first["step_acc"][2] + 0.3  # later TTT steps learn too
    assert all(len(s.step_loss) == 3 and len(s.step_acc) == 3 for s in result.steps)
    assert len(result.steps) == 2 * FAST.epochs  # 12 rows of 52 tokens, 8 rows per 416-token batch
    step_lines = [line for line in lines if line.startswith("step ")]
    assert len(step_lines) == len(result.steps) and "acc@ttt [" in step_lines[0] and "tok/s" in step_lines[0]
    assert result.tokens_per_s > 0 and result.rows_used == 12 and result.rows_skipped == 0


def test_training_exports_a_valid_checkpoint_with_metrics(trained, target, vocab):
    result, _ = trained
    report = validate_checkpoint(result.checkpoint_dir, target_config=target.config)
    assert report.aux_capture_ids == [2, 4, 5]
    metrics = json.loads((result.checkpoint_dir / "training_metrics.json").read_text())
    assert len(metrics["steps"]) == len(result.steps) and metrics["aux_capture_ids"] == [2, 4, 5]
    drafter, loaded_vocab = load_drafter(result.checkpoint_dir, target)
    assert np.array_equal(loaded_vocab.d2t, vocab.d2t)


def test_same_seed_same_losses_other_seed_other_losses(target_dir, rows, vocab, tmp_path):
    config = TrainConfig(lr=1e-2, epochs=2, ttt_steps=2, batch_tokens=416, seed=3, num_threads=1)
    a = train_drafter(target_dir, rows[:8], vocab, config, tmp_path / "a")
    b = train_drafter(target_dir, rows[:8], vocab, config, tmp_path / "b")
    c = train_drafter(target_dir, rows[:8], vocab, replace(config, seed=4), tmp_path / "c")
    # target features recomputed per batch instead of cached: same numbers
    d = train_drafter(target_dir, rows[:8], vocab, replace(config, feature_cache_bytes=0), tmp_path / "d")
    assert [s.loss for s in a.steps] == [s.loss for s in b.steps] == [s.loss for s in d.steps]
    assert [s.loss for s in a.steps] != [s.loss for s in c.steps]
    assert a.feature_seconds > 0 and d.feature_seconds == 0


def test_malformed_rows_are_skipped_and_counted(target_dir, rows, vocab, tmp_path):
    bad = [
        (np.array([1, 2, 3]), np.array([0, 1])),  # lengths differ
        (np.array([1, 2, VOCAB + 5]), np.array([0, 1, 1])),  # id outside the vocab
        (np.array([1, 2, 3]), np.array([0, 0, 0])),  # no completion
        (np.array([1, 2, 3]), np.array([0, 2, 1])),  # mask not 0/1
        "not a row",
    ]
    config = TrainConfig(epochs=1, ttt_steps=2, batch_tokens=416, max_length=30, num_threads=1)
    result = train_drafter(target_dir, rows[:3] + bad, vocab, config, tmp_path / "ckpt")
    assert result.rows_used == 3 and result.rows_skipped == 5 and result.rows_truncated == 3
    assert result.skip_reasons == {
        "shape_mismatch": 1, "id_out_of_vocab": 1, "no_completion_tokens": 1, "mask_not_binary": 1, "not_a_pair": 1,
    }
    with pytest.raises(ValueError, match="no usable training row"):
        train_drafter(target_dir, bad, vocab, config, tmp_path / "none")
    with pytest.raises(ValueError, match="rebuild draft_vocab"):
        train_drafter(target_dir, rows[:3], build_draft_vocab({}, VOCAB + 1, 10), config, tmp_path / "v")


def reference_acceptance(target, drafter, rows, k):
    """Brute-force chain speculative decoding along each row: at each verification point, decode k drafts one at a
    time with an explicit KV cache, then verify them with one target forward over prefix + drafts."""
    capture = list(drafter.config.aux_capture_ids)
    layer = drafter.layers[0]
    lengths = []

    def draft_step(tokens, hidden, positions, cache):
        cos, sin = drafter.rotary.cos_sin(positions)
        x = torch.cat([layer.input_layernorm(drafter.embed(tokens)), layer.hidden_norm(hidden)], -1)
        q, key, value = layer.self_attn.project(x, drafter.rotary, cos, sin)
        if cache is None:
            cache = (key, value)
            attn = F.scaled_dot_product_attention(q, key, value, is_causal=True)
        else:
            cache = (torch.cat([cache[0], key], 2), torch.cat([cache[1], value], 2))
            attn = F.scaled_dot_product_attention(q, *cache)
        h = hidden + layer.self_attn.finish(attn)
        return h + layer.mlp(layer.post_attention_layernorm(h)), cache

    with torch.no_grad():
        for ids, mask in rows:
            ids = torch.from_numpy(ids.astype(np.int64))
            for start, end in completion_segments(mask):
                n = start
                while n <= end - 2:
                    prefix = ids[: n + 1].unsqueeze(0)
                    states = target(prefix, output_hidden_states=True).hidden_states
                    aux = torch.cat([states[c] for c in capture], -1)[:, :n]
                    out, cache = draft_step(prefix[:, 1:], drafter.fc(aux), torch.arange(n)[None], None)
                    hidden = out[:, -1:]
                    drafts = []
                    for j in range(k):
                        token = drafter.draft_token_ids[drafter.logits(hidden).argmax(-1)]
                        drafts.append(int(token))
                        if j + 1 < k:
                            hidden, cache = draft_step(token, hidden, torch.tensor([[n + j]]), cache)
                    limit = min(k, end - 1 - n)
                    verify = torch.cat([prefix, torch.tensor([drafts[:limit]])], 1)
                    greedy = target(verify).logits[0, n : n + limit].argmax(-1).tolist()
                    accepted = 0
                    while accepted < limit and drafts[accepted] == greedy[accepted]:
                        accepted += 1
                    lengths.append(accepted)
                    n += accepted + 1
    return lengths


def test_simulated_acceptance_equals_brute_force_speculative_decoding(trained, target, rows):
    result, _ = trained
    drafter, vocab = load_drafter(result.checkpoint_dir, target)
    k = 4
    learned = simulate_acceptance(target, drafter, vocab, rows[:2], k=k, max_positions=None)
    assert learned.tau > 1.8  # the trained drafter really drafts on the rows it learned
    assert learned.exact_reruns == 0  # greedy rows: the target's choices are the row's own tokens
    # Rows that leave the greedy path: drafts the target accepts then differ from the row's tokens, which the
    # simulation must settle by re-running the target on the exact prefix.
    gen = np.random.default_rng(5)
    off_path = []
    for ids, mask in rows[2:4]:
        ids = ids.copy()
        ids[PROMPT + 20 :] = gen.integers(0, VOCAB, ids.size - PROMPT - 20)
        off_path.append((ids, mask))
    held = rows[:2] + off_path
    sim = simulate_acceptance(target, drafter, vocab, held, k=k, max_positions=None)
    ref = reference_acceptance(target, drafter, held, k)
    assert sim.n_verifications == len(ref)
    assert sim.accept_length_histogram == np.bincount(ref, minlength=k + 1).tolist()
    assert sim.tau == pytest.approx(1 + np.mean(ref))
    assert sim.exact_reruns > 0
    assert sim.per_position_acceptance[0] >= sim.per_position_acceptance[1] >= sim.per_position_acceptance[-1]
    assert simulate_acceptance(target, drafter, vocab, held, k=k, max_positions=5).n_verifications == 5


def test_simulation_skips_malformed_rows_with_a_note(trained, target, rows):
    result, _ = trained
    drafter, vocab = load_drafter(result.checkpoint_dir, target)
    bad = ["xy", (np.array([1, 2, 3]), np.array([0, 1])), (np.array([1, VOCAB, 3, 4]), np.array([0, 0, 1, 1]))]
    sim = simulate_acceptance(target, drafter, vocab, bad + rows[:1], k=2, max_positions=None)
    assert sim.n_rows == 1 and sim.n_verifications > 0
    assert [note.split(":")[0] for note in sim.notes] == ["row 0", "row 1", "row 2"]
    empty = simulate_acceptance(target, drafter, vocab, bad, k=2)
    assert empty.tau == 0.0 and empty.n_verifications == 0 and "no verification point" in empty.notes[-1]
    with pytest.raises(ValueError, match="not the vocab"):
        simulate_acceptance(target, drafter, build_draft_vocab({}, VOCAB, 200), rows[:1], k=2)


# -- the recipe: a run sized by the data; validation curve; early stopping; honest spread --------------------------


def test_run_length_is_the_smaller_of_the_token_budget_and_the_epoch_cap():
    from eagle_assets.drafter.training.recipe import plan_steps

    per_batch = [400, 400, 200]  # 1000 tokens per epoch in 3 batches (333.3 per batch)
    by_tokens = plan_steps(per_batch, TrainConfig(epochs=None, train_tokens=5000))
    assert by_tokens.total_steps == 15 and by_tokens.limited_by == "train_tokens" and by_tokens.epochs == 5
    capped = plan_steps(per_batch, TrainConfig(epochs=2.5, train_tokens=5000))
    assert capped.total_steps == 8 and capped.limited_by == "epochs"  # ceil(2.5 * 3): the last epoch is partial
    assert plan_steps(per_batch, TrainConfig(epochs=1.0, eval_every_tokens=700)).eval_every_steps == 2
    assert plan_steps(per_batch, TrainConfig(epochs=40.0)).warmup_steps == 6  # 5% of 120
    with pytest.raises(ValueError, match="set epochs or train_tokens"):
        train_drafter("unused", [], None, TrainConfig(epochs=None, train_tokens=None), "unused")


@pytest.fixture(scope="module")
def validated(target, target_dir, rows, vocab, tmp_path_factory):
    """A run scored on 4 validation rows every 3 steps, with early stopping and the best weights kept.

    The validation rows are 4 of the training rows: a random target's continuations of other random prompts are not
    learnable from 12 rows, and what is under test here is the curve and the stopping rule, not generalization."""
    validation = rows[:4]
    config = replace(FAST, epochs=None, train_tokens=60 * 416, eval_every_tokens=2 * 416, patience=3,
                     min_delta=0.01, acceptance_k=4)
    lines: list[str] = []
    out = tmp_path_factory.mktemp("validated") / "ckpt"
    result = train_drafter(target_dir, rows, vocab, config, out, log=lines.append, validation_rows=validation)
    return result, lines, validation, config


def test_learning_curve_tracks_validation_tau_and_early_stopping_keeps_the_best(validated, target):
    result, lines, validation, config = validated
    curve = result.curve
    assert result.validation_rows == 4 and len(curve) >= 3
    assert [p.step for p in curve] == sorted({p.step for p in curve}) and all(
        p.step % result.plan.eval_every_steps == 0 for p in curve[:-1])
    assert result.plan.eval_every_steps == 3  # 832 tokens / 312 per batch (two batches of 416 and 208 tokens)
    assert [p.tokens for p in curve] == [sum(s.tokens for s in result.steps[: p.step]) for p in curve]
    assert max(p.val_tau for p in curve) > curve[0].val_tau + 0.5
    assert curve[-1].val_loss < curve[0].val_loss
    assert sum(1 for line in lines if line.startswith("eval at ")) == len(curve)
    best = max(curve, key=lambda p: p.val_tau)
    if result.stopped_early:
        assert len(result.steps) < result.plan.total_steps
        since = [p for p in curve if p.step > best.step]
        assert len(since) == config.patience and all(p.val_tau <= best.val_tau + config.min_delta for p in since)
    # The exported drafter is the best point's: re-simulating it on the validation rows gives that point's tau.
    drafter, vocab = load_drafter(result.checkpoint_dir, target)
    again = simulate_acceptance(target, drafter, vocab, validation, k=4, max_positions=None)
    kept = best if result.best_step >= 0 else curve[-1]
    assert again.tau == pytest.approx(kept.val_tau, abs=1e-9)
    assert result.eval_seconds > 0 and result.to_dict()["curve"][0]["val_tau"] == curve[0].val_tau


def test_early_stopping_stops_when_tau_stops_improving(target_dir, rows, vocab, target, tmp_path):
    # A gain of 5 tokens per verification between two steps never happens: the first point stays the best and the
    # run stops after `patience` more points, keeping the first point's weights.
    validation = make_rows(target, 2, 20, seed=9)
    config = replace(FAST, epochs=None, train_tokens=40 * 416, eval_every_tokens=416, patience=2, min_delta=5.0,
                     acceptance_k=2, ttt_steps=2)
    result = train_drafter(target_dir, rows[:8], vocab, config, tmp_path / "ckpt", validation_rows=validation)
    assert result.plan.total_steps == 40 and result.plan.eval_every_steps == 1  # one 8-row batch per epoch
    assert result.stopped_early and len(result.steps) == len(result.curve) == config.patience + 1
    assert result.best_step == result.curve[0].step == 1
    final = load_file(str(result.checkpoint_dir / "model.safetensors"))
    drafter, vocab_back = load_drafter(result.checkpoint_dir, target)
    again = simulate_acceptance(target, drafter, vocab_back, validation, k=2, max_positions=None)
    assert again.tau == pytest.approx(result.curve[0].val_tau, abs=1e-9) and final


def test_tau_spread_over_rows(trained, target, rows):
    from eagle_assets.drafter.evaluation.acceptance import bootstrap_tau, mean_tau_over_groups

    result, _ = trained
    drafter, vocab = load_drafter(result.checkpoint_dir, target)
    sim = simulate_acceptance(target, drafter, vocab, rows[:6], k=4, max_positions=None)
    assert len(sim.row_verifications) == len(sim.row_tokens) == sim.n_rows == 6
    assert sum(sim.row_verifications) == sim.n_verifications and sum(sim.row_tokens) == sim.n_tokens
    lo, hi = sim.tau_ci95
    assert lo <= sim.tau <= hi and sim.tau_row_sd >= 0
    assert bootstrap_tau(sim.row_verifications, sim.row_tokens) == (sim.tau_ci95, sim.tau_row_sd)  # seeded
    # Identical rows: no spread at all.
    assert bootstrap_tau([10] * 5, [30] * 5) == ([3.0, 3.0], 0.0)
    mean, ci = mean_tau_over_groups({"a": ([10, 10], [20, 20]), "b": ([5, 5], [25, 25]), "empty": ([], [])})
    assert mean == 3.5 and ci == [3.5, 3.5]  # each group weighs the same, whatever its verifications
    cached: dict = {}
    first = simulate_acceptance(target, drafter, vocab, rows[:2], k=4, max_positions=None, features=cached)
    assert set(cached) == {0, 1}
    assert simulate_acceptance(target, drafter, vocab, rows[:2], k=4, max_positions=None,
                               features=cached).to_dict() == first.to_dict()
