"""The default demo target really writes the reply structure on prompts from the committed demo files.

Uses conftest's session-scoped ``demo_target`` (default cache $EAGLE_ASSETS_HOME/demo-target, else
<cwd>/.eagle_assets/demo-target): the first run on a machine builds it (a few minutes on 2 cores), once.
"""

from __future__ import annotations

import json

import pytest

from eagle_assets.demo.gate import GATE_MIN_STRUCTURE_RATE, default_catalog_caps
from eagle_assets.demo.raw_samples import N_RECORDS, turn_samples
from eagle_assets.demo.transcripts import KINDS, TURN_KINDS

pytestmark = pytest.mark.slow(seconds=30)  # minutes more when the target is not cached yet


def test_the_build_gate_passed_on_every_committed_prompt(demo_target):
    gate = json.loads((demo_target / "recipe.json").read_text())["gate"]
    assert gate is not None and gate["failures"] == []
    caps = default_catalog_caps()
    later = turn_samples()
    for kind in KINDS + TURN_KINDS:
        r = gate["report"][kind]
        n = N_RECORDS if kind in KINDS else sum(s.kind == kind for s in later)
        assert r["n"] == n and r["ok"] >= GATE_MIN_STRUCTURE_RATE * r["n"], (kind, r)
        assert r["at_cap"] == 0 and r["max_tokens"] < caps[kind], (kind, r)


def test_structure_and_lengths_on_demo_prompts(demo_target, one_thread):
    """Generated again here, independently of the build, on the first prompts of each kind: the structure and
    lengths hold, and every reply is, token for token, the one the gate recorded for these weights (in
    ``demo/gate_reference.json`` when the build took that verdict instead of regenerating all 276 replies, else in
    the build's own ``recipe.json``)."""
    from transformers import AutoTokenizer

    from eagle_assets.demo import gate_reference
    from eagle_assets.demo.recipe import DemoRecipe
    from eagle_assets.demo.gate import select_gate_set
    from eagle_assets.demo.gate import generate_replies, summarize_replies
    from eagle_assets.serving.engine import load_causal_lm

    meta = json.loads((demo_target / "recipe.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(demo_target)
    samples, prompts, caps = select_gate_set(tokenizer, DemoRecipe())
    gate = meta["gate"]
    if "verified_by" in gate:  # the build took a recorded verdict: it must be for these bytes and these inputs
        entry = gate_reference.load_references().get(meta["weights_sha256"])
        assert entry is not None and entry["gate_inputs_sha256"] == gate_reference.gate_inputs_digest(
            tokenizer, prompts, caps, GATE_MIN_STRUCTURE_RATE), entry
        recorded = entry["gate"]["reply_sha256"]
    else:
        # This build ran its gate (a machine whose numerics give other bytes, or gate inputs changed since the
        # verdict was recorded: `python -m eagle_assets.demo.build --record-gate-reference` records a new one).
        recorded = gate["reply_sha256"]
    assert gate["failures"] == [] and len(recorded) == len(samples)
    picks = [i for kind in KINDS + TURN_KINDS for i in [j for j, s in enumerate(samples) if s.kind == kind][:3]]
    replies = generate_replies(load_causal_lm(str(demo_target), dtype="auto"), tokenizer,
                               [prompts[i] for i in picks], [caps[i] for i in picks])
    assert [gate_reference.reply_digest(r) for r in replies] == [recorded[i] for i in picks]
    report = summarize_replies([samples[i] for i in picks], replies, tokenizer, default_catalog_caps())
    assert all(report[k]["ok"] == 3 and report[k]["at_cap"] == 0 for k in KINDS + TURN_KINDS), report
    median = {k: report[k]["median_tokens"] for k in KINDS}
    assert median["tool"] < 100 < 200 < min(median["math"], median["reasoning"]), median
    assert median["tool"] < median["code"] < max(median["math"], median["reasoning"]), median
