"""Run in the SGLang 0.5.23 CPU venv (test-only): load exported drafters into SGLang's own draft classes and draft
chains with SGLang's own modules, driven as its EAGLE worker drives the draft model.

    python draft_chains.py CASES.json OUT.json

``CASES.json``: ``{"cases": [{"name", "checkpoint", "inputs": npz with aux [T, 3H] float32, ids [T] int64,
embed [V, H] float32, "positions": [p, ...], "k": k, "window": W or null}]}``. For each case and each ``p``: the
draft extend over the prefix ``0..p`` (row ``q`` fed ``(embed(ids[q + 1]), aux[q])``, as SGLang's draft extend
after verification), then ``k - 1`` draft decode steps, each fed its own previous token (``hot_token_id`` of the
draft argmax) and the previous step's aux output. ``OUT.json``: per case the chains (target ids ``[len(P), k]``),
each step's draft logits ``[draft_vocab]`` and their top-two margin, and the load report (parameters SGLang's
``load_weights`` wrote, parameters it left untouched).

What is SGLang's and what is a reference here:

- SGLang's: the class (``LlamaForCausalLMEagle3`` / ``Eagle3DeepseekV2ForCausalLM``) built from the checkpoint's
  ``config.json`` through transformers' ``AutoConfig`` as SGLang's loader does; its ``load_weights`` (name mapping,
  stacked q/k/v and gate/up, MLA's q_a/kv_a fusion and ``post_load_weights``' ``w_kc``/``w_vc`` split); every
  module the forward calls: ``fc`` (and ``input_norm`` / ``fc_norm``), ``embed_tokens``, the norms (with their
  fused residual add), ``qkv_proj`` / MLA's ``fused_qkv_a_proj_with_mqa``, ``q_a_layernorm``, ``q_b_proj``,
  ``kv_a_layernorm``, ``rotary_emb``, ``o_proj``, the MLP, the final ``norm``, ``lm_head``, ``hot_token_id``;
  ``attn.scaling`` and the window SGLang puts on ``attn.sliding_window_size`` from
  ``--speculative-draft-window-size`` (published through SGLang's own ``ServerArgs``).
- Reference, line by line: the attention backend (``RadixAttention`` needs a forward batch and KV pool that do
  not run on CPU without the compiled kernels): a softmax over the cached keys with SGLang's
  ``torch_native_backend`` mask (``k_pos <= q_pos`` and ``k_pos >= q_pos - window``); for MLA the absorbed form of
  ``DeepseekV2AttentionMLA.forward_absorb`` (``q_nope @ w_kc`` against the latent cache, ``@ w_vc`` after); the
  decoder layers' ``forward`` bodies (copied statement for statement, since they take the forward batch); the MLA
  model's ``_fc_gatherer`` (an all-gather, the identity at TP 1) is not called.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch


def _init(window):
    """World-1 gloo groups (as SGLang's ``test/layer_ut_utils.py``), built once; the window is written into the
    published server args the way ``--speculative-draft-window-size`` is, before each class is built."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 2000))
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )
    from sglang.srt.runtime_context import get_context
    from sglang.test.test_utils import publish_build_topology

    if not torch.distributed.is_initialized():
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    if not model_parallel_is_initialized():
        publish_build_topology(tp_size=1, ep_size=1, pp_size=1)
        initialize_model_parallel(backend="gloo")
    get_context().override("draft_chains", speculative_draft_window_size=window)


def load_over_nan(model, checkpoint):
    """Fill every parameter of SGLang's ``model`` with NaN, then run its own ``load_weights`` on the checkpoint's
    ``model.safetensors``: a parameter still NaN afterwards is one the loader never wrote. Returns the tensors read
    (name -> tensor)."""
    from safetensors.torch import load_file

    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    weights = load_file(os.path.join(checkpoint, "model.safetensors"))
    model.load_weights(iter(weights.items()))
    return weights


