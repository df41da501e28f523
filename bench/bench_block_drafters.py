"""Training speed of the block drafters (DFlash, DSpark) against SpecForge 0.2.0's own modules, side by side on CPU.

For each family and shape, one batch (rows of prompt + completion tokens, the anchors of each row, random target
features and final hiddens), the same draft weights loaded into both, and the same anchors: a training step is the
loss's forward and backward (ours: ``dflash.model.block_loss`` / ``dspark.model.dspark_loss``; SpecForge's:
``OnlineDFlashModel`` / ``OnlineDSparkModel`` with SDPA attention, its CPU path, and its defaults: the objective in
checkpointed chunks of ``objective_chunk_blocks = 128`` blocks). The target's embedding and LM head are one frozen
``[V, H]`` tensor shared by both sides (SpecForge's trainer freezes the target head, ``training/assembly.py``; a tied
tensor saves 2.3 GiB at the 8B vocab and changes no arithmetic). Each side runs one warm-up step, then the timed
steps alternate ours / SpecForge's, so both see the same machine load. Reported: seconds per step (median of the
timed steps), training tokens/s (row tokens through one step), the ratio ours / SpecForge's, the process's peak RSS
while each side's steps ran (a 1 ms sampler of ``/proc/self/statm``; both sides' weights are resident throughout,
so the difference between the two columns is the difference between the two steps' working memory) and that the
two losses agree.

Shapes: ``demo`` (the embedded target's: hidden 128, 4 heads / 2 KV heads of 32, MLP 384, vocab 1,536) and ``8b``
(Qwen3-8B's: hidden 4,096, 32 / 8 heads of 128, MLP 12,288, vocab 151,936), one draft layer, block 16 (DFlash) /
7 drafts (DSpark), Markov rank 64. ``--anchors`` caps the anchors per row (a seeded uniform draw, the same for both
sides; SpecForge's ``num_anchors``): every anchor at ``demo`` (95 per row), 16 per row at ``8b``, where one step
over every anchor of two 128-token rows takes minutes on one thread and the process (both drafts, their gradients,
the 2.3 GiB head) would pass 8 GiB.

Run in the SGLang CPU venv, which has SpecForge (``eagle_assets_tests/sglang_cpu/setup_venv.sh``)::

    PYTHONPATH=.:eagle_assets_tests/sglang_cpu .eagle_assets/sglang-cpu-venv/bin/python bench/bench_block_drafters.py \\
        [--shapes demo 8b] [--rows 2] [--tokens 128] [--anchors demo=all 8b=16] [--steps demo=5 8b=3] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

import torch

SHAPES = {
    "demo": dict(hidden_size=128, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 vocab_size=1536, num_hidden_layers=4),
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
               head_dim=128, vocab_size=151936, num_hidden_layers=36),
}
DEFAULT_ANCHORS = {"demo": None, "8b": 16}
DEFAULT_STEPS = {"demo": 5, "8b": 3}

# three target layers read, ascending (k = the output of layer k, <= L - 2)
TARGET_LAYERS = {"demo": [0, 1, 2], "8b": [1, 17, 33]}
GIB = 2 ** 30


class PeakRSS:
    """The process's resident set, sampled every ``period`` seconds on a thread; :meth:`reset` starts a new peak."""

    def __init__(self, period: float = 0.001):
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._fd = os.open("/proc/self/statm", os.O_RDONLY)
        self.peak = self.now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period,), daemon=True)
        self._thread.start()

    def now(self) -> int:
        return int(os.pread(self._fd, 128, 0).split()[1]) * self._page

    def _run(self, period):
        while not self._stop.wait(period):
            self.peak = max(self.peak, self.now())

    def reset(self) -> None:
        self.peak = self.now()

    def read(self) -> int:
        return max(self.peak, self.now())

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        os.close(self._fd)


