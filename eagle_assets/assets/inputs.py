"""Observable source assets for what the pipeline reads outside its asset graph, and the wiring that makes each
asset depend on exactly the inputs that change its rows.

Partitioned (one per catalog partition, observed together by ``partition_inputs``):

``source_files``       source files (content sha256), record selection   -> ``raw_prompts``
``render_settings``    ``enable_thinking``, ``max_prompt_tokens``          -> ``tokenized_prompts``
``sampling_settings``  the ``sampling`` block                             -> ``generations``
``qc_settings``        ``thresholds``, ``tool_call_in_reasoning``         -> ``qc_shards``

Unpartitioned (observed together by ``global_inputs``):

``target_tokenizer``   tokenizer files, chat template, eos ids, profile   -> ``tokenized_prompts``, ``qc_shards``
``target_model``       config, weight files, launch settings              -> ``generations``, ``drafter_checkpoint``
``training_settings``  the ``training`` block     -> ``draft_vocab``, ``training_mix``, ``drafter_checkpoint``

Their data versions come from ``lineage.versions``. They are observed at the start of every ``partition_job`` and
``training_job`` run (the jobs select them), by the ``inputs_sensor`` between runs, and by "Observe sources" in
the UI. A new data version marks the dependent asset partitions unsynced in the UI, and the automation sensor
(``assets.automation``) materializes them when it is on.
"""

from __future__ import annotations

import warnings

import dagster as dg

from eagle_assets.lineage.versions import (
    CODE_VERSIONS,
    InputVersion,
    global_input_versions,
    partition_input_versions,
)

SOURCE_FILES = "source_files"
RENDER_SETTINGS = "render_settings"
SAMPLING_SETTINGS = "sampling_settings"
QC_SETTINGS = "qc_settings"
TARGET_TOKENIZER = "target_tokenizer"
TARGET_MODEL = "target_model"
TRAINING_SETTINGS = "training_settings"
PARTITION_INPUTS = (SOURCE_FILES, RENDER_SETTINGS, SAMPLING_SETTINGS, QC_SETTINGS)
GLOBAL_INPUTS = (TARGET_TOKENIZER, TARGET_MODEL, TRAINING_SETTINGS)
INPUTS_GROUP = "inputs"
PARTITION_INPUTS_OP = "partition_inputs"
GLOBAL_INPUTS_OP = "global_inputs"

# The inputs each asset reads besides its upstream assets (the catalog fields it reads: see lineage.versions).
INPUTS_OF: dict[str, tuple[str, ...]] = {
    "raw_prompts": (SOURCE_FILES,),
    "tokenized_prompts": (RENDER_SETTINGS, TARGET_TOKENIZER),
    "generations": (SAMPLING_SETTINGS, TARGET_MODEL),
    "qc_shards": (QC_SETTINGS, TARGET_TOKENIZER),
    "draft_vocab": (TRAINING_SETTINGS,),
    "training_mix": (TRAINING_SETTINGS,),
    "drafter_checkpoint": (TRAINING_SETTINGS, TARGET_MODEL),
    "evaluation": (TRAINING_SETTINGS, TARGET_MODEL),
}
_DESCRIPTIONS = {
    SOURCE_FILES: "A partition's source files (sha256 of their bytes) and record selection (prompt_policy, limit, "
                  "seed).",
    RENDER_SETTINGS: "A partition's chat-template settings: enable_thinking, max_prompt_tokens.",
    SAMPLING_SETTINGS: "A partition's SGLang sampling params.",
    QC_SETTINGS: "A partition's QC thresholds and tool_call_in_reasoning rule.",
    TARGET_TOKENIZER: "The target's tokenizer files and chat template, eos ids and profile overrides.",
    TARGET_MODEL: "The target's config and weight files: what is served, whichever way the server was started.",
    TRAINING_SETTINGS: "The catalog's training block.",
}


