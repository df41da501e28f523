"""The dataset catalog: one YAML file that defines the target, the server, the partitions and training settings.

Shape (see catalogs/default.yaml)::

    target:   {model: demo | <local model dir> | <hub id in the local cache>, profile: {overrides}}
    server:   {url: null | str | [str], launch: embedded | sglang, concurrency, timeout_s, api_key_env,
               max_reply_bytes, extra_args}
    partitions:
      <key>:  {description, sources: [{path, format}], prompt_policy, enable_thinking, sampling: {max_new_tokens,
               temperature, top_p, top_k}, limit, seed, max_prompt_tokens, thresholds: {...}, max_turns,
               tool_result_match, chunks}
    training: {draft_vocab_size, ttt_steps, epochs, train_tokens, lr, schedule, warmup_steps, max_length,
               batch_tokens, seed, save_every_steps, holdout_fraction | holdout_rows, validation_rows,
               eval_every_tokens, patience, min_delta, aux_layer_ids, acceptance..., mix: {...},
               features: local | served | {source, url, teacher, top_k, cache, ...}}
    evaluation: {k: [1..8], heldout, position_buckets, bootstrap, suites: {<name>: {description, sources, thinking:
               on | off | both | default, sampling, limit, max_turns, thresholds, tau_warn, min_tau_margin}}}
    (left out: the defaults, held-out rows and no suites, unless features are served; ``null``: none
    (``load.with_default_evaluation``). A legacy ``training.unseen_eval`` becomes the suite ``unseen``:
    ``load.unseen_eval_as_suite``)

Each entry under ``partitions`` is a *dataset*. A dataset is one Dagster partition, or, with ``chunks: N`` (N > 1),
N partitions ``<dataset>.c00`` .. ``<dataset>.c{N-1}`` (:func:`chunk_keys`), each a run of its own over the rows a
keyed hash of the sample id assigns to it (``raw_prompts.write.chunk_of``); :meth:`Catalog.partition` resolves a
partition key of either kind to its spec, so every asset looks a key up the same way.

Each evaluation suite is one more partition, ``eval-<suite>`` (:func:`suite_partition_key`), never trained on:
:attr:`Catalog.partition_keys` holds the training datasets' keys then the suites', and
:attr:`Catalog.training_partition_keys` the former only.

Relative source paths resolve against the catalog file's directory; ``${VAR}`` and ``${VAR:-default}`` in any
string are expanded from the environment. Validation uses pydantic; every problem is reported as a
:class:`CatalogError` naming the file, the field path and what to do.

Modules: :mod:`~eagle_assets.catalog.base` (the error, the strict model), :mod:`~eagle_assets.catalog.partitions`
(target, server, partitions, chunk keys), :mod:`~eagle_assets.catalog.training` (the ``training`` section),
:mod:`~eagle_assets.catalog.evaluation` (the ``evaluation`` section),
:mod:`~eagle_assets.catalog.load` (the whole :class:`Catalog` and :func:`load_catalog`); their public names are
importable from here.
"""

from __future__ import annotations

from eagle_assets.catalog.base import CatalogError, StrictModel
from eagle_assets.catalog.evaluation import SUITE_PREFIX, EvaluationSpec, SuiteSpec, suite_partition_key
from eagle_assets.catalog.load import CATALOG_ENV, Catalog, default_catalog_path, load_catalog, repo_root
from eagle_assets.catalog.partitions import (
    CHUNK_KEY_RE,
    MAX_CHUNKS,
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
from eagle_assets.catalog.training import BucketCap, DrafterSpec, FeaturesSpec, MixSpec, TrainingSpec, UnseenEvalSpec

__all__ = [
    "CATALOG_ENV", "CHUNK_KEY_RE", "MAX_CHUNKS", "PARTITION_KEY_RE", "SUITE_PREFIX", "BucketCap", "Catalog",
    "CatalogError", "DrafterSpec", "EvaluationSpec", "FeaturesSpec", "LiveSpec", "MixSpec", "PartitionSpec",
    "SamplingSpec", "ServerSpec", "ShareLevels", "SourceSpec", "StrictModel", "SuiteSpec", "TargetSpec", "Thresholds",
    "TrainingSpec", "UnseenEvalSpec", "chunk_keys", "default_catalog_path", "load_catalog", "repo_root",
    "suite_partition_key",
]
