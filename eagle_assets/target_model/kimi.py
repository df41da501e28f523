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

Replaying the merges takes ~4 CPU seconds, in every process that loads the tokenizer (each Dagster run step, each
test worker). The built core is therefore also kept on disk as a ``tokenizers`` JSON file (~5 MB, ~0.7 s to load),
named by the sha256 of ``tiktoken.model``, the special tokens, this module's build rules (:data:`CORE_FORMAT`) and the
``tokenizers`` version, in ``$EAGLE_ASSETS_TOKENIZER_CACHE`` (default ``$XDG_CACHE_HOME/eagle-assets/kimi-tokenizer``,
``~/.cache`` when unset; ``off`` disables it). A cache that cannot be written is skipped; one that cannot be read is
rebuilt.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from eagle_assets.storage.shards import atomic_file
from eagle_assets.target_model.tokenizer_errors import TokenizerLoadError

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
# Bump when _build_core changes what it builds: cached cores of an older format are then never read.
CORE_FORMAT = 1
CACHE_ENV = "EAGLE_ASSETS_TOKENIZER_CACHE"

log = logging.getLogger(__name__)


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte -> printable-character table used by every byte-level BPE.
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def read_tiktoken_ranks(path: Path, text: str | None = None) -> dict[bytes, int]:
    """``tiktoken.model`` (or its ``text``, already read) -> {token bytes: rank}; raises TokenizerLoadError on a
    malformed line or sparse ranks."""
    ranks: dict[bytes, int] = {}
    if text is None:
        text = path.read_text(encoding="ascii")
    for lineno, line in enumerate(text.splitlines()):
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
            raise TokenizerLoadError(f"tiktoken rank {rank} ({tok!r}) is not reachable by merging two lower-ranked "
                                     "tokens; not a BPE vocabulary")
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


def core_cache_dir() -> Path | None:
    """Where built cores are kept (module docstring); None when ``$EAGLE_ASSETS_TOKENIZER_CACHE`` is ``off``."""
    env = os.environ.get(CACHE_ENV)
    if env is not None and env.strip().lower() == "off":
        return None
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "eagle-assets" / "kimi-tokenizer"


def _specials(config: dict, n: int) -> list[tuple[str, bool]]:
    named = {int(k): v for k, v in (config.get("added_tokens_decoder") or {}).items()}
    out = []
    for idx in range(n, n + NUM_RESERVED_SPECIAL_TOKENS):
        entry = named.get(idx)
        out.append((entry["content"], bool(entry.get("special", True))) if entry
                   else (f"<|reserved_token_{idx}|>", True))
    return out


def _specials_misplaced(core: Any, n: int, specials: list[tuple[str, bool]]) -> tuple[str, int | None, int] | None:
    """(text, id it got, id it should have) of the first special token off its id, else None."""
    for idx, (text, _) in zip(range(n, n + NUM_RESERVED_SPECIAL_TOKENS), specials):
        if core.token_to_id(text) != idx:
            return text, core.token_to_id(text), idx
    return None


def _read_cached_core(path: Path, n: int, specials: list[tuple[str, bool]]) -> Any | None:
    from tokenizers import Tokenizer

    try:
        core = Tokenizer.from_file(str(path))
    except FileNotFoundError:
        return None
    except Exception as e:  # a damaged file: rebuilt and replaced by the caller
        log.warning("cached Kimi tokenizer %s is unreadable (%s); rebuilding it", path, e)
        return None
    if core.get_vocab_size(with_added_tokens=True) != n + NUM_RESERVED_SPECIAL_TOKENS or \
            _specials_misplaced(core, n, specials) is not None:
        log.warning("cached Kimi tokenizer %s does not match its tiktoken.model; rebuilding it", path)
        return None
    return core


def _write_cached_core(path: Path, core: Any) -> None:
    try:
        with atomic_file(path) as tmp:
            Path(tmp).write_text(core.to_str(), encoding="utf-8")
            os.chmod(tmp, 0o644)  # mkstemp makes it 0600; a cache shared by several users must stay readable
    except OSError as e:
        log.info("not caching the Kimi tokenizer at %s (%s); set %s to a writable directory", path, e, CACHE_ENV)


@functools.lru_cache(maxsize=4)
def _cached_core(model_path: str, config_path: str) -> Any:
    """The core for these files: from this process's memory, else the disk cache, else built (and cached)."""
    try:
        raw = Path(model_path).read_bytes()
        text = raw.decode("ascii")
    except UnicodeDecodeError as e:
        raise TokenizerLoadError(f"{model_path}: not ASCII ({e}); not a tiktoken BPE file") from None
    config = json.loads(Path(config_path).read_text()) if Path(config_path).is_file() else {}
    n = sum(1 for line in text.splitlines() if line.strip())
    specials = _specials(config, n)
    cache_dir = core_cache_dir()
    cache_file = None
    if cache_dir is not None:
        import tokenizers

        # The tokenizers version is in the key too: a file is only ever read by the library that wrote it.
        key = hashlib.sha256(json.dumps({"format": CORE_FORMAT, "pat": KIMI_PAT_STR, "specials": specials,
                                         "tokenizers": tokenizers.__version__}, sort_keys=True).encode()
                             + b"\0" + raw).hexdigest()
        cache_file = cache_dir / f"{key[:32]}.json"
        core = _read_cached_core(cache_file, n, specials)
        if core is not None:
            return core
    ranks = read_tiktoken_ranks(Path(model_path), text)
    core = _build_core(ranks, specials)
    misplaced = _specials_misplaced(core, len(ranks), specials)
    if misplaced is not None:
        token, got, want = misplaced
        raise TokenizerLoadError(f"{model_path}: special token {token!r} landed on id {got}, expected {want}")
    if cache_file is not None:
        _write_cached_core(cache_file, core)
    return core


def load_kimi_tokenizer(model_dir: str | Path, chat_template_path: str | Path | None = None) -> Any:
    """Build a ``PreTrainedTokenizerFast`` for a Kimi-K2/K2.5 model directory.

    Args:
        model_dir: directory with ``tiktoken.model`` and ``tokenizer_config.json``.
        chat_template_path: a jinja chat template (Kimi-K2.5's tokenizer dir has none; e.g. the Kimi-K2-Thinking
            template). Default: ``chat_template.jinja`` in model_dir, else tokenizer_config's ``chat_template``.
    Returns:
        tokenizer with 163,840 ids, bos ``[BOS]``, eos ``[EOS]``, pad ``[PAD]``, unk ``[UNK]``. Building the merges
        takes a few seconds; the result is cached per process and on disk (module docstring).
    Raises:
        TokenizerLoadError: missing or malformed files.
    """
    from transformers import PreTrainedTokenizerFast

    model_dir = Path(model_dir)
    model_path = model_dir / "tiktoken.model"
    config_path = model_dir / "tokenizer_config.json"
    if not model_path.is_file():
        raise TokenizerLoadError(f"{model_dir}: no tiktoken.model; a Kimi tokenizer needs tiktoken.model and "
                                 "tokenizer_config.json")
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
        # PreTrainedTokenizerFast deep-copies tokenizer_object itself (transformers 5.24,
        # tokenization_utils_tokenizers.py), so this instance's changes never reach the cached core; a second copy
        # here cost ~0.9 s a load (test_target_kimi checks that the instance does not share the core).
        tokenizer_object=core,
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
