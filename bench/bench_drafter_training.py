"""Drafter training benchmark on CPU: tokens/s, analytic FLOP/s, and that as a share of measured matmul FLOP/s.

One run (issue "EAGLE-3 drafter: faithful training", item 8) measures, with the same thread count throughout:

(a) training throughput of :func:`eagle_assets.drafter.train.train_drafter` on a random Qwen3 target of a
    realistic-but-CPU-sized shape: tokens per second of the optimizer steps (all tokens of the batch, and the
    supervised ones = teacher positions trained at TTT step 0), timed between the trainer's step log lines.
    Target features are cached before the loop (2 epochs), so a step holds the drafter's TTT forward + backward +
    AdamW and no target forward; the feature extraction is reported on its own line. The first ``--skip-steps``
    steps (allocator warm-up) are not timed.
(b) the analytic FLOPs of each timed step, hence achieved FLOP/s. Per step, with ``B`` rows of ``T`` tokens,
    ``k`` TTT steps, ``r0 = max(0, first teacher position - k)`` (rows before it skip TTT steps >= 1, see
    ``_ttt_loss``), ``R_0 = B*T`` rows at TTT step 0 and ``R_i = B*(T - r0)`` at steps i >= 1, ``n_i`` supervised
    rows of TTT step i (from the step metrics), hidden ``H``, MLP width ``I``, ``h`` query and ``g`` KV heads of
    size ``d``, draft vocab ``D``; one multiply-add = 2 FLOPs::

        fc       = 2 * R_0 * 3H * H                                    (step 0 only)
        proj_i   = 2 * R_i * 2H * (h + 2g) * d  +  2 * R_i * h*d * H     (q, k, v over [embed, hidden]; o)
        mlp_i    = 2 * R_i * 3 * H * I                                 (gate, up, down)
        attn_0   = 2 * 2 * B * h * d * T(T+1)/2                        (QK^T and PV, causal: useful keys only)
        attn_i   = 2 * 2 * B * h * d * sum_{p=r0}^{T-1} (p + 1 + i)    (step-0 keys 0..p plus i chain keys)
        head_i   = 2 * n_i * H * D                                     (drafter lm_head at supervised rows)
        teacher  = 2 * n_0 * H * D                                     (target head over the draft vocab, no grad)
        step     = 2 * fc + 3 * sum_i (proj_i + mlp_i + attn_i + head_i) + teacher

    Backward costs 2x forward for a matmul whose input needs a gradient (dX and dW) and 1x for ``fc`` (its input,
    the target's features, needs none), hence the 3x and 2x; the teacher head runs forward only. Norms, rotary,
    softmax, loss and AdamW are elementwise and not counted, nor is the attention backward's recomputation of the
    scores: "model FLOPs" as in the MFU definition of Chowdhery et al., PaLM (arXiv 2204.02311, appendix B).
(c) this machine's matmul FLOP/s on the SAME shapes: for every linear of a full batch, the three matmuls autograd
    runs (forward ``X @ W^T`` [R, in] x [in, out], input grad ``G @ W`` [R, out] x [out, in], weight grad
    ``G^T @ X`` [out, R] x [R, in]), float32, timed after warm-up (best of ``--repeats``), weighted by how often
    each occurs per step. Printed: achieved / measured.

Usage: ``.venv/bin/python bench/bench_drafter_training.py [--hidden 384] [--seq-len 512] [--rows 12]
[--batch-tokens 2048] [--ttt-steps 7] [--draft-vocab 4096] [--threads N]``. Takes about 30 s on 2 idle cores with
the defaults (several times longer when other processes compete for them). The output starts with the command line.

Wall-clock numbers depend on the free cores: the long training loop and the short best-of-N matmul timings suffer
unequally from other processes, so the wall-clock ratio is only meaningful on an idle machine. The run therefore
also reports the run-queue wait share (seconds this process's threads were ready to run but waited for a CPU, per
wall second and thread; Linux schedstat; near 0 = the wall-clock numbers are clean) and FLOPs per process
CPU-second for training and matmuls alike, which other processes move much less. That second ratio is work per
core-second: torch runs the small matmuls on one thread while the trainer's threads also count when they spin
idle in OpenMP, so it sits below the wall-clock ratio on an idle machine.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from schedstat import runq_wait_s  # noqa: E402

from eagle_assets.drafter.data.vocab import build_draft_vocab  # noqa: E402
from eagle_assets.drafter.features.local_capture import aux_layer_ids, head_argmax, run_target  # noqa: E402
from eagle_assets.drafter.training.loop import TrainConfig, train_drafter  # noqa: E402


@dataclass(frozen=True)
class Shape:
    """Drafter and batch shape: everything the FLOP count needs."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    draft_vocab: int
    seq_len: int
    prompt_len: int
    ttt_steps: int

    @property
    def row_start(self) -> int:
        # First teacher position is prompt_len - 1 (it teaches the first completion token); see _ttt_loss.
        return max(0, self.prompt_len - 1 - self.ttt_steps)

    def linears(self, rows: int) -> list[tuple[str, int, int, int, int]]:
        """The drafter's linears (lm_head excluded: its rows come from the supervision) for a batch of ``rows``
        tokens (whole rows of ``seq_len``), as ``(name, R, in, out, count)``: ``R`` rows it runs over, ``count`` its
        occurrences per optimizer step (TTT step 0 over all rows, steps >= 1 over rows from ``row_start``)."""
        h, d = self.hidden, self.head_dim
        later = rows // self.seq_len * (self.seq_len - self.row_start)
        out = [("fc", rows, 3 * h, h, 1)]
        for r, count in ((rows, 1), (later, self.ttt_steps - 1)):
            if count == 0:
                continue
            out += [
                ("q_proj", r, 2 * h, self.heads * d, count),
                ("k_proj", r, 2 * h, self.kv_heads * d, count),
                ("v_proj", r, 2 * h, self.kv_heads * d, count),
                ("o_proj", r, self.heads * d, h, count),
                ("gate_proj", r, h, self.intermediate, count),
                ("up_proj", r, h, self.intermediate, count),
                ("down_proj", r, self.intermediate, h, count),
            ]
        return out

    def step_flops(self, batch_rows: int, supervised: list[int]) -> dict[str, float]:
        """Analytic FLOPs of one optimizer step (formula in the module docstring), by term, forward + backward."""
        t, r0, k = self.seq_len, self.row_start, self.ttt_steps
        hd = self.heads * self.head_dim
        flops = {"fc": 0.0, "proj": 0.0, "mlp": 0.0, "attn": 0.0, "lm_head": 0.0, "teacher": 0.0}
        for name, rows, n_in, n_out, count in self.linears(batch_rows * t):
            mult = 2 if name == "fc" else 3
            term = "fc" if name == "fc" else "mlp" if name.endswith(("gate_proj", "up_proj", "down_proj")) else "proj"
            flops[term] += mult * count * 2.0 * rows * n_in * n_out
        keys = [t * (t + 1) / 2] + [sum(p + 1 + i for p in range(r0, t)) for i in range(1, k)]
        flops["attn"] = 3 * sum(2 * 2.0 * batch_rows * hd * kk for kk in keys)
        flops["lm_head"] = 3 * sum(2.0 * n * self.hidden * self.draft_vocab for n in supervised)
        flops["teacher"] = 2.0 * supervised[0] * self.hidden * self.draft_vocab
        return flops


