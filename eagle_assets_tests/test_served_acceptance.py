"""The ``acceptance_length`` check of ``drafter_checkpoint`` with ``training.features: served``: the held-out test
rows' aux hidden states and the target's greedy ids come from the server and the exact re-runs off a row are
requests; the asset never builds the target with
transformers (the test makes that raise). The tau it reports must be the tau the local path (the target run in
this process) measures for the same drafter on the same rows.

What is real: an 8-layer variant of the embedded demo target (conftest ``target8``, so SGLang's default capture ids
apply) behind our aiohttp server in SGLang's aux-capture mode (in a thread of this process, started before the target
loaders are made to raise), HTTP through the serving client, a real Dagster
instance materializing ``draft_vocab``, ``training_mix`` and ``drafter_checkpoint``, Parquet QC shards. The QC rows
are written directly (the partition pipeline is tested elsewhere): chat prompts plus 24 tokens the demo target
sampled at temperature 1 (seeded), so rows leave the greedy path and the walk must ask the server for the greedy
token after prefixes off the row (the exact re-runs). At temperature 0.8 a demo target confident enough on these
prompts left the rows so rarely that no accepted draft left one (no re-run, nothing of that path tested); at 1
every one of four seed sets tried gave re-runs.

Tolerance, and why: tau is a ratio of counts (accepted drafts per verification). The server computes the target in
float64, the local path in float32; both feed the same drafter, whose drafts and the target's greedy ids are
argmaxes. They agree unless two logits lie within float32 rounding (~1e-6 relative) of each other, which these rows
do not have, so the counts must be equal: the held-out tau per partition, its verifications and the mean tau
must match to 1e-9 (the metadata rounds per-partition tau to 4 digits: compared rounded). One flipped argmax would
move tau by about 1/verifications (> 1e-2 here) and fail.
"""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import transformers
import yaml
from transformers import AutoTokenizer

from eagle_assets.catalog import load_catalog
from eagle_assets.definitions import build_definitions
from eagle_assets.drafter.data.splits import row_splits
from eagle_assets.drafter.data.vocab import draft_vocab_from_arrays
from eagle_assets.drafter.eagle3.export import load_drafter
from eagle_assets.drafter.evaluation.heldout import evaluate_groups
from eagle_assets.drafter.training import loop as train_module
from eagle_assets.serving.server import serve_in_thread
from eagle_assets_tests.dagster_runs import materialize_training

QUESTIONS = ["What is 7 times 6?", "Write a function that reverses a list.", "Why do leaves fall?",
             "Name two planets.", "Convert 3 hours to minutes.", "Give a word that rhymes with cat.",
             "What is the capital of France?", "Add 12 and 30.", "Describe a cat in one line.",
             "How many legs does a spider have?", "Spell the word apple.", "What color is the sky?",
             "Count from one to five.", "Say hello politely."]
NEW_TOKENS = 24


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    pass


@pytest.fixture(scope="module")
def served(target8):
    with serve_in_thread(str(target8), enable_return_aux_hidden_states=True,
                         speculative_algorithm="EAGLE3") as running:
        yield running


def _post(url: str, path: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _qc_partition(directory, target8, url: str) -> None:
    """A passing partition's QC shard of the demo target's own sampled rows (module docstring)."""
    tok = AutoTokenizer.from_pretrained(str(target8))
    records = []
    for i, q in enumerate(QUESTIONS):
        text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        prompt = list(tok(text, add_special_tokens=False)["input_ids"])
        out = _post(url, "/generate", {"input_ids": prompt, "sampling_params": {
            "max_new_tokens": NEW_TOKENS, "temperature": 1.0, "sampling_seed": i, "ignore_eos": True}})["output_ids"]
        ids = np.array(prompt + out, dtype=np.int32)
        records.append({"sample_id": f"s{i:03d}", "input_ids": ids.tolist(),
                        "loss_mask": [0] * len(prompt) + [1] * NEW_TOKENS, "n_prompt_tokens": len(prompt)})
    schema = pa.schema([("sample_id", pa.string()), ("input_ids", pa.list_(pa.int32())),
                        ("loss_mask", pa.list_(pa.int8())), ("n_prompt_tokens", pa.int32())])
    directory.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(records, schema=schema), directory / "shard-00000.parquet")
    (directory / "qc_status.json").write_text(json.dumps({"passed": True, "kept": len(records)}))


