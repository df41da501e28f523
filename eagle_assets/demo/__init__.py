"""The embedded default target: a tiny Qwen3 trained on seeded synthetic transcripts, shipped in ``target/`` (made
by ``python -m eagle_assets.demo.build --ship`` on CPU in ~3 minutes, the same bytes at any load or thread setting
on one kind of CPU, accepted only when it passes its quality gate).

Public API::

    build_demo_target(cache_root=None, force=False, recipe=None, log=None, workers=None) -> Path  # HF dir by hash
    DemoTargetRejected                                                     # the gate failed (message: what to do)
    demo_target() -> Path ; DemoTargetStale                                # the shipped target, checked first
    demo_target_path(cache_root=None, recipe=None) -> Path                         # where it lives; builds nothing
    recipe_hash(recipe=None) -> str ; DemoRecipe ; default_cache_root() -> Path
    generate_samples(kind, n, seed) -> list[DemoSample] ; KINDS ; completion_text(sample) -> str
    write_raw_samples(out_dir=None) -> list[Path]                                  # catalogs/demo_data/*

Kinds and partitions: tool -> B1_glaive, code -> B2_opencodeinstruct, math -> B4_mixturethoughts,
reasoning -> B5_openthoughts. CLIs: ``python -m eagle_assets.demo.build``, ``python -m eagle_assets.demo.raw_samples``,
``python -m eagle_assets.demo.evaluate``.

Modules, lowest first: ``transcripts`` and ``tokenizer`` (the synthetic data and its BPE), ``recipe`` (settings and
hash), ``shipped`` (the committed target, checked against the recipe), ``rows`` (encoded training rows and the step
plan), ``gate`` (the quality gate), ``trainer`` (one training worker), ``build`` (the cached, locked build),
``raw_samples`` and ``evaluate`` (CLIs).
"""

import importlib
from typing import Any

# Attribute -> defining submodule. Resolved lazily so that importing the package (or running one of its modules
# with ``python -m``) does not import torch/transformers or the other submodules first.
_EXPORTS = {
    "DemoRecipe": "recipe",
    "DemoTargetRejected": "build",
    "DemoTargetStale": "shipped",
    "demo_target": "shipped",
    "build_demo_target": "build",
    "default_cache_root": "recipe",
    "demo_target_path": "recipe",
    "recipe_hash": "recipe",
    "write_raw_samples": "raw_samples",
    "KINDS": "transcripts",
    "DemoSample": "transcripts",
    "completion_text": "transcripts",
    "generate_samples": "transcripts",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"eagle_assets.demo.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'eagle_assets.demo' has no attribute {name!r}")