def _batch(shape, rows, tokens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    v, h = shape["vocab_size"], shape["hidden_size"]
    ids = torch.randint(0, v - 1, (rows, tokens), generator=gen)
    mask = torch.zeros(rows, tokens, dtype=torch.long)
    mask[:, tokens // 4:] = 1  # a prompt, then the completion
    return ids, mask, torch.randn(rows, tokens, 3 * h, generator=gen), torch.randn(rows, tokens, h, generator=gen)


def _time_side_by_side(steps_of, n_steps, rss):
    """One warm-up step per side (the allocator and the first kernels), then ``n_steps`` rounds alternating the
    sides. Returns ``{side: (median seconds, peak RSS bytes over its steps)}``."""
    times, peaks = {k: [] for k in steps_of}, {k: 0 for k in steps_of}

    def run(side, record):
        rss.reset()
        t0 = time.perf_counter()
        steps_of[side]()
        dt = time.perf_counter() - t0
        peaks[side] = max(peaks[side], rss.read())
        if record:
            times[side].append(dt)

    for side in steps_of:
        run(side, False)
    for _ in range(n_steps):
        for side in steps_of:
            run(side, True)
    return {k: (statistics.median(times[k]), peaks[k]) for k in steps_of}


def bench(family, shape_name, rows, tokens, steps, num_anchors, rss):
    from safetensors.torch import load_file
    from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel, OnlineDSparkModel
    from specforge.modeling.draft.dflash import DFlashDraftModel as SFDFlash
    from specforge.modeling.draft.dspark import DSparkDraftModel as SFDSpark
    from transformers import AutoConfig

    from eagle_assets.drafter.dflash.model import anchors_of, block_loss, config_from_target
    from eagle_assets.drafter.family import family_named

    shape = dict(SHAPES[shape_name], rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=4096)
    torch.manual_seed(0)
    base = config_from_target(shape, mask_token_id=shape["vocab_size"] - 1, num_hidden_layers=1, block_size=16,
                              target_layer_ids=TARGET_LAYERS[shape_name])
    v, h = shape["vocab_size"], shape["hidden_size"]
    head_w = torch.randn(v, h) * 0.02  # the target's embedding and LM head: one frozen tensor, shared by both
    if family == "dspark":
        from eagle_assets.drafter.dspark.model import DSparkConfig, DSparkDraftModel, dspark_loss

        config = DSparkConfig(**{**asdict(base), "block_size": 7, "markov_rank": 64})
        ours = DSparkDraftModel(config, head_w, None)
    else:
        from eagle_assets.drafter.dflash.model import DFlashDraftModel

        ours = DFlashDraftModel(base, head_w, None)
    ids, mask, hidden, last = _batch(shape, rows, tokens)
    anchors, keep = anchors_of(mask, num_anchors, torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as tmp:
        family_named(family).export(ours, None, None, ours.config.aux_capture_ids, Path(tmp) / "ckpt")
        sf_config = AutoConfig.from_pretrained(Path(tmp) / "ckpt")
        sf_config._attn_implementation = "sdpa"
        sf = (SFDSpark if family == "dspark" else SFDFlash)(sf_config).float()
        sf.load_state_dict(load_file(str(Path(tmp) / "ckpt" / "model.safetensors")), strict=True)
    sf_embed = torch.nn.Embedding.from_pretrained(head_w)  # frozen
    sf_head = torch.nn.Linear(h, v, bias=False, device="meta")
    sf_head.weight = torch.nn.Parameter(head_w, requires_grad=False)  # frozen, as SpecForge's trainer sets it
    online = (OnlineDSparkModel if family == "dspark" else OnlineDFlashModel)(
        sf, sf_head, sf_embed, mask_token_id=ours.config.mask_token_id, block_size=ours.config.block_size,
        attention_backend="sdpa", num_anchors=int(anchors.shape[1]))
    online._sample_anchor_positions = lambda *_a, **_k: (anchors, keep)
    losses = {}

    def clear():  # neither side's gradients from its last step stay resident during the other's
        ours.zero_grad(set_to_none=True)
        sf.zero_grad(set_to_none=True)

    def our_step():
        clear()
        if family == "dspark":
            loss, _ = dspark_loss(ours, hidden, ids, mask, anchors, keep, last)
        else:
            loss, _ = block_loss(ours, hidden, ids, mask, anchors, keep)
        loss.backward()
        losses["ours"] = float(loss.detach())

    def their_step():
        clear()
        args = (ids, hidden, mask.float())
        loss = (online(*args, target_last_hidden_states=last) if family == "dspark" else online(*args))[0]
        loss.backward()
        losses["specforge"] = float(loss.detach())

    res = _time_side_by_side({"ours": our_step, "specforge": their_step}, steps, rss)
    (t_ours, rss_ours), (t_theirs, rss_theirs) = res["ours"], res["specforge"]
    n = rows * tokens
    return {"family": family, "shape": shape_name, "anchors": int(keep.sum(1).max()), "steps": steps,
            "ours_s": t_ours, "specforge_s": t_theirs, "ours_tok_s": n / t_ours, "specforge_tok_s": n / t_theirs,
            "ratio": t_theirs / t_ours, "rss_ours": rss_ours / GIB, "rss_specforge": rss_theirs / GIB,
            "loss_ours": losses["ours"], "loss_specforge": losses["specforge"]}


def _per_shape(values, default, cast):
    """``["5"]`` (every shape) or ``["demo=5", "8b=2"]`` over ``default``; ``all`` / ``none`` = None."""
    out = dict(default)
    for item in values or []:
        name, _, value = item.rpartition("=")
        value = None if value in ("all", "none") else cast(value)
        for shape in ([name] if name else SHAPES):
            out[shape] = value
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=["demo", "8b"], choices=sorted(SHAPES))
    p.add_argument("--families", nargs="+", default=["dflash", "dspark"])
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--anchors", nargs="*", help="anchors per row: N, or SHAPE=N / SHAPE=all per shape "
                   f"(default {DEFAULT_ANCHORS})")
    p.add_argument("--steps", nargs="*", help=f"timed steps per side: N or SHAPE=N (default {DEFAULT_STEPS})")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    anchors = _per_shape(args.anchors, DEFAULT_ANCHORS, int)
    steps = _per_shape(args.steps, DEFAULT_STEPS, int)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.rows} rows x {args.tokens} tokens; per shape: "
          f"anchors per row {anchors}, timed steps {steps} (median, after one warm-up per side, alternating sides); "
          f"cpu: {os.cpu_count()} cores", flush=True)
    print("| family | shape | anchors/row | ours s/step | SpecForge s/step | ours tok/s | SpecForge tok/s | "
          "ours faster by | peak RSS ours GiB | peak RSS SpecForge GiB | loss ours | loss SpecForge |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    # imported here, not first inside bench(): an import error that SpecForge's or transformers' imports catch and
    # keep would hold bench()'s frame (both models, the 8B head) through its traceback for the rest of the run
    import specforge.algorithms.common.dflash_family_model  # noqa: F401
    import specforge.modeling.draft.dspark  # noqa: F401

    rss = PeakRSS()
    for shape in args.shapes:
        for family in args.families:
            r = bench(family, shape, args.rows, args.tokens, steps[shape], anchors[shape], rss)
            print(f"| {r['family']} | {r['shape']} | {r['anchors']} | {r['ours_s']:.3f} | {r['specforge_s']:.3f} | "
                  f"{r['ours_tok_s']:.0f} | {r['specforge_tok_s']:.0f} | {r['ratio']:.2f}x | {r['rss_ours']:.2f} | "
                  f"{r['rss_specforge']:.2f} | {r['loss_ours']:.6f} | {r['loss_specforge']:.6f} |", flush=True)
    rss.close()
    print(f"process peak RSS (ru_maxrss): {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
