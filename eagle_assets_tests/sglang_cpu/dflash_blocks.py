"""Run in the SGLang 0.5.23 CPU venv (test-only): load exported DFlash and DSpark drafts into SGLang's own
``DFlashDraftModel`` / ``DSparkDraftModel`` and draft blocks with SGLang's own modules, driven as its
``DFlashWorkerV2`` / DSpark ``DraftBlockProposer`` drive the draft.

    python dflash_blocks.py CASES.json OUT.json

``CASES.json``: ``{"cases": [{"name", "checkpoint", "inputs": npz with aux [T, K*H] float32, ids [T] int64,
embed [V, H] float32, lm_head [V, H] float32, "positions": [p, ...]}]}``. For each ``p``: the verified prefix holds
positions ``0..p`` and the target just emitted ``ids[p + 1]`` (the anchor, whose own features are not computed);
the block is ``[ids[p + 1], mask x (B - 1)]`` at positions ``p + 1 .. p + B``, the context the features of
positions ``0..p``, and the proposals are ``argmax(lm_head(out[1:]))`` (``dflash_worker_v2.py``: slot 0 discarded,
slot ``k`` the token at ``anchor + k``). DSpark (``sample_from_anchor``): the block is ``[ids[p + 1], mask x (g - 1)]``
and SGLang's own ``compute_base_logits`` and ``draft_markov_block`` (temperature 0) propose ``g`` tokens, slot ``k``
the token at ``anchor + k + 1``, each Markov bias from the anchor or the previous draft; its ``compute_confidence``
gives the confidence of each draft (the head is built: ``SGLANG_RAGGED_VERIFY_MODE=compact``). ``OUT.json``: per
case the blocks (target ids), their logits, the confidences (DSpark) and the load report (parameters
``load_weights`` wrote / left untouched, tensors consumed).

Sampled DSpark (SGLang's default, ``SGLANG_DSPARK_USE_GREEDY_DRAFT`` unset), two optional keys of a case:

- ``"sampled": {"position": p, "temperature": T, "draws": R, "top_ks": [...]}``: ``draft_markov_block`` at step
  temperature ``T`` on ``R`` copies of the block of ``p`` (each row its own Philox noise) gives ``R`` drawn blocks;
  ``dspark_verify._draft_probs`` (``SoftmaxTemp`` of the kept ``corrected_logits``) gives the ``q`` the verifier
  reads, at every drawn token; ``resolve_draft_params`` gives the step temperature of a request at each top_k.
- ``"verify": {"inputs": npz with candidates [R, g + 1] int64 ([anchor | drafts]), target_logits [R * (g + 1), V]
  float32, step_logits [R, g, V] float32; "temperature", "top_k", "top_p", "seed"}``: SGLang's
  ``dspark_verify.accept_draft_tokens`` with its default arguments (no block verification, no block-wise
  rejection) on those blocks, coins from torch's generator seeded with ``seed``: the accepted count of each row.
  The Triton rejection kernel (``reject_sampling.py``) runs in Triton's CPU interpreter (``TRITON_INTERPRET=1``,
  set before anything imports triton).

What is SGLang's and what is a reference here:

- SGLang's: the class built from the checkpoint's ``config.json`` through transformers' ``AutoConfig`` as SGLang's
  loader does, its ``load_weights`` (q/k/v -> ``qkv_proj``, gate/up -> ``gate_up_proj``), the mask token id and
  block size from its ``parse_dflash_draft_config``, and every module the draft runs: ``project_target_hidden``
  (``fc`` then ``hidden_norm``), the attention's ``kv_proj_only`` / ``apply_k_norm`` / ``apply_k_rope`` (the
  context keys and values), ``qkv_proj``, the q/k norms (``models.utils.apply_qk_norm``), ``rotary_emb``,
  ``o_proj``, the norms with their fused residual add, the MLP, the final ``norm``; ``attn.scaling``.
- Reference: the attention kernel (``RadixAttention`` needs a forward batch and a KV pool that do not run on CPU),
  a softmax of the block's queries over the context keys and the block's keys with no mask (the layers are
  ``ENCODER_ONLY``, bidirectional, and the context holds only positions before the anchor), and the decoder layer's
  ``forward`` body (copied statement for statement, since it takes the forward batch). The target embedding and
  LM head are the target's tensors, as the worker borrows them.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any import of triton: the rejection kernel runs on CPU

import numpy as np  # noqa: E402
import torch  # noqa: E402


def _load(checkpoint):
    from draft_chains import load_over_nan
    from sglang.srt.models.dflash import DFlashDraftModel
    from sglang.srt.models.dspark import DSparkDraftModel
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(checkpoint)
    cls = DSparkDraftModel if config.architectures == ["DSparkDraftModel"] else DFlashDraftModel
    model = cls(config).float()
    weights = load_over_nan(model, checkpoint)
    written, untouched = [], []
    for name, p in model.named_parameters():
        (untouched if torch.isnan(p).any() else written).append(name)
    shards = {"qkv_proj": 3, "gate_up_proj": 2}
    consumed = sum(shards.get(name.split(".")[-2], 1) for name in written)
    parsed = parse_dflash_draft_config(draft_hf_config=config)
    return model, parsed, written, untouched, {"tensors": len(weights), "consumed": consumed}


def _hidden(model, aux, ids, embed, p, mask_id, block):
    from sglang.srt.models.utils import apply_qk_norm

    anchor = p + 1
    ctx = model.project_target_hidden(aux[:anchor])  # context: positions 0..p, strictly before the anchor
    ctx_pos = torch.arange(anchor)
    block_ids = torch.full((block,), mask_id, dtype=torch.long)
    block_ids[0] = ids[anchor]
    x = embed[block_ids]
    pos = torch.arange(anchor, anchor + block)
    residual = None
    for layer in model.layers:
        at = layer.self_attn
        ck, cv = at.kv_proj_only(model.prepare_context_hidden_for_kv(layer, ctx))
        ck = at.apply_k_rope(ctx_pos, at.apply_k_norm(ck))
        # DFlashDecoderLayer.forward, statement for statement, with a reference attention
        if residual is None:
            residual = x
            h = layer.input_layernorm(x)
        else:
            h, residual = layer.input_layernorm(x, residual)
        qkv, _ = at.qkv_proj(h)
        q, k, v = qkv.split([at.q_size, at.kv_size, at.kv_size], -1)
        q, k = apply_qk_norm(q, k, at.q_norm, at.k_norm, at.head_dim, allow_inplace=False)
        q, k = at.rotary_emb(pos, q, k)
        rep = at.num_heads // at.num_kv_heads
        keys = torch.cat([ck, k]).view(-1, at.num_kv_heads, at.head_dim).transpose(0, 1).repeat_interleave(rep, 0)
        values = torch.cat([cv, v]).view(-1, at.num_kv_heads, at.head_dim).transpose(0, 1).repeat_interleave(rep, 0)
        queries = q.view(block, at.num_heads, at.head_dim).transpose(0, 1)
        attn = torch.softmax((queries @ keys.transpose(-1, -2)) * at.attn.scaling, -1) @ values
        out, _ = at.o_proj(attn.transpose(0, 1).reshape(block, -1))
        h, residual = layer.post_attention_layernorm(out, residual)
        x = layer.mlp(h)
    out, _ = model.norm(x, residual)
    return out


def _dspark_block(model, anchor_token, hidden, embed, lm_head):
    """SGLang's DSpark proposal at temperature 0 (``DraftBlockProposer``'s calls), and its confidences."""
    from sglang.srt.speculative.dspark_components.dspark_draft import DraftNoise, draft_markov_block

    class NoSync:  # tensor parallelism of one: nothing to gather
        def sync(self, site, values):
            return values

    head = torch.nn.Module()
    head.weight, head.org_vocab_size, head.quant_method, head.tp_size = lm_head, lm_head.shape[0], None, 1
    model.attach_shared_modules(embed_tokens=torch.nn.Embedding.from_pretrained(embed), lm_head=head)
    g, v = hidden.shape[0], lm_head.shape[0]
    base, features = model.compute_base_logits(hidden)
    tokens, step_logits = draft_markov_block(
        markov_head=model.markov_head, base_logits=base.view(1, g, v), anchor_tokens=anchor_token.view(1),
        draft_hidden=hidden.view(1, g, -1), step_temperatures=torch.zeros(1),
        noise=DraftNoise(key=1, offset=torch.zeros(1, dtype=torch.int64)), tp_sync=NoSync(), greedy_draft=False)
    confidence, _raw = model.compute_confidence(anchor_tokens=anchor_token.view(1), draft_tokens=tokens,
                                                confidence_features=features)
    return tokens[0].tolist(), step_logits[0].tolist(), confidence[0].tolist()


def _dspark_sampled(model, anchor_token, hidden, spec):
    """SGLang's sampled DSpark draft of one block, ``spec["draws"]`` times (module docstring)."""
    from types import SimpleNamespace

    from sglang.srt.speculative.dspark_components.dspark_draft import (
        DraftBlockResult,
        DraftNoise,
        draft_markov_block,
        resolve_draft_params,
    )
    from sglang.srt.speculative.dspark_components.dspark_verify import _draft_probs

    class NoSync:
        def sync(self, site, values):
            return values

    r, temperature = int(spec["draws"]), float(spec["temperature"])
    g = hidden.shape[0]
    base, _features = model.compute_base_logits(hidden)
    base = base.view(1, g, -1).expand(r, -1, -1).contiguous()
    temps = torch.full((r,), temperature)
    tokens, step_logits = draft_markov_block(
        markov_head=model.markov_head, base_logits=base, anchor_tokens=anchor_token.view(1).expand(r),
        draft_hidden=hidden.view(1, g, -1).expand(r, -1, -1), step_temperatures=temps,
        noise=DraftNoise(key=12345, offset=torch.zeros(1, dtype=torch.int64)), tp_sync=NoSync(), greedy_draft=False)
    block = DraftBlockResult(draft_tokens=tokens, corrected_logits=step_logits, greedy_mask=torch.zeros(r, dtype=bool),
                             temperatures=temps, greedy_draft=False)
    q = _draft_probs(block, base.shape[-1], torch.device("cpu")).gather(2, tokens.unsqueeze(-1))[..., 0]
    step_temperatures = {}
    for top_k in spec.get("top_ks", []):
        info = SimpleNamespace(temperatures=torch.tensor([[temperature]]), top_ks=torch.tensor([int(top_k)]))
        step_temperatures[str(top_k)] = float(resolve_draft_params(sampling_info=info, bs=1,
                                                                   device=torch.device("cpu")).step_temperatures[0])
    return {"tokens": tokens.tolist(), "q": q.tolist(), "step_temperatures": step_temperatures}


