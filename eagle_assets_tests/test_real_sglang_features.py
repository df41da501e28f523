"""Served drafter features from SGLang 0.5.23's own aux capture, on CPU (``real_sglang``), against the local
features of the same rows, through real Dagster runs of ``draft_vocab``, ``training_mix`` and ``drafter_checkpoint``.

Two catalogs that differ only in ``training.features``:

- ``served`` (``teacher: topk`` with ``top_k`` = the vocab size, so the teacher is the full target softmax) and no
  URL: the pipeline's server resource (``launch: sglang``, ``device: cpu``) starts the real server itself with
  SGLang's capture flags for the catalog's non-default ``aux_layer_ids`` [1, 3, 7] (Qwen3's +1 rule:
  ``--return-aux-hidden-state-layer-ids 0 2 6``), the trainer reads every training and validation row's aux hidden
  states and top-K logprobs from it, and ``acceptance_length`` walks the held-out rows on the server's greedy ids.
- ``local``: the target run in the asset's process by transformers.

What is compared: the feature shards the served run stored (per row: the ``[T, 3H]`` aux hidden states) with the
local capture of the same rows; the two drafters, tensor by tensor; the step losses and the held-out tau.

Tolerance, and why: SGLang runs the target in float32 (``--dtype float32``) with its ``torch_native`` attention and
its own RMSNorm/rotary code; transformers runs it in float32 with SDPA. Measured on 2026-12-05: the aux states were
equal bit for bit, the logprobs within 1.9e-6, and after training the weights within 3.3e-5 per element (tensors of
magnitude ~0.1). The test allows 1e-4 on features and logprobs and 5e-4 per weight element, as
``test_served_training`` does for its float64 server; a wrong row, position, layer or teacher differs by order 1 and
cannot pass. Tau is a ratio of argmax counts and must be equal unless two logits tie within float32 rounding.

The rows: chat prompts with 24 tokens the demo target sampled (seeded, temperature 1, by our embedded engine in
this process: SGLang's seeded sampling needs a compiled kernel the stand-in lacks), so held-out rows leave the greedy
path and the acceptance walk asks the real server for greedy tokens after prefixes off the row.
"""

from __future__ import annotations

import json
import os
import tempfile
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoTokenizer

from eagle_assets_tests.dagster_runs import materialize_training
from eagle_assets_tests.real_sglang import sglang_env

pytestmark = pytest.mark.slow(seconds=150)  # one real server start, two small trainings

QUESTIONS = ["What is 7 times 6?", "Write a function that reverses a list.", "Why do leaves fall?",
             "Name two planets.", "Convert 3 hours to minutes.", "Give a word that rhymes with cat.",
             "What is the capital of France?", "Add 12 and 30.", "Describe a cat in one line.",
             "How many legs does a spider have?", "Spell the word apple.", "What color is the sky?"]
NEW_TOKENS = 24
CAPTURE = [1, 3, 7]
KEY_ENV = "EAGLE_REAL_SGLANG_KEY"
PLANTED_KEY = f"sk-planted-{uuid.uuid4().hex}"


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    pass


def _qc_partition(directory: Path, target8: Path) -> None:
    """A passing partition's QC shard of the target's own sampled rows (module docstring)."""
    from eagle_assets.serving.server import serve_in_thread

    tok = AutoTokenizer.from_pretrained(str(target8))
    prompts = []
    for q in QUESTIONS:
        text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        prompts.append(list(tok(text, add_special_tokens=False)["input_ids"]))
    records = []
    with serve_in_thread(str(target8)) as ours:
        for i, prompt in enumerate(prompts):
            body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 1.0,
                                                             "sampling_seed": i, "ignore_eos": True}}
            req = urllib.request.Request(ours.url + "/generate", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as resp:
                ids = prompt + json.loads(resp.read())["output_ids"]
            records.append({"sample_id": f"s{i:03d}", "input_ids": ids, "n_prompt_tokens": len(prompt),
                            "loss_mask": [0] * len(prompt) + [1] * NEW_TOKENS})
    schema = pa.schema([("sample_id", pa.string()), ("input_ids", pa.list_(pa.int32())),
                        ("loss_mask", pa.list_(pa.int8())), ("n_prompt_tokens", pa.int32())])
    directory.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(records, schema=schema), directory / "shard-00000.parquet")
    (directory / "qc_status.json").write_text(json.dumps({"passed": True, "kept": len(records)}))


