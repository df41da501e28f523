"""The dataset catalog: one YAML file that defines the target, the server, the partitions and training settings.

Shape (see catalogs/default.yaml)::

    target:   {model: demo | <local model dir> | <hub id in the local cache>, profile: {overrides}}
    server:   {url: null | str | [str], launch: embedded | sglang, concurrency, timeout_s, api_key_env, extra_args}
    partitions:
      <key>:  {description, sources: [{path, format}], prompt_policy, enable_thinking, sampling: {max_new_tokens,
               temperature, top_p, top_k}, limit, seed, max_prompt_tokens, thresholds: {...}, max_turns,
               tool_result_match, chunks}
    training: {draft_vocab_size, ttt_steps, epochs, train_tokens, lr, schedule, warmup_steps, max_length,
               batch_tokens, seed, save_every_steps, holdout_fraction | holdout_rows, validation_rows,
               eval_every_tokens, patience, min_delta, aux_layer_ids, acceptance..., unseen_eval: {...}, mix: {...},
               features: local | served | {source, url, teacher, top_k, cache, ...}}

Each entry under ``partitions`` is a *dataset*. A dataset is one Dagster partition, or, with ``chunks: N`` (N > 1),
N partitions ``<dataset>.c00`` .. ``<dataset>.c{N-1}`` (:func:`chunk_keys`), each a run of its own over the rows a
keyed hash of the sample id assigns to it (``raw_prompts.write.chunk_of``); :meth:`Catalog.partition` resolves a
partition key of either kind to its spec, so every asset looks a key up the same way.

Relative source paths resolve against the catalog file's directory; ``${VAR}`` and ``${VAR:-default}`` in any
string are expanded from the environment. Validation uses pydantic; every problem is reported as a
:class:`CatalogError` naming the file, the field path and what to do.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

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
CATALOG_ENV = "EAGLE_ASSETS_CATALOG"
_ENV_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class CatalogError(ValueError):
    """An invalid catalog: the message names the file, the field and what to do."""

    def __init__(self, file: str | Path, field: str, problem: str, fix: str = ""):
        self.file = str(file)
        self.field = field
        self.problem = problem
        self.fix = fix
        super().__init__(f"{file}: {field}: {problem}" + (f" -- {fix}" if fix else ""))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TargetSpec(_Strict):
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
            raise ValueError(f"unknown profile override(s) {unknown}; use {sorted(PROFILE_OVERRIDE_KEYS)} (token text or id)")
        return v


class ServerSpec(_Strict):
    """Where generations come from: ``url`` (one SGLang server / sglang-router URL or a list) or, when null, a
    server launched by the pipeline (``launch``: embedded | sglang)."""

    url: str | list[str] | None = None
    launch: Literal["embedded", "sglang"] = "embedded"
    concurrency: int = Field(32, gt=0)
    timeout_s: float = Field(600, gt=0)
    api_key_env: str | None = None
    extra_args: list[str] = Field(default_factory=list)

    @property
    def urls(self) -> list[str]:
        """The configured URLs (empty = launch a server)."""
        if self.url is None:
            return []
        return [self.url] if isinstance(self.url, str) else list(self.url)

    @field_validator("url")
    @classmethod
    def _urls_are_http(cls, v: Any) -> Any:
        for u in [v] if isinstance(v, str) else v or []:
            if not re.match(r"^https?://", u):
                raise ValueError(f"{u!r} is not an http(s) URL (write e.g. http://127.0.0.1:30000)")
        return v


class SamplingSpec(_Strict):
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


class ShareLevels(_Strict):
    """WARN and ERROR levels for one share (fractions 0..1; None = not checked at that level)."""

    warn: float | None = Field(None, ge=0, le=1)
    error: float | None = Field(None, ge=0, le=1)

    @model_validator(mode="after")
    def _warn_below_error(self) -> ShareLevels:
        if self.warn is not None and self.error is not None and self.warn > self.error:
            raise ValueError(f"warn ({self.warn}) is above error ({self.error}); the warning level must not exceed the error level")
        return self


class Thresholds(_Strict):
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
                raise ValueError(f"max_share_{kind}_warn ({warn}) is above max_share_{kind}_error ({err}); the warning level must not exceed the error level")
        return self


class LiveSpec(_Strict):
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


class SourceSpec(_Strict):
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


class PartitionSpec(_Strict):
    """One partition = one source dataset and its generation settings."""

    description: str = ""
    sources: list[SourceSpec] = Field(min_length=1)
    # all_turns: every assistant turn regenerated on-policy (eagle_assets.conversation, docs/multi_turn.md)
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


class BucketCap(_Strict):
    """At most ``max_share`` of the mix's completion tokens may come from rows with fewer than ``below_tokens``
    completion tokens."""

    below_tokens: int = Field(gt=0)
    max_share: float = Field(ge=0, le=1)


class MixSpec(_Strict):
    """The ``training_mix`` asset: which QC rows the drafter trains on (see ``drafter.mix``).

    ``mode``: "balanced" (per-partition weights and length-bucket caps) or "concat" (rows of every partition in
    catalog order until the budget is spent: the unbalanced baseline). ``token_budget``: completion (loss) tokens
    of the mix; null = every training row's tokens. ``weights``: relative token share per partition key (missing
    keys weigh 1.0). ``bucket_caps``: caps on the share of tokens from short rows. ``seed``: row order.
    ``turn_weights``: {turn index: weight} for ``all_turns`` partitions (``drafter.turn_mix``).
    """

    mode: Literal["balanced", "concat"] = "balanced"
    token_budget: int | None = Field(None, gt=0)
    weights: dict[str, float] = Field(default_factory=dict)
    bucket_caps: list[BucketCap] = Field(default_factory=list)
    seed: int = 0
    # all_turns partitions: a partition's share split between its turn indexes by these weights (unlisted = 1.0)
    turn_weights: dict[int, float] = Field(default_factory=dict)

    @field_validator("weights", "turn_weights")
    @classmethod
    def _non_negative(cls, v: dict[str, float]) -> dict[str, float]:
        bad = {k: w for k, w in v.items() if w < 0}
        if bad:
            raise ValueError(f"weights must be >= 0 (got {bad}); 0 leaves a partition out of the mix")
        return v


class UnseenEvalSpec(_Strict):
    """Prompts from a source the drafter never trains on, for a second acceptance figure.

    The ``drafter_checkpoint`` asset renders them with the target's chat template (as ``tokenized_prompts`` does),
    generates greedily with the local target (``max_new_tokens`` each, stopping at the target's stop ids) and
    simulates chain drafting on the result; the generations are cached beside the checkpoint.
    """

    description: str = ""
    sources: list[SourceSpec] = Field(min_length=1)
    prompt_policy: Literal["last_user", "first_user"] = "last_user"
    enable_thinking: bool | None = None
    max_new_tokens: int = Field(256, gt=0)
    limit: int | None = Field(32, gt=0)
    max_prompt_tokens: int | None = Field(2048, gt=0)

    def resolved_sources(self, catalog_file: Path | None) -> list[tuple[Path, str]]:
        """``[(absolute path, canonical format name)]``; relative paths resolve against ``catalog_file``'s directory.

        Raises:
            CatalogError: a source file does not exist.
        """
        out = []
        base = Path(catalog_file).parent if catalog_file is not None else Path(".")
        for i, src in enumerate(self.sources):
            p = Path(src.path).expanduser()
            p = (p if p.is_absolute() else base / p).resolve()
            if not p.is_file():
                raise CatalogError(
                    catalog_file or "<catalog>", f"training.unseen_eval.sources[{i}].path",
                    f"file {p} does not exist",
                    "fix the path (relative paths resolve against the catalog file's directory) or remove unseen_eval",
                )
            out.append((p, resolve_format(src.format)))
        return out


class FeaturesSpec(_Strict):
    """``training.features``: where the drafter's target features (aux hidden states, teacher) come from.

    ``local`` (the default) runs the target with transformers in the trainer's process
    (``eagle_assets.drafter.feature_cache``); ``served`` fetches them from an SGLang server in aux-capture mode
    (``eagle_assets.drafter.served_features``; docs/served_features.md). ``features: served`` is short for
    ``features: {source: served}``.

    Fields (``served`` only):
        url: server(s) in aux-capture mode; null = the pipeline's ``sglang`` resource (its ``server.url``, or a
            server it launches with the capture flags).
        teacher: ``hard`` (the row's own next token) | ``topk`` (the target's top-``top_k`` logprobs, renormalized
            over the draft vocab; with ``top_k`` >= the vocab size it is the local teacher).
        cache: ``disk`` (verified shards under ``cache_dir``, reused across runs) | ``memory`` | ``none`` (fetched
            for every batch when trained on). cache_dir: null = beside the checkpoint.
        storage_dtype: ``auto`` (bfloat16 when lossless) | ``bfloat16`` | ``float32``; shard_mb: aux bytes
            (float32-equivalent) per shard.
        concurrency: requests in flight per server; timeout_s / max_attempts: per HTTP attempt / attempts per row
            (connection errors, timeouts, 5xx and unusable replies are retried); api_key_env: the server's key.
    """

    source: Literal["local", "served"] = "local"
    url: str | list[str] | None = None
    teacher: Literal["hard", "topk"] = "hard"
    top_k: int = Field(20, gt=0)
    cache: Literal["disk", "memory", "none"] = "disk"
    cache_dir: str | None = None
    storage_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    shard_mb: float = Field(512, gt=0)
    concurrency: int = Field(4, gt=0)
    timeout_s: float = Field(600.0, gt=0)
    max_attempts: int = Field(4, gt=0)
    api_key_env: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        return {"source": v} if isinstance(v, str) else v

    @field_validator("url")
    @classmethod
    def _urls_are_http(cls, v: Any) -> Any:
        return ServerSpec._urls_are_http(v)

    @property
    def urls(self) -> list[str]:
        """The configured URLs (empty = the pipeline's server resource)."""
        if self.url is None:
            return []
        return [self.url] if isinstance(self.url, str) else list(self.url)


class TrainingSpec(_Strict):
    """Drafter training settings (EAGLE-3 defaults: 7 TTT steps, 32k draft vocab).

    The run length is ``train_tokens`` capped at ``epochs`` passes (see ``eagle_assets.drafter.recipe``, which also
    gives recommended values per target class). Held-out rows (``assets.training.row_splits``): per partition a
    ``holdout_fraction`` share by keyed hash, at most ``holdout_rows``, never trained on; ``validation_rows`` of them
    give the learning curve and early stopping, the rest are the ``acceptance_length`` check's test rows.
    """

    draft_vocab_size: int = Field(32000, gt=0)
    ttt_steps: int = Field(7, gt=0)
    epochs: float | None = Field(10, gt=0)  # at most this many passes (null = no cap)
    train_tokens: int | None = Field(None, gt=0)  # at most this many row tokens through the optimizer (null = no cap)
    lr: float = Field(1.0e-4, gt=0)
    max_length: int = Field(2048, gt=0)
    batch_tokens: int = Field(16384, gt=0)
    seed: int = 0
    holdout_fraction: float = Field(0.1, ge=0, lt=1)  # share of each partition never trained on (keyed hash)
    holdout_rows: int | None = Field(None, ge=0)  # at most this many held-out rows per partition (null = no cap)
    validation_rows: int = Field(0, ge=0)  # of the held-out rows per partition: these steer training (at most half)
    eval_every_tokens: int = Field(0, ge=0)  # learning-curve points every this many training tokens (0 = end only)
    patience: int = Field(0, ge=0)  # early stop after this many points without a val-tau gain of min_delta (0 = off)
    min_delta: float = Field(0.0, ge=0)
    aux_layer_ids: list[int] | None = None
    # Acceptance-length check: simulated chain drafting of acceptance_k tokens (SGLang --speculative-num-steps).
    acceptance_k: int = Field(7, gt=0)
    acceptance_max_positions: int | None = Field(None, gt=0)  # verification points per partition (null = all rows)
    min_tau_margin: float = Field(0.05, ge=0)  # ERROR when mean held-out tau <= 1 + margin
    tau_warn: float = Field(1.5, ge=1)  # WARN under this mean held-out tau
    unseen_eval: UnseenEvalSpec | None = None
    warmup_steps: int | None = Field(None, ge=0)  # linear warm-up steps; null = 5% of all steps, 0 = none
    schedule: Literal["cosine", "constant"] = "cosine"  # learning rate after warm-up
    # Resumable training: a state (weights, AdamW moments, position) every this many steps and at each epoch end.
    save_every_steps: int = Field(50, ge=0)
    # torch CPU threads for training and the acceptance simulations (null = torch's default: every core). A drafter
    # as small as the demo's runs its many small ops fastest on one thread, and two threads on two busy cores stall
    # each other at every op.
    threads: int | None = Field(None, gt=0)
    # How drafter_checkpoint runs the trainer: inline (in the step's process) or torchrun (the training command in
    # nproc_per_node data-parallel processes, through Dagster Pipes; eagle_assets.drafter.train_command). The weights
    # do not depend on it (up to float rounding: eagle_assets.drafter.distributed).
    launcher: Literal["inline", "torchrun"] = "inline"
    nproc_per_node: int = Field(1, gt=0)
    mix: MixSpec = Field(default_factory=MixSpec)
    features: FeaturesSpec = Field(default_factory=FeaturesSpec)  # local | served (docs/served_features.md)

    @field_validator("aux_layer_ids")
    @classmethod
    def _three_layers(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (len(v) != 3 or any(i < 0 for i in v)):
            raise ValueError("aux_layer_ids must be null (SGLang default [2, L//2, L-3]) or three non-negative layer ids")
        return v

    @model_validator(mode="after")
    def _run_length(self) -> TrainingSpec:
        if self.epochs is None and self.train_tokens is None:
            raise ValueError("set training.epochs or training.train_tokens (or both: the run stops at the first)")
        return self


class Catalog(_Strict):
    """A validated catalog. Build with :func:`load_catalog`."""

    target: TargetSpec = Field(default_factory=TargetSpec)
    server: ServerSpec = Field(default_factory=ServerSpec)
    partitions: dict[str, PartitionSpec] = Field(min_length=1)
    training: TrainingSpec = Field(default_factory=TrainingSpec)

    _path: Path | None = PrivateAttr(default=None)

    @field_validator("partitions")
    @classmethod
    def _keys(cls, v: dict[str, PartitionSpec]) -> dict[str, PartitionSpec]:
        for key in v:
            if not PARTITION_KEY_RE.match(key):
                raise ValueError(f"partition key {key!r} must match {PARTITION_KEY_RE.pattern} (letters, digits, '_' and '-'; no path separators or dots)")
        return v

    @model_validator(mode="after")
    def _mix_weights_name_partitions(self) -> Catalog:
        unknown = sorted(set(self.training.mix.weights) - set(self.partitions))
        if unknown:
            raise ValueError(f"training.mix.weights names unknown partition(s) {unknown}; "
                             f"known partitions: {list(self.partitions)}")
        return self

    @property
    def path(self) -> Path | None:
        """The catalog file this was loaded from."""
        return self._path

    @property
    def dataset_keys(self) -> list[str]:
        """Dataset keys (the entries under ``partitions``) in file order."""
        return list(self.partitions)

    @property
    def partition_keys(self) -> list[str]:
        """Dagster partition keys in file order: a dataset's key, or its chunk keys when it has ``chunks`` > 1."""
        return [k for d in self.partitions for k in self.dataset_partition_keys(d)]

    @property
    def chunked_datasets(self) -> list[str]:
        """The datasets split into more than one chunk, in file order."""
        return [d for d, spec in self.partitions.items() if spec.chunks > 1]

    def dataset_partition_keys(self, dataset: str) -> list[str]:
        """The partition keys of one dataset: ``[dataset]`` or its chunk keys; raises CatalogError for an unknown
        dataset."""
        if dataset not in self.partitions:
            raise CatalogError(self._path or "<catalog>", f"partitions.{dataset}", "no such dataset",
                               f"known datasets: {self.dataset_keys}")
        chunks = self.partitions[dataset].chunks
        return chunk_keys(dataset, chunks) if chunks > 1 else [dataset]

    def resolve(self, key: str) -> tuple[str, int | None, int]:
        """``(dataset key, chunk index or None, chunk count)`` of a partition key (``<dataset>`` or
        ``<dataset>.cNN``). Raises CatalogError naming the known partition keys for an unknown dataset, a chunk
        index out of range or not padded as :func:`chunk_keys` writes it, the bare key of a chunked dataset (its
        partitions are its chunks) and a chunk key of a dataset that is not chunked."""
        known = self.partition_keys
        shown = known if len(known) <= 20 else [*known[:20], f"... ({len(known)} in all)"]
        where = self._path or "<catalog>"
        match = CHUNK_KEY_RE.match(key) if isinstance(key, str) else None
        dataset = match.group("dataset") if match else key
        if dataset not in self.partitions:
            raise CatalogError(where, f"partitions.{dataset}", "no such partition", f"known partitions: {shown}")
        chunks = self.partitions[dataset].chunks
        if match is None:
            if chunks > 1:
                raise CatalogError(where, f"partitions.{dataset}", f"dataset {dataset} is split into {chunks} chunks: "
                                   "a run takes one chunk",
                                   f"use its chunk keys {chunk_keys(dataset, chunks)[0]} .. "
                                   f"{chunk_keys(dataset, chunks)[-1]}")
            return dataset, None, 1
        if key not in chunk_keys(dataset, chunks) or chunks == 1:
            raise CatalogError(where, f"partitions.{dataset}", f"no chunk {key!r}: {dataset} has "
                               + (f"{chunks} chunks" if chunks > 1 else "no chunks (chunks: 1)"),
                               f"known partitions: {shown}")
        return dataset, int(match.group("index")), chunks

    def partition(self, key: str) -> PartitionSpec:
        """The spec of one partition key (a dataset's or a chunk's, see :meth:`resolve`): for a chunk, a copy of
        its dataset's spec whose ``key`` is the chunk key and ``chunk`` its index. Raises CatalogError listing the
        known keys."""
        dataset, chunk, _ = self.resolve(key)
        spec = self.partitions[dataset]
        if chunk is None:
            return spec
        copy = spec.model_copy()
        copy._key, copy._dataset, copy._chunk = key, dataset, chunk
        return copy


def chunk_keys(dataset: str, chunks: int) -> list[str]:
    """The partition keys of a dataset split into ``chunks`` chunks: ``<dataset>.c<i>``, ``i`` zero-padded to two
    digits or the width of ``chunks - 1`` if wider (8 chunks: ``.c00`` .. ``.c07``; 200: ``.c000`` .. ``.c199``), so
    they sort in chunk order."""
    width = max(2, len(str(chunks - 1)))
    return [f"{dataset}.c{i:0{width}d}" for i in range(chunks)]


def _expand_env(value: Any, where: str, file: Path) -> Any:
    if isinstance(value, dict):
        return {k: _expand_env(v, f"{where}.{k}" if where else str(k), file) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand_env(v, f"{where}[{i}]", file) for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        name, default = m.group(1), m.group(2)
        if name in os.environ:
            return os.environ[name]
        if default is not None:
            return default
        raise CatalogError(file, where, f"environment variable {name} is not set", f"export {name}=... or write ${{{name}:-default}}")

    return _ENV_RE.sub(sub, value)


_FIXES = {
    "max_new_tokens": "set sampling.max_new_tokens explicitly (SGLang silently generates at most 128 tokens when it is missing)",
    "sources": "list at least one {path: ..., format: ...}",
    "sampling": "add a sampling block with at least max_new_tokens",
    "partitions": "define at least one partition under 'partitions:'",
}


def _field_path(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts[-1:] = [f"{parts[-1]}[{item}]"] if parts else [f"[{item}]"]
        elif str(item) in ("str", "list[str]") or str(item).startswith("function-after["):
            continue  # pydantic union/validator branch labels, not fields
        else:
            parts.append(str(item))
    return ".".join(parts) or "<top level>"


def _all_field_names() -> set[str]:
    names: set[str] = set()
    for model in (TargetSpec, ServerSpec, SamplingSpec, Thresholds, ShareLevels, LiveSpec, SourceSpec, PartitionSpec,
                  BucketCap, MixSpec, FeaturesSpec, TrainingSpec, Catalog):
        names.update(model.model_fields)
    return names


def _catalog_error(file: Path, err: ValidationError) -> CatalogError:
    # An unknown key usually explains a "missing" one next to it (a typo), so report unknown keys first.
    errors = sorted(err.errors(), key=lambda e: e["type"] != "extra_forbidden")
    first = errors[0]
    loc = tuple(first["loc"])
    field = _field_path(loc)
    last = next((str(x) for x in reversed(loc) if not isinstance(x, int)), "")
    kind = first["type"]
    if kind == "missing":
        problem = "is required but missing"
    elif kind == "extra_forbidden":
        problem = "is not a known field (typo?)"
    else:
        problem = first["msg"].removeprefix("Value error, ")
        if "input" in first and not isinstance(first["input"], (dict, list)):
            problem += f" (got {first['input']!r})"
    fix = _FIXES.get(last, "")
    if kind == "extra_forbidden":
        close = difflib.get_close_matches(last, sorted(_all_field_names()), n=1)
        fix = (f"did you mean {close[0]!r}? " if close else "") + "remove it or fix its spelling; see catalogs/default.yaml for the accepted fields"
    more = len(errors) - 1
    if more:
        fix = (fix + "; " if fix else "") + f"{more} more problem(s) after this one"
    return CatalogError(file, field, problem, fix)


def load_catalog(path: str | Path) -> Catalog:
    """Read, expand and validate a catalog YAML file.

    Raises:
        CatalogError: missing/unreadable file, invalid YAML, unset environment variable, or a schema violation;
            the message names the file, the field path (e.g. ``partitions.B1_glaive.sampling.max_new_tokens``)
            and what to do.
    """
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise CatalogError(file, "<file>", "catalog file does not exist", f"create it or point ${CATALOG_ENV} at an existing catalog")
    try:
        raw = yaml.safe_load(file.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "<yaml>"
        raise CatalogError(file, where, f"invalid YAML ({getattr(e, 'problem', e)})", "fix the YAML syntax") from None
    if not isinstance(raw, dict):
        raise CatalogError(file, "<top level>", f"expected a mapping with target/server/partitions/training, got {type(raw).__name__}", "see catalogs/default.yaml")
    raw = _expand_env(raw, "", file)
    try:
        catalog = Catalog.model_validate(raw)
    except ValidationError as e:
        raise _catalog_error(file, e) from None
    catalog._path = file
    for key, spec in catalog.partitions.items():
        spec._base_dir = file.parent
        spec._key = key
        spec._dataset = key
        spec._catalog_file = file
    return catalog


def repo_root() -> Path:
    """The repository checkout this package lives in (catalogs/ sits at its top level)."""
    return Path(__file__).resolve().parents[1]


def default_catalog_path() -> Path:
    """``$EAGLE_ASSETS_CATALOG`` if set, else ``<repo>/catalogs/default.yaml``."""
    env = os.environ.get(CATALOG_ENV)
    return Path(env).expanduser() if env else repo_root() / "catalogs" / "default.yaml"
