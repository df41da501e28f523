"""Kimi-K2 / K2.5 tokenizer built from its tiktoken files, without tiktoken and without the model's remote code.

Moonshot ships ``tiktoken.model`` (one ``base64(token_bytes) rank`` line per id, 163,584 ids) and
``tokenizer_config.json`` (``added_tokens_decoder`` for ids 163584..163839); their loader
``tokenization_kimi.py`` (``TikTokenTokenizer``) is remote code. This module rebuilds the same tokenizer as a
Hugging Face ``tokenizers`` byte-level BPE:

- vocab: token bytes mapped through GPT-2's bytes-to-unicode table, id = rank;
- merges: for every multi-byte token, the pair it is built from, found by replaying tiktoken's merge loop on its
  bytes with only lower ranks allowed (exact for a rank-ordered BPE), ordered by rank;
- ``ignore_merges=True``: like tiktoken, a pre-token that is itself in the vocab maps straight to its id;
- pre-tokenizer: the ``pat_str`` regex of ``tokenization_kimi.py`` (Han runs split from other letters, via
  character-class intersection, which Oniguruma supports), then byte-level mapping;
- the 256 reserved ids above the BPE vocab: named from ``added_tokens_decoder``, the rest
  ``<|reserved_token_{id}|>`` as in ``tokenization_kimi.py``.
"""

from __future__ import annotations

import base64
import copy
import functools
import json
from pathlib import Path
from typing import Any

from eagle_assets.target_model.tokenizer import TokenizerLoadError

# tokenization_kimi.py, TikTokenTokenizer.pat_str (identical for Kimi-K2, K2-Thinking, K2.5).
KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
NUM_RESERVED_SPECIAL_TOKENS = 256


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte -> printable-character table used by every byte-level BPE.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """``tiktoken.model`` -> {token bytes: rank}; raises TokenizerLoadError on a malformed line or sparse ranks."""
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(path.read_text(encoding="ascii").splitlines()):
        if not line.strip():
            continue
        try:
            token_b64, rank = line.split()
            ranks[base64.b64decode(token_b64)] = int(rank)
        except ValueError as e:
            raise TokenizerLoadError(f"{path}: line {lineno + 1} is not 'base64 rank' ({e})") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerLoadError(f"{path}: ranks are not exactly 0..{len(ranks) - 1}; not a tiktoken BPE file")
    return ranks


def _merge_parts(ranks: dict[bytes, int], token: bytes, limit: int) -> list[bytes]:
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 1:
        best_rank, best_i = limit, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best_rank:
                best_rank, best_i = r, i
        if best_i < 0:
            break
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return parts


def _build_core(ranks: dict[bytes, int], specials: list[tuple[str, bool]]) -> Any:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    table = _bytes_to_unicode()

    def enc(b: bytes) -> str:
        return "".join(table[x] for x in b)

    vocab = {enc(tok): rank for tok, rank in ranks.items()}
    merges: list[tuple[str, str]] = []
    for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(tok) < 2:
            continue
        parts = _merge_parts(ranks, tok, rank)
        if len(parts) != 2:
            raise TokenizerLoadError(f"tiktoken rank {rank} ({tok!r}) is not reachable by merging two lower-ranked tokens; not a BPE vocabulary")
        merges.append((enc(parts[0]), enc(parts[1])))
    core = Tokenizer(BPE(vocab, merges, fuse_unk=False, ignore_merges=True))
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(KIMI_PAT_STR), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    core.decoder = decoders.ByteLevel()
    core.add_tokens([AddedToken(text, special=special, normalized=False) for text, special in specials])
    return core


@functools.lru_cache(maxsize=4)
def _cached_core(model_path: str, config_path: str) -> Any:
    ranks = read_tiktoken_ranks(Path(model_path))
    config = json.loads(Path(config_path).read_text()) if Path(config_path).is_file() else {}
    named = {int(k): v for k, v in (config.get("added_tokens_decoder") or {}).items()}
    n = len(ranks)
    specials = []
    for idx in range(n, n + NUM_RESERVED_SPECIAL_TOKENS):
        entry = named.get(idx)
        specials.append((entry["content"], bool(entry.get("special", True))) if entry else (f"<|reserved_token_{idx}|>", True))
    core = _build_core(ranks, specials)
    for idx, (text, _) in zip(range(n, n + NUM_RESERVED_SPECIAL_TOKENS), specials):
        if core.token_to_id(text) != idx:
            raise TokenizerLoadError(f"{model_path}: special token {text!r} landed on id {core.token_to_id(text)}, expected {idx}")
    return core


def load_kimi_tokenizer(model_dir: str | Path, chat_template_path: str | Path | None = None) -> Any:
    """Build a ``PreTrainedTokenizerFast`` for a Kimi-K2/K2.5 model directory.

    Args:
        model_dir: directory with ``tiktoken.model`` and ``tokenizer_config.json``.
        chat_template_path: a jinja chat template (Kimi-K2.5's tokenizer dir has none; e.g. the Kimi-K2-Thinking
            template). Default: ``chat_template.jinja`` in model_dir, else tokenizer_config's ``chat_template``.
    Returns:
        tokenizer with 163,840 ids, bos ``[BOS]``, eos ``[EOS]``, pad ``[PAD]``, unk ``[UNK]``. Building the merges
        takes a few seconds; the result is cached per process.
    Raises:
        TokenizerLoadError: missing or malformed files.
    """
    from transformers import PreTrainedTokenizerFast

    model_dir = Path(model_dir)
    model_path = model_dir / "tiktoken.model"
    config_path = model_dir / "tokenizer_config.json"
    if not model_path.is_file():
        raise TokenizerLoadError(f"{model_dir}: no tiktoken.model; a Kimi tokenizer needs tiktoken.model and tokenizer_config.json")
    core = _cached_core(str(model_path.resolve()), str(config_path.resolve()))
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    template = None
    if chat_template_path is not None:
        template = Path(chat_template_path).read_text(encoding="utf-8")
    elif (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    else:
        template = config.get("chat_template")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=copy.deepcopy(core),  # the cached core must not see this instance's changes
        bos_token=config.get("bos_token", "[BOS]"),
        eos_token=config.get("eos_token", "[EOS]"),
        unk_token=config.get("unk_token", "[UNK]"),
        pad_token=config.get("pad_token", "[PAD]"),
        additional_special_tokens=config.get("additional_special_tokens"),
        clean_up_tokenization_spaces=False,
        model_max_length=config.get("model_max_length", 1 << 20),
    )
    tok.name_or_path = str(model_dir)
    if template is not None:
        tok.chat_template = template
    return tok