def _dspark_verify(spec):
    """SGLang's default sampled DSpark accept (``accept_draft_tokens``) on given blocks (module docstring)."""
    from types import SimpleNamespace

    from sglang.srt.speculative.dspark_components.dspark_draft import DraftBlockResult
    from sglang.srt.speculative.dspark_components.dspark_verify import accept_draft_tokens

    data = np.load(spec["inputs"])
    candidates = torch.from_numpy(data["candidates"]).long()
    target_logits = torch.from_numpy(data["target_logits"]).float()
    step_logits = torch.from_numpy(data["step_logits"]).float()
    r, g = step_logits.shape[:2]
    vocab = step_logits.shape[-1]
    temperature, top_k, top_p = float(spec["temperature"]), int(spec["top_k"]), float(spec["top_p"])
    top_k = top_k if top_k > 0 else 1 << 30  # SGLang's TOP_K_ALL for "no top_k"
    temps = torch.full((r, 1), temperature)
    info = SimpleNamespace(temperatures=temps, top_ks=torch.full((r,), top_k, dtype=torch.int32),
                           top_ps=torch.full((r,), top_p), need_top_k_sampling=top_k < vocab,
                           need_top_p_sampling=top_p < 1.0, is_all_greedy=False, is_any_greedy=False)
    block = DraftBlockResult(draft_tokens=candidates[:, 1:], corrected_logits=step_logits,
                             greedy_mask=torch.zeros(r, dtype=torch.bool), temperatures=temps.view(-1),
                             greedy_draft=False)
    torch.manual_seed(int(spec["seed"]))
    correct_len, _bonus, _trim = accept_draft_tokens(
        candidates=candidates, target_logits=target_logits, draft_block=block, sampling_info=info,
        draft_input=SimpleNamespace(max_top_k=min(top_k, vocab), uniform_top_k_value=min(top_k, vocab)), gamma=g,
        verify_num_draft_tokens=g + 1)
    return {"accepted": correct_len.tolist()}


