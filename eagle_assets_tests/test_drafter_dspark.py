"""The DSpark family (issue 46): DFlash's backbone with a Markov head and a confidence head, SGLang 0.5.23's slot
layout (slot ``k`` proposes the token at ``anchor + k + 1``, the anchor's row included), SpecForge 0.2.0's objective.

- The objective, checked against a brute-force computation, block by block and slot by slot, that shares no code
  with the batched one: labels ``ids[a + k + 1]``, teacher-forced previous tokens, the cumulative mask, ``0.1 CE +
  0.9 L1(softmax(z), softmax(target)) + BCE(confidence, 1 - L1/2)`` over the weight sum.
- The export: the heads' keys at the top level (SGLang's builders read them there) and in ``dflash_config``
  (SpecForge's), every tensor SGLang loads, the confidence head included.
- SGLang's own ``DSparkDraftModel`` (its ``load_weights``, ``compute_base_logits``, ``draft_markov_block`` at
  temperature 0, ``compute_confidence``), driven on CPU by ``sglang_cpu/dflash_blocks.py``, drafts our blocks with
  our step logits and confidences within 1e-4.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from eagle_assets.drafter.dflash.model import anchors_of, config_from_target
from eagle_assets.drafter.dspark.family import FAMILY as DSPARK
from eagle_assets.drafter.dspark.model import DSparkConfig, DSparkDraftModel, dspark_loss
from eagle_assets.drafter.family import family_for, family_of_checkpoint
from eagle_assets_tests.real_sglang import run_sglang_driver
from eagle_assets_tests.test_drafter_dflash import TARGET, H, V, _qc_rows, assert_chunks_match, masked_batch

GAMMA = 4


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    pass


def _draft(layers=2, ids=(1, 3), seed=0, confidence=True) -> DSparkDraftModel:
    from dataclasses import asdict

    torch.manual_seed(seed)
    base = config_from_target(TARGET, mask_token_id=V - 1, num_hidden_layers=layers, target_layer_ids=list(ids))
    config = DSparkConfig(**{**asdict(base), "block_size": GAMMA, "markov_rank": 8,
                             "enable_confidence_head": confidence})
    model = DSparkDraftModel(config, torch.randn(V, H), torch.randn(V, H))
    with torch.no_grad():
        for p in model.parameters():
            (p.uniform_(0.5, 1.5) if p.dim() == 1 else p.normal_(0, 0.3))
    return model


def _brute_loss(model, aux, ids, mask, target_hidden):
    total, weight = 0.0, 0.0
    s = ids.shape[1]
    for b in range(ids.shape[0]):
        for a in range(s - 1):
            if not (mask[b, a] and mask[b, a + 1]):
                continue
            hidden = model.blocks(aux[b:b + 1, :a], ids[b:b + 1, :a + 1].clone(), torch.tensor([[a]]),
                                  torch.tensor([[True]]))[0, 0]
            prev = ids[b, a]
            for k in range(GAMMA):
                j = a + k + 1
                if j >= s or not mask[b, j]:
                    break  # cumulative: the first unsupervised label ends the block
                y = ids[b, j]
                z = hidden[k] @ model.lm_head_weight.T + model.markov_head.markov_w2(model.markov_head.markov_w1(prev))
                p_t = torch.softmax(target_hidden[b, j - 1] @ model.lm_head_weight.T, -1)
                l1 = (torch.softmax(z, -1) - p_t).abs().sum()
                c = model.confidence_head.proj(torch.cat([hidden[k], model.markov_head.markov_w1(prev)]))[0]
                bce = F.binary_cross_entropy_with_logits(c, (1 - l1 / 2).clamp(0, 1).detach())
                total = total + 0.1 * F.cross_entropy(z[None], y[None]) + 0.9 * l1 + bce
                weight += 1
                prev = y  # teacher forcing
    return total / weight


def test_the_batched_objective_equals_a_slot_by_slot_computation():
    model = _draft()
    # a hole in row 1 ends every block that reaches it
    ids, mask, aux, target_hidden = masked_batch(2, 13, ((slice(3, None),), (slice(2, 7), slice(8, None))),
                                                 (2 * H, H))
    anchors, keep = anchors_of(mask)
    loss, per_slot = dspark_loss(model, aux, ids, mask, anchors, keep, target_hidden)
    assert loss.item() == pytest.approx(_brute_loss(model, aux, ids, mask, target_hidden).item(), rel=1e-5)
    assert len(per_slot) == GAMMA and per_slot[0][0] > per_slot[-1][0]
    loss.backward()
    assert model.confidence_head.proj.weight.grad is not None and model.markov_head.markov_w1.weight.grad is not None


def test_the_export_writes_the_heads_where_each_reader_looks(tmp_path):
    model = _draft()
    report = DSPARK.export(model, TARGET, None, model.config.aux_capture_ids, tmp_path / "ckpt")
    cfg = report.config
    assert cfg["architectures"] == ["DSparkDraftModel"] and cfg["block_size"] == GAMMA
    for key, value in (("markov_rank", 8), ("markov_head_type", "vanilla"), ("enable_confidence_head", True),
                       ("confidence_head_with_markov", True), ("sample_from_anchor", True)):
        assert cfg[key] == value and cfg["dflash_config"][key] == value  # SGLang reads the top, SpecForge the nest
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
            "confidence_head.proj.bias"} <= set(report.tensors)
    assert family_of_checkpoint(tmp_path / "ckpt") is DSPARK and family_for("dspark") is DSPARK
    loaded, _ = DSPARK.load(tmp_path / "ckpt")
    assert isinstance(loaded, DSparkDraftModel) and loaded.config == model.config
    assert DSPARK.serve_flags(tmp_path / "ckpt", 7)[-2:] == ["--speculative-dspark-block-size", str(GAMMA)]


def test_drafts_chain_through_the_markov_head_from_the_anchor():
    model = _draft(seed=3)
    gen = torch.Generator().manual_seed(3)
    ids, aux = torch.randint(0, V - 1, (12,), generator=gen), torch.randn(1, 12, 2 * H, generator=gen)
    chain = model.draft_chain(aux, ids, GAMMA)
    p = 5  # by hand: the block anchored at ids[p + 1], each slot biased by the token before it
    hidden = model.blocks(aux, ids[None], torch.tensor([[p + 1]]), torch.tensor([[True]]))[0, 0]
    prev, want = ids[p + 1], []
    for k in range(GAMMA):
        prev = int(model.step_logits(hidden[k], prev).argmax())
        want.append(prev)
        prev = torch.tensor(prev)
    assert chain[p].tolist() == want and (chain[-1] == -1).all()


@pytest.fixture(scope="module")
def sglang_blocks(sglang_python, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dspark_sglang")
    cases, ours = [], {}
    for name, layers, ids in (("one_layer", 1, [2]), ("two_layers", 2, [0, 4])):
        model = _draft(layers, ids, seed=layers)
        DSPARK.export(model, TARGET, None, model.config.aux_capture_ids, tmp / name)
        gen = torch.Generator().manual_seed(layers)
        row_ids = torch.randint(0, V - 1, (18,), generator=gen)
        aux = torch.randn(18, len(ids) * H, generator=gen)
        np.savez(tmp / f"{name}.npz", aux=aux.numpy(), ids=row_ids.numpy(), embed=model.embed_weight.numpy(),
                 lm_head=model.lm_head_weight.numpy())
        positions = [0, 4, 9, 15]
        cases.append({"name": name, "checkpoint": str(tmp / name), "inputs": str(tmp / f"{name}.npz"),
                      "positions": positions})
        chain = model.draft_chain(aux[None], row_ids, GAMMA)
        hidden = model.blocks(aux[None], row_ids[None], torch.tensor([[p + 1 for p in positions]]),
                              torch.ones(1, len(positions), dtype=torch.bool))[0]
        prev = torch.cat([row_ids[[p + 1 for p in positions]].unsqueeze(1),
                          torch.from_numpy(chain[positions, :-1])], 1)
        with torch.no_grad():
            ours[name] = {"blocks": [chain[p].tolist() for p in positions],
                          "logits": model.step_logits(hidden, prev).numpy(),
                          "confidences": torch.sigmoid(model.confidence_logit(hidden, prev)).numpy()}
    return run_sglang_driver(sglang_python, "dflash_blocks.py", cases, tmp), ours


@pytest.mark.parametrize("case", ["one_layer", "two_layers"])
def test_sglang_loads_every_parameter_of_the_exported_dspark_draft(sglang_blocks, case):
    got = sglang_blocks[0][case]
    assert got["untouched"] == [] and got["consumed"] == got["tensors"]
    assert {"markov_head.markov_w1.weight", "confidence_head.proj.weight"} <= set(got["written"])


@pytest.mark.parametrize("case", ["one_layer", "two_layers"])
def test_sglang_drafts_the_dspark_blocks_our_draft_drafts(sglang_blocks, case):
    sglang, ours = sglang_blocks[0][case], sglang_blocks[1][case]
    assert sglang["blocks"] == ours["blocks"]
    assert np.abs(np.asarray(sglang["logits"]) - ours["logits"]).max() < 1e-4
    assert np.abs(np.asarray(sglang["confidences"]) - ours["confidences"]).max() < 1e-4


def test_the_training_assets_train_and_export_a_dspark_draft_and_compare_it_with_an_eagle3_one(target8, tmp_path):
    """``training.drafter.architecture: dspark`` through the real training assets, and ``training.compare``: an
    EAGLE-3 drafter trained beside it from the same rows and recipe by ``drafter_comparison``, its export held to
    its family's contract with its lineage, both measured on the same rows (the DSpark draft's figures are the
    ``evaluation`` asset's to the digit; the EAGLE-3 draft's k=1 tau is a walk of our own)."""
    import yaml

    from eagle_assets.definitions import build_definitions
    from eagle_assets_tests.dagster_runs import materialize_training

    (tmp_path / "source.jsonl").write_text("")
    training = {"draft_vocab_size": 256, "epochs": 3, "lr": 3.0e-3, "batch_tokens": 256, "max_length": 256,
                "holdout_fraction": 0.3, "validation_rows": 1, "acceptance_k": 4, "min_tau_margin": 0.0,
                "tau_warn": 1.0, "threads": 1, "warmup_steps": 1, "save_every_steps": 0, "mix": {"bucket_caps": []},
                "drafter": {"architecture": "dspark", "block_size": 5},
                "compare": {"eagle3": {"architecture": "llama"}}}
    catalog = {"target": {"model": str(target8)}, "training": training,
               "partitions": {"P1": {"sources": [{"path": str(tmp_path / "source.jsonl"), "format": "messages"}],
                                     "sampling": {"max_new_tokens": 32}}}}
    path = tmp_path / "dsp.yaml"
    path.write_text(yaml.safe_dump(catalog))
    _qc_rows(tmp_path / "store" / "dsp" / "qc_shards" / "P1", target8)
    defs = build_definitions(path, storage_root=tmp_path / "store")
    result, logs = materialize_training(defs)
    assert result.success, "\n".join(logs[-30:])
    checks = {e.check_name: e for e in result.get_asset_check_evaluations()}
    assert checks["export_contract"].passed
    described = checks["acceptance_length"].metadata["drafter_architecture"].value
    assert described.startswith("dspark: 1 layer(s), 5 drafts, target layers [4]")
    ckpt = tmp_path / "store" / "dsp" / "drafter_checkpoint" / "checkpoint"
    assert family_of_checkpoint(ckpt) is DSPARK
    metrics = json.loads((ckpt.parent / "training_metrics.json").read_text())
    assert len(metrics["steps"][0]["step_loss"]) == 5  # one figure per drafted slot, the anchor's row included
    _compare_with_eagle3(defs, tmp_path / "store" / "dsp", target8, metrics)


def _compare_with_eagle3(defs, store, target_dir, metrics) -> None:
    from transformers import AutoModelForCausalLM

    from eagle_assets.catalog import load_catalog
    from eagle_assets.drafter.data.splits import load_split_rows
    from eagle_assets.drafter.eagle3.family import FAMILY as EAGLE3
    from eagle_assets.drafter.features.local_capture import run_target
    from eagle_assets.storage.shards import Layout
    from eagle_assets_tests.dagster_runs import materialize_training

    result, logs = materialize_training(defs, ("evaluation", "drafter_comparison"))
    assert result.success, "\n".join(logs[-30:])
    check = {e.check_name: e for e in result.get_asset_check_evaluations()}["compared_exports"]
    assert check.passed, check.description
    doc = json.loads((store / "drafter_comparison" / "report.json").read_text())
    dspark, eagle3 = doc["drafters"]
    assert (dspark["label"], eagle3["label"]) == ("drafter", "eagle3")
    assert (dspark["sglang_class"], eagle3["sglang_class"]) == ("DSparkDraftModel", "LlamaForCausalLMEagle3")
    assert dspark["records"] == json.loads((store / "evaluation" / "report.json").read_text())["records"]
    ckpt = store / "drafter_comparison" / "eagle3" / "checkpoint"
    assert eagle3["parameters"] == EAGLE3.validate(ckpt).parameters > 0 and eagle3["train_seconds"] > 0
    provenance = json.loads((ckpt / "provenance.json").read_text())  # its lineage, as drafter_checkpoint's
    assert provenance["asset"] == "drafter_comparison" and provenance["inputs"]
    trained = json.loads((ckpt.parent / "training_metrics.json").read_text())
    assert (trained["rows_used"], trained["tokens_per_epoch"]) == (metrics["rows_used"], metrics["tokens_per_epoch"])
    # the EAGLE-3 draft's held-out greedy tau at k=1, walked here: one target forward per row gives every verdict
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    model, _ = EAGLE3.load(ckpt, target)
    catalog = load_catalog(defs.resources["settings"].catalog_path)
    tokens = verifications = 0
    for _sid, ids, mask, _key in load_split_rows(Layout(store.parent, store.name), catalog, ["P1"], "test"):
        x = torch.as_tensor(np.asarray(ids, np.int64))
        with torch.no_grad():
            aux, _ = run_target(target, x, model.config.aux_capture_ids)
            first = model.draft_chain(aux, x, 1)[:, 0]  # row n - 1 drafts token n + 1
            argmax = target(x[None]).logits[0].argmax(-1).numpy()
        n, end = int(np.argmax(np.asarray(mask) > 0)), len(ids)
        while n <= end - 2:
            accepted = int(first[n - 1] == argmax[n])
            tokens, verifications, n = tokens + accepted + 1, verifications + 1, n + accepted + 1
    held = [r for r in eagle3["records"] if (r["suite"], r["k"], r["temperature"]) == ("heldout", 1, 0.0)]
    assert len(held) == 1 and held[0]["tau"] == round(tokens / verifications, 6) and verifications > 0
    md = (store / "drafter_comparison" / "report.md").read_text()
    assert "| drafter | dspark: 1 layer(s), 5 drafts" in md and "| eagle3 | llama (1 layer) |" in md
    assert doc["supported"] in ("drafter", "eagle3") and "mean greedy tau" in doc["reason"]


def test_a_walk_past_the_block_measures_the_blocks_own_drafts():
    """SGLang verifies at most ``g`` DSpark drafts (``B - 1`` DFlash ones): the chain past them never matches."""
    model = _draft(seed=4)
    gen = torch.Generator().manual_seed(4)
    ids, aux = torch.randint(0, V - 1, (10,), generator=gen), torch.randn(1, 10, 2 * H, generator=gen)
    chain = model.draft_chain(aux, ids, GAMMA + 2)
    assert np.array_equal(chain[:, :GAMMA], model.draft_chain(aux, ids, GAMMA)) and (chain[:, GAMMA:] == -1).all()


def test_the_sampled_walk_verifies_no_draft_past_the_block(target8):
    """At a suite's temperature a chain past the block is never fed to the target nor counted (its -1 slots)."""
    from transformers import AutoModelForCausalLM

    from eagle_assets.drafter.data.vocab import draft_vocab_from_arrays
    from eagle_assets.drafter.dflash.family import draft_config
    from eagle_assets.drafter.dspark.family import build_model
    from eagle_assets.drafter.evaluation.sampled import chain_probabilities
    from eagle_assets.drafter.family import DraftArchitecture

    target = AutoModelForCausalLM.from_pretrained(str(target8), dtype=torch.float32).eval()
    cfg = json.loads((target8 / "config.json").read_text())
    from dataclasses import asdict

    base = draft_config(cfg, 0, [3, 5], None, DraftArchitecture("dspark", mask_token_id=0))
    model = build_model(DSparkConfig(**{**asdict(base), "block_size": 3}), target.get_input_embeddings().weight,
                        None, target.get_output_embeddings().weight)
    v = cfg["vocab_size"]
    vocab = draft_vocab_from_arrays(np.zeros(v, dtype=np.int64), np.ones(v, dtype=bool))
    row = (np.arange(5, 25, dtype=np.int64), np.r_[np.zeros(6), np.ones(14)].astype(np.int8))
    chains = chain_probabilities(target, model, vocab, [row], k=5, temperature=1.0)
    assert chains.limits.max() == 3 and (chains.probs[..., 3:] == 0).all()


