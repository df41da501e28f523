"""Versions of everything an asset's output depends on: the inputs it reads outside the asset graph (data versions
of the observable source assets in ``assets.inputs``) and its own code (code versions).

Dagster marks an asset partition *unsynced* (stale) when its code version differs from the one recorded by its
latest materialization, or when the data version of one of its dependencies differs from the one recorded as its
input (``dagster/input_data_version/<dep>`` tags; ``CachingStaleStatusResolver`` in
``dagster/_core/definitions/data_version.py``). A code version is one value per asset, not per partition, so the
per-partition catalog entries (a partition's sampling, thresholds, ...) enter as the data versions of partitioned
observable source assets; the target's tokenizer and weights, and the training settings, as unpartitioned ones.

Each ``*_version`` function below returns an :class:`InputVersion`: a sha256 over a canonical JSON of the facts that
change the asset's output and nothing else (e.g. ``sampling_settings`` holds the partition's ``sampling`` block;
``live`` thresholds, ``description`` and server URLs are not in any version, since they do not change a row).
The observation functions, the ``inputs_sensor`` and ``generations``' shard reuse check call these functions, so one
fact has one source.

Code versions (:data:`CODE_VERSIONS`) are the version of each asset's own logic: bump an asset's entry when the same
inputs would now give different rows (a changed render rule, a new QC drop reason), never for refactors.

Data versions of materializations: the partitioned assets (``raw_prompts``, ``tokenized_prompts``, ``generations``,
``qc_shards``) report the sha256 of their files (:func:`directory_content_version`, which says why); the others get
Dagster's default, a hash of the code version and the input data versions (``compute_logical_data_version``). Either
way, re-materializing unchanged inputs leaves everything downstream in sync.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle_assets.catalog import Catalog, PartitionSpec

# The version of each asset's own code; see the module docstring for when to bump one.
CODE_VERSIONS: dict[str, str] = {
    "raw_prompts": "2",
    "tokenized_prompts": "1",
    "generations": "2",
    "qc_shards": "1",
    "length_report": "1",
    "dataset_qc": "1",
    "draft_vocab": "1",
    "training_mix": "1",
    "drafter_checkpoint": "1",
    "evaluation": "1",
    "speculators_export": "1",
    "specforge_export": "1",
}

# Files beside a model that decide its tokenization, chat template and stop ids (``target_model.profile`` reads the
# eos ids of generation_config.json and config.json).
TOKENIZER_FILE_PREFIXES = ("tokenizer", "chat_template", "special_tokens_map", "added_tokens", "vocab", "merges",
                           "tiktoken", "generation_config", "config.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_CHUNK = 1 << 20


def canonical_digest(facts: Any) -> str:
    """sha256 hex of ``facts`` as canonical JSON (sorted keys, no whitespace; non-JSON values via ``str``)."""
    body = json.dumps(facts, sort_keys=True, separators=(",", ":"), default=str, ensure_ascii=False)
    return hashlib.sha256(body.encode()).hexdigest()


def file_sha256(path: Path) -> str:
    """sha256 hex of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class InputVersion:
    """The data version of one observable source asset (partition).

    ``key``: the source asset's name (``assets.inputs``); ``partition``: the partition key, None for an
    unpartitioned input; ``data_version``: sha256 hex of ``facts``; ``facts``: what went into it (JSON-able), shown
    as the observation's metadata; ``problem``: set when a source file cannot be read: the version is then not
    reported by the sensor, and an observation in a run fails with this text.
    """

    key: str
    partition: str | None
    data_version: str
    facts: dict
    problem: str | None = None


def _version(key: str, partition: str | None, facts: dict, problem: str | None = None) -> InputVersion:
    return InputVersion(key, partition, canonical_digest(facts), facts, problem)


@dataclass
class SourceDigest:
    """Content digest of one partition's source files.

    ``digest``: sha256 hex over (resolved path, format, file sha256) of every source in catalog order; None when a
    source is missing. ``files``: per-file cache entries ``{path: [size, mtime_ns, sha256]}``. ``newest_mtime``:
    newest source mtime in seconds (epoch). ``missing``: sources that do not exist or cannot be read.
    """

    digest: str | None
    sources: list[str]
    files: dict[str, list] = field(default_factory=dict)
    newest_mtime: float = 0.0
    missing: list[str] = field(default_factory=list)