def _load(checkpoint):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(checkpoint)
    arch = config.architectures[0]
    if arch == "LlamaForCausalLMEagle3":
        from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3 as cls
    else:
        from sglang.srt.models.kimi_k25_eagle3 import Eagle3DeepseekV2ForCausalLM as cls
    model = cls(config).float()
    weights = load_over_nan(model, checkpoint)
    written, untouched = [], []
    for name, p in model.named_parameters():
        rows = config.draft_vocab_size if name == "lm_head.weight" else p.shape[0]  # padded vocab rows stay unset
        (untouched if torch.isnan(p[:rows]).any() else written).append(name)
    # every checkpoint tensor consumed: each written parameter takes its shards (q/k/v, gate/up, MLA's q_a/kv_a),
    # d2t and t2d are read, so any other tensor would have been skipped
    shards = {"qkv_proj": 3, "gate_up_proj": 2, "fused_qkv_a_proj_with_mqa": 2}
    consumed = sum(shards.get(name.split(".")[-2], 1) for name in written) + 2
    return model, config, arch, written, untouched, {"tensors": len(weights), "consumed": consumed}


def _attend(q, keys, values, q_pos, k_pos, scale, window):
    """q [nh, Tq, d]; keys/values [nh, Tk, d]; torch_native_backend's mask."""
    visible = k_pos[None, :] <= q_pos[:, None]
    if window is not None and window > -1:
        visible &= k_pos[None, :] >= q_pos[:, None] - window
    scores = (q @ keys.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1) @ values


class LlamaDriver:
    def __init__(self, model):
        self.m = model.model
        self.cache = [None] * len(self.m.layers)

    def layer(self, i, layer, positions, embeds, hidden, residual):
        # LlamaDecoderLayer.forward (llama_eagle3.py), statement for statement
        if layer.is_input_layer:
            residual = hidden
            hidden = layer.hidden_norm(hidden)
            embeds = layer.input_layernorm(embeds)
            hidden = torch.cat([embeds, hidden], dim=-1)
        else:
            hidden, residual = layer.hidden_norm(hidden, residual)
        attn = layer.self_attn
        qkv, _ = attn.qkv_proj(hidden)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q, k = attn.rotary_emb(positions, q, k)
        t = q.shape[0]
        q = q.view(t, attn.num_heads, attn.head_dim).transpose(0, 1)
        k = k.view(t, attn.num_kv_heads, attn.head_dim).transpose(0, 1)
        v = v.view(t, attn.num_kv_heads, attn.head_dim).transpose(0, 1)
        rep = attn.num_heads // attn.num_kv_heads
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        if self.cache[i] is not None:
            pk, pv, pp = self.cache[i]
            k, v, kpos = torch.cat([pk, k], 1), torch.cat([pv, v], 1), torch.cat([pp, positions])
        else:
            kpos = positions
        self.cache[i] = (k, v, kpos)
        out = _attend(q, k, v, positions, kpos, attn.attn.scaling, attn.attn.sliding_window_size)
        out, _ = attn.o_proj(out.transpose(0, 1).reshape(t, -1))
        hidden, residual = layer.post_attention_layernorm(out, residual)
        return layer.mlp(hidden), residual

    def forward(self, ids, positions, hidden):
        # LlamaModel.forward (llama_eagle3.py)
        embeds = self.m.embed_tokens(ids)
        if hidden.shape[-1] != embeds.shape[-1]:
            if self.m.input_norm is not None:
                hidden = self.m.input_norm(hidden)
            if self.m.fc_norm is not None:
                chunks = hidden.chunk(self.m.num_aux_hidden_states, dim=-1)
                hidden = torch.cat([norm(c) for norm, c in zip(self.m.fc_norm, chunks)], dim=-1)
            hidden = self.m.fc(hidden)
        residual = None
        for i, layer in enumerate(self.m.layers):
            hidden, residual = self.layer(i, layer, positions, embeds, hidden, residual)
        to_logits, to_aux = self.m.norm(hidden, residual)
        return to_logits, (to_logits if self.m.norm_output else to_aux)


