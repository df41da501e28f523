"""Single tensors of a target checkpoint, read from its safetensors files without building the model."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def read_target_tensor(model_dir: str | Path, suffix: str = "embed_tokens.weight") -> torch.Tensor:
    """One weight of a safetensors checkpoint, read without building the model (the drafter needs only the
    target's input embedding ``[V, H]`` when its features are served).

    The tensor is the single name ending in ``suffix`` (DeepSeek-V3 ``model.embed_tokens.weight``, Kimi-K2.5
    ``language_model.model.embed_tokens.weight``), found through ``model.safetensors.index.json`` or in
    ``model.safetensors``; only its shard is opened.

    Raises:
        FileNotFoundError: no safetensors checkpoint in ``model_dir``.
        KeyError: no tensor, or several, end in ``suffix``.
    """
    from safetensors import safe_open

    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
    elif (root / "model.safetensors").is_file():
        with safe_open(str(root / "model.safetensors"), framework="pt") as f:
            weight_map = {name: "model.safetensors" for name in f.keys()}
    else:
        raise FileNotFoundError(f"{root} has no model.safetensors(.index.json)")
    names = [n for n in weight_map if n == suffix or n.endswith("." + suffix)]
    if len(names) != 1:
        raise KeyError(f"{root}: {len(names)} tensors end in {suffix!r} ({names[:4]}); pass a longer suffix")
    with safe_open(str(root / weight_map[names[0]]), framework="pt") as f:
        return f.get_tensor(names[0])
