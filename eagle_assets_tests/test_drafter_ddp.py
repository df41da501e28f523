"""Data-parallel drafter training under torchrun: 2 gloo processes end with the weights one process gets with the
same global batch, and resume a state one process wrote.

Each launch is the real command (``python -m torch.distributed.run --standalone --nproc_per_node 2 -m
eagle_assets.drafter.training.command``), one torch thread per process, on a tiny random Qwen3 target.

Tolerance: the 2-process weights equal the 1-process weights to ``ATOL`` absolute (float32 weights of order
0.01-1). They are not bitwise equal: each rank runs the target and the drafter on its own, smaller padded batch,
and the gradient is the sum of two partial sums instead of one. With ``lr`` 1e-2 over 14 AdamW steps the measured
difference is ~1e-7; a wrong global batch (a rank training on the whole batch, a loss not normalized by the
global counts, a gradient summed instead of averaged) moves weights by 1e-3 or more.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tiny_targets import tiny_qwen3

from eagle_assets.drafter.data.vocab import build_draft_vocab, count_completion_tokens
from eagle_assets.drafter.training.command import read_rows, train_result_from_dict, write_training_inputs
from eagle_assets.drafter.training.loop import train_drafter
from eagle_assets.drafter.training.recipe import TrainConfig

pytestmark = pytest.mark.slow(seconds=100)  # its share of a parallel session: scheduled early (conftest)

VOCAB, LAYERS = 300, 8
ATOL = 1e-5
# 13 rows of 16-40 tokens and one of 120 (a batch of its own, so rank 1 gets an empty shard there), batches of at
# most 96 tokens: 7 batches per epoch of 1-4 rows, 14 steps; validation scored every 2 steps. keep_best off, so
# the exported weights are those after the last step.
CONFIG = TrainConfig(lr=1e-2, epochs=2, ttt_steps=3, batch_tokens=96, seed=5, num_threads=1, warmup_steps=2,
                     save_every_steps=3, eval_every_tokens=160, acceptance_k=3, keep_best=False)
TOTAL, PER_EPOCH = 14, 7
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    pass


def make_rows(n, seed, lengths=(16, 41), long_rows=0):
    gen = np.random.default_rng(seed)
    out = []
    for i in range(n + long_rows):
        t = 120 if i >= n else int(gen.integers(*lengths))
        prompt = int(gen.integers(4, t // 2))
        mask = np.zeros(t, dtype=np.int8)
        mask[prompt:] = 1
        out.append((gen.integers(0, VOCAB, t).astype(np.int32), mask))
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tmp_path_factory.mktemp("ddp")
    target_dir = base / "target"
    tiny_qwen3(VOCAB, LAYERS, initializer_range=1.0).save_pretrained(target_dir)
    rows = make_rows(13, seed=3, long_rows=1)
    validation = make_rows(3, seed=4)
    vocab = build_draft_vocab(count_completion_tokens(rows, VOCAB), VOCAB, 200)
    vocab_dir = base / "vocab"
    vocab_dir.mkdir()
    np.save(vocab_dir / "d2t.npy", vocab.d2t)
    np.save(vocab_dir / "t2d.npy", vocab.t2d)
    np.save(vocab_dir / "token_counts.npy", vocab.counts)
    inputs = write_training_inputs(base / "inputs", rows, validation, CONFIG, vocab_dir)
    return {"base": base, "target": target_dir, "rows": rows, "validation": validation, "vocab": vocab,
            "inputs": inputs}


@pytest.fixture(scope="module")
def one_process(setup):
    """The reference: one process, no launcher."""
    return train_drafter(setup["target"], setup["rows"], setup["vocab"], CONFIG, setup["base"] / "one" / "ckpt",
                         validation_rows=setup["validation"])


def torchrun(setup, out: Path, state_dir: Path, nproc: int = 2) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "eagle_assets.drafter.training.command", "--target", str(setup["target"]),
           "--inputs", str(setup["inputs"]), "--out", str(out), "--state-dir", str(state_dir), "--log-every-s", "0"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DAGSTER_PIPES")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return proc


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a if a[k].is_floating_point())


@pytest.fixture(scope="module")
def two_processes(setup):
    out = setup["base"] / "two" / "ckpt"
    proc = torchrun(setup, out, setup["base"] / "two" / "state")
    return out, proc


def test_inputs_round_trip(setup):
    back = read_rows([setup["inputs"] / "train.parquet"])
    assert len(back) == len(setup["rows"])
    for (i, m), (j, n) in zip(back, setup["rows"]):
        assert i.dtype == np.int32 and m.dtype == np.int8
        np.testing.assert_array_equal(i, j)
        np.testing.assert_array_equal(m, n)


def test_two_gloo_processes_get_the_weights_of_one(setup, one_process, two_processes):
    out, proc = two_processes
    assert "data-parallel training on 2 process(es), backend gloo" in proc.stdout
    ref = load_file(str(one_process.checkpoint_dir / "model.safetensors"))
    got = load_file(str(out / "model.safetensors"))
    for k in ("d2t", "t2d"):
        assert torch.equal(ref[k], got[k])
    diff = max_diff(ref, got)
    assert diff < ATOL, f"2-process weights differ from 1-process by {diff:.3g} (tolerance {ATOL})"
    metrics = json.loads((out / "training_metrics.json").read_text())
    result = train_result_from_dict(metrics)
    assert len(result.steps) == len(one_process.steps) == one_process.plan.total_steps == TOTAL
    assert one_process.plan.batches_per_epoch == PER_EPOCH
    # every rank's metrics are the global batch's: the same supervised counts and tokens per step, losses close
    for a, b in zip(one_process.steps, result.steps):
        assert (a.supervised, a.tokens, a.lr) == (b.supervised, b.tokens, b.lr)
        assert b.loss == pytest.approx(a.loss, rel=1e-4, abs=1e-5)
    assert result.out_of_draft_positions == one_process.out_of_draft_positions
    # rank 0 scored the validation rows at the same steps, and both took the same best step
    assert [p.step for p in result.curve] == [p.step for p in one_process.curve] and len(result.curve) >= 3
    assert [p.val_tau for p in result.curve] == pytest.approx([p.val_tau for p in one_process.curve], abs=1e-6)
    assert result.best_step == one_process.best_step


def test_training_moves_the_weights_far_beyond_the_tolerance(setup, one_process, tmp_path):
    """Guards the tolerance: one step fewer differs from the full run by orders of magnitude more than ATOL."""
    shorter = train_drafter(setup["target"], setup["rows"], setup["vocab"],
                            replace(CONFIG, epochs=(TOTAL - 1) / PER_EPOCH), tmp_path / "ckpt",
                            validation_rows=setup["validation"])
    assert len(shorter.steps) == len(one_process.steps) - 1
    diff = max_diff(load_file(str(one_process.checkpoint_dir / "model.safetensors")),
                    load_file(str(shorter.checkpoint_dir / "model.safetensors")))
    assert diff > 100 * ATOL


def test_two_processes_resume_a_state_one_process_wrote(setup, one_process, tmp_path):
    """Rank 0 and rank 1 both load the state from the shared directory and finish the run."""

    class Crash(Exception):
        pass

    def crash_at_7(line):
        if line.startswith("step 7/"):
            raise Crash(line)

    state = tmp_path / "state"
    with pytest.raises(Crash):
        train_drafter(setup["target"], setup["rows"], setup["vocab"], CONFIG, tmp_path / "first",
                      log=crash_at_7, state_dir=state, validation_rows=setup["validation"])
    assert json.loads((state / "state.json").read_text())["step"] == 6
    out = tmp_path / "ckpt"
    proc = torchrun(setup, out, state)
    assert f"resuming from {state}: 6/{TOTAL} steps done" in proc.stdout
    result = train_result_from_dict(json.loads((out / "training_metrics.json").read_text()))
    assert result.resumed_from_step == 6 and len(result.steps) == TOTAL
    diff = max_diff(load_file(str(one_process.checkpoint_dir / "model.safetensors")),
                    load_file(str(out / "model.safetensors")))
    assert diff < ATOL


def test_a_dspark_block_drafter_under_two_processes_gets_the_weights_of_one(setup, tmp_path):
    """The block drafters under torchrun: a DSpark draft (three drafts per block, the target's final hidden state
    for its L1 term) trained by 2 gloo processes, each on its rows' blocks of the global batch, normalized by the
    global batch's weighted slots, ends with one process's weights; the learning curve is rank 0's. (How a row over
    the anchor cap draws its blocks once for the global batch: ``test_drafter_dflash.py``'s data-parallel test.)"""
    from eagle_assets.drafter.family import DraftArchitecture

    config = replace(CONFIG, epochs=1, drafter=DraftArchitecture("dspark", block_size=3), eval_every_tokens=0)
    one = train_drafter(setup["target"], setup["rows"], setup["vocab"], config, tmp_path / "one",
                        validation_rows=setup["validation"])
    vocab_dir = setup["base"] / "vocab"
    inputs = write_training_inputs(tmp_path / "inputs", setup["rows"], setup["validation"], config, vocab_dir)
    out = tmp_path / "two"
    proc = torchrun({**setup, "inputs": inputs}, out, tmp_path / "state")
    assert "data-parallel training on 2 process(es)" in proc.stdout
    diff = max_diff(load_file(str(one.checkpoint_dir / "model.safetensors")), load_file(str(out / "model.safetensors")))
    assert diff < ATOL, f"2-process DSpark weights differ from 1-process by {diff:.3g} (tolerance {ATOL})"
    result = train_result_from_dict(json.loads((out / "training_metrics.json").read_text()))
    assert len(result.steps) == len(one.steps) == PER_EPOCH
    for a, b in zip(one.steps, result.steps):
        assert a.supervised == b.supervised and len(a.supervised) == 3  # per slot: the global batch's counts
        assert b.loss == pytest.approx(a.loss, rel=1e-4, abs=1e-5)
    assert [p.val_loss for p in result.curve] == pytest.approx([p.val_loss for p in one.curve], rel=1e-5)
