"""The DFlash family (issue 46): our block drafter, its objective, its export, held to SGLang 0.5.23's own class.

- The objective: SpecForge 0.2.0's ``dflash`` loss (anchors where two adjacent tokens are supervised, slot ``k``
  trained on the token AT ``anchor + k``, slot 0 never, weights per slot by the loss mask, ``sum(w CE) / sum(w)``),
  checked against a brute-force computation block by block that shares no code with the batched one: one block at a
  time, its own context cut, no mask.
- The export: every tensor SGLang's ``DFlashDraftModel.load_weights`` needs, nothing it would skip; SGLang's modules
  (``sglang_cpu/dflash_blocks.py``, driven as ``DFlashWorkerV2`` drives the draft) draft the same block after each
  verified prefix, logits within 1e-4.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from eagle_assets.drafter.dflash.export import (
    CheckpointError,
    export_checkpoint,
    load_drafter,
    serve_flags,
    validate_checkpoint,
)
from eagle_assets.drafter.dflash.model import (
    DFlashDraftModel,
    anchors_of,
    block_loss,
    build_target_layer_ids,
    config_from_target,
)
from eagle_assets.drafter.family import family_for, family_of_checkpoint
from eagle_assets_tests.real_sglang import run_sglang_driver

V, H, LAYERS, BLOCK = 96, 32, 6, 5
TARGET = {"hidden_size": H, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 8, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512,
          "vocab_size": V, "num_hidden_layers": LAYERS}


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    pass


def _draft(layers=2, ids=(1, 3), seed=0) -> DFlashDraftModel:
    torch.manual_seed(seed)
    config = config_from_target(TARGET, mask_token_id=V - 1, num_hidden_layers=layers, block_size=BLOCK,
                                target_layer_ids=list(ids))
    model = DFlashDraftModel(config, torch.randn(V, H), torch.randn(V, H))
    with torch.no_grad():  # norms away from 1 so a misplaced norm shows
        for name, p in model.named_parameters():
            (p.uniform_(0.5, 1.5) if p.dim() == 1 else p.normal_(0, 0.3))
    return model


def test_target_layer_ids_follow_sglangs_rule():
    assert build_target_layer_ids(28, 1) == [14] and build_target_layer_ids(28, 3) == [1, 13, 25]
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33] and build_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    with pytest.raises(ValueError, match="ascending ids in"):
        config_from_target(TARGET, V - 1, target_layer_ids=[LAYERS - 1])  # the last layer's output is never captured


def _brute_loss(model, aux, ids, mask):
    """The objective one block at a time: context = features before the anchor, no mask, plain loops."""
    c = model.config
    ces, ws = [], []
    for b in range(ids.shape[0]):
        s = ids.shape[1]
        for a in range(s - 1):
            if not (mask[b, a] and mask[b, a + 1]):
                continue
            hidden = model.blocks(aux[b:b + 1, :a], ids[b:b + 1, :a + 1].clone(), torch.tensor([[a]]),
                                  torch.tensor([[True]]))[0, 0]
            for k in range(1, c.block_size):
                if a + k < s and mask[b, a + k]:
                    ces.append(F.cross_entropy(model.logits(hidden[k])[None], ids[b, a + k][None]))
                    ws.append(1.0)
    return torch.stack(ces).sum() / sum(ws)


def masked_batch(seed: int, length: int, spans: tuple[tuple[slice, ...], ...], widths: tuple[int, ...]):
    """A batch of ``len(spans)`` random rows of ``length`` ids, ``loss_mask`` 1 on each row's spans (a gap between
    two spans is a hole), and one random float tensor ``[rows, length, w]`` per width, all from ``seed``:
    ``(ids, mask, *tensors)``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V - 1, (len(spans), length), generator=gen)
    mask = torch.zeros(len(spans), length, dtype=torch.long)
    for row, row_spans in enumerate(spans):
        for span in row_spans:
            mask[row, span] = 1
    return (ids, mask, *(torch.randn(len(spans), length, w, generator=gen) for w in widths))