def time_matmul(a: torch.Tensor, b: torch.Tensor, repeats: int) -> tuple[float, float]:
    """``(wall s, process CPU s)`` of the fastest (wall) of ``repeats`` runs of ``a @ b``, after one warm-up run."""
    torch.matmul(a, b)
    best = (float("inf"), float("inf"))
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        torch.matmul(a, b)
        best = min(best, (time.perf_counter() - w0, time.process_time() - c0))
    return best


def measure_linears(shape: Shape, batch_rows: int, supervised: list[int], repeats: int) -> list[dict]:
    """Measured float32 matmul time of every linear's forward, input-grad and weight-grad products (see (c))."""
    gen = torch.Generator().manual_seed(0)
    rows = shape.linears(batch_rows * shape.seq_len)
    k = shape.ttt_steps
    # lm_head: step 0 supervises n_0 rows, later steps a few fewer; time the typical (mean) row count k times.
    n_head = max(1, round(sum(supervised) / len(supervised)))
    rows.append(("lm_head", n_head, shape.hidden, shape.draft_vocab, k))
    results = []
    for name, r, n_in, n_out, count in rows:
        x = torch.randn(r, n_in, generator=gen)
        w = torch.randn(n_out, n_in, generator=gen)
        g = torch.randn(r, n_out, generator=gen)
        times = [time_matmul(x, w.t(), repeats)]
        if name != "fc":  # fc's input (target features) needs no gradient
            times.append(time_matmul(g, w, repeats))
        times.append(time_matmul(g.t(), x, repeats))
        flops = len(times) * 2.0 * r * n_in * n_out
        results.append({"name": name, "rows": r, "in": n_in, "out": n_out, "count": count, "flops": flops * count,
                        "seconds": sum(t for t, _ in times) * count, "cpu": sum(c for _, c in times) * count})
    return results


