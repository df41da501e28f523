"""A target model directory's ``config.json`` and ``generation_config.json``, read once per file version.

Every stage that needs a field of the target's config (vocab size, eos ids, hidden size, layer count, MLA dims)
reads it here, so the file is parsed once per process and a changed file (another mtime or size) is read again.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any


class ModelConfigError(ValueError):
    """A ``config.json`` that is missing or not a JSON object; the message names the file and what to do."""


@lru_cache(maxsize=32)
def _read(path: str, mtime_ns: int, size: int) -> dict[str, Any]:
    try:
        obj = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ModelConfigError(f"{path} is not readable JSON ({exc}): point target.model at a Hugging Face model "
                               "directory whose config.json loads") from None
    if not isinstance(obj, dict):
        raise ModelConfigError(f"{path} holds a {type(obj).__name__}, not a JSON object")
    return obj


def read_json_config(model_dir: str | Path, name: str = "config.json") -> dict[str, Any]:
    """``model_dir/name`` parsed (cached by path, mtime and size; do not mutate the result).

    Raises:
        FileNotFoundError: the file does not exist.
        ModelConfigError: it is not a JSON object.
    """
    path = Path(str(model_dir)) / name
    st = path.stat()
    return _read(str(path), st.st_mtime_ns, st.st_size)


def optional_json_config(model_dir: str | Path | None, name: str = "config.json") -> dict[str, Any]:
    """:func:`read_json_config`, or ``{}`` when there is no directory, no such file, or it is not a JSON object."""
    if model_dir is None:
        return {}
    try:
        return read_json_config(model_dir, name)
    except (OSError, ModelConfigError):
        return {}


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a config: ``text_config`` of a multimodal config (Kimi-K2.5), else itself."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) else config


def config_vocab_size(model_dir: str | Path) -> int:
    """``vocab_size`` of ``config.json`` (top level or ``text_config``): the embedding's row count.

    Raises:
        FileNotFoundError / ModelConfigError: as :func:`read_json_config`.
        KeyError: neither level has a positive int ``vocab_size``.
    """
    cfg = read_json_config(model_dir)
    for size in (cfg.get("vocab_size"), text_config(cfg).get("vocab_size")):
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            return size
    raise KeyError(f"{Path(str(model_dir)) / 'config.json'} has no vocab_size (top level or text_config)")
