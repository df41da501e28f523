"""The default demo target really writes the reply structure on prompts from the committed demo files.

Uses conftest's session-scoped ``demo_target`` (default cache $EAGLE_ASSETS_HOME/demo-target, else
<cwd>/.eagle_assets/demo-target): the first run on a machine builds it (about two minutes on 2 cores).
"""

from __future__ import annotations

import statistics

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from eagle_assets.demo.build import encode_sample
from eagle_assets.demo.evaluate import check_reply, generate_replies
from eagle_assets.demo.raw_samples import prompt_samples
from eagle_assets.demo.transcripts import KINDS

pytestmark = pytest.mark.slow  # over a minute when the target is not cached yet


@pytest.fixture(scope="module")
def target(demo_target):
    return AutoTokenizer.from_pretrained(demo_target), AutoModelForCausalLM.from_pretrained(demo_target).eval()


def test_structure_and_lengths_on_demo_prompts(target):
    tokenizer, model = target
    samples = [s for kind in KINDS for s in prompt_samples(kind)[:3]]
    prompts = [encode_sample(tokenizer, s)[0] for s in samples]
    think = tokenizer.convert_tokens_to_ids("<think>")
    assert all(p[-1] == think for p in prompts)
    replies = generate_replies(model, tokenizer, prompts, max_new_tokens=600)
    checks = [check_reply(r, tokenizer, s.kind == "tool") for s, r in zip(samples, replies)]
    bad = [(s.kind, c.reason, tokenizer.decode(r)[-200:]) for s, r, c in zip(samples, replies, checks) if not c.ok]
    assert len(bad) <= 1, bad
    median = {k: statistics.median(c.n_tokens for s, c in zip(samples, checks) if s.kind == k) for k in KINDS}
    assert median["tool"] < 100 < 200 < min(median["math"], median["reasoning"]), median
    assert median["tool"] < median["code"] < max(median["math"], median["reasoning"]), median
