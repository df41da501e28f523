"""A whole catalog (:class:`Catalog`) and reading one from YAML: ``${VAR}`` expansion, validation, and each
problem reported as a :class:`~eagle_assets.catalog.base.CatalogError` naming the file, the field path and the fix."""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator

from eagle_assets.catalog.base import CatalogError, StrictModel
from eagle_assets.catalog.evaluation import EvaluationSpec, SuiteSpec, suite_partition_key
from eagle_assets.catalog.partitions import (
    CHUNK_KEY_RE,
    PARTITION_KEY_RE,
    LiveSpec,
    PartitionSpec,
    SamplingSpec,
    ServerSpec,
    ShareLevels,
    SourceSpec,
    TargetSpec,
    Thresholds,
    chunk_keys,
)
from eagle_assets.catalog.training import BucketCap, FeaturesSpec, MixSpec, TrainingSpec

CATALOG_ENV = "EAGLE_ASSETS_CATALOG"
_ENV_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class Catalog(StrictModel):
    """A validated catalog. Build with :func:`load_catalog`."""

    target: TargetSpec = Field(default_factory=TargetSpec)
    server: ServerSpec = Field(default_factory=ServerSpec)
    partitions: dict[str, PartitionSpec] = Field(min_length=1)
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    # None only for an explicit ``evaluation: null`` or a catalog with served features: load_catalog gives every
    # other catalog the default section (with_default_evaluation)
    evaluation: EvaluationSpec | None = None

    _path: Path | None = PrivateAttr(default=None)
    _notes: list[str] = PrivateAttr(default_factory=list)
    _suites: dict[str, PartitionSpec] | None = PrivateAttr(default=None)

    @field_validator("partitions")
    @classmethod
    def _keys(cls, v: dict[str, PartitionSpec]) -> dict[str, PartitionSpec]:
        for key in v:
            if not PARTITION_KEY_RE.match(key):
                raise ValueError(f"partition key {key!r} must match {PARTITION_KEY_RE.pattern} "
                                 "(letters, digits, '_' and '-'; no path separators or dots)")
        return v

    @model_validator(mode="after")
    def _mix_weights_name_partitions(self) -> Catalog:
        unknown = sorted(set(self.training.mix.weights) - set(self.partitions))
        if unknown:
            raise ValueError(f"training.mix.weights names unknown partition(s) {unknown}; "
                             f"known partitions: {list(self.partitions)}")
        return self

    @model_validator(mode="after")
    def _suite_keys_are_free(self) -> Catalog:
        taken = sorted(set(self.suite_keys) & set(self.partitions))
        if taken:
            raise ValueError(f"evaluation suite partition key(s) {taken} are also dataset keys under partitions: "
                             "rename the suite or the dataset")
        return self

    @model_validator(mode="after")
    def _compared_drafters_are_measured(self) -> Catalog:
        if self.training.compare and (self.evaluation is None or self.training.features.source == "served"):
            raise ValueError("training.compare measures each drafter with the evaluation section on the target run "
                             "here: keep an evaluation section (not null) and features: local, or remove "
                             "training.compare")
        return self

    @property
    def path(self) -> Path | None:
        """The catalog file this was loaded from."""
        return self._path

    def short_tokens(self) -> dict[str, int]:
        """Each dataset's ``thresholds.short_tokens`` by dataset key (the ``partition`` column of its QC rows)."""
        return {key: spec.thresholds.short_tokens for key, spec in self.partitions.items()}

    def warnings(self) -> list[str]:
        """Settings that are valid but defeat themselves, one line each with what to change (empty when none):
        a partition whose ``sampling.max_new_tokens`` is below its ``thresholds.short_tokens`` can only produce
        rows the ``response_length`` check counts as short; an API key sent over plain ``http://`` to a host that
        is not this machine (:func:`cleartext_key_urls`)."""
        out = list(self._notes)
        features = self.training.features
        for where, urls, key_env in (("server.url", self.server.urls, self.server.api_key_env),
                                     ("training.features.url", features.urls,
                                      features.api_key_env or self.server.api_key_env)):
            for url in cleartext_key_urls(urls, key_env):
                out.append(f"{where}: {url} is plain http:// to another host, so the API key in ${key_env} crosses "
                           "the network in clear text; use https://, an SSH tunnel or a private network")
        for key, spec in self.partitions.items():
            cap, short = spec.sampling.max_new_tokens, spec.thresholds.short_tokens
            if cap < short:
                out.append(f"partitions.{key}: sampling.max_new_tokens {cap} is below thresholds.short_tokens {short}, "
                           "so every reply counts as short (response_length warns at max_share_short_warn); lower "
                           "thresholds.short_tokens or raise max_new_tokens")
        return out

    @property
    def dataset_keys(self) -> list[str]:
        """Dataset keys (the entries under ``partitions``) in file order."""
        return list(self.partitions)

    @property
    def training_partition_keys(self) -> list[str]:
        """The training datasets' partition keys in file order: a dataset's key, or its chunk keys when it has
        ``chunks`` > 1."""
        return [k for d in self.partitions for k in self.dataset_partition_keys(d)]

    @property
    def suite_keys(self) -> list[str]:
        """The evaluation suites' partition keys (``eval-<suite>``) in file order; never trained on."""
        suites = self.evaluation.suites if self.evaluation is not None else {}
        return [suite_partition_key(name) for name in suites]

    @property
    def partition_keys(self) -> list[str]:
        """Every Dagster partition key: :attr:`training_partition_keys`, then :attr:`suite_keys`."""
        return self.training_partition_keys + self.suite_keys

    def suite_partitions(self) -> dict[str, PartitionSpec]:
        """Suite partition key -> the suite as a partition spec (``SuiteSpec.partition_spec``)."""
        if self._suites is None:
            suites = self.evaluation.suites if self.evaluation is not None else {}
            built = {}
            for name, suite in suites.items():
                spec = suite.partition_spec()
                key = suite_partition_key(name)
                spec._base_dir = self._path.parent if self._path is not None else Path(".")
                spec._key = spec._dataset = key
                spec._catalog_file = self._path
                built[key] = spec
            self._suites = built
        return self._suites

    @property
    def chunked_datasets(self) -> list[str]:
        """The datasets split into more than one chunk, in file order."""
        return [d for d, spec in self.partitions.items() if spec.chunks > 1]

    def dataset_partition_keys(self, dataset: str) -> list[str]:
        """The partition keys of one dataset: ``[dataset]`` or its chunk keys; raises CatalogError for an unknown
        dataset."""
        if dataset in self.suite_keys:
            return [dataset]
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
        if key in self.suite_keys:
            return key, None, 1
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
        if dataset in self.suite_keys:
            return self.suite_partitions()[dataset]
        spec = self.partitions[dataset]
        if chunk is None:
            return spec
        copy = spec.model_copy()
        copy._key, copy._dataset, copy._chunk = key, dataset, chunk
        return copy


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
        raise CatalogError(file, where, f"environment variable {name} is not set",
                           f"export {name}=... or write ${{{name}:-default}}")

    return _ENV_RE.sub(sub, value)


