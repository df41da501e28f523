"""The drafter trainer on served features (catalog ``training.features.source: served``) against the trainer on
local features: an 8-layer variant of the embedded demo target (conftest ``target8``) behind our real aiohttp
server in SGLang's aux-capture mode, and ``train_drafter`` end to end (rows, batches, TTT, AdamW, validation curve
with simulated acceptance, export).

What is real: that target, the server and its engine (float64), HTTP through the serving client, orjson, the
safetensors feature shards, the trainer. What is not: SGLang itself (no GPU here; docs/served_features.md says
what follows its source only).

Tolerance, and why: the server computes the target in float64 and sends each value as JSON text; a float64's
shortest repr parses back to the same float64, which is then rounded once to float32, so the JSON trip itself
loses nothing beyond that one rounding. The local path runs the same target in float32. So the two feature sets
(and the top-K = vocab teachers) differ by float32 rounding of the local forward, about 1e-6 relative. AdamW
divides each element's step by its own gradient scale, so that noise reaches the weights as about 1e-5 of how far
they moved (measured here: at most 6.5e-5 per tensor, Frobenius norm of the difference over the norm of the
training move) and, for the rare element whose gradient is near zero, as up to about 1e-4 absolute (measured
1.1e-4 in fc.weight at lr 3e-3). The test asks for every float tensor to lie within 1e-3 of its training move
(norm ratio) and within 5e-4 per element, and for the step losses (rtol 1e-4), the validation TTT loss (1e-4)
and the simulated tau (exact: greedy ids agree) to match; a wrong row, position, teacher or layer gives
differences of order 1 and cannot pass.
"""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from eagle_assets.catalog import FeaturesSpec, TrainingSpec
from eagle_assets.drafter.data.vocab import build_draft_vocab, count_completion_tokens
from eagle_assets.drafter.features.local_cache import prepare_rows
from eagle_assets.drafter.features.source import ServedFeatures, feature_source
from eagle_assets.drafter.training import loop as train_module
from eagle_assets.drafter.training.loop import train_drafter
from eagle_assets.drafter.training.recipe import TrainConfig
from eagle_assets.serving.server import serve_in_thread
from eagle_assets_tests.dagster_runs import materialize_training

pytestmark = pytest.mark.slow(seconds=40)  # its share of a parallel session: scheduled early (conftest)

QUESTIONS = ["What is 7 times 6?", "Write a function that reverses a list.", "Why do leaves fall?",
             "Name two planets.", "Convert 3 hours to minutes.", "Give a word that rhymes with cat."]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    pass


@pytest.fixture(scope="module")
def served(target8):
    with serve_in_thread(str(target8), enable_return_aux_hidden_states=True,
                         speculative_algorithm="EAGLE3") as running:
        yield running


def _generate(url: str, prompt: list[int], n: int) -> list[int]:
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())["output_ids"]


@pytest.fixture(scope="module")
def rows(target8, served):
    """Chat prompt + 20 tokens the target generated greedily (loss mask on them): 4 training, 2 validation rows.
    The validation rows' tail is replaced by other tokens after 10, so the acceptance simulation must re-run the
    target on prefixes off the row (served: a request each)."""
    tok = AutoTokenizer.from_pretrained(str(target8))
    out = []
    for q in QUESTIONS:
        text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        prompt = list(tok(text, add_special_tokens=False)["input_ids"])
        ids = np.array(prompt + _generate(served.url, prompt, 20), dtype=np.int64)
        mask = np.zeros(ids.size, dtype=np.int8)
        mask[len(prompt):] = 1
        out.append((ids, mask))
    for ids, mask in out[4:]:
        ids[-10:] = ids[-20:-10]
    return out[:4], out[4:]


def _config(**over) -> TrainConfig:
    base = dict(lr=3e-3, epochs=3, batch_tokens=128, ttt_steps=3, seed=0, max_length=512, num_threads=1,
                warmup_steps=1, acceptance_k=3, save_every_steps=0)
    base.update(over)
    return TrainConfig(**base)


def _vocab(train_rows, vocab_size: int):
    return build_draft_vocab(count_completion_tokens(train_rows, vocab_size), vocab_size, 256)


def test_catalog_switch():
    assert TrainingSpec().features.source == "local"
    assert TrainingSpec(features="served").features == FeaturesSpec(source="served")
    spec = TrainingSpec(features={"source": "served", "url": ["http://a:1", "http://b:2"], "teacher": "topk"})
    assert spec.features.urls == ["http://a:1", "http://b:2"] and spec.features.top_k == 20
    with pytest.raises(ValueError, match="not an http"):
        FeaturesSpec(source="served", url="feat-1:30000")
    with pytest.raises(ValueError, match="extra"):
        FeaturesSpec(source="served", teachr="topk")