def partition_source_digest(spec: PartitionSpec, cache: dict[str, list] | None = None) -> SourceDigest:
    """Hash a partition's resolved source files; files whose (size, mtime_ns) match ``cache`` are not re-read.

    Never raises for a missing or unreadable file: it is listed in ``missing`` and ``digest`` is None.
    """
    cache = cache or {}
    resolved = spec.resolved_sources(check_exists=False)
    outer = hashlib.sha256()
    files: dict[str, list] = {}
    missing: list[str] = []
    newest = 0.0
    for path, fmt in resolved:
        key = str(path)
        try:
            st = path.stat()
            if not path.is_file():
                raise IsADirectoryError(f"{key} is not a file")
            hit = cache.get(key)
            sha = hit[2] if hit and hit[0] == st.st_size and hit[1] == st.st_mtime_ns else file_sha256(path)
        except OSError:  # absent, unreadable or not a file: reported, never raised
            missing.append(key)
            continue
        files[key] = [st.st_size, st.st_mtime_ns, sha]
        newest = max(newest, st.st_mtime)
        outer.update(f"{key}\0{fmt}\0{sha}\n".encode())
    return SourceDigest(digest=None if missing else outer.hexdigest(), sources=[str(p) for p, _ in resolved],
                        files=files, newest_mtime=newest, missing=missing)


def source_files_version(spec: PartitionSpec,
                         cache: dict[str, list] | None = None) -> tuple[InputVersion, SourceDigest]:
    """``source_files[<partition>]``: the content of the partition's source files and the record selection that
    ``raw_prompts`` applies to them (``prompt_policy``, ``limit``, ``seed``; for a chunk, its index and count).
    Returns the version and the digest (whose ``files`` the sensor keeps in its cursor)."""
    digest = partition_source_digest(spec, cache)
    facts = {"sources_sha256": digest.digest, "sources": digest.sources, "prompt_policy": spec.prompt_policy,
             "limit": spec.limit, "seed": spec.seed}
    if spec.chunk is not None:  # which slice of the dataset (a chunk key is reused when the chunk count changes)
        facts["chunk"] = [spec.chunk, spec.chunks]
    problem = (f"source file(s) of partition {spec.key} missing or unreadable: {digest.missing}; fix the path in the "
               "catalog or restore the file") if digest.missing else None
    return _version("source_files", spec.key, facts, problem), digest


def render_settings_version(spec: PartitionSpec) -> InputVersion:
    """``render_settings[<partition>]``: what ``tokenized_prompts`` passes to the chat template besides the messages."""
    return _version("render_settings", spec.key,
                    {"enable_thinking": spec.enable_thinking, "max_prompt_tokens": spec.max_prompt_tokens})


def sampling_settings_version(spec: PartitionSpec) -> InputVersion:
    """``sampling_settings[<partition>]``: the partition's SGLang sampling params (``generations``)."""
    return _version("sampling_settings", spec.key, {"sampling": spec.sampling.model_dump(mode="json")})


def qc_settings_version(spec: PartitionSpec) -> InputVersion:
    """``qc_settings[<partition>]``: the thresholds and the tool-call rule ``qc_shards`` applies."""
    return _version("qc_settings", spec.key, {"thresholds": spec.thresholds.model_dump(mode="json"),
                                              "tool_call_in_reasoning": spec.tool_call_in_reasoning})


def target_location(model: str) -> tuple[Path | None, str | None]:
    """``(model directory, demo recipe hash)`` of a catalog ``target.model``, checking nothing.

    ``demo`` gives the shipped embedded target's directory and its recipe hash, which fixes every file of it; a local
    directory gives ``(path, None)``; anything else (a hub id) gives ``(None, None)``.
    """
    if model == "demo":
        from eagle_assets.demo.recipe import recipe_hash
        from eagle_assets.demo.shipped import shipped_dir

        return shipped_dir(), recipe_hash()
    path = Path(model).expanduser()
    return (path if path.is_dir() else None), None


def _tokenizer_files(model_dir: Path) -> dict[str, str]:
    return {p.name: file_sha256(p) for p in sorted(model_dir.iterdir())
            if p.is_file() and p.name.startswith(TOKENIZER_FILE_PREFIXES) and not p.name.endswith(WEIGHT_SUFFIXES)}


def target_tokenizer_version(catalog: Catalog) -> InputVersion:
    """``target_tokenizer``: the target's tokenizer files (chat template included: ``chat_template.jinja`` or the
    ``chat_template`` field of tokenizer_config.json), the eos ids of generation_config.json / config.json, and the
    catalog's ``target.profile`` overrides. Feeds ``tokenized_prompts`` and ``qc_shards``."""
    model = catalog.target.model
    model_dir, recipe = target_location(model)
    facts: dict[str, Any] = {"model": model, "profile_overrides": catalog.target.profile}
    if recipe is not None:
        facts["demo_recipe_sha256"] = recipe
    elif model_dir is not None:
        facts["files_sha256"] = _tokenizer_files(model_dir)
    else:  # a hub id: only its name is known here; a changed download under the same name is not noticed
        facts["note"] = "not a local directory: versioned by name only"
    return _version("target_tokenizer", None, facts)


