"""The default demo target really writes the reply structure on prompts from the committed demo files.

Uses conftest's session-scoped ``demo_target`` (default cache $EAGLE_ASSETS_HOME/demo-target, else
<cwd>/.eagle_assets/demo-target): the first run on a machine builds it (a few minutes on 2 cores), once.
"""

from __future__ import annotations

import json

import pytest

from eagle_assets.demo.evaluate import GATE_MIN_STRUCTURE_RATE, default_catalog_caps, evaluate_target
from eagle_assets.demo.raw_samples import N_RECORDS, prompt_samples, turn_samples
from eagle_assets.demo.transcripts import KINDS, TURN_KINDS

pytestmark = pytest.mark.slow  # minutes when the target is not cached yet


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
    # Generated again here, independently of the build's own gate, on the first prompts of each file.
    later = turn_samples()
    samples = ([s for kind in KINDS for s in prompt_samples(kind)[:3]]
               + [s for kind in TURN_KINDS for s in [t for t in later if t.kind == kind][:3]])
    report = evaluate_target(demo_target, samples, default_catalog_caps())
    assert all(report[k]["ok"] == 3 and report[k]["at_cap"] == 0 for k in KINDS + TURN_KINDS), report
    median = {k: report[k]["median_tokens"] for k in KINDS}
    assert median["tool"] < 100 < 200 < min(median["math"], median["reasoning"]), median
    assert median["tool"] < median["code"] < max(median["math"], median["reasoning"]), median
