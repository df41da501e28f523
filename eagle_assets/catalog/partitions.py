"""The catalog's target, server and partitions: what each dataset reads, how it is sampled and the QC levels it is
held to; a dataset with ``chunks: N`` is N partitions (:func:`chunk_keys`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from eagle_assets.catalog.base import CatalogError, StrictModel
from eagle_assets.formats import FormatError, known_formats, resolve_format
from eagle_assets.structure.segment import DROP_REASONS
from eagle_assets.target_model.profile import OVERRIDE_KEYS as PROFILE_OVERRIDE_KEYS

PARTITION_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_\-]*$")
# A chunk's partition key: "<dataset>.c<index>", the index zero-padded (chunk_keys). Dataset keys
# hold no dots (PARTITION_KEY_RE), so the suffix is unambiguous.
CHUNK_KEY_RE = re.compile(r"^(?P<dataset>[A-Za-z0-9][A-Za-z0-9_\-]*)\.c(?P<index>[0-9]+)$")
# Every chunk is a Dagster partition and a run; past a thousand the UI's partition bar and a backfill's bookkeeping
# grow for no gain (a chunk of a 5M-row dataset at 1,000 chunks is already 5k rows).
MAX_CHUNKS = 1000


def check_http_urls(v: Any) -> Any:
    """``v`` (a URL, a list of them or None) unchanged when every URL is http(s); raises ValueError otherwise."""
    for u in [v] if isinstance(v, str) else v or []:
        if not re.match(r"^https?://", u):
            raise ValueError(f"{u!r} is not an http(s) URL (write e.g. http://127.0.0.1:30000)")
    return v


class TargetSpec(StrictModel):
    """The target model. ``model``: "demo" (the embedded tiny target, built on demand), a local model dir, or a
    hub id already in the local Hugging Face cache. ``profile``: FamilyProfile overrides (see target.profile)."""

    model: str = "demo"
    profile: dict[str, Any] = Field(default_factory=dict)

    @property
    def is_demo(self) -> bool:
        return self.model == "demo"

    @field_validator("profile")
    @classmethod
    def _override_keys(cls, v: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(v) - set(PROFILE_OVERRIDE_KEYS))
        if unknown:
            raise ValueError(f"unknown profile override(s) {unknown}; use {sorted(PROFILE_OVERRIDE_KEYS)} "
                             "(token text or id)")
        return v


class ServerSpec(StrictModel):
    """Where generations come from: ``url`` (one SGLang server / sglang-router URL or a list) or, when null, a
    server launched by the pipeline (``launch``: embedded | sglang). For ``launch: sglang``: ``device`` (auto = CPU
    when torch sees no CUDA device; on CPU SGLang's CPU engine, ``serving.launch.cpu_server_args``) and ``python``
    (the interpreter of an environment with SGLang; null = the pipeline's own). ``max_reply_bytes``: the most bytes
    one ``/generate`` reply may have (an int >= 1); null (default) = derived per request from its ``max_new_tokens``
    (``serving.client.generate_reply_cap``: 1 MiB + 512 bytes per token, far above a genuine reply); a larger reply
    is one ``reply_too_large`` failure instead of a process that runs out of memory."""

    url: str | list[str] | None = None
    launch: Literal["embedded", "sglang"] = "embedded"
    concurrency: int = Field(32, gt=0)
    timeout_s: float = Field(600, gt=0)
    api_key_env: str | None = None
    max_reply_bytes: int | None = None
    extra_args: list[str] = Field(default_factory=list)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    python: str | None = None

    @property
    def urls(self) -> list[str]:
        """The configured URLs (empty = launch a server)."""
        if self.url is None:
            return []
        return [self.url] if isinstance(self.url, str) else list(self.url)

    @field_validator("url")
    @classmethod
    def _urls_are_http(cls, v: Any) -> Any:
        return check_http_urls(v)

    @field_validator("max_reply_bytes", mode="before")
    @classmethod
    def _reply_cap(cls, v: Any) -> Any:
        # before pydantic's coercion: "64MiB", 1.5e6 or true must not pass as some number of bytes; digits from a
        # ${VAR} expansion (a string) are a number, as for the other int fields
        if isinstance(v, str) and v.strip().isdigit():
            v = int(v)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError("must be a whole number of bytes >= 1 (e.g. 67108864 for 64 MiB), or null to derive "
                             "the cap from each request's max_new_tokens (1 MiB + 512 bytes per token)")
        return v


class SamplingSpec(StrictModel):
    """SGLang sampling params. ``max_new_tokens`` is required: SGLang silently uses 128 when it is absent."""

    max_new_tokens: int = Field(gt=0)
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0, le=1)

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError("top_k must be -1 (disabled) or a positive number")
        return v


class ShareLevels(StrictModel):
    """WARN and ERROR levels for one share (fractions 0..1; None = not checked at that level)."""

    warn: float | None = Field(None, ge=0, le=1)
    error: float | None = Field(None, ge=0, le=1)

    @model_validator(mode="after")
    def _warn_below_error(self) -> ShareLevels:
        if self.warn is not None and self.error is not None and self.warn > self.error:
            raise ValueError(f"warn ({self.warn}) is above error ({self.error}); "
                             "the warning level must not exceed the error level")
        return self


class Thresholds(StrictModel):
    """Length and structure gates of a partition (token counts of the completion; shares are fractions 0..1).

    ``max_share_by_reason`` sets WARN / ERROR levels for single drop reasons (names from
    ``structure.segment.DROP_REASONS``), e.g. ``{missing_think_end: {warn: 0.02, error: 0.1}}``, on top of the total
    ``max_share_dropped_*`` levels.
    """

    short_tokens: int = Field(300, gt=0)
    min_median_tokens: int = Field(20, ge=0)
    max_share_short_warn: float = Field(0.9, ge=0, le=1)
    max_share_short_error: float = Field(1.0, ge=0, le=1)
    max_share_truncated_warn: float = Field(0.02, ge=0, le=1)
    max_share_truncated_error: float = Field(0.1, ge=0, le=1)
    max_share_dropped_warn: float = Field(0.05, ge=0, le=1)
    max_share_dropped_error: float = Field(0.2, ge=0, le=1)
    max_share_by_reason: dict[str, ShareLevels] = Field(default_factory=dict)

    @field_validator("max_share_by_reason")
    @classmethod
    def _known_reasons(cls, v: dict[str, ShareLevels]) -> dict[str, ShareLevels]:
        unknown = sorted(set(v) - set(DROP_REASONS))
        if unknown:
            raise ValueError(f"unknown drop reason(s) {unknown}; use names from {list(DROP_REASONS)}")
        return v

    @model_validator(mode="after")
    def _warn_below_error(self) -> Thresholds:
        for kind in ("short", "truncated", "dropped"):
            warn, err = getattr(self, f"max_share_{kind}_warn"), getattr(self, f"max_share_{kind}_error")
            if warn > err:
                raise ValueError(f"max_share_{kind}_warn ({warn}) is above max_share_{kind}_error ({err}); "
                                 "the warning level must not exceed the error level")
        return self


class LiveSpec(StrictModel):
    """Live quality monitoring while a partition generates (see ``qc.live``).

    After ``warmup_rows`` generated rows, the running figures are compared with the partition's ``thresholds``
    every ``report_every_rows`` rows: a WARN-level breach is logged with example sample ids; an ERROR-level
    structural breach (share dropped, or a per-reason ERROR level) stops the partition when ``fail_fast`` is set,
    keeping every row already generated. The stats reach the Dagster log at most every ``log_every_s`` seconds and
    ``live_stats.json`` beside the shards at every report.
    """

    warmup_rows: int = Field(50, gt=0)
    report_every_rows: int = Field(25, gt=0)
    log_every_s: float = Field(30.0, gt=0)
    fail_fast: bool = True
    example_ids: int = Field(3, ge=0)


class SourceSpec(StrictModel):
    """One source file and its raw layout (a name from eagle_assets.formats.known_formats())."""

    path: str
    format: str = "auto"

    @field_validator("format")
    @classmethod
    def _known(cls, v: str) -> str:
        try:
            resolve_format(v)
        except FormatError:
            raise ValueError(f"unknown format {v!r}; use one of {known_formats()}") from None
        return v


class PartitionSpec(StrictModel):
    """One partition = one source dataset and its generation settings."""

    description: str = ""
    sources: list[SourceSpec] = Field(min_length=1)
    # all_turns: every assistant turn regenerated on-policy (eagle_assets.generations.rollout, docs/multi_turn.md)
    prompt_policy: Literal["last_user", "first_user", "all_turns"] = "last_user"
    # "both" (all_turns only): every conversation generated twice, thinking on and thinking off
    enable_thinking: bool | Literal["both"] | None = None
    # A tool call inside the reasoning block: "drop" the row, or "keep" it and count it as a flag.
    tool_call_in_reasoning: Literal["drop", "keep"] = "drop"
    # all_turns: replies per conversation at most; a model call answered by the dataset's recorded result when it
    # names the same function with the same arguments ("arguments") or the same function only ("name")
    max_turns: int = Field(8, gt=0)
    tool_result_match: Literal["arguments", "name"] = "arguments"
    # N > 1: the dataset runs as N partitions <key>.c00 .. (a keyed hash of the sample id picks each row's chunk)
    chunks: int = Field(1, ge=1, le=MAX_CHUNKS)
    sampling: SamplingSpec
    limit: int | None = Field(None, gt=0)
    seed: int = 0
    max_prompt_tokens: int | None = Field(2048, gt=0)
    thresholds: Thresholds = Field(default_factory=Thresholds)
    live: LiveSpec = Field(default_factory=LiveSpec)

    _base_dir: Path = PrivateAttr(default=Path("."))
    _key: str = PrivateAttr(default="")
    _dataset: str = PrivateAttr(default="")
    _chunk: int | None = PrivateAttr(default=None)
    _catalog_file: Path | None = PrivateAttr(default=None)

    @property
    def key(self) -> str:
        """The Dagster partition key: the dataset key, or a chunk's ``<dataset>.cNN``."""
        return self._key

    @property
    def dataset(self) -> str:
        """The catalog key of the dataset this partition belongs to (its sample ids are keyed by it)."""
        return self._dataset or self._key

    @property
    def chunk(self) -> int | None:
        """The chunk index of this partition (0 .. ``chunks`` - 1), None for a dataset that is not chunked."""
        return self._chunk

    @model_validator(mode="after")
    def _both_needs_all_turns(self) -> "PartitionSpec":
        if self.enable_thinking == "both" and self.prompt_policy != "all_turns":
            raise ValueError("enable_thinking 'both' generates every conversation twice and needs prompt_policy "
                             "all_turns (its rows carry the mode); set prompt_policy: all_turns, or true / false")
        return self

    def resolved_sources(self, check_exists: bool = True) -> list[tuple[Path, str]]:
        """``[(absolute path, canonical format name)]``; relative paths resolve against the catalog's directory.

        Raises:
            CatalogError: a source file does not exist (when check_exists).
        """
        out = []
        for i, src in enumerate(self.sources):
            p = Path(src.path).expanduser()
            p = (p if p.is_absolute() else self._base_dir / p).resolve()
            if check_exists and not p.is_file():
                raise CatalogError(
                    self._catalog_file or "<catalog>",
                    f"partitions.{self._key}.sources[{i}].path",
                    f"file {p} does not exist",
                    "fix the path (relative paths resolve against the catalog file's directory) or create the file",
                )
            out.append((p, resolve_format(src.format)))
        return out


def chunk_keys(dataset: str, chunks: int) -> list[str]:
    """The partition keys of a dataset split into ``chunks`` chunks: ``<dataset>.c<i>``, ``i`` zero-padded to two
    digits or the width of ``chunks - 1`` if wider (8 chunks: ``.c00`` .. ``.c07``; 200: ``.c000`` .. ``.c199``), so
    they sort in chunk order."""
    width = max(2, len(str(chunks - 1)))
    return [f"{dataset}.c{i:0{width}d}" for i in range(chunks)]
