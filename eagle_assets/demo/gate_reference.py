"""Gate verdicts recorded for exact weights, so a build that reproduces those bytes need not regenerate them.

The demo build is deterministic (:mod:`eagle_assets.demo.trainer`): a recipe gives the same ``model.safetensors``
bytes on one kind of machine, at any load (another CPU can give other bytes: one entry per kind measured). The gate's verdict is a function of those bytes and of the gate's
own inputs (the prompt ids, the caps, the malformed-share levels, the tokenizer, the decoder's source and the torch/transformers
versions). So when a fresh build's weights hash to the sha256 of a build whose gate was run for real, and the gate
inputs hash to the same digest, that build has passed (or failed) the gate already: the figures are taken from the
reference, and the greedy replies (about a minute of both cores, two on a loaded machine) are not regenerated.
Any other build (another machine's numerics, another recipe, an edited decoder) runs the gate itself.

``gate_reference.json`` (shipped in this package) maps ``weights_sha256`` to::

    {"gate_inputs_sha256": str, "gate": {...recipe.json's gate, with "reply_sha256": [sha256 of each reply's
     int32 little-endian ids, gate prompt order]...}, "recorded": {"torch", "transformers", "recipe_hash", "at"}}

Record (or refresh) it after a recipe or decoder change with
``python -m eagle_assets.demo.build --record-gate-reference``: that builds the target if needed and records the
verdict its build generated (``--regate`` generates every reply again first, in worker processes as the build
does). ``test_demo_target.py`` regenerates some replies of the session's
target and checks them against the recorded digests.
"""

from __future__ import annotations

import hashlib
import json
import time
from importlib import metadata, resources
from pathlib import Path
from typing import Any

REFERENCE_FILE = "gate_reference.json"
# Sources whose code decides the gate's replies or verdicts (besides the weights and the prompts).
_GATE_SOURCES = (("eagle_assets.demo", "gate.py"), ("eagle_assets.serving", "engine.py"))


def default_reference_path() -> Path:
    """The reference file shipped in the package."""
    return Path(str(resources.files("eagle_assets.demo").joinpath(REFERENCE_FILE)))


def gate_inputs_digest(tokenizer, prompts: list[list[int]], caps: list[int], drop_levels: dict[str, float]) -> str:
    """sha256 (hex) of everything besides the weights that decides the gate's outcome: the prompt ids and caps in
    order, the malformed-share level per partition (``gate.default_catalog_drop_levels``), the tokenizer's
    vocabulary, the decoder's and the checker's source files and the torch and transformers versions."""
    h = hashlib.sha256()
    h.update(json.dumps({"prompts": prompts, "caps": caps, "drop_levels": sorted(drop_levels.items()),
                         "vocab": sorted(tokenizer.get_vocab().items()),
                         "torch": metadata.version("torch"), "transformers": metadata.version("transformers")},
                        separators=(",", ":")).encode())
    for package, name in _GATE_SOURCES:
        h.update(name.encode() + b"\x00" + resources.files(package).joinpath(name).read_bytes() + b"\x00")
    return h.hexdigest()


def reply_digest(output_ids: list[int]) -> str:
    """sha256 (hex) of one reply's ids as int32 little-endian bytes."""
    import array
    import sys

    buf = array.array("i", output_ids)
    if sys.byteorder != "little":
        buf.byteswap()
    return hashlib.sha256(buf.tobytes()).hexdigest()


def load_references(path: Path | None = None) -> dict[str, Any]:
    """``{weights_sha256: entry}``; empty when the file is absent or unreadable (then every build gates itself)."""
    try:
        data = json.loads(Path(path or default_reference_path()).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def matching_reference(references: dict[str, Any], weights_sha256: str, inputs_sha256: str) -> dict[str, Any] | None:
    """The entry recorded for these exact weights and gate inputs, or None."""
    entry = references.get(weights_sha256)
    if isinstance(entry, dict) and entry.get("gate_inputs_sha256") == inputs_sha256 and "gate" in entry:
        return entry
    return None


def reference_gate(entry: dict[str, Any], weights_sha256: str) -> dict[str, Any]:
    """recipe.json's ``gate`` for a build verified against ``entry``: the recorded figures, plus ``verified_by``
    saying where they came from."""
    return {**entry["gate"], "verified_by": {"weights_sha256": weights_sha256, **entry.get("recorded", {}),
                                             "how": "weights and gate inputs equal a build whose gate ran; "
                                                    "replies not regenerated"}}


def record(path: Path, weights_sha256: str, gate: dict[str, Any], recipe_hash: str) -> dict[str, Any]:
    """Add (or replace) the entry for ``weights_sha256`` in ``path``; returns it. ``gate`` is recipe.json's gate of
    a build (or a regeneration) that generated its replies: it carries ``inputs_sha256`` and ``reply_sha256``.

    Raises:
        ValueError: ``gate`` was itself taken from a reference, or lacks the digests.
    """
    if "verified_by" in gate or "inputs_sha256" not in gate or "reply_sha256" not in gate:
        raise ValueError("a reference must be recorded from a gate whose replies were generated (with its "
                         "inputs_sha256 and reply_sha256), not from one taken from a reference")
    references = load_references(path)
    entry = {"gate_inputs_sha256": gate["inputs_sha256"], "gate": gate,
             "recorded": {"torch": metadata.version("torch"), "transformers": metadata.version("transformers"),
                          "recipe_hash": recipe_hash, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}}
    references[weights_sha256] = entry
    Path(path).write_text(json.dumps(references, indent=1, sort_keys=True) + "\n")
    return entry
