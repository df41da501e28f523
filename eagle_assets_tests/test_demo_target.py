"""The default demo target really writes the reply structure on prompts from the committed demo files.

Uses conftest's session-scoped ``demo_target`` (default cache $EAGLE_ASSETS_HOME/demo-target, else
<cwd>/.eagle_assets/demo-target): the first run on a machine builds it (a few minutes on 2 cores), once.
"""

from __future__ import annotations

import json

import pytest

from eagle_assets.demo.gate import default_catalog_caps, default_catalog_drop_levels
from eagle_assets.demo.raw_samples import N_RECORDS, turn_samples
from eagle_assets.demo.transcripts import KINDS, PARTITION_KIND, TURN_KINDS

pytestmark = pytest.mark.slow(seconds=30)  # minutes more when the target is not cached yet


def test_the_build_gate_passed_on_every_committed_prompt(demo_target):
    gate = json.loads((demo_target / "recipe.json").read_text())["gate"]
    assert gate is not None and gate["failures"] == []
    caps = default_catalog_caps()
    levels = default_catalog_drop_levels()
    assert gate["drop_levels"] == levels and set(levels) == set(KINDS)
    later = turn_samples()
    malformed = dict.fromkeys(KINDS, 0)
    replies = dict.fromkeys(KINDS, 0)
    for kind in KINDS + TURN_KINDS:
        r = gate["report"][kind]
        n = N_RECORDS if kind in KINDS else sum(s.kind == kind for s in later)
        assert r["n"] == n and r["at_cap"] == 0 and r["max_tokens"] < caps[kind], (kind, r)
        assert r["n"] - r["ok"] == sum(r["failures"].values()), (kind, r)
        malformed[PARTITION_KIND[kind]] += r["n"] - r["ok"]
        replies[PARTITION_KIND[kind]] += r["n"]
    # Each default-catalog partition's malformed share stays within the QC's own warn level for it.
    assert all(malformed[k] <= levels[k] * replies[k] for k in KINDS), (malformed, replies, levels)


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
            tokenizer, prompts, caps, default_catalog_drop_levels()), entry
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
    # The structure checker agrees with the gate on these replies: no more malformed ones than the gate counted for
    # the kind (the build's or the reference's figures for these exact bytes), none at its cap.
    counted = gate["report"] if "verified_by" not in gate else entry["gate"]["report"]
    for k in KINDS + TURN_KINDS:
        assert report[k]["n"] == 3 and report[k]["at_cap"] == 0, (k, report[k])
        assert report[k]["n"] - report[k]["ok"] <= counted[k]["n"] - counted[k]["ok"], (k, report[k], counted[k])
    median = {k: report[k]["median_tokens"] for k in KINDS}
    assert median["tool"] < 100 < 200 < min(median["math"], median["reasoning"]), median
    assert median["tool"] < median["code"] < max(median["math"], median["reasoning"]), median