def test_served_training_gives_the_local_drafter(target8, served, rows, tmp_path, monkeypatch):
    train_rows, validation = rows
    config = json.loads((target8 / "config.json").read_text())
    vocab_size = int(config["vocab_size"])
    vocab = _vocab(train_rows, vocab_size)
    cfg = _config()

    local = train_drafter(target8, train_rows, vocab, cfg, tmp_path / "local", validation_rows=validation)
    # where training started: the same seed with a learning rate too small to move anything
    train_drafter(target8, train_rows, vocab, _config(lr=1e-12), tmp_path / "init")

    # the served run must not load the target's weights: only config.json and the embedding tensor
    def no_target(_dir):
        raise AssertionError("the served path loaded the target model")

    monkeypatch.setattr(train_module, "load_target", no_target)
    spec = FeaturesSpec(source="served", url=served.url, teacher="topk", top_k=vocab_size, cache="disk",
                        cache_dir=str(tmp_path / "features"), shard_mb=0.2)
    lines: list[str] = []
    remote = train_drafter(target8, train_rows, vocab, cfg, tmp_path / "served", validation_rows=validation,
                           features=spec, log=lines.append)
    assert sorted((tmp_path / "features").glob("features-*.safetensors")), "no verified feature shards written"

    assert remote.rows_used == local.rows_used == 4 and remote.skip_reasons == local.skip_reasons == {}
    assert [s.supervised for s in remote.steps] == [s.supervised for s in local.steps]
    np.testing.assert_allclose([s.loss for s in remote.steps], [s.loss for s in local.steps], rtol=1e-4)
    # the validation curve: TTT loss from served teachers, tau from served greedy ids and served re-runs
    assert len(remote.curve) == len(local.curve) == 1
    assert remote.curve[0].val_tau == pytest.approx(local.curve[0].val_tau, abs=1e-9)
    assert remote.curve[0].val_loss == pytest.approx(local.curve[0].val_loss, rel=1e-4)

    init = load_file(str(tmp_path / "init" / "model.safetensors"))
    a = load_file(str(tmp_path / "local" / "model.safetensors"))
    b = load_file(str(tmp_path / "served" / "model.safetensors"))
    assert a.keys() == b.keys() == init.keys()
    moved = 0.0
    for name, w in a.items():
        if not w.is_floating_point():  # d2t / t2d: the same draft vocab
            assert torch.equal(b[name], w), name
            continue
        step = float((w.double() - init[name].double()).norm())
        gap = float((b[name].double() - w.double()).norm())
        moved = max(moved, step)
        assert gap <= 1e-3 * step, (name, gap, step)
        torch.testing.assert_close(b[name], w, atol=5e-4, rtol=0, msg=name)
    assert moved > 0.5  # training moved the weights far more than the tolerance
    assert json.loads((tmp_path / "served" / "config.json").read_text()) == \
        json.loads((tmp_path / "local" / "config.json").read_text())

    # a rerun on the same rows reads the verified shards: the same drafter, not one request to the server
    # (no validation rows here: their acceptance re-runs would ask the server for greedy tokens)
    before = _submitted(served.url)
    again = train_drafter(target8, train_rows, vocab, cfg, tmp_path / "again", features=spec)
    assert _submitted(served.url) == before
    c = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert all(torch.equal(c[n], b[n]) for n in b) and again.skip_reasons == {}


