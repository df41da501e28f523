"""The shipped demo target really writes the reply structure on prompts from the committed demo files, and the
recipe rebuilds a target that passes the same gate.
"""

from __future__ import annotations

import json
import os

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
    lengths hold, and every reply is, token for token, the one the shipped build's gate recorded."""
    from transformers import AutoTokenizer

    from eagle_assets.demo.gate import generate_replies, reply_digest, select_gate_set, summarize_replies
    from eagle_assets.demo.recipe import DemoRecipe
    from eagle_assets.serving.engine import load_causal_lm

    gate = json.loads((demo_target / "recipe.json").read_text())["gate"]
    tokenizer = AutoTokenizer.from_pretrained(demo_target)
    samples, prompts, caps = select_gate_set(tokenizer, DemoRecipe())
    recorded = gate["reply_sha256"]
    assert gate["failures"] == [] and len(recorded) == len(samples)
    picks = [i for kind in KINDS + TURN_KINDS for i in [j for j, s in enumerate(samples) if s.kind == kind][:3]]
    replies = generate_replies(load_causal_lm(str(demo_target), dtype="auto"), tokenizer,
                               [prompts[i] for i in picks], [caps[i] for i in picks])
    assert [reply_digest(r) for r in replies] == [recorded[i] for i in picks]
    report = summarize_replies([samples[i] for i in picks], replies, tokenizer, default_catalog_caps())
    # The structure checker agrees with the gate on these replies: no more malformed ones than the gate counted for
    # the kind, none at its cap.
    for k in KINDS + TURN_KINDS:
        assert report[k]["n"] == 3 and report[k]["at_cap"] == 0, (k, report[k])
        assert report[k]["n"] - report[k]["ok"] <= gate["report"][k]["n"] - gate["report"][k]["ok"], (k, report[k])
    median = {k: report[k]["median_tokens"] for k in KINDS}
    assert median["tool"] < 100 < 200 < min(median["math"], median["reasoning"]), median
    assert median["tool"] < median["code"] < max(median["math"], median["reasoning"]), median


@pytest.mark.skipif(os.environ.get("EAGLE_ASSETS_REBUILD_DEMO") != "1",
                    reason="rebuilds the demo target from its recipe (about four minutes of 2 cores, more than the "
                           "suite's budget); run with EAGLE_ASSETS_REBUILD_DEMO=1 after changing eagle_assets/demo/")
def test_rebuilding_the_shipped_target_passes_the_gate(demo_target, tmp_path):
    """The recipe in this checkout, built afresh (training and the gate's 276 greedy replies), gives a model that
    passes the gate the shipped one passed; on the kind of CPU that built the shipped bytes it gives those bytes."""
    from eagle_assets.demo.build import build_demo_target
    from eagle_assets.demo.recipe import recipe_hash

    rebuilt = build_demo_target(tmp_path, log=lambda _: None)  # raises DemoTargetRejected when the gate fails
    meta = json.loads((rebuilt / "recipe.json").read_text())
    shipped = json.loads((demo_target / "recipe.json").read_text())
    assert meta["recipe_hash"] == shipped["recipe_hash"] == recipe_hash()
    assert meta["gate"]["failures"] == [] and meta["gate"]["drop_levels"] == shipped["gate"]["drop_levels"]
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (rebuilt / name).read_bytes() == (demo_target / name).read_bytes(), name
    print(f"rebuilt weights {meta['weights_sha256'][:12]}..., shipped {shipped['weights_sha256'][:12]}...: "
          f"{'the same bytes' if meta['weights_sha256'] == shipped['weights_sha256'] else 'other bytes'}")