def _weights_identity(path: Path) -> dict:
    """Name, size and (safetensors) header sha256 of a weight file: the header lists every tensor's name, dtype,
    shape and byte range, so a different checkpoint of the same size still differs; hashing the full weights
    (many GB) on every observation would not be affordable."""
    ident: dict[str, Any] = {"bytes": path.stat().st_size}
    if path.suffix == ".safetensors":
        with open(path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if 0 < n <= 100 * _CHUNK:
                ident["header_sha256"] = hashlib.sha256(fh.read(n)).hexdigest()
    return ident


def target_model_version(catalog: Catalog) -> InputVersion:
    """``target_model``: what is served, i.e. the weights that generate and give the drafter's aux hidden states
    (the model path, config.json, each weight file's identity, the shard index). Feeds ``generations`` and
    ``drafter_checkpoint``.

    How the server was started is not part of it (``server.launch``, ``server.url``, ``server.extra_args``): the
    same weights served by the embedded server, a launched SGLang or a running one behind a URL are the same target,
    and a partition switched from one to another resumes its rows instead of generating them again (a launch flag
    that changes the replies, e.g. another ``--dtype``, is a reason to materialize with ``regenerate: true``)."""
    model = catalog.target.model
    model_dir, recipe = target_location(model)
    facts: dict[str, Any] = {"model": model}
    if recipe is not None:
        facts["demo_recipe_sha256"] = recipe
    elif model_dir is not None:
        files = sorted(p for p in model_dir.iterdir() if p.is_file())
        config = model_dir / "config.json"
        facts["config_sha256"] = file_sha256(config) if config.is_file() else None
        facts["index_sha256"] = {p.name: file_sha256(p) for p in files if p.name.endswith(".index.json")}
        facts["weights"] = {p.name: _weights_identity(p) for p in files if p.name.endswith(WEIGHT_SUFFIXES)}
    else:
        facts["note"] = "not a local directory: versioned by name only"
    return _version("target_model", None, facts)


def training_settings_version(catalog: Catalog) -> InputVersion:
    """``training_settings``: the catalog's ``training`` block (draft vocab, mix, TTT, optimizer, acceptance)."""
    return _version("training_settings", None, {"training": catalog.training.model_dump(mode="json")})


def partition_input_versions(spec: PartitionSpec,
                             cache: dict[str, list] | None = None) -> tuple[list[InputVersion], SourceDigest]:
    """The four partitioned inputs of one partition, and its source digest."""
    source, digest = source_files_version(spec, cache)
    return [source, render_settings_version(spec), sampling_settings_version(spec), qc_settings_version(spec)], digest


def global_input_versions(catalog: Catalog) -> list[InputVersion]:
    """The three unpartitioned inputs."""
    return [target_tokenizer_version(catalog), target_model_version(catalog),
            training_settings_version(catalog)]




def generation_fingerprint(catalog: Catalog, key: str) -> dict:
    """What the rows of a partition's generation shards were generated from, besides the set of prompts: sampling
    params, render settings and prompt policy (they change an existing sample id's prompt ids), the target's
    tokenizer and weights. ``{"sha256": ..., "inputs": {...}}``.

    Shards generated under another fingerprint are not resumed from but generated again (see
    ``generations.staging.generation_inputs_changed``), since the sample ids stay the same when only these change,
    as SpecForge's tokenized cache did before it was keyed by the template (SpecForge commit 1de70d18). Adding or
    removing source records does not change it: new sample ids are generated, the old rows are reused.
    """
    spec = catalog.partition(key)
    inputs = {
        "sampling_settings": sampling_settings_version(spec).data_version,
        "render_settings": render_settings_version(spec).data_version,
        "prompt_policy": spec.prompt_policy,
        "target_tokenizer": target_tokenizer_version(catalog).data_version,
        "target_model": target_model_version(catalog).data_version,
    }
    if spec.prompt_policy == "all_turns":  # which recorded results answer a call changes later turns' prompts
        from eagle_assets.generations.reply import HISTORY_RULES

        inputs["tool_result_match"] = spec.tool_result_match
        inputs["history_rules"] = HISTORY_RULES  # how a reply becomes the history the next turn renders
    return {"sha256": canonical_digest(inputs), "inputs": inputs}


def directory_content_version(directory: Path, patterns: tuple[str, ...]) -> str:
    """sha256 hex over (name, sha256 of bytes) of the files in ``directory`` matching any of ``patterns`` (glob),
    sorted by name: the data version of an asset whose rows are these files.

    Why the partitioned assets carry content versions instead of Dagster's default (a hash of the code version and
    the input data versions): for a partitioned observable dependency that was not observed in the same run,
    Dagster 1.13 records the latest observation of *any* partition as the input data version (the asset record's
    ``last_observation_record``; ``dagster/_core/execution/context/data_version_cache.py``, whose partition lookup
    reads materializations only, "TODO: this needs to account for observations also"), so a default version would
    change when another partition's input was observed. Content versions also keep downstream in sync when a
    changed input leaves the files byte-identical (e.g. a threshold no row is near)."""
    directory = Path(directory)
    paths = sorted({p for pattern in patterns for p in directory.glob(pattern) if p.is_file()})
    return canonical_digest([[p.name, file_sha256(p)] for p in paths])