def test_the_batched_objective_equals_a_block_by_block_computation():
    model = _draft()
    # a hole in row 1: slots landing on position 9 weigh 0, later slots still count
    ids, mask, aux = masked_batch(1, 14, ((slice(4, None),), (slice(3, 9), slice(10, None))), (2 * H,))
    anchors, keep = anchors_of(mask)
    assert anchors[0][keep[0]].tolist() == list(range(4, 13))
    assert anchors[1][keep[1]].tolist() == [3, 4, 5, 6, 7, 10, 11, 12]
    loss, per_slot = block_loss(model, aux, ids, mask, anchors, keep)
    assert loss.item() == pytest.approx(_brute_loss(model, aux, ids, mask).item(), rel=1e-5)
    assert len(per_slot) == BLOCK - 1 and per_slot[0][0] > per_slot[-1][0]  # later slots run off the row
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_a_sampled_anchor_set_is_seeded_and_a_subset():
    mask = torch.ones(1, 40, dtype=torch.long)
    a1, k1 = anchors_of(mask, 8, torch.Generator().manual_seed(3))
    a2, _ = anchors_of(mask, 8, torch.Generator().manual_seed(3))
    assert torch.equal(a1, a2) and k1.all() and a1.shape == (1, 8)
    assert a1[0].tolist() == sorted(set(a1[0].tolist())) and a1.max() <= 38
    state = torch.get_rng_state()
    every, _ = anchors_of(mask, 512)  # a row within the cap takes all its anchors and draws nothing
    assert every[0].tolist() == list(range(39)) and torch.equal(torch.get_rng_state(), state)