def test_a_dflash_block_drafter_trains_on_five_served_layers_as_on_local_ones(target8, rows, tmp_path, monkeypatch):
    """A block drafter on served features: five target layers (capture ids [1, 3, 4, 5, 6], K != 3) on a server
    launched with the flag ``AuxCapture.for_target`` derives for them (``0 2 3 4 5`` under Qwen3's ``+ 1`` rule),
    its aux rows equal to the target's own hidden states at those layers, and a DFlash draft (the target's LM head
    from safetensors, without building the target: the demo target ties it to the embedding) trained on them ends
    with the weights, step losses and validation loss of the local run."""
    from transformers import AutoModelForCausalLM

    from eagle_assets.drafter.family import DraftArchitecture
    from eagle_assets.drafter.features.served_client import ServedFeatureSource
    from eagle_assets.serving.aux_capture import AuxCapture

    train_rows, validation = rows
    config = json.loads((target8 / "config.json").read_text())
    vocab_size, capture = int(config["vocab_size"]), [1, 3, 4, 5, 6]
    flag = AuxCapture.for_target(config, capture).layer_ids
    assert flag == (0, 2, 3, 4, 5)
    cfg = _config(epochs=1, aux_layer_ids=tuple(capture), drafter=DraftArchitecture("dflash", block_size=4))
    vocab = _vocab(train_rows, vocab_size)
    local = train_drafter(target8, train_rows, vocab, cfg, tmp_path / "local", validation_rows=validation[:1])
    with serve_in_thread(str(target8), enable_return_aux_hidden_states=True, speculative_algorithm="EAGLE3",
                         return_aux_hidden_state_layer_ids=list(flag)) as server:
        spec = FeaturesSpec(source="served", url=server.url, teacher="topk", top_k=vocab_size, cache="memory")
        source = ServedFeatureSource(target8, spec, capture_ids=capture)
        source.check_server()
        ids, mask = train_rows[0]
        got = source.fetch_row("r0", ids, mask)
        target = AutoModelForCausalLM.from_pretrained(str(target8), dtype=torch.float32).eval()
        with torch.no_grad():
            states = target(torch.from_numpy(ids)[None], output_hidden_states=True).hidden_states
        torch.testing.assert_close(got.aux_hidden, torch.cat([states[c][0] for c in capture], -1), atol=1e-4,
                                   rtol=0)

        def no_target(_dir):
            raise AssertionError("the served path loaded the target model")

        monkeypatch.setattr(train_module, "load_target", no_target)
        remote = train_drafter(target8, train_rows, vocab, cfg, tmp_path / "served", validation_rows=validation[:1],
                               features=spec)
    assert remote.aux_capture_ids == local.aux_capture_ids == capture
    assert [s.supervised for s in remote.steps] == [s.supervised for s in local.steps]
    np.testing.assert_allclose([s.loss for s in remote.steps], [s.loss for s in local.steps], rtol=1e-4)
    assert remote.curve[0].val_loss == pytest.approx(local.curve[0].val_loss, rel=1e-4)
    a = load_file(str(tmp_path / "local" / "model.safetensors"))
    b = load_file(str(tmp_path / "served" / "model.safetensors"))
    assert a.keys() == b.keys() and a["fc.weight"].shape[1] == 5 * config["hidden_size"]
    for name, w in a.items():
        torch.testing.assert_close(b[name], w, atol=5e-4, rtol=0, msg=name)


def _submitted(url: str) -> int:
    with urllib.request.urlopen(url + "/server_info", timeout=30) as resp:
        return int(json.loads(resp.read())["engine"]["requests_submitted"])


def test_hard_teacher_rows_refused_by_the_server_are_skipped(target8, rows, tmp_path):
    """A server that refuses a row (here: longer than its context) costs that row, counted by reason, not the run;
    the hard teacher trains on the rows' own tokens."""
    train_rows, _ = rows
    lengths = [int(ids.size) for ids, _ in train_rows]
    context = max(lengths)  # the server refuses a prompt of context_length tokens or more (HTTP 400)
    refused = sum(n >= context for n in lengths)
    assert 0 < refused < len(lengths)
    config = json.loads((target8 / "config.json").read_text())
    vocab = _vocab(train_rows, int(config["vocab_size"]))
    with serve_in_thread(str(target8), enable_return_aux_hidden_states=True, speculative_algorithm="EAGLE3",
                         context_length=context) as short:
        spec = FeaturesSpec(source="served", url=short.url, teacher="hard", cache="memory")
        source = feature_source(target8, spec, train_module.load_target, lambda _l: None)
        assert isinstance(source, ServedFeatures)
        prepared, reasons, _ = prepare_rows(train_rows, int(config["vocab_size"]), 512)
        kept = source.admit(prepared, reasons, "train", [2, 4, 5], vocab)
        assert len(kept) == len(lengths) - refused and reasons == {"served_bad_request": refused}
        assert [r.ids.size for r in kept] == [n for n in lengths if n < context]
        assert source.source.stats.hard_label_disagreement == 0.0  # the rows are the target's own greedy output
        result = train_drafter(target8, train_rows, vocab, _config(epochs=1), tmp_path / "hard", features=spec)
    assert result.rows_used == len(lengths) - refused and result.skip_reasons == {"served_bad_request": refused}
    assert np.isfinite([s.loss for s in result.steps]).all()


def test_served_needs_a_url_and_a_model_directory(target8, tmp_path):
    with pytest.raises(ValueError, match="needs training.features.url"):
        feature_source(target8, FeaturesSpec(source="served"), train_module.load_target, print)
    with pytest.raises(ValueError, match="cache_dir"):
        feature_source(target8, FeaturesSpec(source="served", url="http://127.0.0.1:9"),
                       train_module.load_target, print)