def _materialize(tmp: Path, target8: Path, qc_dir: Path, features: dict, server: dict) -> tuple[Path, dict, list]:
    """draft_vocab + training_mix + drafter_checkpoint of a one-partition catalog; (stage dir, checks, logs)."""
    import shutil

    from eagle_assets.definitions import build_definitions

    vocab_size = int(json.loads((target8 / "config.json").read_text())["vocab_size"])
    tmp.mkdir()
    (tmp / "source.jsonl").write_text("")  # the partition's source; never read here
    features = {**features, "top_k": vocab_size} if features["source"] == "served" else features
    training = {"draft_vocab_size": 256, "ttt_steps": 3, "epochs": 3, "lr": 3.0e-3, "batch_tokens": 128,
                "max_length": 512, "holdout_fraction": 0.4, "validation_rows": 1, "acceptance_k": 3,
                "min_tau_margin": 0.05, "tau_warn": 1.0, "threads": 1, "warmup_steps": 1, "save_every_steps": 0,
                "seed": 0, "mix": {"bucket_caps": []}, "aux_layer_ids": CAPTURE, "features": features}
    catalog = {"target": {"model": str(target8)}, "server": server,
               "partitions": {"P1": {"sources": [{"path": str(tmp / "source.jsonl"), "format": "messages"}],
                                     "sampling": {"max_new_tokens": 32}}},
               "training": training}
    path = tmp / "rs.yaml"
    path.write_text(yaml.safe_dump(catalog))
    store = tmp / "store"
    shutil.copytree(qc_dir, store / "rs" / "qc_shards" / "P1")
    defs = build_definitions(path, storage_root=store)
    result, logs = materialize_training(defs)
    assert result.success, "\n".join(logs[-30:])
    checks = {e.check_name: e for e in result.get_asset_check_evaluations()}
    return store / "rs" / "drafter_checkpoint", checks, logs


