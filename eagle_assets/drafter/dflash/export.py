"""A DFlash draft as SGLang 0.5.23 loads it: ``config.json`` + ``model.safetensors`` in HF names.

``config.json`` (``sglang/srt/speculative/dflash_utils.py::parse_dflash_draft_config`` reads ``dflash_config`` first,
then the top level): ``architectures: ["DFlashDraftModel"]``, ``model_type: qwen3``, the target's width, heads, norm
eps and rotary, ``num_hidden_layers``, ``num_target_layers``, ``block_size``, ``layer_types: full_attention`` per
layer (bidirectional in a block: never write ``is_causal``, which turns every layer causal), and
``dflash_config: {target_layer_ids, mask_token_id, block_size}`` written explicitly (SGLang's defaults for a missing
one differ from what was trained: one id per draft layer, and a ``<|MASK|>`` token it adds to the tokenizer).

Weights: ``layers.N.self_attn.{q,k,v,o}_proj.weight``, ``q_norm``/``k_norm``, ``layers.N.mlp.{gate,up,down}_proj``,
``input_layernorm``/``post_attention_layernorm``, ``fc.weight`` ``[H, K*H]``, ``hidden_norm``, ``norm``; SGLang's
``load_weights`` fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``, skips names it does not know
without a word, and never reports a parameter nothing wrote: :func:`validate_checkpoint` checks both ways.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle_assets.drafter.data.vocab import DraftVocab, draft_vocab_from_arrays
from eagle_assets.drafter.dflash.model import DFlashConfig, DFlashDraftModel

WEIGHTS = "model.safetensors"


class CheckpointError(ValueError):
    """An exported DFlash draft SGLang would not load as trained (the message lists every problem)."""


@dataclass
class CheckpointReport:
    """What :func:`validate_checkpoint` found: the directory, its config and tensors (name -> shape)."""

    path: Path
    config: dict[str, Any]
    tensors: dict[str, tuple[int, ...]]

    @property
    def parameters(self) -> int:
        n = 0
        for shape in self.tensors.values():
            count = 1
            for d in shape:
                count *= d
            n += count
        return n


def expected_tensors(config: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor SGLang's class for ``config`` needs, by checkpoint name, with its shape."""
    model = config.build()
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def export_checkpoint(model: DFlashDraftModel, target_config: Any, draft_vocab: DraftVocab | None,
                      aux_capture_ids: Any, out_dir: str | Path, dtype: str = "float32") -> CheckpointReport:
    """Write ``model`` to ``out_dir`` (replaced atomically: written beside it, then renamed) and validate it.

    ``target_config``, ``draft_vocab`` and ``aux_capture_ids``: the family interface's arguments; a DFlash draft
    has no vocab of its own (the target's LM head) and its capture ids are its ``target_layer_ids + 1``, so they
    are only checked against the model's.

    Raises:
        ValueError: ``aux_capture_ids`` disagree with the model's target layers.
        CheckpointError: the written directory does not validate.
    """
    if aux_capture_ids is not None and list(aux_capture_ids) != model.config.aux_capture_ids:
        raise ValueError(f"capture ids {list(aux_capture_ids)} are not the draft's {model.config.aux_capture_ids}")
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".writing")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    tensors = {k: v.detach().to(torch_dtype).contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
    config = model.config.to_json()
    config["torch_dtype"] = dtype
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    validate_checkpoint(tmp, config_cls=type(model.config))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return validate_checkpoint(out, config_cls=type(model.config))


def validate_checkpoint(checkpoint_dir: str | Path, target_config: Any = None,
                        config_cls: type[DFlashConfig] = DFlashConfig) -> CheckpointReport:
    """Check an exported draft against what SGLang 0.5.23 loads: the architecture, the ``dflash_config`` keys,
    every expected tensor present with its shape and nothing else (SGLang would skip an unknown name silently and
    leave a missing parameter unwritten), finite values; against ``target_config`` when given: the vocab, width
    and depth. ``config_cls``: the family's config (DFlash's, or a subclass such as DSpark's).

    Raises:
        CheckpointError: every problem found, in one message.
    """
    path = Path(checkpoint_dir)
    problems: list[str] = []
    try:
        cfg = json.loads((path / "config.json").read_text())
        config = config_cls.from_json(cfg)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: no valid DFlash config.json ({type(exc).__name__}: {exc})") from None
    if cfg.get("architectures") != [config.architecture]:
        problems.append(f"architectures is {cfg.get('architectures')!r}, must be [{config.architecture!r}]")
    if "is_causal" in cfg:
        problems.append("is_causal is set: SGLang would run every layer causal, not bidirectional in a block")
    for key in ("target_layer_ids", "mask_token_id"):
        if key not in (cfg.get("dflash_config") or {}):
            problems.append(f"dflash_config.{key} is missing: SGLang would use a default other than the trained one")
    want = expected_tensors(config)
    tensors: dict[str, tuple[int, ...]] = {}
    try:
        with safe_open(str(path / WEIGHTS), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                tensors[name] = tuple(t.shape)
                if t.is_floating_point() and not torch.isfinite(t).all():
                    problems.append(f"{name} holds non-finite values")
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read {WEIGHTS}: {exc}") from None
    missing = sorted(set(want) - set(tensors))
    unknown = sorted(set(tensors) - set(want))
    wrong = sorted(n for n in set(want) & set(tensors) if want[n] != tensors[n])
    problems += [f"missing tensor {n} {want[n]}" for n in missing]
    problems += [f"tensor {n} is not one SGLang loads (it would be skipped silently)" for n in unknown]
    problems += [f"tensor {n} has shape {tensors[n]}, expected {want[n]}" for n in wrong]
    if target_config is not None:
        get = (target_config.get if isinstance(target_config, dict) else
               lambda name, default=None: getattr(target_config, name, default))
        for name in ("vocab_size", "hidden_size"):
            if get(name) is not None and int(get(name)) != cfg[name]:
                problems.append(f"{name} {cfg[name]} differs from the target's {get(name)}")
        if get("num_hidden_layers") is not None and int(get("num_hidden_layers")) != config.num_target_layers:
            problems.append(f"num_target_layers {config.num_target_layers} differs from the target's depth "
                            f"{get('num_hidden_layers')}")
    if problems:
        raise CheckpointError(f"{path}: " + "; ".join(problems))
    return CheckpointReport(path, cfg, tensors)


def load_drafter(checkpoint_dir: str | Path, target: Any = None,
                 config_cls: type[DFlashConfig] = DFlashConfig) -> tuple[DFlashDraftModel, DraftVocab]:
    """Rebuild an exported draft (safetensors only) in eval mode, float32, with the target's embedding and LM head
    attached when ``target`` (a HF causal LM) is given; its draft vocab is the target's whole vocab (identity).

    Raises:
        CheckpointError: the directory does not validate.
    """
    report = validate_checkpoint(checkpoint_dir, config_cls=config_cls)
    config = config_cls.from_json(report.config)
    model = config.build()
    with safe_open(str(Path(checkpoint_dir) / WEIGHTS), framework="pt") as f:
        model.load_state_dict({k: f.get_tensor(k).float() for k in f.keys()})
    if target is not None:
        head = target.get_output_embeddings()
        model.attach_target(target.get_input_embeddings().weight, None if head is None else head.weight)
    import numpy as np

    v = config.vocab_size
    vocab = draft_vocab_from_arrays(np.zeros(v, dtype=np.int64), np.ones(v, dtype=bool))
    return model.eval(), vocab


def serve_flags(checkpoint: str | Path, k: int) -> list[str]:
    """SGLang 0.5.23 ``launch_server`` flags that serve the draft at ``checkpoint`` (its block size from the
    config; ``k`` is unused: a block drafter proposes ``block_size - 1`` tokens)."""
    block = json.loads((Path(checkpoint) / "config.json").read_text())["dflash_config"]["block_size"]
    return ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(checkpoint),
            "--speculative-dflash-block-size", str(int(block))]
