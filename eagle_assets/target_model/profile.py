"""Per-family marker and stop token ids of a target model, detected from its tokenizer.

Sources for the markers:
- Qwen3 (``Qwen/Qwen3-*`` tokenizer_config.json): ``<think>`` 151667, ``</think>`` 151668, ``<tool_call>`` 151657,
  ``</tool_call>`` 151658, ``<|im_end|>`` 151645, ``<|endoftext|>`` 151643; generation_config eos [151645, 151643].
- DeepSeek-V3/R1 (``deepseek-ai/DeepSeek-V3`` tokenizer): ``<think>`` 128798, ``</think>`` 128799,
  ``<｜tool▁calls▁begin｜>`` / ``<｜tool▁calls▁end｜>`` around ``<｜tool▁call▁begin｜>`` / ``<｜tool▁call▁end｜>``,
  every turn ends with ``<｜end▁of▁sentence｜>`` (id 1, the eos).
- Kimi-K2 / K2.5 (``moonshotai/Kimi-K2*`` tokenizer_config.json + config.json): ``<think>`` 163606, ``</think>``
  163607, ``<|tool_calls_section_begin|>`` 163595 / ``_end|>`` 163596 around ``<|tool_call_begin|>`` 163597 /
  ``<|tool_call_end|>`` 163599, ``<|im_end|>`` 163586 (config eos), ``[EOS]`` 163585.
- the embedded demo target: Qwen-style ChatML tokens (see eagle_assets/demo), small vocab.

Sources for the reasoning rules (``tool_call_ends_reasoning``, ``implicit_think_start``): SGLang's reasoning
parsers in ``python/sglang/srt/parser/reasoning_parser.py`` (``KimiK2Detector`` passes
``tool_start_token="<|tool_calls_section_begin|>"``, sgl-project/sglang PRs 19552 / 19696, issue 18086;
``DeepSeekR1Detector`` forces reasoning until ``</think>`` even without a leading ``<think>``) and vLLM's
``KimiK2ReasoningParser``. docs/token-structure.md has the per-family table and what was found for Qwen3.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from eagle_assets.target_model.config import optional_json_config, text_config


class ProfileError(ValueError):
    """The tokenizer's family cannot be profiled, or an override names a token the tokenizer does not have."""


