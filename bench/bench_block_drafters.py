"""Training speed of the block drafters (DFlash, DSpark) against SpecForge 0.2.0's own modules, side by side on CPU.

For each family and shape, one batch (rows of prompt + completion tokens, every anchor of each row, random target
features and final hiddens), the same draft weights loaded into both, and the same anchors: a training step is the
loss's forward and backward (ours: ``dflash.model.block_loss`` / ``dspark.model.dspark_loss``; SpecForge's:
``OnlineDFlashModel`` / ``OnlineDSparkModel`` with SDPA attention, its CPU path). Reported: seconds per step
(median of the timed steps after warm-up), training tokens/s (row tokens through one step), the ratio ours /
SpecForge's, and that the two losses agree.

Shapes: ``demo`` (the embedded target's: hidden 128, 4 heads / 2 KV heads of 32, MLP 384, vocab 1,536) and ``8b``
(Qwen3-8B's: hidden 4,096, 32 / 8 heads of 128, MLP 12,288, vocab 151,936), one draft layer, block 16 (DFlash) /
7 drafts (DSpark), Markov rank 64.

Run in the SGLang CPU venv, which has SpecForge (``eagle_assets_tests/sglang_cpu/setup_venv.sh``)::

    PYTHONPATH=.:eagle_assets_tests/sglang_cpu .eagle_assets/sglang-cpu-venv/bin/python bench/bench_block_drafters.py \\
        [--shapes demo 8b] [--rows 2] [--tokens 128] [--steps 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
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


# three target layers read, ascending (k = the output of layer k, <= L - 2)
TARGET_LAYERS = {"demo": [0, 1, 2], "8b": [1, 17, 33]}


def _batch(shape, rows, tokens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    v, h = shape["vocab_size"], shape["hidden_size"]
    ids = torch.randint(0, v - 1, (rows, tokens), generator=gen)
    mask = torch.zeros(rows, tokens, dtype=torch.long)
    mask[:, tokens // 4:] = 1  # a prompt, then the completion
    return ids, mask, torch.randn(rows, tokens, 3 * h, generator=gen), torch.randn(rows, tokens, h, generator=gen)


def _time(step, steps):
    step()  # warm-up: the allocator and the first kernels
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def bench(family, shape_name, rows, tokens, steps):
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
    embed, head_w = torch.randn(v, h) * 0.02, torch.randn(v, h) * 0.02
    if family == "dspark":
        from eagle_assets.drafter.dspark.model import DSparkConfig, DSparkDraftModel, dspark_loss

        config = DSparkConfig(**{**asdict(base), "block_size": 7, "markov_rank": 64})
        ours = DSparkDraftModel(config, embed, head_w)
    else:
        from eagle_assets.drafter.dflash.model import DFlashDraftModel

        ours = DFlashDraftModel(base, embed, head_w)
    ids, mask, hidden, last = _batch(shape, rows, tokens)
    anchors, keep = anchors_of(mask)
    with tempfile.TemporaryDirectory() as tmp:
        family_named(family).export(ours, None, None, ours.config.aux_capture_ids, Path(tmp) / "ckpt")
        sf_config = AutoConfig.from_pretrained(Path(tmp) / "ckpt")
        sf_config._attn_implementation = "sdpa"
        sf = (SFDSpark if family == "dspark" else SFDFlash)(sf_config).float()
        sf.load_state_dict(load_file(str(Path(tmp) / "ckpt" / "model.safetensors")), strict=True)
    sf_embed = torch.nn.Embedding.from_pretrained(embed)
    sf_head = torch.nn.Linear(h, v, bias=False)
    sf_head.weight.data = head_w
    online = (OnlineDSparkModel if family == "dspark" else OnlineDFlashModel)(
        sf, sf_head, sf_embed, mask_token_id=ours.config.mask_token_id, block_size=ours.config.block_size,
        attention_backend="sdpa", num_anchors=int(anchors.shape[1]))
    online._sample_anchor_positions = lambda *_a, **_k: (anchors, keep)
    losses = {}

    def our_step():
        ours.zero_grad(set_to_none=True)
        if family == "dspark":
            loss, _ = dspark_loss(ours, hidden, ids, mask, anchors, keep, last)
        else:
            loss, _ = block_loss(ours, hidden, ids, mask, anchors, keep)
        loss.backward()
        losses["ours"] = float(loss.detach())

    def their_step():
        sf.zero_grad(set_to_none=True)
        args = (ids, hidden, mask.float())
        loss = (online(*args, target_last_hidden_states=last) if family == "dspark" else online(*args))[0]
        loss.backward()
        losses["specforge"] = float(loss.detach())

    t_ours, t_theirs = _time(our_step, steps), _time(their_step, steps)
    n = rows * tokens
    return {"family": family, "shape": shape_name, "ours_s": t_ours, "specforge_s": t_theirs,
            "ours_tok_s": n / t_ours, "specforge_tok_s": n / t_theirs, "ratio": t_theirs / t_ours,
            "loss_ours": losses["ours"], "loss_specforge": losses["specforge"]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=["demo", "8b"], choices=sorted(SHAPES))
    p.add_argument("--families", nargs="+", default=["dflash", "dspark"])
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.rows} rows x {args.tokens} tokens, "
          f"median of {args.steps} steps after one warm-up; cpu: {os.cpu_count()} cores")
    print("| family | shape | ours s/step | SpecForge s/step | ours tok/s | SpecForge tok/s | ours faster by | "
          "loss ours | loss SpecForge |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        for family in args.families:
            r = bench(family, shape, args.rows, args.tokens, args.steps)
            print(f"| {r['family']} | {r['shape']} | {r['ours_s']:.3f} | {r['specforge_s']:.3f} | "
                  f"{r['ours_tok_s']:.0f} | {r['specforge_tok_s']:.0f} | {r['ratio']:.2f}x | {r['loss_ours']:.6f} | "
                  f"{r['loss_specforge']:.6f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