def test_the_export_validates_both_ways_and_round_trips(tmp_path):
    model = _draft()
    report = export_checkpoint(model, TARGET, None, model.config.aux_capture_ids, tmp_path / "ckpt")
    cfg = report.config
    assert cfg["architectures"] == ["DFlashDraftModel"] and "is_causal" not in cfg
    assert cfg["dflash_config"] == {"target_layer_ids": [1, 3], "mask_token_id": V - 1, "block_size": BLOCK}
    assert "embed_tokens.weight" not in report.tensors and "lm_head.weight" not in report.tensors
    assert family_of_checkpoint(tmp_path / "ckpt").name == "dflash" and family_for("dflash").name == "dflash"
    loaded, vocab = load_drafter(tmp_path / "ckpt")
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    assert vocab.draft_vocab_size == V
    assert serve_flags(tmp_path / "ckpt", 7)[-2:] == ["--speculative-dflash-block-size", str(BLOCK)]
    # held back: a tensor SGLang would skip and a missing one are both refused, naming them
    from safetensors.torch import load_file, save_file

    weights = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    weights["embed_tokens.weight"] = torch.zeros(V, H)
    del weights["layers.1.mlp.down_proj.weight"]
    save_file(weights, str(tmp_path / "ckpt" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensor layers.1.mlp.down_proj.weight.*embed_tokens.weight "
                                              r"is not one SGLang loads"):
        validate_checkpoint(tmp_path / "ckpt")


@pytest.fixture(scope="module")
def sglang_blocks(sglang_python, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dflash_sglang")
    cases, ours = [], {}
    for name, layers, ids in (("one_layer", 1, [2]), ("three_layers_three_ids", 3, [0, 2, 4])):
        model = _draft(layers, ids, seed=layers)
        export_checkpoint(model, TARGET, None, model.config.aux_capture_ids, tmp / name)
        gen = torch.Generator().manual_seed(layers)
        row_ids = torch.randint(0, V - 1, (20,), generator=gen)
        aux = torch.randn(20, len(ids) * H, generator=gen)
        np.savez(tmp / f"{name}.npz", aux=aux.numpy(), ids=row_ids.numpy(), embed=model.embed_weight.numpy(),
                 lm_head=model.lm_head_weight.numpy())
        positions = [0, 3, 9, 17]
        cases.append({"name": name, "checkpoint": str(tmp / name), "inputs": str(tmp / f"{name}.npz"),
                      "positions": positions})
        chain = model.draft_chain(aux[None], row_ids, BLOCK - 1)
        hidden = model.blocks(aux[None], row_ids[None], torch.tensor([[p + 1 for p in positions]]),
                              torch.ones(1, len(positions), dtype=torch.bool))[0]
        ours[name] = {"blocks": [chain[p].tolist() for p in positions],
                      "logits": model.logits(hidden[:, 1:]).detach().numpy()}
    return run_sglang_driver(sglang_python, "dflash_blocks.py", cases, tmp), ours


@pytest.mark.parametrize("case", ["one_layer", "three_layers_three_ids"])
def test_sglang_loads_every_parameter_of_the_exported_draft(sglang_blocks, case):
    got = sglang_blocks[0][case]
    assert got["untouched"] == [] and got["consumed"] == got["tensors"]  # nothing unwritten, nothing skipped
    assert any(n.endswith("qkv_proj.weight") for n in got["written"])
    assert got["mask_token_id"] == V - 1 and got["block_size"] == BLOCK


@pytest.mark.parametrize("case", ["one_layer", "three_layers_three_ids"])
def test_sglang_drafts_the_blocks_our_draft_drafts(sglang_blocks, case):
    sglang, ours = sglang_blocks[0][case], sglang_blocks[1][case]
    assert sglang["blocks"] == ours["blocks"]
    assert np.abs(np.asarray(sglang["logits"]) - ours["logits"]).max() < 1e-4


QUESTIONS = ["What is 2 plus 3?", "Name a color.", "Say hello.", "Count to five.", "What is the capital of France?",
             "Give me a fruit.", "Spell cat.", "What day comes after Monday?", "Is water wet?", "Name an animal."]


def _qc_rows(directory, target_dir, new_tokens=24):
    """A passing partition's QC shard: chat prompts and the target's own greedy replies (ids, loss mask)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    records = []
    for i, q in enumerate(QUESTIONS):
        text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        prompt = list(tok(text, add_special_tokens=False)["input_ids"])
        with torch.no_grad():
            out = target.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                                  min_new_tokens=new_tokens, pad_token_id=0)[0, len(prompt):].tolist()
        records.append({"sample_id": f"s{i:03d}", "input_ids": prompt + out,
                        "loss_mask": [0] * len(prompt) + [1] * len(out), "n_prompt_tokens": len(prompt)})
    schema = pa.schema([("sample_id", pa.string()), ("input_ids", pa.list_(pa.int32())),
                        ("loss_mask", pa.list_(pa.int8())), ("n_prompt_tokens", pa.int32())])
    directory.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(records, schema=schema), directory / "shard-00000.parquet")
    (directory / "qc_status.json").write_text(json.dumps({"passed": True, "kept": len(records)}))


def test_the_training_assets_train_and_export_a_dflash_draft(target8, tmp_path):
    """``training.drafter.architecture: dflash`` through the real ``draft_vocab``, ``training_mix`` and
    ``drafter_checkpoint`` assets: the family's target layers (SGLang's default for an 8-layer target, one draft
    layer: [4]), the mask token by the stated rule, the export SGLang loads, the acceptance check walked with the
    draft's blocks, and the serve flags of its class."""
    import yaml

    from eagle_assets.definitions import build_definitions
    from eagle_assets_tests.dagster_runs import materialize_training

    (tmp_path / "source.jsonl").write_text("")  # the partition's source; never read here
    training = {"draft_vocab_size": 256, "epochs": 3, "lr": 3.0e-3, "batch_tokens": 256, "max_length": 256,
                "holdout_fraction": 0.3, "validation_rows": 1, "acceptance_k": 4, "min_tau_margin": 0.0,
                "tau_warn": 1.0, "threads": 1, "warmup_steps": 1, "save_every_steps": 0, "mix": {"bucket_caps": []},
                "drafter": {"architecture": "dflash", "block_size": 6}}
    catalog = {"target": {"model": str(target8)}, "training": training,
               "partitions": {"P1": {"sources": [{"path": str(tmp_path / "source.jsonl"), "format": "messages"}],
                                     "sampling": {"max_new_tokens": 32}}}}
    path = tmp_path / "dfl.yaml"
    path.write_text(yaml.safe_dump(catalog))
    _qc_rows(tmp_path / "store" / "dfl" / "qc_shards" / "P1", target8)
    defs = build_definitions(path, storage_root=tmp_path / "store")
    result, logs = materialize_training(defs)
    assert result.success, "\n".join(logs[-30:])
    checks = {e.check_name: e for e in result.get_asset_check_evaluations()}
    assert checks["export_contract"].passed
    acceptance = checks["acceptance_length"]
    described = acceptance.metadata["drafter_architecture"].value
    assert described.startswith("dflash: 1 layer(s), block 6, target layers [4]")
    assert acceptance.metadata["mean_tau"].value >= 1.0
    ckpt = tmp_path / "store" / "dfl" / "drafter_checkpoint" / "checkpoint"
    report = validate_checkpoint(ckpt, json.loads((target8 / "config.json").read_text()))
    assert report.config["dflash_config"]["target_layer_ids"] == [4] and report.config["block_size"] == 6
    from transformers import AutoTokenizer

    tok, vocab = AutoTokenizer.from_pretrained(str(target8)), report.config["vocab_size"]
    mask = report.config["dflash_config"]["mask_token_id"]
    assert mask == (len(tok) if len(tok) < vocab else tok.pad_token_id)  # the first unused row, else pad
    assert family_of_checkpoint(ckpt).serve_flags(ckpt, 4)[:2] == ["--speculative-algorithm", "DFLASH"]
    metrics = json.loads((ckpt.parent / "training_metrics.json").read_text())
    assert len(metrics["steps"][0]["step_loss"]) == 5  # one figure per drafted slot, 1..B-1


def shards_add_up(family, model, monkeypatch, extra=None, cap=5, world=2):
    """The data-parallel loss of ``family`` taken apart by hand: one process's loss and gradient of a 5-row batch
    whose longer rows have more than ``cap`` anchors (so the blocks are drawn), against ``world`` ranks' shards
    (``rows[r::world]``, each padded to its own longest row) with the global per-slot counts as ``normalizer``:
    DDP averages the ranks' gradients of ``world x`` their losses, so the ranks' losses and gradients must add up
    to one process's. Returns the drawn ``keep`` mask."""
    import eagle_assets.drafter.dflash.family as dflash_family
    from eagle_assets.drafter.family import TrainBatch, block_rows

    monkeypatch.setattr(dflash_family, "NUM_ANCHORS", cap)
    gen = torch.Generator().manual_seed(4)
    lengths = [16, 14, 12, 9, 7]
    ids = torch.randint(0, V - 1, (5, 16), generator=gen)
    mask = torch.zeros(5, 16, dtype=torch.bool)
    for r, n in enumerate(lengths):
        mask[r, 3:n] = True
    aux = torch.randn(5, 16, len(model.config.target_layer_ids) * H, generator=gen)
    more = dict(extra or {})

    def batch(rows, anchors):
        t = max(lengths[r] for r in rows)
        return TrainBatch(aux=aux[rows, :t], ids=ids[rows, :t], loss_mask=mask[rows, :t], supervision=None,
                          draft_token_ids=None, anchors=anchors, **{k: v[rows, :t] for k, v in more.items()})

    torch.manual_seed(11)
    drawn = family.draw_anchors(mask)
    torch.manual_seed(11)
    assert all(torch.equal(a, b) for a, b in zip(drawn, family.draw_anchors(mask)))  # every rank draws this
    steps = family.loss_steps(model.config, 0)
    params = [p for p in model.parameters() if p.requires_grad]
    everyone = list(range(5))
    loss, per_slot = family.batch_loss(model, batch(everyone, block_rows(drawn, everyone)), None)
    want = torch.autograd.grad(loss, params)
    shards = [everyone[r::world] for r in range(world)]
    local = [family.loss_counts(batch(rows, block_rows(drawn, rows)), steps) for rows in shards]
    normalizer = [sum(c) for c in zip(*local)]
    assert normalizer == [n for n, _, _ in per_slot]  # the global counts are one process's
    total, got = 0.0, [torch.zeros_like(p) for p in params]
    for rows in shards:
        part, _ = family.batch_loss(model, batch(rows, block_rows(drawn, rows)), None, normalizer=normalizer)
        total += float(part.detach())
        for g, d in zip(got, torch.autograd.grad(world * part, params)):
            g += d / world
    assert total == pytest.approx(float(loss.detach()), rel=1e-5)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    return drawn[1]


def test_data_parallel_shards_add_up_to_one_process_on_the_blocks_it_drew(monkeypatch):
    """DFlash under torchrun: every rank draws the global batch's blocks (rows over the anchor cap draw, from
    torch's generator, the same on every rank) and trains its rows on them; divided by the global batch's slot
    counts, the ranks' losses and averaged gradients are one process's."""
    keep = shards_add_up(family_for("dflash"), _draft(), monkeypatch)
    assert keep.sum(1).tolist() == [5, 5, 5, 5, 3]  # rows 0-3 drew 5 of their 12, 10, 8, 5 anchors; row 4 all 3


def test_the_chunked_objective_gives_the_unchunked_loss_and_gradients():
    """block_loss's objective in chunks of 1 and 3 blocks equals it in one chunk and the autograd block-by-block
    objective: the loss and every parameter's gradient (the gradient is computed in the chunks' forward)."""
    model = _draft()
    ids, mask, aux = masked_batch(4, 12, ((slice(3, None),), (slice(2, 6), slice(7, None))), (2 * H,))
    anchors, keep = anchors_of(mask)
    assert_chunks_match(model, lambda: _brute_loss(model, aux, ids, mask),
                        lambda chunk: block_loss(model, aux, ids, mask, anchors, keep, chunk_blocks=chunk)[0])


def assert_chunks_match(model, reference, chunked) -> None:
    """``chunked(chunk_blocks)`` (a loss) at chunks of every block, 1 and 3 gives ``reference()``'s loss and every
    parameter's gradient of ``model``."""
    def run(loss_fn):
        model.zero_grad(set_to_none=True)
        loss = loss_fn()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    ref_loss, ref_grads = run(reference)
    for chunk in (None, 1, 3):
        loss, grads = run(lambda: chunked(chunk))
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-5, msg=f"{name}, chunks of {chunk}")
