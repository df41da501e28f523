"""EAGLE-3 draft model (one Llama decoder layer over fused target features) and its training-time-test unroll.

Architecture, parameter names and shapes follow SGLang's serving class ``LlamaForCausalLMEagle3``
(``python/sglang/srt/models/llama_eagle3.py``) so the exported weights load by name:

- ``fc``: ``Linear(3 * target_hidden, hidden, bias=False)`` over the three aux hidden states (EAGLE-3 paper,
  arXiv 2503.01840, section 3: low/mid/high-level feature fusion).
- ``midlayer``: a Llama decoder layer whose q/k/v projections take ``2 * hidden`` inputs: the concatenation
  ``[input_layernorm(embed(token)), hidden_norm(hidden)]`` (embedding FIRST, as in SGLang's ``LlamaDecoderLayer``
  override). The residual is the un-normed ``hidden``. ``post_attention_layernorm`` and a SiLU MLP follow.
- ``norm`` then ``lm_head`` (``hidden -> draft_vocab``). The hidden state handed to the next draft step is the
  PRE-norm layer output (SGLang returns ``hidden_states_to_aux`` before ``norm``); ``fc`` is only applied to the
  target's ``3H`` features.
- The token embedding is the target's (frozen, never saved: SGLang shares the target's ``embed_tokens``).

Training-time test (EAGLE-3 section 3.2; SpecForge ``specforge/algorithms/eagle3/model.py``): step 0 runs every row
``p`` on ``(fc(aux[p]), embed(x[p+1]))`` at rotary position ``p`` with causal attention. Step ``i >= 1`` feeds row
``p`` its own previous pre-norm output and the token ``x[p+i+1]`` at rotary position ``p + i``; its query attends to
the step-0 keys of rows ``0..p`` (causal) and to the keys of steps ``1..i`` of the SAME row (the diagonal). That is
exactly what row ``p``'s query sees at serving time when it is the ``i``-th chained draft after a verified prefix
ending at token ``p + 1``: the prefix's cache plus its own chain.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class DrafterConfig:
    """Shape and rotary settings of an EAGLE-3 drafter (the fields SGLang's ``LlamaForCausalLMEagle3`` reads).

    ``hidden_size`` must equal the target's hidden size: the drafter borrows the target's embedding. Aux ids are
    stored as CAPTURE ids (see :mod:`eagle_assets.drafter.features.local_capture`).
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    aux_capture_ids: tuple[int, ...]
    rope_scaling: Mapping[str, Any] | None = None
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    @classmethod
    def from_target(
        cls,
        target_config: Any,
        draft_vocab_size: int,
        aux_capture_ids: Sequence[int],
        intermediate_size: int | None = None,
    ) -> "DrafterConfig":
        """Derive the drafter's shape from a HF target config (a ``PretrainedConfig`` or its dict).

        Heads, head_dim, norm eps, rotary settings and max positions are copied from the target; the MLP width
        defaults to the target's ``intermediate_size``.

        Raises:
            ValueError: the target uses an activation other than SiLU in a way we cannot mirror, or lacks a field.
        """
        get = _getter(target_config)
        hidden = int(get("hidden_size"))
        heads = int(get("num_attention_heads"))
        head_dim = get("head_dim", None) or hidden // heads
        theta, scaling = rope_settings(target_config)
        dtype = get("dtype", None) or (target_config.get("torch_dtype") if isinstance(target_config, Mapping) else None)
        dtype = dtype or "float32"
        if not isinstance(dtype, str):
            dtype = str(dtype).replace("torch.", "")
        if dtype not in ("float32", "bfloat16", "float16"):
            dtype = "float32"
        return cls(
            hidden_size=hidden,
            intermediate_size=int(intermediate_size or get("intermediate_size")),
            num_attention_heads=heads,
            num_key_value_heads=int(get("num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            vocab_size=int(get("vocab_size")),
            draft_vocab_size=int(draft_vocab_size),
            target_hidden_size=hidden,
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(get("max_position_embeddings", 8192)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            aux_capture_ids=tuple(int(c) for c in aux_capture_ids),
            torch_dtype=dtype,
            bos_token_id=get("bos_token_id", None),
            eos_token_id=get("eos_token_id", None),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def rope_settings(config: Any) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` of a HF config, reading transformers-5 ``rope_parameters`` or the legacy fields.

    ``rope_scaling`` is None for plain RoPE, else a dict with ``rope_type`` and its parameters (no ``rope_theta``).
    """
    get = _getter(config)
    params = get("rope_parameters", None)
    if isinstance(params, Mapping) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        kind = params.get("rope_type", params.get("type", "default"))
        scaling = None if kind in (None, "default") else {k: v for k, v in params.items() if k != "rope_theta"}
        return theta, scaling
    theta = float(get("rope_theta", 10000.0))
    scaling = get("rope_scaling", None)
    if isinstance(scaling, Mapping):
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        scaling = None if kind in (None, "default") else dict(scaling)
    else:
        scaling = None
    return theta, scaling


def _getter(config: Any):
    if isinstance(config, Mapping):
        def get(name, default=KeyError):
            if name in config:
                return config[name]
            if default is KeyError:
                raise ValueError(f"target config has no {name!r}")
            return default
        return get

    def get_attr(name, default=KeyError):
        if hasattr(config, name):
            return getattr(config, name)
        if default is KeyError:
            raise ValueError(f"target config has no {name!r}")
        return default
    return get_attr


class RMSNorm(nn.Module):
    """Llama RMSNorm: ``weight * x / sqrt(mean(x^2) + eps)``, computed in float32. Weight ``[hidden]``."""

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """Neox-style rotary embedding (SGLang ``get_rope(..., is_neox_style=True)``, HF ``rotate_half``)."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        inv_freq, scale = _inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scale = scale

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: int ``[..., T]`` -> cos, sin float32 ``[..., T, head_dim]``."""
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos() * self.scale, emb.sin() * self.scale


def _inv_freq(config: DrafterConfig) -> tuple[torch.Tensor, float]:
    dim = config.head_dim
    if config.rope_scaling is None:
        inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        return inv, 1.0
    # Scaled variants (llama3, yarn, linear, ...) are computed by transformers' own tables so training matches the
    # serving side, which implements the same published formulas.
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kind = config.rope_scaling.get("rope_type", config.rope_scaling.get("type"))
    if kind not in ROPE_INIT_FUNCTIONS:
        raise ValueError(
            f"rope_type {kind!r} is not supported by this drafter; supported: {sorted(ROPE_INIT_FUNCTIONS)}"
        )
    params = {"rope_theta": config.rope_theta, **dict(config.rope_scaling), "rope_type": kind}
    llama = LlamaConfig(
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters=params,
    )
    inv, factor = ROPE_INIT_FUNCTIONS[kind](llama, torch.device("cpu"))
    return inv.float(), float(factor)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, heads, T, d]; cos/sin [B or 1, T, d] -> broadcast over heads.
    cos = cos.unsqueeze(1).to(x.dtype)
    sin = sin.unsqueeze(1).to(x.dtype)
    return x * cos + _rotate_half(x) * sin


class Eagle3Attention(nn.Module):
    """Self-attention over ``2 * hidden`` inputs with grouped KV heads; q/k/v/o without bias (SGLang defaults)."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        h, nh, nkv, d = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        if nh % nkv:
            raise ValueError(f"num_attention_heads ({nh}) must be a multiple of num_key_value_heads ({nkv})")
        self.num_heads, self.num_kv_heads, self.head_dim = nh, nkv, d
        self.q_proj = nn.Linear(2 * h, nh * d, bias=False)
        self.k_proj = nn.Linear(2 * h, nkv * d, bias=False)
        self.v_proj = nn.Linear(2 * h, nkv * d, bias=False)
        self.o_proj = nn.Linear(nh * d, h, bias=False)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x ``[B, T, 2H]`` -> rotated q ``[B, nh, T, d]``, rotated k and v ``[B, nh, T, d]`` (KV heads repeated)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = _apply_rotary(q, cos, sin)
        k = _apply_rotary(k, cos, sin)
        rep = self.num_heads // self.num_kv_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        return q, k, v

    def finish(self, attn: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


#: query rows per block in the TTT attention; bounds the live score block to [B, heads, 64, T].
ATTENTION_BLOCK = 64


class _ChainAttention(torch.autograd.Function):
    """Softmax attention of each query row over (a) step-0 keys up to its own row and (b) its own chain keys.

    Written flash-attention style (blocks of query rows, scores recomputed in backward, only the output and its
    log-sum-exp saved) because on CPU the cost of TTT attention is memory traffic over ``[B, h, T, T]`` score
    tensors, not arithmetic; blocks also skip the keys that lie in every row's future.
    """

    @staticmethod
    def forward(ctx, q, k0, v0, kd, vd, row_offset: int):
        # q [B,h,Tq,d] (pre-scaled); k0/v0 [B,h,T,d]; kd/vd [B,h,Tq,n,d]; query r is absolute row row_offset + r.
        tq = q.shape[-2]
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=q.dtype, device=q.device)
        for c0 in range(0, tq, ATTENTION_BLOCK):
            c1 = min(tq, c0 + ATTENTION_BLOCK)
            s, sd, kend = _chain_scores(q, k0, kd, row_offset, c0, c1)
            m = torch.maximum(s.amax(-1), sd.amax(-1)).unsqueeze(-1)
            e = torch.exp(s - m)
            ed = torch.exp(sd - m)
            z = e.sum(-1, keepdim=True) + ed.sum(-1, keepdim=True)
            acc = torch.matmul(e, v0[:, :, :kend]) + (ed.unsqueeze(-1) * vd[:, :, c0:c1]).sum(-2)
            out[:, :, c0:c1] = acc / z
            lse[:, :, c0:c1] = (m + torch.log(z)).squeeze(-1)
        ctx.save_for_backward(q, k0, v0, kd, vd, out, lse)
        ctx.row_offset = row_offset
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k0, v0, kd, vd, out, lse = ctx.saved_tensors
        row_offset = ctx.row_offset
        grad_out = grad_out.contiguous()
        dq = torch.empty_like(q)
        dk0 = torch.zeros_like(k0)
        dv0 = torch.zeros_like(v0)
        dkd = torch.empty_like(kd)
        dvd = torch.empty_like(vd)
        delta = (grad_out * out).sum(-1, keepdim=True)
        tq = q.shape[-2]
        for c0 in range(0, tq, ATTENTION_BLOCK):
            c1 = min(tq, c0 + ATTENTION_BLOCK)
            s, sd, kend = _chain_scores(q, k0, kd, row_offset, c0, c1)
            g = grad_out[:, :, c0:c1]
            l = lse[:, :, c0:c1].unsqueeze(-1)
            dl = delta[:, :, c0:c1]
            p = torch.exp(s - l)
            pd = torch.exp(sd - l)
            ds = p * (torch.matmul(g, v0[:, :, :kend].transpose(-1, -2)) - dl)
            dsd = pd * ((g.unsqueeze(-2) * vd[:, :, c0:c1]).sum(-1) - dl)
            qc = q[:, :, c0:c1]
            dq[:, :, c0:c1] = torch.matmul(ds, k0[:, :, :kend]) + (dsd.unsqueeze(-1) * kd[:, :, c0:c1]).sum(-2)
            dk0[:, :, :kend] += torch.matmul(ds.transpose(-1, -2), qc)
            dv0[:, :, :kend] += torch.matmul(p.transpose(-1, -2), g)
            dkd[:, :, c0:c1] = dsd.unsqueeze(-1) * qc.unsqueeze(-2)
            dvd[:, :, c0:c1] = pd.unsqueeze(-1) * g.unsqueeze(-2)
        return dq, dk0, dv0, dkd, dvd, None


def _chain_scores(q, k0, kd, row_offset: int, c0: int, c1: int):
    """Scores of query rows ``c0:c1``: step-0 part ``[B,h,C,kend]`` (future masked to -inf) and chain part."""
    first, last = row_offset + c0, row_offset + c1 - 1
    kend = last + 1
    qc = q[:, :, c0:c1]
    s = torch.matmul(qc, k0[:, :, :kend].transpose(-1, -2))
    rows = torch.arange(first, last + 1, device=q.device).unsqueeze(-1)
    cols = torch.arange(kend, device=q.device).unsqueeze(0)
    s = s.masked_fill(cols > rows, float("-inf"))
    sd = (qc.unsqueeze(-2) * kd[:, :, c0:c1]).sum(-1)
    return s, sd, kend


def ttt_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    history: Sequence[tuple[torch.Tensor, torch.Tensor]],
    row_offset: int = 0,
) -> torch.Tensor:
    """Attention of one TTT step.

    Args:
        q, k, v: ``[B, heads, Tq, d]`` of the current step; query ``r`` belongs to absolute row ``row_offset + r``
            (one chain per row).
        history: ``(k, v)`` of earlier steps; ``history[0]`` is step 0 over ALL rows ``[B, heads, T, d]``, attended
            causally (keys ``0..row``); the rest are steps ``1..i-1`` over the same rows as ``q``, attended only on
            the query's own row (the chain's earlier drafts). The current ``k, v`` are the chain's newest entry.

    Returns:
        ``[B, heads, Tq, d]``. With an empty history this is plain causal attention (step 0, ``row_offset`` 0).
    """
    if not history:
        if row_offset:
            raise ValueError("step 0 runs over all rows; row_offset applies to later steps")
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    k0, v0 = history[0]
    keys = torch.stack([kj for kj, _ in history[1:]] + [k], dim=-2)  # [B, h, Tq, i, d]
    values = torch.stack([vj for _, vj in history[1:]] + [v], dim=-2)
    q = q * (1.0 / math.sqrt(q.shape[-1]))
    return _ChainAttention.apply(q.contiguous(), k0.contiguous(), v0.contiguous(), keys, values, int(row_offset))


class Eagle3MLP(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"SGLang's LlamaMLP only supports silu; got hidden_act={config.hidden_act!r}")
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    """SGLang's EAGLE-3 ``midlayer``: parameter names ``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``,
    ``hidden_norm``, ``input_layernorm``, ``post_attention_layernorm``."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.self_attn = Eagle3Attention(config)
        self.mlp = Eagle3MLP(config)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        history: Sequence[tuple[torch.Tensor, torch.Tensor]],
        row_offset: int = 0,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """embeds, hidden ``[B, T, H]`` -> (pre-norm output ``[B, T, H]``, this step's ``(k, v)``)."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        q, k, v = self.self_attn.project(x, cos, sin)
        h = hidden + self.self_attn.finish(ttt_attention(q, k, v, history, row_offset))
        out = h + self.mlp(self.post_attention_layernorm(h))
        return out, (k, v)


class Eagle3DraftModel(nn.Module):
    """EAGLE-3 drafter; ``state_dict()`` keys are exactly SGLang's checkpoint names minus ``d2t``/``t2d``.

    Args:
        config: :class:`DrafterConfig`.
        embed_weight: the target's input embedding ``[vocab_size, hidden_size]`` (frozen; kept as a non-persistent
            buffer so it is never saved). May be attached later with :meth:`attach_embedding`.
        draft_token_ids: int64 ``[draft_vocab_size]`` target id of each draft id (``DraftVocab.draft_token_ids``);
            used to turn draft predictions into target tokens when the drafter feeds itself.
    """

    def __init__(
        self,
        config: DrafterConfig,
        embed_weight: torch.Tensor | None = None,
        draft_token_ids: torch.Tensor | None = None,
    ):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.rotary = Rotary(config)
        self.register_buffer("embed_weight", torch.empty(0), persistent=False)
        if draft_token_ids is None:
            draft_token_ids = torch.arange(config.draft_vocab_size)
        self.register_buffer("draft_token_ids", torch.as_tensor(draft_token_ids, dtype=torch.long), persistent=False)
        if self.draft_token_ids.shape != (config.draft_vocab_size,):
            raise ValueError(
                f"draft_token_ids has shape {tuple(self.draft_token_ids.shape)}, "
                f"expected ({config.draft_vocab_size},)"
            )
        self.reset_parameters()
        if embed_weight is not None:
            self.attach_embedding(embed_weight)

    def reset_parameters(self) -> None:
        """Normal(0, initializer_range) linears, unit norms (HF/SpecForge ``post_init`` convention)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def attach_embedding(self, weight: torch.Tensor) -> None:
        """Use the target's embedding ``[vocab_size, hidden_size]`` (detached, frozen)."""
        expected = (self.config.vocab_size, self.config.hidden_size)
        if tuple(weight.shape) != expected:
            raise ValueError(
                f"target embedding has shape {tuple(weight.shape)}, the drafter needs {expected} "
                "(vocab_size x hidden_size of the target it was trained for)"
            )
        self.embed_weight = weight.detach().to(self.fc.weight.dtype)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """int ``[B, T]`` target ids -> ``[B, T, H]`` target embeddings."""
        if self.embed_weight.numel() == 0:
            raise RuntimeError(
                "the drafter has no token embedding: it borrows the target's; call "
                "attach_embedding(target.get_input_embeddings().weight) or load_drafter(dir, target)"
            )
        return F.embedding(token_ids, self.embed_weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden ``[..., H]`` -> draft-vocab logits ``[..., draft_vocab_size]``."""
        return self.lm_head(self.norm(hidden))

    def unroll(
        self,
        aux_hidden: torch.Tensor,
        input_ids: torch.Tensor,
        steps: int,
        *,
        feed_own_tokens: bool = False,
        row_start: int = 0,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Run ``steps`` TTT steps over whole sequences.

        Args:
            aux_hidden: float ``[B, T, 3 * target_hidden]`` target aux states; row ``p`` = features of position ``p``.
            input_ids: int ``[B, T]`` the ORIGINAL token sequence ``x`` (right-padded); the model shifts it itself.
            steps: number of TTT steps (>= 1).
            feed_own_tokens: False (training): step ``i`` row ``p`` embeds ``x[p+i+1]``. True (simulated serving at
                temperature 0): step 0 embeds ``x[p+1]`` and step ``i >= 1`` embeds the drafter's own greedy
                token of step ``i-1``, mapped to a target id.
            row_start: only rows ``p >= row_start`` are carried through the steps (all rows still serve as step-0
                context). Rows before it are prompt rows no loss reaches; skipping them saves time, never changes
                the kept rows' values.

        Returns:
            ``(hiddens, drafts)``: per step the pre-norm output ``[B, T - row_start, H]`` (index ``p - row_start``);
            ``drafts`` is per step the greedy TARGET id ``[B, T - row_start]`` (row ``p`` at step ``i`` predicts
            token ``p + i + 2``) when ``feed_own_tokens``, else an empty list. Rows past a sequence's end are
            padding and carry garbage.
        """
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        b, t, _ = aux_hidden.shape
        if not 0 <= row_start < t:
            raise ValueError(f"row_start must be in [0, {t}), got {row_start}")
        ids = input_ids.to(torch.long)
        pos = torch.arange(t, device=aux_hidden.device).unsqueeze(0)
        cos, sin = self.rotary.cos_sin(pos)
        hidden, kv0 = self.midlayer(
            self.embed(F.pad(ids[:, 1:], (0, 1), value=0)), self.fc(aux_hidden.to(self.fc.weight.dtype)), cos, sin, []
        )
        hidden = hidden[:, row_start:]
        history: list[tuple[torch.Tensor, torch.Tensor]] = [kv0]
        hiddens = [hidden]
        drafts: list[torch.Tensor] = []
        rows = pos[:, row_start:]
        tokens = None
        if feed_own_tokens:
            tokens = self.draft_token_ids[self.logits(hidden).argmax(-1)]
            drafts.append(tokens)
        for i in range(1, steps):
            if not feed_own_tokens:
                tokens = F.pad(ids[:, i + 1 :], (0, i + 1), value=0)[:, row_start:t]
            cos, sin = self.rotary.cos_sin(rows + i)
            hidden, kv = self.midlayer(self.embed(tokens), hidden, cos, sin, history, row_offset=row_start)
            history.append(kv)
            hiddens.append(hidden)
            if feed_own_tokens:
                tokens = self.draft_token_ids[self.logits(hidden).argmax(-1)]
                drafts.append(tokens)
        return hiddens, drafts