def main(cases_path, out_path):
    # DSpark's confidence head is built only in a ragged verify mode; DFlash reads no such setting
    os.environ["SGLANG_RAGGED_VERIFY_MODE"] = "compact"
    cases = json.loads(open(cases_path).read())["cases"]
    # world-1 gloo groups, as for the EAGLE-3 drafts (no draft window here)
    from draft_chains import _init

    _init(None)
    results = {}
    for case in cases:
        model, parsed, written, untouched, counts = _load(case["checkpoint"])
        data = np.load(case["inputs"])
        aux, ids = torch.from_numpy(data["aux"]).float(), torch.from_numpy(data["ids"]).long()
        embed, lm_head = torch.from_numpy(data["embed"]).float(), torch.from_numpy(data["lm_head"]).float()
        mask_id, block = parsed.mask_token_id, parsed.resolve_block_size(default=16)
        dspark = hasattr(model, "markov_head")
        blocks, logits, confidences = [], [], []
        with torch.no_grad():
            for p in case["positions"]:
                out = _hidden(model, aux, ids, embed, p, mask_id, block)
                if dspark:
                    got, lg, conf = _dspark_block(model, ids[p + 1], out, embed, lm_head)
                    confidences.append(conf)
                else:
                    step = out[1:] @ lm_head.T  # DFlashWorkerV2: slot 0 discarded
                    got, lg = step.argmax(-1).tolist(), step.tolist()
                blocks.append(got)
                logits.append(lg)
        extra = {}
        with torch.no_grad():
            if dspark and "sampled" in case:
                p = case["sampled"]["position"]
                out = _hidden(model, aux, ids, embed, p, mask_id, block)
                extra["sampled"] = _dspark_sampled(model, ids[p + 1], out, case["sampled"])
            if dspark and "verify" in case:
                extra["verify"] = _dspark_verify(case["verify"])
        results[case["name"]] = {**extra, "written": written, "untouched": untouched, **counts, "blocks": blocks,
                                 "logits": logits, "confidences": confidences, "mask_token_id": mask_id,
                                 "block_size": block,
                                 "target_layer_ids": list(parsed.target_layer_ids or [])}
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
