"""Write, check and read back an SGLang-loadable EAGLE-3 drafter directory.

Contract (SGLang 0.5.23): ``architecture: llama`` -> ``python/sglang/srt/models/llama_eagle3.py``
``LlamaForCausalLMEagle3``; ``architecture: mla`` -> ``kimi_k25_eagle3.py`` ``Eagle3DeepseekV2ForCausalLM``.

- ``config.json``: ``architectures`` (the class), ``model_type`` (``llama`` / ``deepseek_v3``, so transformers'
  ``AutoConfig`` builds a config with the fields the class reads), ``num_hidden_layers`` (every layer is trained;
  the MLA class takes exactly 1), ``tie_word_embeddings: false`` (true would make SGLang use the embedding as
  lm_head and drop ours), ``draft_vocab_size`` (None would make SGLang load the target's full lm_head instead),
  ``target_hidden_size``, ``hidden_act: "silu"`` (its MLPs refuse others), the EAGLE-3.1 switches ``fc_norm`` and
  ``norm_output`` and the Llama class's ``norm_before_fc``, for MLA its dims and ``rope_interleave: true``, and
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` in LAYER-OUTPUT numbering (SGLang adds 1 to get capture ids;
  see :mod:`eagle_assets.drafter.features.local_capture`). A sliding window is served with
  ``--speculative-draft-window-size`` (SGLang never reads it from the config); it is recorded under
  ``speculative_draft_window_size`` so :func:`serve_flags` can print it.
- ``model.safetensors``: exactly the names :func:`expected_tensors` gives: a one-layer Llama draft under the legacy
  ``midlayer.*`` (what every SGLang release and SpecForge read), every other draft under ``layers.N.*`` (SGLang maps
  ``midlayer`` -> ``layers.0`` itself; its MLA class maps ``layers.0`` -> ``midlayer``). Layers after the first of a
  Llama draft carry an ``input_layernorm`` SGLang builds and never uses: it is written as ones so that every
  parameter of SGLang's class is loaded. SGLang's ``load_weights`` silently skips names it does not know and leaves
  unloaded parameters at their initial values, so a wrong name is a silent garbage drafter: hence the strict
  validator. ``embed_tokens`` is never shipped (the target's embedding is shared).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle_assets.drafter.data.vocab import DraftVocab, draft_vocab_from_arrays, validate_draft_vocab
from eagle_assets.drafter.eagle3.model import (
    MLA_DIMS,
    DrafterConfig,
    Eagle3DraftModel,
    canonical_name,
    rope_settings,
)
from eagle_assets.drafter.features.local_capture import (
    aux_layer_ids,
    capture_to_layer_output_ids,
    layer_output_to_capture_ids,
)
from eagle_assets.storage.guard import refuse_symlink, remove_tree

WEIGHT_KEYS: tuple[str, ...] = (
    "fc.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.post_attention_layernorm.weight",
    "norm.weight",
    "lm_head.weight",
)
EXPECTED_KEYS: frozenset[str] = frozenset(WEIGHT_KEYS + ("d2t", "t2d"))  # of the default one-layer Llama draft
ARCHITECTURE = "LlamaForCausalLMEagle3"
#: drafter architecture -> (SGLang class, config model_type)
CLASSES = {"llama": (ARCHITECTURE, "llama"), "mla": ("Eagle3DeepseekV2ForCausalLM", "deepseek_v3")}
_FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(ValueError):
    """A drafter directory that SGLang would not load correctly; the message says what and how to fix it."""


@dataclass
class CheckpointReport:
    """What :func:`validate_checkpoint` found in a directory that passed.

    Attributes:
        path: the directory.
        config: the parsed ``config.json``.
        tensors: ``{name: (shape, dtype)}`` of every stored tensor.
        aux_layer_output_ids: ``eagle_config.eagle_aux_hidden_state_layer_ids`` as stored (layer-output ids).
        aux_capture_ids: the same + 1 (inputs of those layers), what the target must capture.
        warnings: non-fatal remarks (e.g. stray ``*.bin`` files).
    """

    path: Path
    config: dict[str, Any]
    tensors: dict[str, tuple[tuple[int, ...], str]]
    aux_layer_output_ids: list[int]
    aux_capture_ids: list[int]
    warnings: list[str] = field(default_factory=list)

    @property
    def parameters(self) -> int:
        """Weights the checkpoint ships (every float tensor's element count; the shared embedding not included)."""
        return sum(math.prod(shape) for name, (shape, _) in self.tensors.items() if name not in ("d2t", "t2d"))


def drafter_config_json(config: DrafterConfig) -> dict[str, Any]:
    """The ``config.json`` dict of a drafter (field list in the module docstring).

    Rotary settings are written both the transformers-4 way (``rope_theta`` + ``rope_scaling``, read by SGLang's
    ``LlamaDecoderLayer`` and ``Eagle3MLADecoderLayer``) and the transformers-5 way (``rope_parameters``).
    """
    rope_parameters = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        rope_parameters = {**dict(config.rope_scaling), "rope_theta": config.rope_theta}
    architecture, model_type = CLASSES[config.architecture]
    out: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "num_hidden_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope_theta,
        "rope_scaling": dict(config.rope_scaling) if config.rope_scaling is not None else None,
        "rope_parameters": rope_parameters,
        "attention_bias": False,
        "mlp_bias": False,
        "bias": config.bias,
        "fc_norm": config.fc_norm,
        "norm_output": config.norm_output,
        "norm_before_fc": config.norm_before_fc,
        "tie_word_embeddings": False,
        "initializer_range": config.initializer_range,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": capture_to_layer_output_ids(config.aux_capture_ids),
            "use_aux_hidden_state": True,
        },
        "speculative_draft_window_size": config.window,
        "torch_dtype": config.torch_dtype,
        "dtype": config.torch_dtype,
    }
    if config.architecture == "mla":
        out.update({name: getattr(config, name) for name in MLA_DIMS})
        out["rope_interleave"] = True
    if config.bos_token_id is not None:
        out["bos_token_id"] = config.bos_token_id
    if config.eos_token_id is not None:
        out["eos_token_id"] = config.eos_token_id
    return out