class MLADriver:
    def __init__(self, model):
        self.m = model.model
        self.cache = None

    def attention(self, attn, positions, x):
        # DeepseekV2AttentionMLA: the fused down projection, then forward_absorb's math
        t = x.shape[0]
        fused, _ = attn.fused_qkv_a_proj_with_mqa(x)
        q_a, latent, k_pe = fused.split([attn.q_lora_rank, attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
        q, _ = attn.q_b_proj(attn.q_a_layernorm(q_a))
        q = q.view(t, attn.num_local_heads, attn.qk_head_dim)
        q_nope, q_pe = q.split([attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
        latent = attn.kv_a_layernorm(latent)
        q_pe, k_pe = attn.rotary_emb(positions, q_pe, k_pe.unsqueeze(1))
        q_latent = torch.bmm(q_nope.transpose(0, 1), attn.w_kc)  # [nh, T, kv_lora_rank]
        keys = torch.cat([latent, k_pe.reshape(t, -1)], dim=-1)  # the MLA cache row: latent + rotary key
        if self.cache is not None:
            keys, kpos = torch.cat([self.cache[0], keys]), torch.cat([self.cache[1], positions])
        else:
            kpos = positions
        self.cache = (keys, kpos)
        query = torch.cat([q_latent, q_pe.transpose(0, 1)], dim=-1)  # [nh, T, kv_lora + rope]
        latent_values = keys[:, : attn.kv_lora_rank]
        out = _attend(query, keys.expand(query.shape[0], *keys.shape),
                      latent_values.expand(query.shape[0], *latent_values.shape), positions, kpos, attn.scaling, None)
        out = torch.bmm(out, attn.w_vc)  # [nh, T, v_head_dim]
        out, _ = attn.o_proj(out.transpose(0, 1).reshape(t, -1))
        return out

    def forward(self, ids, positions, hidden):
        # Eagle3MLAModel.forward and Eagle3MLADecoderLayer.forward (kimi_k25_eagle3.py)
        embeds = self.m.embed_tokens(ids)
        if hidden.shape[-1] != embeds.shape[-1]:
            if self.m.fc_norm is not None:
                chunks = hidden.chunk(self.m.num_aux_hidden_states, dim=-1)
                hidden = torch.cat([norm(c) for norm, c in zip(self.m.fc_norm, chunks)], dim=-1)
            hidden, _ = self.m.fc(hidden)
        layer = self.m.midlayer
        residual = hidden
        embeds = layer.input_layernorm(embeds)
        hidden = layer.hidden_norm(hidden)
        out = self.attention(layer.self_attn, positions, torch.cat([embeds, hidden], dim=-1))
        hidden, residual = layer.post_attention_layernorm(out, residual)
        hidden = layer.mlp(hidden)
        to_logits, to_aux = self.m.norm(hidden, residual)
        return to_logits, (to_logits if self.m.norm_output else to_aux)


def chains(model, config, arch, data, positions, k):
    ids = torch.from_numpy(data["ids"]).long()
    aux = torch.from_numpy(data["aux"]).float()
    embed = torch.from_numpy(data["embed"]).float()
    with torch.no_grad():
        model.model.embed_tokens.weight[: embed.shape[0]] = embed  # SGLang shares the target's embedding
    head = model.lm_head.weight[: config.draft_vocab_size]
    hot = model.get_hot_token_id()
    out, margins, all_logits = [], [], []
    for p in positions:
        driver = LlamaDriver(model) if arch == "LlamaForCausalLMEagle3" else MLADriver(model)
        with torch.no_grad():
            to_logits, carried = driver.forward(ids[1 : p + 2], torch.arange(p + 1), aux[: p + 1])
            chain, chain_margins, chain_logits = [], [], []
            for i in range(k):
                logits = to_logits[-1] @ head.T
                chain_logits.append(logits.tolist())
                top = torch.topk(logits, 2).values
                chain_margins.append(float(top[0] - top[1]))
                token = int(hot[int(logits.argmax())])
                chain.append(token)
                if i + 1 < k:
                    to_logits, carried = driver.forward(torch.tensor([token]), torch.tensor([p + 1 + i]),
                                                        carried[-1:])
        out.append(chain)
        margins.append(chain_margins)
        all_logits.append(chain_logits)
    return out, margins, all_logits


def main(cases_path, out_path):
    cases = json.loads(open(cases_path).read())["cases"]
    results = {}
    for case in cases:
        _init(case.get("window"))
        model, config, arch, written, untouched, counts = _load(case["checkpoint"])
        data = np.load(case["inputs"])
        got, margins, logits = chains(model, config, arch, data, case["positions"], case["k"])
        results[case["name"]] = {"class": arch, "written": written, "untouched": untouched, **counts, "chains": got,
                                 "margins": margins, "logits": logits,
                                 "window": [layer.self_attn.attn.sliding_window_size
                                            for layer in getattr(model.model, "layers", [])]}
    with open(out_path, "w") as fh:
        json.dump(results, fh)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