@pytest.fixture(scope="module")
def runs(sglang_python, target8, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("real_sglang_features")
    qc_dir = tmp / "qc"
    _qc_partition(qc_dir, target8)
    with pytest.MonkeyPatch.context() as mp:
        for name, value in sglang_env().items():
            mp.setenv(name, value)
        # the real server requires a key it gets through the supervisor's FIFO (never argv): every capture
        # request must carry it, and no file of the run may hold it
        mp.setenv(KEY_ENV, PLANTED_KEY)
        served = _materialize(tmp / "served", target8, qc_dir, {"source": "served", "teacher": "topk"},
                              {"launch": "sglang", "python": str(sglang_python), "device": "cpu",
                               "api_key_env": KEY_ENV,
                               "extra_args": ["--max-total-tokens", "8192"]})
    local = _materialize(tmp / "local", target8, qc_dir, {"source": "local"}, {"launch": "embedded"})
    return served, local, qc_dir


def test_sglang_aux_capture_gives_the_local_features(runs, target8):
    """Every stored row: SGLang's aux hidden states, its top-K (= whole vocab) logprobs and its greedy ids against
    the same row run by transformers in this process."""
    from eagle_assets.drafter.features.local_capture import run_target
    from eagle_assets.drafter.features.shard_format import FeatureSpec, read_rows, verify_shard
    from eagle_assets.drafter.training.loop import load_target

    (stage, _, logs), _, qc_dir = runs
    assert any("features served by http://127.0.0.1:" in m for m in logs), logs
    shards = sorted((stage / "features").glob("features-*.safetensors"))
    assert shards, "the served run stored no feature shards"
    qc_rows = {tuple(ids) for ids in pq.read_table(qc_dir / "shard-00000.parquet").column("input_ids").to_pylist()}
    target = load_target(target8)
    head = target.get_output_embeddings().weight.float()
    rows, aux_gap, logprob_gap = 0, 0.0, 0.0
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            stored = json.loads(f.metadata()["spec"])
        assert stored["capture_ids"] == CAPTURE and stored["flag_layer_ids"] == [c - 1 for c in CAPTURE]
        spec = FeatureSpec(**{**stored, "capture_ids": tuple(stored["capture_ids"]),
                              "flag_layer_ids": tuple(stored["flag_layer_ids"])})
        for row in read_rows(verify_shard(shard, spec)):
            assert tuple(row.input_ids.tolist()) in qc_rows, "a feature row that is not a training row"
            with torch.no_grad():
                aux, final = run_target(target, torch.from_numpy(row.input_ids), CAPTURE)
                logprobs = torch.log_softmax(final[0] @ head.T, dim=-1)
            assert row.aux_hidden.shape == aux[0].shape == (row.input_ids.size, 3 * 128)
            aux_gap = max(aux_gap, float((row.aux_hidden - aux[0]).abs().max()))
            local = logprobs[torch.from_numpy(row.teacher_positions)]
            logprob_gap = max(logprob_gap, float((row.teacher_logprobs - local.gather(1, row.teacher_ids)).abs().max()))
            assert np.array_equal(row.target_greedy[:-1], logprobs.argmax(-1).numpy()[:-1])
            rows += 1
    assert rows >= 6
    assert aux_gap < 1e-4 and logprob_gap < 1e-4, (aux_gap, logprob_gap)


def test_the_drafter_trained_on_sglang_features_is_the_local_drafter(runs):
    (served_stage, served_checks, _), (local_stage, local_checks, _), _ = runs
    a = load_file(str(local_stage / "checkpoint" / "model.safetensors"))
    b = load_file(str(served_stage / "checkpoint" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name, w in a.items():
        if not w.is_floating_point():  # d2t / t2d: the same draft vocab
            assert torch.equal(b[name], w), name
            continue
        torch.testing.assert_close(b[name], w, atol=5e-4, rtol=0, msg=name)
    ma = json.loads((local_stage / "training_metrics.json").read_text())
    mb = json.loads((served_stage / "training_metrics.json").read_text())
    assert mb["rows_used"] == ma["rows_used"] > 0
    np.testing.assert_allclose([s["loss"] for s in mb["steps"]], [s["loss"] for s in ma["steps"]], rtol=1e-4)
    ta, tb = (c["acceptance_length"] for c in (local_checks, served_checks))
    assert ta.passed and tb.passed
    assert tb.metadata["mean_tau"].value == pytest.approx(ta.metadata["mean_tau"].value, abs=1e-9)


def test_the_real_sglang_got_its_key_through_the_fifo_and_no_file_holds_it(runs):
    """SGLang 0.5.23 launched by the server resource required the planted key (the capture requests carried it, or
    training would have had no features) and logged its ``server_args`` with ``api_key`` redacted."""
    (served_dir, _, _), _, _ = runs
    logs = list(Path(tempfile.gettempdir()).glob(f"eagle-assets-server-*/sglang-server-{os.getpid()}-*.log"))
    assert logs, "the launched SGLang's log was not found"
    text = "\n".join(p.read_text(errors="replace") for p in logs)
    assert "'api_key': '***'" in text and PLANTED_KEY not in text
    store = served_dir.parents[1]
    leaked = [str(p) for p in store.rglob("*") if p.is_file() and PLANTED_KEY.encode() in p.read_bytes()]
    assert leaked == []
