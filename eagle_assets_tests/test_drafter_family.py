"""The drafter family registry (``drafter.family``): the training loop, the export check, the evaluation and the CLI
reach a family's code only through it, so a new family is one folder and one registry entry.

A recording family (EAGLE-3's functions, each call counted) is registered under another name for one test: the
loop must build, train, export and the walk must draft through it, with the same weights as EAGLE-3 itself.
"""

from __future__ import annotations

import json
import sys
import types
from dataclasses import replace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from eagle_assets.drafter import family as family_module
from eagle_assets.drafter.data.vocab import build_draft_vocab, count_completion_tokens
from eagle_assets.drafter.family import UnknownFamilyError, family_for, family_named, family_of_checkpoint
from eagle_assets.drafter.training.loop import TrainConfig, train_drafter
from eagle_assets_tests.tiny_targets import tiny_qwen3

VOCAB, LAYERS, PROMPT = 120, 4, 6


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    pass


def test_every_architecture_the_catalog_names_has_a_family_and_unknown_ones_are_refused():
    eagle3 = family_named("eagle3")
    assert all(family_for(a) is eagle3 for a in ("auto", "llama", "mla"))
    assert family_for("dflash") is family_named("dflash") and family_for("dspark") is family_named("dspark")
    with pytest.raises(UnknownFamilyError, match=r"no drafter family trains architecture 'medusa'.*eagle3.*dflash"):
        family_for("medusa")
    with pytest.raises(UnknownFamilyError, match="registered"):
        family_named("medusa")


def test_a_checkpoint_names_its_family_through_its_config(tmp_path):
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    (tmp_path / "mla").mkdir()
    (tmp_path / "mla" / "config.json").write_text(json.dumps({"architectures": ["Eagle3DeepseekV2ForCausalLM"]}))
    assert family_of_checkpoint(tmp_path / "llama").name == family_of_checkpoint(tmp_path / "mla").name == "eagle3"
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({"architectures": ["DFlash2DraftModel"]}))
    with pytest.raises(UnknownFamilyError, match=r"DFlash2DraftModel.*which no drafter family exports"):
        family_of_checkpoint(tmp_path / "other")
    with pytest.raises(UnknownFamilyError, match="not a readable drafter config"):
        family_of_checkpoint(tmp_path / "missing")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    target = tiny_qwen3(VOCAB, LAYERS, initializer_range=1.0)
    target.save_pretrained(path)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, VOCAB, (6, PROMPT), generator=gen)
    with torch.no_grad():
        out = target.eval().generate(prompts, max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=None)
    rows = []
    for r in out:
        mask = np.zeros(r.numel(), dtype=np.int8)
        mask[PROMPT:] = 1
        rows.append((r.numpy().astype(np.int32), mask))
    vocab = build_draft_vocab(count_completion_tokens(rows, VOCAB), VOCAB, 64)
    return path, rows, vocab


def test_the_loop_and_the_walk_reach_the_drafter_only_through_its_family(tiny, tmp_path, monkeypatch):
    target_dir, rows, vocab = tiny
    eagle3 = family_named("eagle3")
    calls: dict[str, int] = {}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return wrapper

    def build_model(*args, **kwargs):
        model = eagle3.build_model(*args, **kwargs)
        # the evaluation walk drafts through the model's draft_chain (drafter.family.DraftModel)
        model.draft_chain = counted("draft_chain", model.draft_chain)
        return model

    recording = replace(eagle3, name="recording", build_model=counted("build_model", build_model),
                        batch_loss=counted("batch_loss", eagle3.batch_loss), export=counted("export", eagle3.export),
                        config_from_target=counted("config_from_target", eagle3.config_from_target))
    module = types.ModuleType("recording_family")
    module.FAMILY = recording
    monkeypatch.setitem(sys.modules, "recording_family", module)
    config = TrainConfig(lr=2e-2, epochs=2, ttt_steps=2, batch_tokens=200, seed=0, num_threads=1,
                         aux_layer_ids=[1, 2, 3])

    monkeypatch.setattr(family_module, "FAMILIES", {"recording": "recording_family"})
    recorded = train_drafter(target_dir, rows[:4], vocab, config, tmp_path / "recorded", eval_rows=rows[4:])
    monkeypatch.undo()
    plain = train_drafter(target_dir, rows[:4], vocab, config, tmp_path / "plain", eval_rows=rows[4:])

    assert calls["config_from_target"] == calls["build_model"] == calls["export"] == 1
    assert calls["batch_loss"] == len(recorded.steps) > 0
    assert calls["draft_chain"] >= 1  # the acceptance walk on eval_rows drafted through the family's model
    # the registry adds no arithmetic: the same weights and the same tau as EAGLE-3 reached directly
    a, b = (load_file(str(r.checkpoint_dir / "model.safetensors")) for r in (recorded, plain))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert recorded.acceptance.tau == plain.acceptance.tau