_FIXES = {
    "max_new_tokens": ("set sampling.max_new_tokens explicitly (SGLang silently generates at most 128 tokens when it "
                       "is missing)"),
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
                  BucketCap, MixSpec, FeaturesSpec, TrainingSpec, SuiteSpec, EvaluationSpec, Catalog):
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
        if "compare" in loc[:2] and close == [last]:
            problem = "is a training setting, not a field of a training.compare entry"
            fix = ("an entry takes training.drafter's fields and aux_layer_ids; every other setting is the same for "
                   "all drafters (the recipe the comparison holds fixed): set it under training, or remove it")
        elif close == [last]:
            problem = "is a field of another section, not of this one"
            fix = "move it to its section or remove it; see catalogs/default.yaml for where each field goes"
        else:
            fix = ((f"did you mean {close[0]!r}? " if close else "")
                   + "remove it or fix its spelling; see catalogs/default.yaml for the accepted fields")
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
        raise CatalogError(file, "<file>", "catalog file does not exist",
                           f"create it or point ${CATALOG_ENV} at an existing catalog")
    try:
        raw = yaml.safe_load(file.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "<yaml>"
        raise CatalogError(file, where, f"invalid YAML ({getattr(e, 'problem', e)})", "fix the YAML syntax") from None
    if not isinstance(raw, dict):
        raise CatalogError(file, "<top level>",
                           f"expected a mapping with target/server/partitions/training, got {type(raw).__name__}",
                           "see catalogs/default.yaml")
    raw = _expand_env(raw, "", file)
    raw, note = unseen_eval_as_suite(raw, file)
    raw = with_default_evaluation(raw)
    try:
        catalog = Catalog.model_validate(raw)
    except ValidationError as e:
        raise _catalog_error(file, e) from None
    catalog._path = file
    catalog._notes = [note] if note else []
    for key, spec in catalog.partitions.items():
        spec._base_dir = file.parent
        spec._key = key
        spec._dataset = key
        spec._catalog_file = file
    return catalog


def repo_root() -> Path:
    """The repository checkout this package lives in (catalogs/ sits at its top level)."""
    return Path(__file__).resolve().parents[2]


def default_catalog_path() -> Path:
    """``$EAGLE_ASSETS_CATALOG`` if set, else ``<repo>/catalogs/default.yaml``."""
    env = os.environ.get(CATALOG_ENV)
    return Path(env).expanduser() if env else repo_root() / "catalogs" / "default.yaml"


def cleartext_key_urls(urls: list[str], api_key_env: str | None) -> list[str]:
    """The URLs of ``urls`` that would carry the API key unencrypted off this machine: ``http://`` (or no scheme,
    which the client reads as ``http://``) to a host other than ``localhost`` or a loopback address, when
    ``api_key_env`` is set."""
    import ipaddress
    from urllib.parse import urlsplit

    if not api_key_env:
        return []
    out = []
    for url in urls:
        parts = urlsplit(url.strip() if "://" in url else "http://" + url.strip())
        host = (parts.hostname or "").lower()
        try:
            local = ipaddress.ip_address(host).is_loopback
        except ValueError:
            local = host == "localhost"
        if parts.scheme.lower() == "http" and not local:
            out.append(url)
    return out


def with_default_evaluation(raw: dict) -> dict:
    """``raw`` (a catalog as read) with ``evaluation: {}`` (held-out rows at k = 1..8, no suites:
    ``EvaluationSpec``'s defaults) when it has no ``evaluation`` key, so every catalog gets the ``evaluation``
    asset and its held-out table. Left as it is: an explicit ``evaluation: null`` (no evaluation asset), and a
    catalog whose ``training.features`` is ``served`` (the asset runs the target in its own process, which such a
    catalog says does not fit; its ``acceptance_length`` check measures the held-out rows through the server)."""
    if "evaluation" in raw:
        return raw
    training = raw.get("training") if isinstance(raw.get("training"), dict) else {}
    features = training.get("features")
    if features == "served" or (isinstance(features, dict) and features.get("source") == "served"):
        return raw
    return {**raw, "evaluation": {}}


#: the suite a legacy ``training.unseen_eval`` becomes
UNSEEN_SUITE = "unseen"


def unseen_eval_as_suite(raw: dict, file: Path) -> tuple[dict, str | None]:
    """``raw`` (a catalog as read) with a legacy ``training.unseen_eval`` turned into the evaluation suite
    :data:`UNSEEN_SUITE` (partition ``eval-unseen``), and the note that says so (None when there was none).

    The suite keeps its sources, description, limit and prompt cap; its replies are greedy (``temperature: 0``,
    the old figure's decoding) with ``max_new_tokens``, ``thinking`` from ``enable_thinking`` (null = the template's
    default), and every user turn is answered (suites use ``all_turns``; for one-turn sources the same prompts). A
    suite that already reads the same sources measures them: then the old key is only dropped.

    Raises:
        CatalogError: the legacy spec is invalid, or ``evaluation.suites`` already has a different suite named
            :data:`UNSEEN_SUITE`.
    """
    from eagle_assets.catalog.training import UnseenEvalSpec

    training = raw.get("training")
    if not isinstance(training, dict) or "unseen_eval" not in training:
        return raw, None
    training = dict(training)
    old = training.pop("unseen_eval")
    raw = {**raw, "training": training}
    if old is None:
        return raw, None
    try:
        spec = UnseenEvalSpec.model_validate(old)
    except ValidationError as e:
        inner = _catalog_error(file, e)
        raise CatalogError(file, f"training.unseen_eval.{inner.field}", inner.problem,
                           f"fix it, or better move it under evaluation.suites ({UNSEEN_SUITE}: ...)") from None
    evaluation = dict(raw.get("evaluation") or {})
    suites = dict(evaluation.get("suites") or {})
    sources = [s.model_dump(mode="json") for s in spec.sources]
    same = [name for name, suite in suites.items()
            if isinstance(suite, dict) and [dict(s) for s in suite.get("sources") or []] == sources]
    if same:
        return raw, (f"training.unseen_eval is measured by the evaluation suite {same[0]} (same sources) and was "
                     "dropped: remove it from the catalog")
    if UNSEEN_SUITE in suites:
        raise CatalogError(file, "training.unseen_eval",
                           f"it becomes the evaluation suite {UNSEEN_SUITE!r}, and evaluation.suites already has one",
                           "move training.unseen_eval under evaluation.suites yourself, under another name")
    suite = {"description": spec.description or "prompts from a source the drafter never trains on (was "
                                                  "training.unseen_eval)",
             "sources": sources, "thinking": {True: "on", False: "off", None: "default"}[spec.enable_thinking],
             "sampling": {"max_new_tokens": spec.max_new_tokens, "temperature": 0.0},
             "limit": spec.limit, "max_prompt_tokens": spec.max_prompt_tokens}
    raw["evaluation"] = {**evaluation, "suites": {**suites, UNSEEN_SUITE: suite}}
    return raw, (f"training.unseen_eval is now the evaluation suite {UNSEEN_SUITE!r} (partition "
                 f"eval-{UNSEEN_SUITE}: its prompts go through the same stages as training data and the evaluation "
                 "asset measures them); move it under evaluation.suites to silence this note")