def drafter_config_from_json(cfg: dict[str, Any]) -> DrafterConfig:
    """The :class:`DrafterConfig` of a checkpoint's ``config.json`` (ours, or one written before the architecture
    fields existed: absent ones are the one-layer Llama draft's).

    Raises:
        CheckpointError: a field is missing or the combination cannot be built.
    """
    kind = {cls: arch for arch, (cls, _) in CLASSES.items()}.get((cfg.get("architectures") or [None])[0])
    theta, scaling = rope_settings(cfg)
    eagle = cfg.get("eagle_config") or {}
    try:
        return DrafterConfig(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            vocab_size=cfg["vocab_size"],
            draft_vocab_size=cfg["draft_vocab_size"],
            target_hidden_size=cfg.get("target_hidden_size") or cfg["hidden_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            rope_theta=theta,
            rope_scaling=scaling,
            aux_capture_ids=tuple(layer_output_to_capture_ids(eagle.get("eagle_aux_hidden_state_layer_ids") or [])),
            hidden_act=cfg.get("hidden_act", "silu"),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            architecture=kind or "llama",
            num_hidden_layers=int(cfg.get("num_hidden_layers") or 1),
            fc_norm=bool(cfg.get("fc_norm") or cfg.get("use_aux_norm")),
            norm_output=bool(cfg.get("norm_output")),
            norm_before_fc=bool(eagle.get("norm_before_fc", cfg.get("norm_before_fc"))),
            bias=bool(cfg.get("bias")),
            window=cfg.get("speculative_draft_window_size"),
            **({name: cfg.get(name) for name in MLA_DIMS} if kind == "mla" else {}),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"config.json does not describe a drafter this project can build: {exc}") from None


def export_name(config: DrafterConfig, name: str) -> str:
    """A drafter state name as the checkpoint stores it (module docstring: ``midlayer.*`` for a one-layer Llama
    draft, else unchanged)."""
    if config.architecture == "llama" and config.num_hidden_layers == 1 and name.startswith("layers.0."):
        return "midlayer." + name[len("layers.0."):]
    return name


def _unused_norms(config: DrafterConfig) -> list[str]:
    """``layers.N.input_layernorm.weight`` (N >= 1) of a Llama draft: built by SGLang, never read by its forward."""
    if config.architecture != "llama":
        return []
    return [f"layers.{i}.input_layernorm.weight" for i in range(1, config.num_hidden_layers)]


def expected_tensors(config: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """``{checkpoint name: shape}`` of every tensor a drafter of ``config`` ships, ``d2t``/``t2d`` included (the
    shapes are the model's own, built on the meta device)."""
    with torch.device("meta"):
        model = Eagle3DraftModel(config)
    out = {export_name(config, k): tuple(v.shape) for k, v in model.state_dict().items()}
    out.update({name: (config.hidden_size,) for name in _unused_norms(config)})
    out.update({"d2t": (config.draft_vocab_size,), "t2d": (config.vocab_size,)})
    return out


def serve_flags(checkpoint: str | Path, k: int) -> list[str]:
    """SGLang 0.5.23 ``launch_server`` flags that serve the drafter at ``checkpoint`` as the acceptance simulation
    drafts (a chain of ``k`` drafts: ``--speculative-eagle-topk 1``, ``k + 1`` draft tokens per verification), with
    ``--speculative-draft-window-size`` when it was trained with a window (SGLang reads it from the flag only)."""
    flags = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(checkpoint),
             "--speculative-num-steps", str(k), "--speculative-eagle-topk", "1",
             "--speculative-num-draft-tokens", str(k + 1)]
    try:
        window = json.loads((Path(checkpoint) / "config.json").read_text()).get("speculative_draft_window_size")
    except (OSError, ValueError):
        window = None
    if window is not None:
        flags += ["--speculative-draft-window-size", str(int(window))]
    return flags


def export_checkpoint(
    model: Eagle3DraftModel,
    target_config: Any,
    draft_vocab: DraftVocab,
    aux_ids: Sequence[int],
    out_dir: str | Path,
    dtype: str | None = None,
) -> CheckpointReport:
    """Write ``config.json`` + ``model.safetensors`` for the drafter's SGLang class and validate them.

    Args:
        model: the trained drafter.
        target_config: the target's HF config (object or dict); cross-checked for vocab and hidden sizes and
            aux ids against its layer count.
        draft_vocab: the vocab the drafter was trained with (``d2t`` int64 ``[draft]``, ``t2d`` bool ``[vocab]``).
        aux_ids: CAPTURE ids used in training (written as layer-output ids = capture - 1).
        out_dir: destination directory; replaced atomically (written to a temporary sibling, then renamed).
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` for the weights; default the drafter config's
            ``torch_dtype`` (copied from the target so SGLang's draft and target dtypes agree).

    Returns:
        The :class:`CheckpointReport` of the written directory.

    Raises:
        CheckpointError: the model, vocab, ids and target config disagree, or the written files fail validation.
        SymlinkRefusedError: ``out_dir`` is a symbolic link (the old checkpoint is deleted when replaced: through
            a link that would be what it points to); checked before anything is written.
    """
    refuse_symlink(Path(out_dir))
    cfg = model.config
    capture = [int(c) for c in aux_ids]
    target_layers = _cfg_get(target_config, "num_hidden_layers")
    try:
        if target_layers is not None:
            aux_layer_ids(int(target_layers), capture)
    except ValueError as exc:
        raise CheckpointError(f"aux ids do not fit the target: {exc}") from exc
    if sorted(capture) != sorted(cfg.aux_capture_ids):
        raise CheckpointError(f"aux capture ids {capture} differ from the drafter's {list(cfg.aux_capture_ids)}")
    for name, want in (("vocab_size", cfg.vocab_size), ("hidden_size", cfg.target_hidden_size)):
        have = _cfg_get(target_config, name)
        if have is not None and int(have) != want:
            raise CheckpointError(f"target config {name}={have} but the drafter was built for {want}")
    if draft_vocab.draft_vocab_size != cfg.draft_vocab_size or draft_vocab.target_vocab_size != cfg.vocab_size:
        raise CheckpointError(
            f"draft vocab ({draft_vocab.draft_vocab_size} of {draft_vocab.target_vocab_size}) does not match the "
            f"drafter ({cfg.draft_vocab_size} of {cfg.vocab_size})"
        )
    if not torch.equal(model.draft_token_ids.cpu(), torch.from_numpy(draft_vocab.draft_token_ids)):
        raise CheckpointError("the drafter was trained with a different draft vocab than the one being exported")
    dtype_name = dtype or cfg.torch_dtype
    if dtype_name not in _FLOAT_DTYPES:
        raise CheckpointError(f"unsupported export dtype {dtype_name!r}; use one of {sorted(_FLOAT_DTYPES)}")
    torch_dtype = _FLOAT_DTYPES[dtype_name]

    tensors = {export_name(cfg, k): v.detach().to("cpu", torch_dtype).contiguous()
               for k, v in model.state_dict().items()}
    for name in _unused_norms(cfg):
        tensors[name] = torch.ones(cfg.hidden_size, dtype=torch_dtype)
    tensors["d2t"] = torch.from_numpy(np.ascontiguousarray(draft_vocab.d2t, dtype=np.int64))
    tensors["t2d"] = torch.from_numpy(np.ascontiguousarray(draft_vocab.t2d, dtype=np.bool_))
    config_json = drafter_config_json(_with_dtype(cfg, dtype_name))

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
        report = validate_checkpoint(tmp, target_config=target_config)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    report.path = out
    return report


def validate_checkpoint(checkpoint_dir: str | Path, target_config: Any = None) -> CheckpointReport:
    """Check a drafter directory against the SGLang contract before anyone serves it.

    Checks: ``config.json`` fields (architecture, model type, one layer, untied lm_head, silu, draft vocab size,
    aux ids, sizes), the exact tensor name set across all ``*.safetensors`` files (SGLang loads every one of them),
    every tensor's shape and dtype, and ``d2t``/``t2d`` consistency. With ``target_config``, also vocab/hidden sizes
    and that the aux ids exist in the target.

    Args:
        checkpoint_dir: the directory.
        target_config: optional HF config (object or dict) of the target it will be served with.

    Returns:
        :class:`CheckpointReport`.

    Raises:
        CheckpointError: naming every problem found (e.g. "missing tensor d2t", "stray tensor
            model.embed_tokens.weight", "draft_vocab_size 32000 but lm_head.weight has 3000 rows").
    """
    root = Path(checkpoint_dir)
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a directory")
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{root} has no config.json; export with export_checkpoint()")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{cfg_path} is not valid JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{cfg_path} must hold a JSON object")

    problems: list[str] = []
    warnings: list[str] = []
    _check_config(cfg, problems)

    files = sorted(root.glob("*.safetensors"))
    if not files:
        problems.append("no *.safetensors file (SGLang needs model.safetensors)")
    for stray in sorted(list(root.glob("*.bin")) + list(root.glob("*.pt")) + list(root.glob("*.pth"))):
        warnings.append(f"stray {stray.name}: pickle weights are ignored here and may confuse loaders; remove it")

    tensors: dict[str, tuple[tuple[int, ...], str]] = {}
    d2t = t2d = None
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():
                    if key in tensors:
                        problems.append(f"tensor {key} appears in more than one safetensors file")
                    sl = handle.get_slice(key)
                    tensors[key] = (tuple(int(s) for s in sl.get_shape()), _dtype_name(sl.get_dtype()))
                    if key in ("d2t", "t2d"):
                        arr = handle.get_tensor(key).numpy()
                        d2t, t2d = (arr, t2d) if key == "d2t" else (d2t, arr)
        except Exception as exc:  # safetensors raises several types for a corrupt header
            problems.append(f"{path.name} is not a readable safetensors file: {exc}")

    dconf = None
    if not problems:
        try:
            dconf = drafter_config_from_json(cfg)
        except CheckpointError as exc:
            problems.append(str(exc))
    if files and dconf is not None:
        expected = {canonical_name(k): (k, shape) for k, shape in expected_tensors(dconf).items()}
        stored = {canonical_name(k): k for k in tensors}
        for key in sorted(set(expected) - set(stored)):
            problems.append(f"missing tensor {expected[key][0]}")
        for key in sorted(set(stored) - set(expected)):
            why = " (never ship embed_tokens: SGLang shares the target's)" if "embed" in key else ""
            problems.append(f"stray tensor {stored[key]}{why}; SGLang would skip or misuse it")
        _check_shapes(cfg, {canonical_name(k): v for k, v in tensors.items()},
                      {k: shape for k, (_, shape) in expected.items()}, problems)
        if d2t is not None and t2d is not None and isinstance(cfg.get("vocab_size"), int):
            try:
                validate_draft_vocab(d2t, t2d, cfg["vocab_size"])
            except ValueError as exc:
                problems.append(f"d2t/t2d: {exc}")

    layer_output_ids = list(((cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or []))
    if target_config is not None:
        _check_against_target(cfg, target_config, layer_output_ids, problems)

    if problems:
        raise CheckpointError(f"{root} is not a valid EAGLE-3 drafter for SGLang:\n- " + "\n- ".join(problems))
    return CheckpointReport(
        path=root,
        config=cfg,
        tensors=tensors,
        aux_layer_output_ids=[int(i) for i in layer_output_ids],
        aux_capture_ids=layer_output_to_capture_ids(layer_output_ids),
        warnings=warnings,
    )


def load_drafter(
    checkpoint_dir: str | Path, target: Any = None
) -> tuple[Eagle3DraftModel, DraftVocab]:
    """Rebuild a drafter from an exported directory (safetensors only; no pickle is ever read).

    Args:
        checkpoint_dir: a directory that passes :func:`validate_checkpoint`.
        target: the target causal LM (its ``get_input_embeddings()`` is attached) or an embedding tensor
            ``[vocab, hidden]``; None leaves the drafter without embedding until ``attach_embedding`` is called.

    Returns:
        ``(drafter in eval mode, float32; DraftVocab)``.

    Raises:
        CheckpointError: the directory fails validation.
    """
    report = validate_checkpoint(checkpoint_dir, target_config=getattr(target, "config", None))
    dconf = drafter_config_from_json(report.config)
    unused = set(_unused_norms(dconf))
    state: dict[str, torch.Tensor] = {}
    for path in sorted(Path(checkpoint_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                if canonical_name(key) not in unused:
                    state[canonical_name(key)] = handle.get_tensor(key)
    vocab = draft_vocab_from_arrays(state.pop("d2t").numpy(), state.pop("t2d").numpy())
    model = Eagle3DraftModel(dconf, draft_token_ids=torch.from_numpy(vocab.draft_token_ids))
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    if target is not None:
        weight = target if isinstance(target, torch.Tensor) else target.get_input_embeddings().weight
        model.attach_embedding(weight.float())
    model.eval()
    return model, vocab


def _check_config(cfg: dict[str, Any], problems: list[str]) -> None:
    classes = {cls: model_type for cls, model_type in CLASSES.values()}
    arch = cfg.get("architectures")
    if not (isinstance(arch, list) and len(arch) == 1 and arch[0] in classes):
        problems.append(f"architectures is {arch!r}, must be one of {[[c] for c in classes]}")
    elif cfg.get("model_type") != classes[arch[0]]:
        problems.append(f"model_type is {cfg.get('model_type')!r}, must be {classes[arch[0]]!r} for {arch[0]}")
    layers = cfg.get("num_hidden_layers")
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        problems.append(f"num_hidden_layers is {layers!r}, must be a positive integer (the draft's layers)")
    if cfg.get("tie_word_embeddings") is not False:
        problems.append("tie_word_embeddings must be false (true makes SGLang use embed_tokens as lm_head)")
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act is {cfg.get('hidden_act')!r}; SGLang's LlamaMLP only supports silu")
    for name in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size", "draft_vocab_size"):
        value = cfg.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            why = " (null makes SGLang load the target's full lm_head)" if name == "draft_vocab_size" else ""
            problems.append(f"{name} must be a positive integer, got {value!r}{why}")
    if isinstance(cfg.get("draft_vocab_size"), int) and isinstance(cfg.get("vocab_size"), int):
        if cfg["draft_vocab_size"] > cfg["vocab_size"]:
            problems.append(f"draft_vocab_size {cfg['draft_vocab_size']} exceeds vocab_size {cfg['vocab_size']}")
    ths = cfg.get("target_hidden_size", cfg.get("hidden_size"))
    if ths != cfg.get("hidden_size"):
        problems.append(
            f"target_hidden_size {ths} != hidden_size {cfg.get('hidden_size')}: SGLang then does not share the "
            "target's embedding, and this checkpoint ships none"
        )
    if cfg.get("attention_bias"):
        problems.append("attention_bias must be false: SGLang's draft attention has no bias")
    eagle = cfg.get("eagle_config")
    if not isinstance(eagle, dict):
        problems.append(
            "eagle_config is missing; it must hold eagle_aux_hidden_state_layer_ids and use_aux_hidden_state"
        )
        return
    if eagle.get("use_aux_hidden_state") is not True:
        problems.append("eagle_config.use_aux_hidden_state must be true")
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if (
        not isinstance(ids, list)
        or len(ids) != 3
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
        or len(set(ids)) != 3
        or min(ids) < 0
    ):
        problems.append(
            f"eagle_config.eagle_aux_hidden_state_layer_ids must be three distinct layer-output ids >= 0, got {ids!r}"
        )


def _check_shapes(cfg: dict[str, Any], tensors: dict[str, tuple[tuple[int, ...], str]],
                  expected: dict[str, tuple[int, ...]], problems: list[str]) -> None:
    declared = str(cfg.get("torch_dtype") or cfg.get("dtype") or "")
    float_dtypes = set()
    for key, shape in expected.items():
        if key not in tensors:
            continue
        have_shape, have_dtype = tensors[key]
        if have_shape != shape:
            problems.append(f"{key} has shape {list(have_shape)}, config implies {list(shape)}")
        if key == "d2t" and have_dtype != "int64":
            problems.append(f"d2t must be int64 (offsets added to arange), got {have_dtype}")
        elif key == "t2d" and have_dtype != "bool":
            problems.append(f"t2d must be bool, got {have_dtype}")
        elif key not in ("d2t", "t2d"):
            float_dtypes.add(have_dtype)
            if have_dtype not in _FLOAT_DTYPES:
                problems.append(f"{key} has dtype {have_dtype}, expected a float dtype")
    if len(float_dtypes) > 1:
        problems.append(f"weights mix dtypes {sorted(float_dtypes)}; export them in one dtype")
    elif float_dtypes and declared in _FLOAT_DTYPES and float_dtypes != {declared}:
        problems.append(f"config torch_dtype is {declared} but weights are {float_dtypes.pop()}")


def _check_against_target(
    cfg: dict[str, Any], target_config: Any, layer_output_ids: list[Any], problems: list[str]
) -> None:
    vocab = _cfg_get(target_config, "vocab_size")
    hidden = _cfg_get(target_config, "hidden_size")
    layers = _cfg_get(target_config, "num_hidden_layers")
    if vocab is not None and cfg.get("vocab_size") != int(vocab):
        problems.append(f"vocab_size {cfg.get('vocab_size')} differs from the target's {vocab}")
    if hidden is not None and cfg.get("target_hidden_size", cfg.get("hidden_size")) != int(hidden):
        problems.append(f"target_hidden_size differs from the target's hidden_size {hidden}")
    if layers is not None and layer_output_ids and all(isinstance(i, int) for i in layer_output_ids):
        try:
            aux_layer_ids(int(layers), layer_output_to_capture_ids(layer_output_ids))
        except ValueError as exc:
            problems.append(f"aux ids vs the {layers}-layer target: {exc}")


def _cfg_get(config: Any, name: str) -> Any:
    if config is None:
        return None
    if isinstance(config, dict):
        return config.get(name)
    return getattr(config, name, None)


def _dtype_name(dtype: str) -> str:
    return {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "I64": "int64", "BOOL": "bool"}.get(
        dtype, dtype.lower()
    )


def _with_dtype(cfg: DrafterConfig, dtype: str) -> DrafterConfig:
    from dataclasses import replace

    return replace(cfg, torch_dtype=dtype)


def _replace_dir(src: Path, dst: Path) -> None:
    refuse_symlink(dst)  # the old directory is deleted below: never through a link
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        remove_tree(old, ignore_errors=True)
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)
