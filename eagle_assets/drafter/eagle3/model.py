"""EAGLE-3 draft models (decoder layers over fused target features) and their training-time-test unroll.

Architecture, parameter names and shapes follow SGLang 0.5.23's serving classes so the exported weights load by name
(``python/sglang/srt/models/llama_eagle3.py`` ``LlamaForCausalLMEagle3`` for ``architecture: llama``;
``kimi_k25_eagle3.py`` ``Eagle3DeepseekV2ForCausalLM`` for ``architecture: mla``):

- ``fc``: ``Linear(3 * target_hidden, hidden, bias=config.bias)`` over the three aux hidden states (EAGLE-3 paper,
  arXiv 2503.01840, section 3: low/mid/high-level feature fusion). EAGLE-3.1 (``fc_norm``) puts one RMSNorm on each
  aux chunk before it (``fc_norm.i``); ``norm_before_fc`` (llama only) one RMSNorm over the whole ``3H`` vector
  (``input_norm``).
- ``layers.0``: a decoder layer whose attention takes ``2 * hidden`` inputs: the concatenation
  ``[input_layernorm(embed(token)), hidden_norm(hidden)]`` (embedding FIRST, as in SGLang's ``LlamaDecoderLayer``
  override). The residual is the un-normed ``hidden``. ``post_attention_layernorm`` and a SiLU MLP follow.
  ``layers.N`` (N >= 1, llama only) take the previous layer's output ``h``: ``hidden_norm(h)`` (``H`` wide) into
  attention, ``h`` as the residual; their ``input_layernorm`` exists in SGLang's class but its forward never uses
  it (the exporter writes ones for it).
- attention: ``llama``: grouped-query attention, q/k/v/o without bias, neox-style rotary over ``head_dim``.
  ``mla``: DeepSeek-V2 multi-latent attention (``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``;
  ``kv_a_proj_with_mqa`` -> ``kv_a_layernorm`` -> ``kv_b_proj``; rotary on the ``qk_rope_head_dim`` part, GPT-J
  (interleaved) style as SGLang's ``rope_interleave`` default; softmax scale ``qk_head_dim ** -0.5`` times
  ``yarn_get_mscale(factor, mscale_all_dim) ** 2`` under yarn, SGLang ``compute_mla_mscale_scaling``). Computed here
  in the expanded form; SGLang's absorbed form (``w_kc``/``w_vc`` split of ``kv_b_proj``) is the same product.
- ``norm`` then ``lm_head`` (``hidden -> draft_vocab``). The hidden state handed to the next draft step is the
  PRE-norm layer output (SGLang's ``hidden_states_to_aux``), or with EAGLE-3.1's ``norm_output`` the post-norm one;
  ``fc`` is only applied to the target's ``3H`` features.
- ``window``: a sliding attention window of ``W`` (a query at position ``q`` sees keys at ``q - W .. q``, SGLang's
  ``torch_native_backend._make_sliding_window_mask``); SGLang reads it from ``--speculative-draft-window-size`` only.
- The token embedding is the target's (frozen, never saved: SGLang shares the target's ``embed_tokens``).

Training-time test (EAGLE-3 section 3.2; SpecForge ``specforge/algorithms/eagle3/model.py``): step 0 runs every row
``p`` on ``(fc(aux[p]), embed(x[p+1]))`` at rotary position ``p`` with causal attention. Step ``i >= 1`` feeds row
``p`` its own previous output (pre- or post-norm, as above) and the token ``x[p+i+1]`` at rotary position ``p + i``;
in every layer its query attends to that layer's step-0 keys of rows ``0..p`` (causal) and to the keys of steps
``1..i`` of the SAME row (the diagonal). That is exactly what row ``p``'s query sees at serving time when it is the
``i``-th chained draft after a verified prefix ending at token ``p + 1``: the prefix's cache plus its own chain.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from eagle_assets.drafter.family import DraftArchitecture

ARCHITECTURES = ("llama", "mla")
#: MLA shape fields, read from the target's config.json when the catalog does not set them.
MLA_DIMS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def target_has_mla(target_config: Any) -> bool:
    """Whether a target (HF config or its dict; a multimodal wrapper's ``text_config`` is looked into) uses
    multi-latent attention: the one test of it here (its config names a ``kv_lora_rank``)."""
    for cfg in (target_config, _getter(target_config)("text_config", None)):
        if cfg is not None and _getter(cfg)("kv_lora_rank", None) is not None:
            return True
    return False


def auto_choice(target_config: Any) -> tuple[str, str]:
    """What ``architecture: auto`` trains for a target, and why: ``("mla" | "llama", reason)``.

    The measurements behind it (docs/drafters.md): on the embedded default the EAGLE-3 chain draft leads the block
    drafters trained on the same rows and recipe (``training.compare``); the MLA draft exists for MLA targets, whose
    KV cache layout SGLang serves it with (the public Kimi-K2.x drafts are MLA, with the 3.1 switches on)."""
    if target_has_mla(target_config):
        return "mla", ("auto -> mla: the target uses multi-latent attention (its config names kv_lora_rank), and "
                       "SGLang serves an MLA draft with the target's own KV cache layout")
    return "llama", ("auto -> llama: the target has no multi-latent attention; the one-layer EAGLE-3 draft led "
                     "DSpark and DFlash trained from the same rows and recipe on the embedded default "
                     "(docs/drafters.md); measure yours with training.compare")


@dataclass(frozen=True)
class DrafterConfig:
    """Shape and rotary settings of an EAGLE-3 drafter (the fields SGLang's draft classes read).

    ``hidden_size`` must equal the target's hidden size: the drafter borrows the target's embedding. Aux ids are
    stored as CAPTURE ids (see :mod:`eagle_assets.drafter.features.local_capture`). The fields after
    ``eos_token_id`` describe the architecture (:class:`DraftArchitecture`, resolved); at their defaults the
    drafter is the one-layer EAGLE-3 Llama draft every earlier checkpoint holds, and :meth:`to_dict` leaves them
    out so fingerprints and metrics written before they existed still match.
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
    architecture: str = "llama"
    num_hidden_layers: int = 1
    fc_norm: bool = False
    norm_output: bool = False
    norm_before_fc: bool = False
    bias: bool = False
    window: int | None = None
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.architecture not in ARCHITECTURES:
            problems.append(f"architecture {self.architecture!r} is not one of {ARCHITECTURES}")
        if self.num_hidden_layers < 1:
            problems.append(f"num_hidden_layers must be >= 1, got {self.num_hidden_layers}")
        if self.window is not None and self.window < 1:
            problems.append(f"window must be >= 1 token (or null for full attention), got {self.window}")
        if self.architecture == "mla":
            missing = [name for name in MLA_DIMS if not getattr(self, name)]
            if missing:
                problems.append(f"an MLA draft needs {missing}: set them under training.drafter, or use a target "
                                "whose config.json has them")
            if self.num_hidden_layers != 1:
                problems.append("SGLang 0.5.23's Eagle3DeepseekV2ForCausalLM takes exactly one layer "
                                f"(num_hidden_layers {self.num_hidden_layers})")
            if self.norm_before_fc:
                problems.append("norm_before_fc is read by SGLang's Llama draft only; its MLA draft has no input_norm")
            if self.window is not None:
                problems.append("SGLang 0.5.23 applies --speculative-draft-window-size to the Llama EAGLE-3 draft "
                                "only, not to its MLA draft: leave window null")
        if problems:
            raise ValueError("drafter config: " + "; ".join(problems))

    @property
    def rotary_dim(self) -> int:
        """Dimensions the rotary embedding turns: ``head_dim`` (llama), ``qk_rope_head_dim`` (mla)."""
        return int(self.qk_rope_head_dim) if self.architecture == "mla" else self.head_dim

    @classmethod
    def from_target(
        cls,
        target_config: Any,
        draft_vocab_size: int,
        aux_capture_ids: Sequence[int],
        intermediate_size: int | None = None,
        arch: DraftArchitecture | None = None,
    ) -> "DrafterConfig":
        """Derive the drafter's shape from a HF target config (a ``PretrainedConfig`` or its dict).

        Heads, head_dim, norm eps, rotary settings and max positions are copied from the target; the MLP width
        defaults to the target's ``intermediate_size``; ``arch`` (default :class:`DraftArchitecture`) picks the
        layout, with the defaults its docstring gives, MLA dims from the target's (text) config.

        Raises:
            ValueError: a field is missing, or the architecture cannot be built (see ``__post_init__``).
        """
        arch = arch or DraftArchitecture()
        get = _getter(target_config)
        text = get("text_config", None)
        tget = _getter(text) if text is not None else get
        hidden = int(tget("hidden_size"))
        heads = int(tget("num_attention_heads"))
        head_dim = tget("head_dim", None) or hidden // heads
        theta, scaling = rope_settings(text if text is not None else target_config)
        dtype = get("dtype", None) or (target_config.get("torch_dtype") if isinstance(target_config, Mapping) else None)
        dtype = dtype or "float32"
        if not isinstance(dtype, str):
            dtype = str(dtype).replace("torch.", "")
        if dtype not in ("float32", "bfloat16", "float16"):
            dtype = "float32"
        kind = arch.architecture
        if kind == "auto":
            kind, _why = auto_choice(target_config)
        if kind not in ARCHITECTURES:
            raise ValueError(f"training.drafter.architecture {arch.architecture!r} is not auto, llama or mla")
        switch = kind == "mla"
        mla = {name: getattr(arch, name) or tget(name, None) for name in MLA_DIMS} if kind == "mla" else {}
        if mla.get("qk_rope_head_dim"):
            head_dim = mla["qk_rope_head_dim"]  # what DeepseekV3Config calls head_dim; MLA heads use the dims above
        return cls(
            hidden_size=hidden,
            intermediate_size=int(intermediate_size or tget("intermediate_size")),
            num_attention_heads=heads,
            num_key_value_heads=int(tget("num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            vocab_size=int(tget("vocab_size", None) or get("vocab_size")),
            draft_vocab_size=int(draft_vocab_size),
            target_hidden_size=hidden,
            rms_norm_eps=float(tget("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(tget("max_position_embeddings", 8192)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            aux_capture_ids=tuple(int(c) for c in aux_capture_ids),
            torch_dtype=dtype,
            bos_token_id=tget("bos_token_id", None),
            eos_token_id=tget("eos_token_id", None),
            architecture=kind,
            num_hidden_layers=int(arch.num_hidden_layers),
            fc_norm=switch if arch.fc_norm is None else bool(arch.fc_norm),
            norm_output=switch if arch.norm_output is None else bool(arch.norm_output),
            norm_before_fc=bool(arch.norm_before_fc),
            window=arch.window,
            **{k: (int(v) if v is not None else None) for k, v in mla.items()},
        )

    def to_dict(self) -> dict[str, Any]:
        """All fields, except architecture fields at their one-layer Llama defaults (class docstring)."""
        out = asdict(self)
        defaults = {f.name: f.default for f in fields(self) if f.name in ARCHITECTURE_FIELDS}
        return {k: v for k, v in out.items() if k not in defaults or v != defaults[k]}

    def describe(self) -> str:
        """One line naming the architecture, e.g. ``mla (1 layer, fc_norm, norm_output)``."""
        extras = [name for name in ("fc_norm", "norm_output", "norm_before_fc", "bias") if getattr(self, name)]
        if self.window is not None:
            extras.append(f"window {self.window}")
        layers = f"{self.num_hidden_layers} layer{'s' if self.num_hidden_layers > 1 else ''}"
        return f"{self.architecture} ({', '.join([layers, *extras])})"


#: DrafterConfig fields that describe the architecture (left out of ``to_dict`` at their defaults).
ARCHITECTURE_FIELDS = ("architecture", "num_hidden_layers", "fc_norm", "norm_output", "norm_before_fc", "bias",
                       "window", *MLA_DIMS)


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
    """Rotary embedding over ``config.rotary_dim`` dims: neox style for ``llama`` (SGLang ``get_rope(...,
    is_neox_style=True)``, HF ``rotate_half``), GPT-J (interleaved pairs) style for ``mla`` (SGLang's
    ``DeepseekV2AttentionMLA`` with ``rope_interleave`` true, its default)."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        with torch.device("cpu"):  # real values even when the model is built on the meta device (shape checks)
            inv_freq, scale = _inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scale = scale
        self.interleaved = config.architecture == "mla"

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: int ``[..., T]`` -> cos, sin float32 ``[..., T, rotary_dim]`` (the half-width table twice)."""
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos() * self.scale, emb.sin() * self.scale

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x ``[B, heads, T, d]``; cos/sin ``[B or 1, T, d]`` from :meth:`cos_sin` -> x rotated."""
        cos = cos.unsqueeze(1).to(x.dtype)
        sin = sin.unsqueeze(1).to(x.dtype)
        if not self.interleaved:
            return x * cos + _rotate_half(x) * sin
        half = x.shape[-1] // 2
        c, s = cos[..., :half], sin[..., :half]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)


def _inv_freq(config: DrafterConfig) -> tuple[torch.Tensor, float]:
    dim = config.rotary_dim
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
        head_dim=dim,
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters=params,
    )
    inv, factor = ROPE_INIT_FUNCTIONS[kind](llama, torch.device("cpu"))
    return inv.float(), float(factor)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def mla_softmax_scale(config: DrafterConfig) -> float:
    """``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times ``(0.1 * mscale_all_dim * ln(factor) + 1) ** 2``
    when the rotary is scaled with ``factor > 1`` (SGLang 0.5.23 ``configs/model_config.py::
    compute_mla_mscale_scaling`` and ``yarn_get_mscale``)."""
    scale = (int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim)) ** -0.5
    rs = config.rope_scaling
    if rs and rs.get("apply_yarn_scaling", True) and rs.get("apply_scale", True):
        factor = float(rs.get("factor", 1.0))
        if factor > 1:
            m = 0.1 * float(rs.get("mscale_all_dim", 0) or 0) * math.log(factor) + 1.0
            scale *= m * m
    return scale


class Eagle3Attention(nn.Module):
    """Grouped-query self-attention (SGLang ``LlamaAttention``) over ``in_dim`` inputs (``2H`` in layer 0, ``H``
    after); q/k/v/o without bias (SGLang defaults)."""

    def __init__(self, config: DrafterConfig, in_dim: int):
        super().__init__()
        h, nh, nkv, d = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        if nh % nkv:
            raise ValueError(f"num_attention_heads ({nh}) must be a multiple of num_key_value_heads ({nkv})")
        self.num_heads, self.num_kv_heads, self.head_dim = nh, nkv, d
        self.scale = None  # 1 / sqrt(d), computed as every earlier release did (d ** -0.5 can differ in the last bit)
        self.q_proj = nn.Linear(in_dim, nh * d, bias=False)
        self.k_proj = nn.Linear(in_dim, nkv * d, bias=False)
        self.v_proj = nn.Linear(in_dim, nkv * d, bias=False)
        self.o_proj = nn.Linear(nh * d, h, bias=False)

    def project(
        self, x: torch.Tensor, rotary: Rotary, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x ``[B, T, in_dim]`` -> rotated q ``[B, nh, T, d]``, rotated k and v ``[B, nh, T, d]`` (KV heads
        repeated)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = rotary.apply(q, cos, sin)
        k = rotary.apply(k, cos, sin)
        rep = self.num_heads // self.num_kv_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        return q, k, v

    def finish(self, attn: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class MLAAttention(nn.Module):
    """DeepSeek-V2 multi-latent attention over ``2H`` inputs, with SGLang's parameter names (module docstring).

    Shapes (``nh`` heads, ``dn``/``dr``/``dv`` = ``qk_nope``/``qk_rope``/``v`` head dims, ``rq``/``rkv`` the LoRA
    ranks): ``q_a_proj [rq, 2H]``, ``q_b_proj [nh*(dn+dr), rq]``, ``kv_a_proj_with_mqa [rkv+dr, 2H]`` (one
    rotary key shared by every head), ``kv_b_proj [nh*(dn+dv), rkv]``, ``o_proj [H, nh*dv]``.
    """

    def __init__(self, config: DrafterConfig, in_dim: int):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.nope, self.rope = int(config.qk_nope_head_dim), int(config.qk_rope_head_dim)
        self.v_dim, self.kv_rank = int(config.v_head_dim), int(config.kv_lora_rank)
        q_rank, nh, eps = int(config.q_lora_rank), self.num_heads, config.rms_norm_eps
        self.scale = mla_softmax_scale(config)
        self.q_a_proj = nn.Linear(in_dim, q_rank, bias=False)
        self.q_a_layernorm = RMSNorm(q_rank, eps)
        self.q_b_proj = nn.Linear(q_rank, nh * (self.nope + self.rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(in_dim, self.kv_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, eps)
        self.kv_b_proj = nn.Linear(self.kv_rank, nh * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(nh * self.v_dim, config.hidden_size, bias=False)

    def project(
        self, x: torch.Tensor, rotary: Rotary, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x ``[B, T, 2H]`` -> q, k ``[B, nh, T, dn + dr]`` (rotary part last) and v ``[B, nh, T, dv]``."""
        b, t, _ = x.shape
        nh = self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(b, t, nh, self.nope + self.rope).transpose(1, 2)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, t, nh, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        q = torch.cat([q_nope, rotary.apply(q_rope, cos, sin)], dim=-1)
        k_rope = rotary.apply(k_rope.unsqueeze(1), cos, sin).expand(b, nh, t, self.rope)
        return q, torch.cat([k_nope, k_rope], dim=-1), v

    def finish(self, attn: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(b, t, self.num_heads * self.v_dim))


#: query rows per block in the TTT attention; bounds the live score block to [B, heads, 64, T].
ATTENTION_BLOCK = 64


class _ChainAttention(torch.autograd.Function):
    """Softmax attention of each query row over (a) step-0 keys up to its own row and (b) its own chain keys.

    Written flash-attention style (blocks of query rows, scores recomputed in backward, only the output and its
    log-sum-exp saved) because on CPU the cost of TTT attention is memory traffic over ``[B, h, T, T]`` score
    tensors, not arithmetic; blocks also skip the keys that lie in every row's future.
    """

    @staticmethod
    def forward(ctx, q, k0, v0, kd, vd, row_offset: int, step: int = 0, window: int = -1):
        # q [B,h,Tq,d] (pre-scaled); k0 [B,h,T,d], v0 [B,h,T,dv]; kd [B,h,Tq,n,d], vd [B,h,Tq,n,dv]; query r is
        # absolute row row_offset + r, at chain step `step`; window < 0 = none.
        tq = q.shape[-2]
        out = q.new_empty(q.shape[:-1] + (v0.shape[-1],))
        lse = torch.empty(q.shape[:-1], dtype=q.dtype, device=q.device)
        for c0 in range(0, tq, ATTENTION_BLOCK):
            c1 = min(tq, c0 + ATTENTION_BLOCK)
            s, sd, kend = _chain_scores(q, k0, kd, row_offset, c0, c1, step, window)
            m = torch.maximum(s.amax(-1), sd.amax(-1)).unsqueeze(-1)
            e = torch.exp(s - m)
            ed = torch.exp(sd - m)
            z = e.sum(-1, keepdim=True) + ed.sum(-1, keepdim=True)
            acc = torch.matmul(e, v0[:, :, :kend]) + (ed.unsqueeze(-1) * vd[:, :, c0:c1]).sum(-2)
            out[:, :, c0:c1] = acc / z
            lse[:, :, c0:c1] = (m + torch.log(z)).squeeze(-1)
        ctx.save_for_backward(q, k0, v0, kd, vd, out, lse)
        ctx.row_offset, ctx.step, ctx.window = row_offset, step, window
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k0, v0, kd, vd, out, lse = ctx.saved_tensors
        row_offset, step, window = ctx.row_offset, ctx.step, ctx.window
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
            s, sd, kend = _chain_scores(q, k0, kd, row_offset, c0, c1, step, window)
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
        return dq, dk0, dv0, dkd, dvd, None, None, None


def _chain_scores(q, k0, kd, row_offset: int, c0: int, c1: int, step: int, window: int):
    """Scores of query rows ``c0:c1``: step-0 part ``[B,h,C,kend]`` (the future, and with a window the keys more
    than ``window`` positions behind the query at position ``row + step``, masked to -inf) and chain part."""
    first, last = row_offset + c0, row_offset + c1 - 1
    kend = last + 1
    qc = q[:, :, c0:c1]
    s = torch.matmul(qc, k0[:, :, :kend].transpose(-1, -2))
    rows = torch.arange(first, last + 1, device=q.device).unsqueeze(-1)
    cols = torch.arange(kend, device=q.device).unsqueeze(0)
    hidden_keys = cols > rows
    if window >= 0:
        hidden_keys |= cols < rows + step - window
    s = s.masked_fill(hidden_keys, float("-inf"))
    sd = (qc.unsqueeze(-2) * kd[:, :, c0:c1]).sum(-1)
    return s, sd, kend


def ttt_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    history: Sequence[tuple[torch.Tensor, torch.Tensor]],
    row_offset: int = 0,
    *,
    scale: float | None = None,
    window: int | None = None,
    step: int = 0,
) -> torch.Tensor:
    """Attention of one TTT step.

    Args:
        q, k: ``[B, heads, Tq, d]``, v ``[B, heads, Tq, dv]`` of the current step; query ``r`` belongs to absolute
            row ``row_offset + r`` (one chain per row).
        history: ``(k, v)`` of earlier steps; ``history[0]`` is step 0 over ALL rows ``[B, heads, T, d]``, attended
            causally (keys ``0..row``); the rest are steps ``1..i-1`` over the same rows as ``q``, attended only on
            the query's own row (the chain's earlier drafts). The current ``k, v`` are the chain's newest entry.
        scale: softmax scale (None = ``d ** -0.5``).
        window: sliding window (keys at most ``window`` positions behind the query's position ``row + step``);
            None = full attention. The chain's own keys are at most ``step`` behind, so a window must be at least
            the number of TTT steps (the model checks).
        step: the TTT step ``i`` (``0`` with an empty history).

    Returns:
        ``[B, heads, Tq, dv]``. With an empty history this is plain causal attention (step 0, ``row_offset`` 0).
    """
    if not history:
        if row_offset:
            raise ValueError("step 0 runs over all rows; row_offset applies to later steps")
        if window is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        pos = torch.arange(q.shape[-2], device=q.device)
        visible = (pos[None, :] <= pos[:, None]) & (pos[None, :] >= pos[:, None] - window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale)
    k0, v0 = history[0]
    keys = torch.stack([kj for kj, _ in history[1:]] + [k], dim=-2)  # [B, h, Tq, i, d]
    values = torch.stack([vj for _, vj in history[1:]] + [v], dim=-2)
    q = q * (scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    return _ChainAttention.apply(q.contiguous(), k0.contiguous(), v0.contiguous(), keys, values, int(row_offset),
                                 int(step), -1 if window is None else int(window))


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
    """One draft decoder layer with SGLang's names: ``self_attn.*`` (:class:`Eagle3Attention` or
    :class:`MLAAttention`), ``mlp.{gate,up,down}_proj``, ``hidden_norm``, ``post_attention_layernorm`` and, in
    layer 0 (the one that takes the token embedding), ``input_layernorm``."""

    def __init__(self, config: DrafterConfig, layer_id: int = 0):
        super().__init__()
        self.is_input_layer = layer_id == 0
        in_dim = (2 if self.is_input_layer else 1) * config.hidden_size
        attention = MLAAttention if config.architecture == "mla" else Eagle3Attention
        self.self_attn = attention(config, in_dim)
        self.mlp = Eagle3MLP(config)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.is_input_layer:
            self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        embeds: torch.Tensor | None,
        hidden: torch.Tensor,
        rotary: Rotary,
        cos: torch.Tensor,
        sin: torch.Tensor,
        history: Sequence[tuple[torch.Tensor, torch.Tensor]],
        row_offset: int = 0,
        *,
        window: int | None = None,
        step: int = 0,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """embeds (layer 0 only), hidden ``[B, T, H]`` -> (layer output before any final norm ``[B, T, H]``, this
        step's ``(k, v)``)."""
        x = self.hidden_norm(hidden)
        if self.is_input_layer:
            x = torch.cat([self.input_layernorm(embeds), x], dim=-1)
        q, k, v = self.self_attn.project(x, rotary, cos, sin)
        attn = ttt_attention(q, k, v, history, row_offset, scale=self.self_attn.scale, window=window, step=step)
        h = hidden + self.self_attn.finish(attn)
        out = h + self.mlp(self.post_attention_layernorm(h))
        return out, (k, v)


class Eagle3DraftModel(nn.Module):
    """EAGLE-3 drafter; ``state_dict()`` keys are SGLang's checkpoint names (``layers.N.*``; the exporter writes
    a one-layer Llama draft's ``layers.0.*`` under the legacy ``midlayer.*``) minus ``d2t``/``t2d``.

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
        width = len(config.aux_capture_ids) * config.target_hidden_size
        # registration order = parameter order (init draws, optimizer indices): a one-layer Llama draft keeps the
        # order of every earlier release (fc, layer 0, norm, lm_head), so its seeds give the same weights
        if config.norm_before_fc:
            self.input_norm = RMSNorm(width, config.rms_norm_eps)
        if config.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(config.target_hidden_size, config.rms_norm_eps)
                                         for _ in config.aux_capture_ids)
        self.fc = nn.Linear(width, config.hidden_size, bias=config.bias)
        self.layers = nn.ModuleList(Eagle3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
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
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
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
        """Layer output ``[..., H]`` (before the final norm) -> draft-vocab logits ``[..., draft_vocab_size]``."""
        return self.lm_head(self.norm(hidden))

    def carried(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the next draft step is fed from a layer output: the output itself, or with ``norm_output`` its
        final-normed form (SGLang ``LlamaModel.forward``: ``aux = hidden_states_to_logits if self.norm_output else
        hidden_states_to_aux``)."""
        return self.norm(hidden) if self.config.norm_output else hidden

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """Target aux states ``[..., k * target_hidden]`` -> ``fc`` input projected to ``[..., H]``, through
        ``input_norm`` / ``fc_norm`` when configured (SGLang's order: ``input_norm``, then ``fc_norm`` per chunk)."""
        x = aux_hidden.to(self.fc.weight.dtype)
        if self.config.norm_before_fc:
            x = self.input_norm(x)
        if self.config.fc_norm:
            x = torch.cat([norm(c) for norm, c in zip(self.fc_norm, x.chunk(len(self.fc_norm), dim=-1))], dim=-1)
        return self.fc(x)

    def step(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        history: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]],
        row_offset: int = 0,
        step: int = 0,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """One pass through the layer stack: embeds and hidden ``[B, T, H]`` at int ``positions`` ``[1 or B, T]``;
        ``history[n]`` is layer ``n``'s earlier ``(k, v)`` (see :func:`ttt_attention`; empty lists at step 0).
        Returns (the last layer's output ``[B, T, H]``, each layer's ``(k, v)``)."""
        cos, sin = self.rotary.cos_sin(positions)
        kvs = []
        for layer, past in zip(self.layers, history):
            hidden, kv = layer(embeds if layer.is_input_layer else None, hidden, self.rotary, cos, sin, past,
                               row_offset, window=self.config.window, step=step)
            kvs.append(kv)
        return hidden, kvs

    @torch.no_grad()
    def draft_chain(self, aux: torch.Tensor, ids: torch.Tensor, k: int) -> np.ndarray:
        """int64 ``[T, k]``: the greedy chain after every position of a row (row ``p`` drafts tokens
        ``p + 2 .. p + k + 1``, each step fed its own previous draft), from the target's aux states ``[1, T, 3H]``
        and the row's ids ``[T]`` (``drafter.family.DraftModel``: what the evaluation walks call)."""
        _, drafts = self.unroll(aux, ids.unsqueeze(0), k, feed_own_tokens=True)
        return torch.stack([d[0] for d in drafts], dim=-1).numpy()

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
            steps: number of TTT steps (>= 1; at most ``window`` with a sliding window).
            feed_own_tokens: False (training): step ``i`` row ``p`` embeds ``x[p+i+1]``. True (simulated serving at
                temperature 0): step 0 embeds ``x[p+1]`` and step ``i >= 1`` embeds the drafter's own greedy
                token of step ``i-1``, mapped to a target id.
            row_start: only rows ``p >= row_start`` are carried through the steps (all rows still serve as step-0
                context). Rows before it are prompt rows no loss reaches; skipping them saves time, never changes
                the kept rows' values.

        Returns:
            ``(hiddens, drafts)``: per step the last layer's output before the final norm ``[B, T - row_start, H]``
            (index ``p - row_start``; :meth:`logits` takes it); ``drafts`` is per step the greedy TARGET id
            ``[B, T - row_start]`` (row ``p`` at step ``i`` predicts token ``p + i + 2``) when ``feed_own_tokens``,
            else an empty list. Rows past a sequence's end are padding and carry garbage.

        Raises:
            ValueError: ``steps < 1``, ``row_start`` outside the rows, or more steps than the window holds.
        """
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        if self.config.window is not None and steps > self.config.window:
            raise ValueError(f"{steps} draft steps do not fit a sliding window of {self.config.window} tokens (a "
                             "chain's own keys would fall out of it); use a window of at least the TTT/draft steps")
        b, t, _ = aux_hidden.shape
        if not 0 <= row_start < t:
            raise ValueError(f"row_start must be in [0, {t}), got {row_start}")
        ids = input_ids.to(torch.long)
        pos = torch.arange(t, device=aux_hidden.device).unsqueeze(0)
        empty: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in self.layers]
        hidden, kv0 = self.step(self.embed(F.pad(ids[:, 1:], (0, 1), value=0)), self.fuse(aux_hidden), pos, empty)
        hidden = hidden[:, row_start:]
        history = [[kv] for kv in kv0]
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
            hidden, kvs = self.step(self.embed(tokens), self.carried(hidden), rows + i, history, row_start, i)
            for past, kv in zip(history, kvs):
                past.append(kv)
            hiddens.append(hidden)
            if feed_own_tokens:
                tokens = self.draft_token_ids[self.logits(hidden).argmax(-1)]
                drafts.append(tokens)
        return hiddens, drafts


#: legacy checkpoint names -> this model's (SGLang 0.5.23 ``LlamaForCausalLMEagle3.load_weights``' own map).
LEGACY_NAMES = {"midlayer.": "layers.0.", "aux_norm_low.": "fc_norm.0.", "aux_norm_mid.": "fc_norm.1.",
                "aux_norm_high.": "fc_norm.2."}


def canonical_name(name: str) -> str:
    """A checkpoint or training-state tensor name in this model's naming (``midlayer.x`` -> ``layers.0.x``, ...)."""
    for legacy, new in LEGACY_NAMES.items():
        if name.startswith(legacy):
            return new + name[len(legacy):]
    return name