def observe_result(version: InputVersion) -> dg.ObserveResult:
    """The ``ObserveResult`` of one input version; raises ``dg.Failure`` when the input cannot be read."""
    if version.problem:
        raise dg.Failure(description=version.problem, allow_retries=False)
    return dg.ObserveResult(
        asset_key=version.key,
        data_version=dg.DataVersion(version.data_version),
        metadata={"inputs": dg.MetadataValue.json(version.facts)},
    )


def observation_event(version: InputVersion) -> dg.AssetObservation:
    """The runless ``AssetObservation`` the ``inputs_sensor`` reports for a changed input version."""
    from dagster._core.definitions.data_version import DATA_VERSION_TAG

    return dg.AssetObservation(
        asset_key=version.key, partition=version.partition, tags={DATA_VERSION_TAG: version.data_version},
        metadata={"inputs": dg.MetadataValue.json(version.facts)},
    )


# Op tags of the assets a job starts with besides its observation steps (raw_prompts, draft_vocab, training_mix):
# Dagster's asset jobs wire no step dependency from an observable source asset to the assets that read it, and the
# executors start ready steps by their ``dagster/priority`` tag, then in plan order (alphabetical among the roots:
# training_job ran draft_vocab before global_inputs, so a first run's materialization recorded no training_settings
# version and showed Unsynced once the observation landed). One below the default, so the observations run first
# (in the in-process executor, before; in parallel executors they are launched first).
AFTER_OBSERVATIONS = {"dagster/priority": "-1"}


def build_input_assets(partitions_def: dg.PartitionsDefinition) -> list:
    """``partition_inputs`` (the four partitioned inputs) and ``global_inputs`` (the three unpartitioned ones)."""
    # multi_observable_source_asset is beta in Dagster 1.13; the pinned release is what the tests here exercise.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dg.BetaWarning)
        return _build_input_assets(partitions_def)


def _build_input_assets(partitions_def: dg.PartitionsDefinition) -> list:

    @dg.multi_observable_source_asset(
        name=PARTITION_INPUTS_OP,
        specs=[dg.AssetSpec(k, group_name=INPUTS_GROUP, description=_DESCRIPTIONS[k]) for k in PARTITION_INPUTS],
        partitions_def=partitions_def,
        required_resource_keys={"settings"},
        description="Data versions of one partition's catalog entry and source files.",
    )
    def partition_inputs(context):
        spec = context.resources.settings.catalog().partition(context.partition_key)
        versions, _digest = partition_input_versions(spec)
        for version in versions:
            yield observe_result(version)

    @dg.multi_observable_source_asset(
        name=GLOBAL_INPUTS_OP,
        specs=[dg.AssetSpec(k, group_name=INPUTS_GROUP, description=_DESCRIPTIONS[k], skippable=True)
               for k in GLOBAL_INPUTS],
        can_subset=True,
        required_resource_keys={"settings", "target"},
        description="Data versions of the target's files and of the catalog's training block.",
    )
    def global_inputs(context):
        catalog = context.resources.settings.catalog()
        selected = {k.to_user_string() for k in context.selected_asset_keys}
        for version in global_input_versions(catalog):
            if version.key in selected:
                yield observe_result(version)

    return [partition_inputs, global_inputs]


def with_inputs_and_versions(asset: dg.AssetsDefinition,
                             conditions: dict[str, dg.AutomationCondition] | None = None) -> dg.AssetsDefinition:
    """``asset`` with its input dependencies (:data:`INPUTS_OF`), its code version (``CODE_VERSIONS``) and its
    automation condition (``conditions``, by asset name) added to its specs."""
    conditions = conditions or {}

    def add(spec: dg.AssetSpec) -> dg.AssetSpec:
        name = spec.key.to_user_string()
        known = {d.asset_key for d in spec.deps}
        extra = [dg.AssetDep(k) for k in INPUTS_OF.get(name, ()) if dg.AssetKey(k) not in known]
        return spec.replace_attributes(
            deps=[*spec.deps, *extra],
            code_version=CODE_VERSIONS.get(name, spec.code_version),
            automation_condition=conditions.get(name, spec.automation_condition),
        )

    return asset.map_asset_specs(add)