@dataclass(frozen=True)
class FamilyProfile:
    """Token ids that structure a target model's output.

    Attributes:
        name: "qwen3" | "deepseek" | "kimi" | "demo" | "custom".
        think_start_id / think_end_id: reasoning block markers, None when the family has none.
        tool_call_start_ids / tool_call_end_ids: paired element-wise, outermost first: ``start[i]`` opens what
            ``end[i]`` closes (Qwen3: (``<tool_call>``,); Kimi: (section begin, call begin) / (section end, call
            end)). Empty when the family has no tool-call tokens.
        end_of_turn_id: the id that ends an assistant turn in the chat template.
        stop_ids: every id that ends generation (end of turn, eos, generation_config eos), end_of_turn_id first.
        tool_call_ends_reasoning: an open reasoning block that has no think-end is closed by the first outermost
            tool-call start (``tool_call_start_ids[0]``): the reasoning is what precedes it, the tool-call section is
            the answer. On for Kimi (SGLang ``KimiK2Detector``, vLLM ``KimiK2ReasoningParser``), off elsewhere;
            a catalog sets it with ``target.profile.tool_call_ends_reasoning``.
        implicit_think_start: the output may reason without writing the think-start: when the prompt did not open
            a block and the output has a think-end, everything before it is reasoning. On for DeepSeek (SGLang
            ``DeepSeekR1Detector`` ``force_reasoning=True``: original R1 templates end with ``<｜Assistant｜>`` and
            R1 starts reasoning without ``<think>``); elsewhere a think-end without a block is a drop reason.
        answer_after_tool_outputs: the template writes no assistant header after tool results: with
            ``add_generation_prompt=True`` a conversation that ends with ``tool`` messages renders the same text as
            without it, and the assistant's next message is rendered right after the tool results (DeepSeek-V3/R1:
            ``...<｜tool▁outputs▁end｜>`` then the answer, no ``<｜Assistant｜>``). SGLang serves that text as is (its
            ``serving_chat._apply_jinja_template`` only calls ``apply_chat_template(..., add_generation_prompt=True)``,
            and its own ``examples/chat_template/tool_chat_template_deepseekv3.jinja`` / ``...deepseekr1.jinja``
            end the same way), so ``render.render_prompt`` accepts such a prompt with an empty generation prompt
            (``render.answers_after_tool_outputs`` checks it) instead of refusing it as
            ``missing_generation_prompt``. On for DeepSeek, off elsewhere.
        history_reasoning: what the client sends back of a reply's reasoning when the conversation goes on (the
            template then decides what it replays, docs/multi_turn.md): ``"reasoning_content"`` (default, every
            family) sends it as the message's ``reasoning_content``, as SGLang returns it; Kimi-K2.5's template
            replays an in-flight tool loop's reasoning only from that field (a client that drops it conditions
            every later turn on a prefix serving never produces: vllm-project/speculators#864), Qwen3's keeps it
            after the last user turn, DeepSeek-R1's ignores it. ``"none"``: the client drops it (clients that keep
            only ``content``; set ``target.profile.history_reasoning: none`` to train on what they send).
    """

    name: str
    think_start_id: int | None
    think_end_id: int | None
    tool_call_start_ids: tuple[int, ...]
    tool_call_end_ids: tuple[int, ...]
    end_of_turn_id: int
    stop_ids: tuple[int, ...]
    tool_call_ends_reasoning: bool = False
    implicit_think_start: bool = False
    answer_after_tool_outputs: bool = False
    history_reasoning: str = "reasoning_content"

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict (for asset metadata and Parquet schema metadata)."""
        return {
            "name": self.name,
            "think_start_id": self.think_start_id,
            "think_end_id": self.think_end_id,
            "tool_call_start_ids": list(self.tool_call_start_ids),
            "tool_call_end_ids": list(self.tool_call_end_ids),
            "end_of_turn_id": self.end_of_turn_id,
            "stop_ids": list(self.stop_ids),
            "tool_call_ends_reasoning": self.tool_call_ends_reasoning,
            "implicit_think_start": self.implicit_think_start,
            "answer_after_tool_outputs": self.answer_after_tool_outputs,
            "history_reasoning": self.history_reasoning,
        }


OVERRIDE_KEYS = {
    "name": "name",
    "think_start": "think_start_id",
    "think_start_id": "think_start_id",
    "think_end": "think_end_id",
    "think_end_id": "think_end_id",
    "tool_call_start": "tool_call_start_ids",
    "tool_call_start_ids": "tool_call_start_ids",
    "tool_call_end": "tool_call_end_ids",
    "tool_call_end_ids": "tool_call_end_ids",
    "end_of_turn": "end_of_turn_id",
    "end_of_turn_id": "end_of_turn_id",
    "stop_ids": "stop_ids",
    "stop": "stop_ids",
    "tool_call_ends_reasoning": "tool_call_ends_reasoning",
    "implicit_think_start": "implicit_think_start",
    "answer_after_tool_outputs": "answer_after_tool_outputs",
    "history_reasoning": "history_reasoning",
}
HISTORY_REASONING = ("reasoning_content", "none")
_BOOL_FIELDS = ("tool_call_ends_reasoning", "implicit_think_start", "answer_after_tool_outputs")


class _TokenIds:
    """token text -> id, as ``get_vocab()`` with ``added_tokens_decoder`` filling gaps, without building that dict.

    A fast tokenizer answers each lookup from its backend (``token_to_id``: added tokens first, then the model
    vocab, the precedence of ``get_vocab()``), so detecting a profile costs a dozen lookups instead of copying a
    150k-entry vocabulary into Python (~0.15 s, paid by every step that detects one). Other tokenizers get the dict.
    """

    def __init__(self, tokenizer: Any):
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._added = {str(tok): int(idx) for idx, tok in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        self._vocab: dict[str, int] | None = None
        if self._backend is None:
            vocab = dict(tokenizer.get_vocab())
            for token, idx in self._added.items():
                vocab.setdefault(token, idx)
            self._vocab = vocab

    def get(self, token: str) -> int | None:
        if self._vocab is not None:
            return self._vocab.get(token)
        idx = self._backend.token_to_id(token)
        return idx if idx is not None else self._added.get(token)

    def __contains__(self, token: str) -> bool:
        return self.get(token) is not None

    def __getitem__(self, token: str) -> int:
        idx = self.get(token)
        if idx is None:
            raise KeyError(token)
        return idx


def _generation_eos(tokenizer: Any) -> list[int]:
    """eos ids from generation_config.json / config.json beside the tokenizer, when it was loaded from a dir."""
    base = Path(str(getattr(tokenizer, "name_or_path", "") or ""))
    ids: list[int] = []
    for fname in ("generation_config.json", "config.json"):
        cfg = optional_json_config(base, fname)
        for source in (cfg, cfg.get("text_config") or {}):
            eos = source.get("eos_token_id") if isinstance(source, dict) else None
            for e in eos if isinstance(eos, list) else [eos]:
                if isinstance(e, int) and e not in ids:
                    ids.append(e)
    return ids


def _resolve(tokenizer: Any, vocab: _TokenIds, value: Any, key: str) -> int:
    n = len(tokenizer)
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ProfileError(f"profile override {key!r}: {value!r} is neither a token string nor an id")
    if isinstance(value, int):
        if not 0 <= value < n:
            raise ProfileError(f"profile override {key!r}: id {value} is outside the tokenizer's {n} ids")
        return value
    if value not in vocab:
        raise ProfileError(f"profile override {key!r}: token {value!r} is not a single token of this tokenizer; "
                           "give its id or the exact token text")
    return vocab[value]


def _apply_overrides(profile: FamilyProfile, tokenizer: Any, vocab: _TokenIds,
                     overrides: dict[str, Any]) -> FamilyProfile:
    changes: dict[str, Any] = {}
    for key, value in overrides.items():
        field_name = OVERRIDE_KEYS.get(key)
        if field_name is None:
            raise ProfileError(f"unknown profile override {key!r}; use one of {sorted(OVERRIDE_KEYS)}")
        if field_name == "name":
            changes["name"] = str(value)
        elif field_name == "history_reasoning":
            if value not in HISTORY_REASONING:
                raise ProfileError(f"profile override {key!r} must be one of {HISTORY_REASONING}, got {value!r}")
            changes[field_name] = value
        elif field_name in _BOOL_FIELDS:
            if not isinstance(value, bool):
                raise ProfileError(f"profile override {key!r} must be true or false, got {value!r}")
            changes[field_name] = value
        elif field_name in ("think_start_id", "think_end_id"):
            changes[field_name] = None if value is None else _resolve(tokenizer, vocab, value, key)
        elif field_name == "end_of_turn_id":
            changes[field_name] = _resolve(tokenizer, vocab, value, key)
        else:
            values = [] if value is None else value if isinstance(value, (list, tuple)) else [value]
            changes[field_name] = tuple(_resolve(tokenizer, vocab, v, key) for v in values)
    profile = replace(profile, **changes)
    if len(profile.tool_call_start_ids) != len(profile.tool_call_end_ids):
        raise ProfileError(f"tool_call_start ids {profile.tool_call_start_ids} and tool_call_end ids "
                           f"{profile.tool_call_end_ids} must pair up one to one")
    if (profile.think_start_id is None) != (profile.think_end_id is None):
        raise ProfileError("think_start and think_end must both be set or both be null")
    if not profile.stop_ids:
        raise ProfileError("stop_ids is empty; generation could never end with a stop token")
    if profile.tool_call_ends_reasoning and not profile.tool_call_start_ids:
        raise ProfileError("tool_call_ends_reasoning is set but the profile has no tool_call_start ids; set "
                           "tool_call_start / tool_call_end too, or leave tool_call_ends_reasoning false")
    if profile.end_of_turn_id not in profile.stop_ids:
        profile = replace(profile, stop_ids=(profile.end_of_turn_id, *profile.stop_ids))
    return profile


def detect_profile(tokenizer: Any, overrides: dict[str, Any] | None = None) -> FamilyProfile:
    """Detect the family profile of a tokenizer, then apply catalog overrides.

    Detection uses the vocabulary only (no model name matching): Kimi's ``<|im_middle|>`` + tool-call section
    tokens, DeepSeek's ``<｜Assistant｜>``, ChatML's ``<|im_start|>``/``<|im_end|>`` (Qwen3, or "demo" when a
    ``recipe.json`` of the embedded demo build sits beside the tokenizer or the vocab is small). Anything else is
    "custom": end of turn = eos, think markers only if ``<think>``/``</think>`` exist.

    Args:
        tokenizer: a transformers tokenizer (``get_vocab``, ``eos_token_id``, ``len``).
        overrides: keys think_start, think_end, tool_call_start, tool_call_end, end_of_turn, stop_ids, name (token
            strings or ids; lists for the tuple fields; null disables think markers), tool_call_ends_reasoning,
            implicit_think_start and answer_after_tool_outputs (true / false).
    Raises:
        ProfileError: no end-of-turn id can be found (custom family without eos) and none is given, or an
            override is invalid.
    """
    vocab = _TokenIds(tokenizer)
    overrides = dict(overrides or {})
    rules: dict[str, bool] = {}

    def tid(token: str) -> int | None:
        return vocab.get(token)

    eos = tokenizer.eos_token_id
    think = (tid("<think>"), tid("</think>"))
    if think[0] is None or think[1] is None:
        think = (None, None)
    extra_eos = _generation_eos(tokenizer)

    if tid("<|im_middle|>") is not None and tid("<|tool_calls_section_begin|>") is not None:
        name = "kimi"
        starts = (tid("<|tool_calls_section_begin|>"), tid("<|tool_call_begin|>"))
        ends = (tid("<|tool_calls_section_end|>"), tid("<|tool_call_end|>"))
        eot = tid("<|im_end|>")
        rules = {"tool_call_ends_reasoning": True}
    elif tid("<｜Assistant｜>") is not None:
        name = "deepseek"
        starts = (tid("<｜tool▁calls▁begin｜>"), tid("<｜tool▁call▁begin｜>"))
        ends = (tid("<｜tool▁calls▁end｜>"), tid("<｜tool▁call▁end｜>"))
        eot = tid("<｜end▁of▁sentence｜>")
        rules = {"implicit_think_start": True, "answer_after_tool_outputs": True}
    elif tid("<|im_start|>") is not None and tid("<|im_end|>") is not None:
        base = Path(str(getattr(tokenizer, "name_or_path", "") or ""))
        name = "demo" if (base / "recipe.json").is_file() or len(tokenizer) < 32000 else "qwen3"
        starts = (tid("<tool_call>"),)
        ends = (tid("</tool_call>"),)
        eot = tid("<|im_end|>")
        endoftext = tid("<|endoftext|>")
        if endoftext is not None and endoftext not in extra_eos:
            extra_eos.append(endoftext)
    else:
        name = "custom"
        starts, ends = (), ()
        eot = eos

    pairs = [(s, e) for s, e in zip(starts, ends) if s is not None and e is not None]
    if eot is None:
        eot = overrides.get("end_of_turn", overrides.get("end_of_turn_id"))
        if eot is None:
            raise ProfileError("the tokenizer has no eos token and no known end-of-turn token; "
                               "set target.profile.end_of_turn (and stop_ids) in the catalog")
        eot = _resolve(tokenizer, vocab, eot, "end_of_turn")
    stops: list[int] = [eot]
    for s in [eos, *extra_eos]:
        if isinstance(s, int) and s not in stops and 0 <= s < len(tokenizer):
            stops.append(s)
    profile = FamilyProfile(
        name=name,
        think_start_id=think[0],
        think_end_id=think[1],
        tool_call_start_ids=tuple(s for s, _ in pairs),
        tool_call_end_ids=tuple(e for _, e in pairs),
        end_of_turn_id=eot,
        stop_ids=tuple(stops),
        **rules,
    )
    return _apply_overrides(profile, tokenizer, vocab, overrides) if overrides else profile


def target_vocab_size(model_dir: str | Path | None, tokenizer: Any) -> int:
    """Number of ids the target model can emit: ``[0, n)`` is the range every output id must lie in.

    Args:
        model_dir: the target's local directory (its ``config.json`` gives ``vocab_size``, or
            ``text_config.vocab_size`` for multimodal configs such as Kimi-K2.5's); None or no usable config =
            fall back to the tokenizer.
        tokenizer: the target's tokenizer; ``len(tokenizer)`` (base vocab + added tokens) is the fallback.
    Returns: the config's vocab size (often padded above ``len(tokenizer)``: Qwen3 151936 vs 151669 ids) when it
        is a positive int at least ``len(tokenizer)``, else ``len(tokenizer)``. A config smaller than the tokenizer
        would call the tokenizer's own special ids out of range, so the larger of the two wins.
    """
    n_tok = len(tokenizer)
    cfg = optional_json_config(model_dir)
    for size in (cfg.get("vocab_size"), text_config(cfg).get("vocab_size")):
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            return max(size, n_tok)
    return n_tok