def test_data_parallel_shards_add_up_to_one_process_on_the_blocks_it_drew(monkeypatch):
    """DSpark under torchrun (see the DFlash test): its cumulative slot weights, summed over the ranks, normalize
    each rank's share of the loss over the blocks drawn once for the global batch."""
    from eagle_assets_tests.test_drafter_dflash import shards_add_up

    hidden = torch.randn(5, 16, H, generator=torch.Generator().manual_seed(5))
    keep = shards_add_up(DSPARK, _draft(), monkeypatch, {"target_hidden": hidden})
    assert keep.sum(1).tolist() == [5, 5, 5, 5, 3]


def test_the_chunked_objective_gives_the_unchunked_loss_and_gradients():
    """dspark_loss's objective in chunks of 1 and 3 blocks equals it in one chunk and the autograd slot-by-slot
    objective: the loss and every parameter's gradient (the Markov head's and the confidence head's included)."""
    model = _draft()
    ids, mask, aux, target_hidden = masked_batch(5, 12, ((slice(3, None),), (slice(2, 6), slice(7, None))),
                                                 (2 * H, H))
    anchors, keep = anchors_of(mask)
    assert_chunks_match(model, lambda: _brute_loss(model, aux, ids, mask, target_hidden),
                        lambda chunk: dspark_loss(model, aux, ids, mask, anchors, keep, target_hidden,
                                                  chunk_blocks=chunk)[0])