def _qc_partition(directory, n: int, vocab: int, seed: int) -> None:
    """A passing partition's QC output written directly (a tiny random target cannot generate well-formed replies;
    the partition pipeline is tested elsewhere): one shard of ``n`` rows and its ``qc_status.json``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    gen = np.random.default_rng(seed)
    records = []
    for i in range(n):
        t = int(gen.integers(16, 33))
        prompt = int(gen.integers(4, t // 2))
        records.append({"sample_id": f"s{i:03d}", "input_ids": gen.integers(0, vocab, t).astype(np.int32).tolist(),
                        "loss_mask": [0] * prompt + [1] * (t - prompt), "n_prompt_tokens": prompt})
    schema = pa.schema([("sample_id", pa.string()), ("input_ids", pa.list_(pa.int32())),
                        ("loss_mask", pa.list_(pa.int8())), ("n_prompt_tokens", pa.int32())])
    directory.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(records, schema=schema), directory / "shard-00000.parquet")
    (directory / "qc_status.json").write_text(json.dumps({"passed": True, "kept": n}))


def test_drafter_checkpoint_asset_trains_on_served_features(tmp_path):
    """The asset with ``features: served`` and no URL: the pipeline's server resource launches our embedded server
    (a subprocess) with SGLang's capture flags for the catalog's non-default ``aux_layer_ids``, and
    ``drafter_checkpoint`` trains from its replies and passes its checks. (That served and local features give the
    same drafter is :func:`test_served_training_gives_the_local_drafter`; this test is the wiring.) The catalog also
    picks a non-default drafter (``training.drafter``: two layers with the EAGLE-3.1 switches), which the
    checkpoint's metadata, its export and the acceptance check report."""
    import yaml
    from tiny_targets import tiny_qwen3

    from eagle_assets.definitions import build_definitions

    vocab = 300
    target_dir = tmp_path / "target"
    tiny_qwen3(vocab, 8, initializer_range=1.0).save_pretrained(target_dir)
    (tmp_path / "source.jsonl").write_text("")  # the partition's source; never read here
    training = {"draft_vocab_size": 200, "ttt_steps": 3, "epochs": 2, "lr": 1.0e-2, "batch_tokens": 96,
                "holdout_fraction": 0.25, "validation_rows": 1, "acceptance_k": 3, "acceptance_max_positions": 8,
                "threads": 1, "warmup_steps": 1, "mix": {"bucket_caps": []}, "aux_layer_ids": [1, 3, 7],
                "features": {"source": "served", "teacher": "topk", "top_k": vocab},
                "drafter": {"architecture": "llama", "num_hidden_layers": 2, "fc_norm": True, "norm_output": True}}
    catalog = {"target": {"model": str(target_dir)}, "server": {"launch": "embedded"},
               "partitions": {"P1": {"sources": [{"path": str(tmp_path / "source.jsonl"), "format": "messages"}],
                                     "sampling": {"max_new_tokens": 32}}},
               "training": training}
    path = tmp_path / "served.yaml"
    path.write_text(yaml.safe_dump(catalog))
    store = tmp_path / "store"
    _qc_partition(store / "served" / "qc_shards" / "P1", 16, vocab, seed=1)
    defs = build_definitions(path, storage_root=store)
    result, logs = materialize_training(defs)
    assert result.success, "\n".join(logs[-30:])
    checks = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
    assert checks["export_contract"] is True
    drafter = "llama (2 layers, fc_norm, norm_output)"
    (mat,) = [e.materialization for e in result.get_asset_materialization_events()
              if e.asset_key.to_user_string() == "drafter_checkpoint"]
    assert mat.metadata["drafter_architecture"].value == drafter
    assert mat.metadata["sglang_class"].value == "LlamaForCausalLMEagle3" and mat.metadata["parameters"].value > 0
    (acceptance,) = [e for e in result.get_asset_check_evaluations() if e.check_name == "acceptance_length"]
    assert acceptance.metadata["drafter_architecture"].value == drafter
    assert acceptance.description.endswith(f"[drafter: {drafter}]")
    stage = store / "served" / "drafter_checkpoint"
    exported = json.loads((stage / "checkpoint" / "config.json").read_text())
    assert (exported["num_hidden_layers"], exported["fc_norm"], exported["norm_output"]) == (2, True, True)
    metrics = json.loads((stage / "training_metrics.json").read_text())
    assert metrics["rows_used"] > 0 and metrics["aux_capture_ids"] == [1, 3, 7]
    # The feature source checked the launched server's /server_info against capture ids [1, 3, 7] before the first
    # request, so the run succeeding means the resource passed --return-aux-hidden-state-layer-ids 0 2 6 (Qwen3's
    # +1 rule); the shards record both numberings.
    from safetensors import safe_open

    shards = sorted((stage / "features").glob("features-*.safetensors"))
    assert shards
    with safe_open(str(shards[0]), framework="pt") as f:
        spec = json.loads(f.metadata()["spec"])
    assert spec["capture_ids"] == [1, 3, 7] and spec["flag_layer_ids"] == [0, 2, 6]
    assert spec["teacher"] == "topk" and spec["top_k"] == vocab