def test_served_acceptance_check_matches_the_local_tau_without_loading_the_target(target8, served, tmp_path,
                                                                                   monkeypatch):
    vocab_size = int(json.loads((target8 / "config.json").read_text())["vocab_size"])
    (tmp_path / "source.jsonl").write_text("")  # the partition's source; never read here
    training = {"draft_vocab_size": 256, "ttt_steps": 3, "epochs": 3, "lr": 3.0e-3, "batch_tokens": 128,
                "max_length": 512, "holdout_fraction": 0.5, "validation_rows": 1, "acceptance_k": 3,
                "min_tau_margin": 0.05, "tau_warn": 1.0, "threads": 1, "warmup_steps": 1, "save_every_steps": 0,
                "mix": {"bucket_caps": []},
                "features": {"source": "served", "url": served.url, "teacher": "topk", "top_k": vocab_size}}
    catalog = {"target": {"model": str(target8)},
               "partitions": {"P1": {"sources": [{"path": str(tmp_path / "source.jsonl"), "format": "messages"}],
                                     "sampling": {"max_new_tokens": 32}}},
               "training": training}
    path = tmp_path / "served.yaml"
    path.write_text(yaml.safe_dump(catalog))
    store = tmp_path / "store"
    shard_dir = store / "served" / "qc_shards" / "P1"
    _qc_partition(shard_dir, target8, served.url)
    t = load_catalog(path).training
    table = pq.read_table(shard_dir / "shard-00000.parquet")
    splits = row_splits(table.column("sample_id").to_pylist(), t)
    test_rows = [(np.asarray(i, np.int32), np.asarray(m, np.int8)) for s, i, m in zip(
        table.column("sample_id").to_pylist(), table.column("input_ids").to_pylist(),
        table.column("loss_mask").to_pylist()) if splits[s] == "test"]
    assert len(test_rows) >= 3

    # from here on the asset's process cannot build the target: the check must get everything from the server
    def no_target(*_a, **_k):
        raise AssertionError("the served path built the target with transformers")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_target)
    monkeypatch.setattr(train_module, "load_target", no_target)
    before = _post(served.url, "/server_info")["engine"]["requests_submitted"]
    defs = build_definitions(path, storage_root=store)
    result, logs = materialize_training(defs)
    assert result.success, "\n".join(logs[-30:])
    monkeypatch.undo()
    assert _post(served.url, "/server_info")["engine"]["requests_submitted"] > before
    checks = {e.check_name: e for e in result.get_asset_check_evaluations()}
    check = checks["acceptance_length"]
    assert check.passed, check.description
    meta = {k: v.value for k, v in check.metadata.items()}
    assert any("features served by " + served.url in m for m in logs)

    # the local path on the same drafter and the same rows: the target run in this process
    stage = store / "served" / "drafter_checkpoint"
    target = train_module.load_target(target8)
    drafter, _ = load_drafter(stage / "checkpoint", target)
    vocab_dir = store / "served" / "draft_vocab"
    vocab = draft_vocab_from_arrays(np.load(vocab_dir / "d2t.npy"), np.load(vocab_dir / "t2d.npy"))
    local = evaluate_groups(target, drafter, vocab, {"P1": test_rows}, k=t.acceptance_k,
                            max_positions=t.acceptance_max_positions)
    assert local.groups["P1"].exact_reruns > 0  # prefixes off the row were asked for (served: requests)
    assert meta["mean_tau"] > 1.0 + t.min_tau_margin
    assert meta["mean_tau"] == pytest.approx(local.mean_tau, abs=1e-9)
    assert meta["tau_P1"] == round(local.groups["P1"].tau, 4)
    assert meta["per_partition"]["P1"]["verifications"] == local.groups["P1"].n_verifications
    assert meta["per_partition"]["P1"]["exact_reruns"] == local.groups["P1"].exact_reruns

