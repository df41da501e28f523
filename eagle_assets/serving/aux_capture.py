"""SGLang's aux-hidden-state capture protocol: which layers a ``--return-aux-hidden-state-layer-ids`` value captures,
the launch flags that turn it on, and the hooks our embedded server captures them with.

Source: SGLang 0.5.23 (``pip download sglang==0.5.23``, files under ``python/sglang/srt/``):

- ``arg_groups/validation_hook.py::handle_aux_hidden_state_capture``: ``--enable-return-aux-hidden-states`` needs
  ``--speculative-algorithm`` EAGLE3 (or DFLASH / DSPARK) to NAME the capture convention; the algorithm is then
  reset to None, so no draft is loaded and the speculative stack stays off. A draft path is refused, pp_size must
  be 1, ``--return-aux-hidden-state-layer-ids`` needs the enable flag and must be non-empty, non-negative and
  without repeats. ``serving_hook.py::handle_return_hidden_states_mode`` then sets ``--return-hidden-states-mode``
  to ``full``.
- ``model_executor/model_runner_components/spec_aux_hidden_state.py::_check_capture_layer_ids_in_range``: every id
  must be ``< num_hidden_layers``; the ids are handed to the model's ``set_eagle3_layers_to_capture``.
- The layer-id rule differs per model class (``models/*.py::set_eagle3_layers_to_capture``):

  * ``plus_one`` (``llama.py``, ``qwen2.py``, ``qwen3.py``, ``qwen3_moe.py``, ``glm4_moe.py``, ``minimax_m2.py``,
    ...): ``layers_to_capture = [i + 1 for i in ids]``: an id is a layer-OUTPUT id (what a drafter's
    ``eagle_aux_hidden_state_layer_ids`` stores).
  * ``deepseek`` (``deepseek_v2.py``, used by DeepSeek-V3/R1 and, through ``kimi_k25.py``'s ``language_model``,
    Kimi-K2.5): ``[i + 1 for i in ids]`` only when ``ids[0] == 1``, otherwise ``list(ids)`` unchanged: ids are
    capture ids unless the list happens to start with 1.
  * ``gpt_oss`` (``gpt_oss.py``): ``list(ids)`` when ``max(ids) == num_hidden_layers``, else ``+ 1``.
  * no ids: ``[2, L // 2, L - 3]`` capture ids for all three.

  Any number of ids is taken (none of these hooks, nor ``logits_processor.py::_check_aux_hidden_states``, which
  counts the captured layers against ``len(layers_to_capture)``, assumes three): a block drafter's K target layers
  come back as ``[T, K * H]`` under the same rule. ``--speculative-algorithm DFLASH`` / ``DSPARK`` instead of
  EAGLE3 route the ids to ``set_dflash_layers_to_capture`` (``set_dspark_layers_to_capture`` where a model has
  one), which is ``[i + 1 for i in ids]`` in every class above, DeepSeek's and gpt-oss's included, and which needs
  the flag (no default): :func:`capture_rule`. This project launches with EAGLE3 and derives the flag from the
  class's EAGLE3 rule (:func:`capture_flag_ids`), which captures the same layers.

  A capture id ``c`` is the INPUT of decoder layer ``c`` (the residual stream after layer ``c - 1``): the models
  capture in ``attn_boundary.prepare`` before layer ``c`` runs (``layers/layer_boundary/stage.py``), so ``c = 0`` is
  the embedding output and ``c = L`` does not exist (``layers/logits_processor.py::_check_aux_hidden_states`` fails
  the first forward: "captured fewer aux hidden states"). The captures are written in execution order
  (``layers/aux_hidden_states.py::AuxHiddenStatePacker``), so the ``[T, k * H]`` concatenation is in ASCENDING
  capture id whatever order the flag lists them in.

The reply side (what ``meta_info.hidden_states`` holds) is built in :mod:`eagle_assets.serving.server`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:  # torch is imported only where hooks run: the launcher imports this module too
    import torch

#: ``--speculative-algorithm`` values SGLang accepts as a capture convention; this project implements EAGLE3.
CAPTURE_ALGORITHMS = ("EAGLE3", "DFLASH", "DSPARK")
CONVENTIONS = ("plus_one", "deepseek", "gpt_oss")

# HF model_type -> SGLang's rule. Anything else follows the llama rule, the one most model files copy.
_MODEL_TYPE_CONVENTION = {
    "deepseek_v2": "deepseek",
    "deepseek_v3": "deepseek",
    "deepseek_v32": "deepseek",
    "kimi_k2": "deepseek",
    "kimi_k25": "deepseek",
    "gpt_oss": "gpt_oss",
}


class AuxCaptureError(ValueError):
    """A capture setting SGLang would refuse (at launch or at its first forward)."""


def text_config(config: Any) -> Any:
    """The language model's config of a multimodal wrapper (Kimi-K2.5's ``text_config``), else ``config``."""
    inner = getattr(config, "text_config", None)
    if isinstance(config, dict):
        inner = config.get("text_config")
    return inner if inner is not None else config


def _get(config: Any, name: str) -> Any:
    return config.get(name) if isinstance(config, dict) else getattr(config, name, None)


def capture_convention(config: Any) -> str:
    """SGLang's layer-id rule for a target config (a ``PretrainedConfig`` or a ``config.json`` dict).

    Returns:
        ``plus_one``, ``deepseek`` or ``gpt_oss`` (see the module docstring).
    """
    for cfg in (config, text_config(config)):
        model_type = str(_get(cfg, "model_type") or "")
        if model_type in _MODEL_TYPE_CONVENTION:
            return _MODEL_TYPE_CONVENTION[model_type]
        for arch in _get(cfg, "architectures") or ():
            if str(arch).startswith(("DeepseekV2", "DeepseekV3", "KimiK25")):
                return "deepseek"
    return "plus_one"


def capture_rule(config: Any, method: str | None = "eagle3") -> str:
    """The layer-id rule of a server in capture mode: ``plus_one`` when it was launched with
    ``--speculative-algorithm DFLASH`` or ``DSPARK`` (its ``/server_info`` ``aux_hidden_state_capture``: the ids go
    to ``set_dflash_layers_to_capture``, ``+ 1`` in every class), else the target's EAGLE3 rule
    (:func:`capture_convention`)."""
    return "plus_one" if str(method or "").lower() in ("dflash", "dspark") else capture_convention(config)


def num_layers_of(config: Any) -> int:
    """``num_hidden_layers`` of the language model (raises AuxCaptureError when the config has none)."""
    n = _get(text_config(config), "num_hidden_layers")
    if n is None:
        raise AuxCaptureError("the target config has no num_hidden_layers; SGLang cannot check aux layer ids")
    return int(n)


def capture_ids_from_flag(layer_ids: Sequence[int] | None, num_layers: int, convention: str) -> list[int]:
    """The capture ids SGLang 0.5.23 captures for a ``--return-aux-hidden-state-layer-ids`` value, ascending.

    Args:
        layer_ids: the flag's ids, in the order given (the ``deepseek`` rule looks at the first one), or None.
        num_layers: the target's ``num_hidden_layers`` (L).
        convention: from :func:`capture_convention`.

    Returns:
        Distinct capture ids in ``[0, L - 1]``, ascending: the order of the concatenated ``[T, k * H]`` columns.

    Raises:
        AuxCaptureError: with SGLang's reasons: empty, negative or repeated ids, an id ``>= L`` (refused at launch),
            or a capture id ``== L`` (SGLang fails the first forward: no layer ``L`` to capture the input of).
    """
    if convention not in CONVENTIONS:
        raise AuxCaptureError(f"unknown capture convention {convention!r}; use one of {CONVENTIONS}")
    L = int(num_layers)
    if layer_ids is None:
        chosen = [2, L // 2, L - 3]
        if len(set(chosen)) != 3 or min(chosen) < 0:
            raise AuxCaptureError(
                f"SGLang's default capture layers [2, L//2, L-3] = {chosen} collide for a {L}-layer target; pass "
                "--return-aux-hidden-state-layer-ids"
            )
        return sorted(chosen)
    ids = [int(i) for i in layer_ids]
    if not ids:
        raise AuxCaptureError("--return-aux-hidden-state-layer-ids must not be empty.")
    if any(i < 0 for i in ids):
        raise AuxCaptureError(f"--return-aux-hidden-state-layer-ids must be non-negative, got {ids}.")
    if len(set(ids)) != len(ids):
        raise AuxCaptureError(f"--return-aux-hidden-state-layer-ids must not repeat a layer, got {ids}.")
    out_of_range = [i for i in ids if i >= L]
    if out_of_range:
        raise AuxCaptureError(
            f"--return-aux-hidden-state-layer-ids {out_of_range} out of range for a target with {L} layers."
        )
    if convention == "plus_one":
        capture = [i + 1 for i in ids]
    elif convention == "deepseek":
        capture = [i + 1 for i in ids] if ids[0] == 1 else list(ids)
    else:
        capture = list(ids) if max(ids) == L else [i + 1 for i in ids]
    if max(capture) >= L:
        raise AuxCaptureError(
            f"--return-aux-hidden-state-layer-ids {ids} ({convention} rule) asks for capture ids {sorted(capture)}; "
            f"capture id {max(capture)} would be the input of layer {max(capture)}, which a {L}-layer target does "
            f"not have (SGLang: 'The model captured fewer aux hidden states'). Use layer-output ids <= {L - 2}."
        )
    return sorted(capture)


def flag_ids_for_capture(capture_ids: Sequence[int], convention: str) -> list[int]:
    """A ``--return-aux-hidden-state-layer-ids`` value that makes SGLang capture exactly ``capture_ids``.

    ``plus_one`` / ``gpt_oss``: ``c - 1`` each (ascending). ``deepseek``: the capture ids themselves, except that a
    list starting with 1 would be shifted by one, so a set containing 1 is passed with its largest id first (the
    rule looks only at the first element; the columns come out ascending either way).

    Raises:
        AuxCaptureError: a capture id 0 under ``plus_one``/``gpt_oss`` (no layer -1 to name), or duplicates.
    """
    caps = sorted(int(c) for c in capture_ids)
    if len(set(caps)) != len(caps):
        raise AuxCaptureError(f"capture ids {list(capture_ids)} repeat a layer")
    if convention == "deepseek":
        return caps if caps[0] != 1 else [caps[-1], *caps[:-1]]
    if convention not in CONVENTIONS:
        raise AuxCaptureError(f"unknown capture convention {convention!r}; use one of {CONVENTIONS}")
    if caps[0] < 1:
        raise AuxCaptureError("capture id 0 (the embedding output) cannot be named under the plus_one rule")
    return [c - 1 for c in caps]


def capture_flag_ids(config: Any, capture_ids: Sequence[int] | None) -> list[int] | None:
    """The ``--return-aux-hidden-state-layer-ids`` value that makes SGLang capture ``capture_ids`` on the target of
    ``config`` (a ``config.json`` dict or ``PretrainedConfig``), or None when none is needed: ``capture_ids`` is None
    or equals SGLang's default ``[2, L // 2, L - 3]``.

    Raises:
        AuxCaptureError: ids SGLang cannot be asked for (see :func:`flag_ids_for_capture`,
            :func:`capture_ids_from_flag`).
    """
    if capture_ids is None:
        return None
    L, convention = num_layers_of(config), capture_convention(config)
    caps = sorted(int(c) for c in capture_ids)
    if caps == capture_ids_from_flag(None, L, convention):
        return None
    flag = flag_ids_for_capture(caps, convention)
    if capture_ids_from_flag(flag, L, convention) != caps:
        raise AuxCaptureError(f"no --return-aux-hidden-state-layer-ids value captures {caps} under the {convention} "
                              f"rule of a {L}-layer target")
    return flag


@dataclass(frozen=True)
class AuxCapture:
    """Launch settings that make a server return aux hidden states (ours and SGLang take the same flags).

    Attributes:
        layer_ids: the ``--return-aux-hidden-state-layer-ids`` value (see :func:`flag_ids_for_capture`); None =
            the model's EAGLE3 default ``[2, L // 2, L - 3]``.
        max_row_tokens: the longest row features will be asked for. SGLang keeps the hidden states of the LAST
            prefill chunk only (``batch_result_processor.py``: middle chunks are not stored), so its
            ``--chunked-prefill-size`` must be at least this; None = leave SGLang's chunk size alone.
    """

    layer_ids: tuple[int, ...] | None = None
    max_row_tokens: int | None = None

    @classmethod
    def for_target(cls, config: Any, capture_ids: Sequence[int] | None = None,
                   max_row_tokens: int | None = None) -> "AuxCapture":
        """Launch settings for features at ``capture_ids`` (the catalog's ``training.aux_layer_ids``; None =
        SGLang's default) of the target of ``config``: the flag value under the target's layer-id rule
        (:func:`capture_flag_ids`), omitted when the ids are the default."""
        flag = capture_flag_ids(config, capture_ids)
        return cls(layer_ids=tuple(flag) if flag is not None else None, max_row_tokens=max_row_tokens)

    def server_args(self, launch: str, given: Sequence[str] = ()) -> list[str]:
        """Command-line flags for a ``launch`` (``embedded`` | ``sglang``) server; flags already in ``given`` (the
        user's ``extra_args``) are not repeated.

        Both: ``--speculative-algorithm EAGLE3 --enable-return-aux-hidden-states
        [--return-aux-hidden-state-layer-ids i j k]``. SGLang also gets ``--disable-radix-cache`` (a prefix-cache
        hit shortens the prefill, and with it the returned rows) and ``--chunked-prefill-size
        max(max_row_tokens, 8192)`` when ``max_row_tokens`` is set.
        """
        present = set(given)
        args: list[str] = []
        if "--speculative-algorithm" not in present:
            args += ["--speculative-algorithm", "EAGLE3"]
        if "--enable-return-aux-hidden-states" not in present:
            args.append("--enable-return-aux-hidden-states")
        if self.layer_ids is not None and "--return-aux-hidden-state-layer-ids" not in present:
            args += ["--return-aux-hidden-state-layer-ids", *[str(int(i)) for i in self.layer_ids]]
        if launch == "sglang":
            if "--disable-radix-cache" not in present:
                args.append("--disable-radix-cache")
            if self.max_row_tokens is not None and "--chunked-prefill-size" not in present:
                # never below 8192 (SGLang's usual default on 80 GB+ GPUs): smaller chunks only slow the prefill
                args += ["--chunked-prefill-size", str(max(int(self.max_row_tokens), 8192))]
        return args


def decoder_modules(model: torch.nn.Module) -> tuple[torch.nn.ModuleList, torch.nn.Module, torch.nn.Module]:
    """``(decoder layers, final norm, lm_head)`` of a HF Llama/Qwen-like causal LM.

    Raises:
        AuxCaptureError: the model has no ``get_decoder().layers`` / ``.norm`` / output embeddings.
    """
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    norm = getattr(decoder, "norm", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if layers is None or norm is None or head is None:
        raise AuxCaptureError(
            f"{type(model).__name__} has no decoder layers / final norm / lm_head this server can hook; serve it "
            "with SGLang to capture hidden states"
        )
    return layers, norm, head


class HiddenStateTap:
    """Forward hooks that record, during one forward, the inputs of the capture layers and the final-normed
    hidden state (what the lm_head sees). Idle (one flag test per hooked module) unless :meth:`recording`.

    Args:
        model: HF causal LM.
        capture_ids: ascending capture ids (:func:`capture_ids_from_flag`); empty = aux capture off.
    """

    def __init__(self, model: torch.nn.Module, capture_ids: Sequence[int]):
        layers, norm, self.lm_head = decoder_modules(model)
        self.capture_ids = [int(c) for c in capture_ids]
        self._on = False
        self._aux: dict[int, torch.Tensor] = {}
        self.final: torch.Tensor | None = None
        self._handles = []
        for cid in self.capture_ids:
            self._handles.append(layers[cid].register_forward_pre_hook(self._pre_hook(cid), with_kwargs=True))
        self._handles.append(norm.register_forward_hook(self._norm_hook))

    def _pre_hook(self, cid: int):
        def hook(_module, args, kwargs):
            if self._on:
                self._aux[cid] = args[0] if args else kwargs["hidden_states"]
        return hook

    def _norm_hook(self, _module, _args, output):
        if self._on:
            self.final = output

    def start(self) -> None:
        """Record the next forward."""
        self._aux.clear()
        self.final = None
        self._on = True

    def stop(self) -> None:
        self._on = False

    def clear(self) -> None:
        """Drop the recorded tensors (they pin a forward's activations until the next recording otherwise)."""
        self._aux.clear()
        self.final = None

    def aux(self) -> torch.Tensor:
        """``[B, S, k * H]``: the recorded capture-layer inputs, concatenated in ascending capture id.

        Raises:
            RuntimeError: a capture layer did not run in the recorded forward.
        """
        import torch

        missing = [c for c in self.capture_ids if c not in self._aux]
        if missing:
            raise RuntimeError(f"decoder layers {missing} did not run; their inputs could not be captured")
        return torch.cat([self._aux[c] for c in self.capture_ids], dim=-1)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