def make_target(args):
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(args.seed)
    config = Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.target_layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, tie_word_embeddings=True, max_position_embeddings=max(4096, args.seq_len),
    )
    return AutoModelForCausalLM.from_config(config).eval().requires_grad_(False)


def make_rows_and_vocab(target, args):
    """Random prompt + completion rows of exactly ``seq_len`` tokens, and a draft vocab of the target's most
    frequent greedy tokens at the teacher positions (so nearly every position is supervised, as with real data
    whose completions the target wrote)."""
    gen = np.random.default_rng(args.seed)
    rows = []
    for _ in range(args.rows):
        mask = np.zeros(args.seq_len, dtype=np.int8)
        mask[args.prompt_len:] = 1
        rows.append((gen.integers(0, args.vocab, args.seq_len).astype(np.int32), mask))
    counts = np.zeros(args.vocab, dtype=np.int64)
    capture = aux_layer_ids(args.target_layers, None)
    per = max(1, args.batch_tokens // args.seq_len)
    with torch.no_grad():
        for start in range(0, len(rows), per):
            ids = torch.from_numpy(np.stack([r[0] for r in rows[start : start + per]]).astype(np.int64))
            _aux, final = run_target(target, ids, capture)
            greedy = head_argmax(target, final[:, args.prompt_len - 1 : -1].reshape(-1, args.hidden))
            counts += np.bincount(greedy.numpy(), minlength=args.vocab)
    return rows, build_draft_vocab(counts, args.vocab, args.draft_vocab)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=384, help="target = drafter hidden size")
    p.add_argument("--intermediate", type=int, default=1024, help="MLP width of target and drafter")
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--target-layers", type=int, default=8, help="target depth (>= 7: distinct default aux layers)")
    p.add_argument("--vocab", type=int, default=16384, help="target vocab")
    p.add_argument("--draft-vocab", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=512, help="tokens per row (all rows this long)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per row (no loss)")
    p.add_argument("--rows", type=int, default=12, help="rows per epoch; 2 epochs are run")
    p.add_argument("--batch-tokens", type=int, default=2048)
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--skip-steps", type=int, default=1, help="first optimizer steps left out of the timing")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per matmul (best taken)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch CPU threads for everything")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.batch_tokens % args.seq_len:
        p.error("--batch-tokens must be a multiple of --seq-len (full batches of whole rows)")
    if args.skip_steps < 1:
        p.error("--skip-steps must be >= 1: timing runs from the end of a step to the end of a later one")
    torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    target = make_target(args)
    rows, vocab = make_rows_and_vocab(target, args)
    setup_s = time.perf_counter() - t0
    config = TrainConfig(lr=3e-4, epochs=2, max_length=args.seq_len, batch_tokens=args.batch_tokens,
                         ttt_steps=args.ttt_steps, seed=args.seed, num_threads=args.threads, warmup_steps=1)
    marks: list[tuple[float, float, float]] = []  # (wall, process CPU, run-queue wait) at the end of each step

    def log(line: str) -> None:
        if line.startswith("step "):
            marks.append((time.perf_counter(), time.process_time(), runq_wait_s()))

    with tempfile.TemporaryDirectory() as tmp:
        result = train_drafter(target, rows, vocab, config, Path(tmp) / "ckpt", log=log)

    shape = Shape(args.hidden, args.intermediate, args.heads, args.kv_heads, args.head_dim, args.draft_vocab,
                  args.seq_len, args.prompt_len, args.ttt_steps)
    timed = result.steps[args.skip_steps:]
    if not timed:
        p.error(f"only {len(result.steps)} steps ran; lower --skip-steps or raise --rows")
    (w0, c0, q0), (w1, c1, q1) = marks[args.skip_steps - 1], marks[-1]
    step_s, step_cpu, step_runq = w1 - w0, c1 - c0, q1 - q0
    tokens = sum(s.tokens for s in timed)
    supervised = sum(s.supervised[0] for s in timed)
    by_term: dict[str, float] = {}
    for s in timed:
        for term, f in shape.step_flops(s.tokens // args.seq_len, s.supervised).items():
            by_term[term] = by_term.get(term, 0.0) + f
    total_flops = sum(by_term.values())
    achieved = total_flops / step_s

    full_rows = args.batch_tokens // args.seq_len
    full = [s for s in timed if s.tokens == full_rows * args.seq_len] or timed
    mean_sup = [round(float(np.mean([s.supervised[i] for s in full]))) for i in range(args.ttt_steps)]
    t1, q1 = time.perf_counter(), runq_wait_s()
    linears = measure_linears(shape, full_rows, mean_sup, args.repeats)
    matmul_s, matmul_runq = time.perf_counter() - t1, runq_wait_s() - q1
    measured = sum(r["flops"] for r in linears) / sum(r["seconds"] for r in linears)
    measured_cpu = sum(r["flops"] for r in linears) / sum(r["cpu"] for r in linears)
    achieved_cpu = total_flops / step_cpu

    print(f"\ndrafter training benchmark: {os.cpu_count()} CPUs, {args.threads} torch threads, torch "
          f"{torch.__version__}, float32")
    print("command: " + shlex.join([".venv/bin/python", "bench/bench_drafter_training.py", *sys.argv[1:]]))
    print(f"drafter: hidden {args.hidden}, MLP {args.intermediate}, heads {args.heads}/{args.kv_heads}x"
          f"{args.head_dim}, draft vocab {args.draft_vocab}/{args.vocab}, TTT steps {args.ttt_steps}; target "
          f"{args.target_layers} layers")
    print(f"data: {args.rows} rows x {args.seq_len} tokens ({args.prompt_len} prompt), {args.batch_tokens} tokens "
          f"per batch, 2 epochs = {len(result.steps)} steps, {len(timed)} timed")
    print(f"setup (target, rows, vocab) {setup_s:.1f}s; target feature extraction {result.feature_seconds:.1f}s "
          f"({result.tokens_per_epoch / max(result.feature_seconds, 1e-9):,.0f} tok/s); matmul timing "
          f"{matmul_s:.1f}s\n")
    print(f"(a) training: {tokens / step_s:,.0f} tokens/s, {supervised / step_s:,.0f} supervised tokens/s "
          f"({step_s / len(timed):.2f} s/step; with feature extraction amortized over both epochs: "
          f"{tokens / (step_s + result.feature_seconds * len(timed) / len(result.steps)):,.0f} tokens/s)")
    print(f"(b) analytic: {total_flops / len(timed) / 1e9:,.1f} GFLOP/step, {total_flops / tokens / 1e6:,.1f} "
          f"MFLOP/token -> achieved {achieved / 1e9:,.2f} GFLOP/s ({achieved_cpu / 1e9:,.2f} GFLOP per CPU-s)")
    print("    by term: " + ", ".join(f"{k} {v / total_flops:.1%}" for k, v in by_term.items()))
    print(f"(c) measured matmul on the same shapes: {measured / 1e9:,.2f} GFLOP/s ({measured_cpu / 1e9:,.2f} GFLOP "
          f"per CPU-s)")
    print(f"    run-queue wait per wall second and thread: training {step_runq / step_s / args.threads:.2f}, "
          f"matmul timing {matmul_runq / matmul_s / args.threads:.2f} (0 = the cores were free)\n")
    print(f"{'linear':<10} {'rows':>6} {'in':>5} {'out':>5} {'x/step':>6} {'GFLOP/step':>10} {'GFLOP/s':>8}")
    for r in linears:
        print(f"{r['name']:<10} {r['rows']:>6} {r['in']:>5} {r['out']:>5} {r['count']:>6} {r['flops'] / 1e9:>10.2f} "
              f"{r['flops'] / r['seconds'] / 1e9:>8.2f}")
    linear_share = (by_term["fc"] + by_term["proj"] + by_term["mlp"] + by_term["lm_head"]) / total_flops
    print(f"\nachieved / measured matmul FLOP/s: {achieved / measured:.3f} wall clock, "
          f"{achieved_cpu / measured_cpu:.3f} per CPU-second (linears are {linear_share:.0%} of the analytic FLOPs; "
          "the rest is attention and the teacher head)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
