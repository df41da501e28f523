"""Loading a target model's tokenizer from local files only (no network, no remote code)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle_assets.target_model.kimi import load_kimi_tokenizer
from eagle_assets.target_model.tokenizer_errors import TokenizerLoadError

__all__ = ["TokenizerLoadError", "load_kimi_tokenizer", "load_tokenizer"]


def load_tokenizer(path_or_name: str | Path) -> Any:
    """Load a tokenizer with ``AutoTokenizer.from_pretrained(..., local_files_only=True)``.

    A directory holding ``tiktoken.model`` and no ``tokenizer.json`` (Kimi-K2/K2.5, whose own loader is remote
    code) is built with :func:`eagle_assets.target_model.kimi.load_kimi_tokenizer`. A hub id is looked up in the local
    Hugging Face cache only.

    Raises:
        TokenizerLoadError: nothing loadable at that path / not in the local cache.
    """
    from transformers import AutoTokenizer

    path = Path(str(path_or_name)).expanduser()
    if path.is_dir():
        if (path / "tiktoken.model").is_file() and not (path / "tokenizer.json").is_file():
            return load_kimi_tokenizer(path)
        try:
            return AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
        except Exception as e:
            raise TokenizerLoadError(f"{path}: cannot load a tokenizer from this directory ({type(e).__name__}: {e}); "
                                     "it needs tokenizer.json or vocab/merges files plus "
                                     "tokenizer_config.json") from None
    if path.exists():
        raise TokenizerLoadError(f"{path}: is a file; give the model directory that contains the tokenizer files")
    try:
        return AutoTokenizer.from_pretrained(str(path_or_name), local_files_only=True, trust_remote_code=False)
    except Exception as e:
        raise TokenizerLoadError(
            f"{path_or_name!r}: not a local directory and not in the local Hugging Face cache ({type(e).__name__}); "
            f"download it first (huggingface-cli download {path_or_name}) or set target.model to a local model dir"
        ) from None
