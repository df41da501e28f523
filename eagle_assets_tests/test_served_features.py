"""Drafter features served over SGLang's aux-capture protocol: an 8-layer variant of the embedded demo target
(conftest ``target8``: its trained layers and four near-identity ones, so SGLang's default capture ids ``[2, 4, 5]``
and other layer sets exist) behind our real HTTP server, compared with the trainer's local features
(eagle_assets.drafter.features.local_capture) computed in this process.

What is real here: that target (a real Qwen3 checkpoint directory), the aiohttp server and its engine, HTTP, orjson, the
safetensors shards on disk, the drafter's TTT loss and AdamW. What is not: SGLang itself (no GPU here); its side of
the protocol is read from the 0.5.23 source (eagle_assets.serving.aux_capture, eagle_assets.serving.server) and the
pure rules (layer ids per model class) are tested against that reading below.
"""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eagle_assets.drafter.features.local_capture import aux_layer_ids, head_argmax, head_logits, run_target
from eagle_assets.drafter.features.served_cache import (
    ServedFeatureCache,
    served_features,
    served_supervision,
    target_to_draft_index,
)
from eagle_assets.drafter.features.served_client import (
    RefusedRow,
    ReplyRefused,
    ServedFeaturesError,
    ServedFeatureSource,
    ServedFeaturesSpec,
)
from eagle_assets.drafter.features.shard_format import FeatureShardError, FeatureSpec, content_sha256, verify_shard
from eagle_assets.drafter.features.target_weights import read_target_tensor
from eagle_assets.drafter.features.teacher import supervision, teacher_positions
from eagle_assets.serving.aux_capture import (
    AuxCapture,
    AuxCaptureError,
    capture_ids_from_flag,
    flag_ids_for_capture,
)
from eagle_assets.serving.launch import launched_server
from eagle_assets.serving.server import ModelServer, serve_in_thread

pytestmark = pytest.mark.slow(seconds=50)  # its share of a parallel session: scheduled early (conftest)

QUESTIONS = ["What is 12 plus 30?", "Write a function that adds two numbers.", "Why is the sky blue?",
             "List three prime numbers.", "Convert 5 km to meters.", "Name a sorting algorithm."]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    pass


@pytest.fixture(scope="module")
def served(target8):
    with serve_in_thread(str(target8), enable_return_aux_hidden_states=True,
                         speculative_algorithm="EAGLE3") as running:
        yield running


@pytest.fixture(scope="module")
def local(target8):
    """The target as the trainer loads it (float32, eval)."""
    return AutoModelForCausalLM.from_pretrained(str(target8), dtype=torch.float32).eval()


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


@pytest.fixture(scope="module")
def rows(target8, served):
    """The target's own greedy rows: chat prompt + 24 generated tokens, loss mask on the generated ones."""
    tok = AutoTokenizer.from_pretrained(str(target8))
    out = []
    for q in QUESTIONS:
        text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        prompt = list(tok(text, add_special_tokens=False)["input_ids"])
        reply = _post(served.url, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 24, "temperature": 0,
                                                                             "ignore_eos": True}})
        ids = np.array(prompt + reply["output_ids"], dtype=np.int64)
        mask = np.zeros(ids.size, dtype=np.int8)
        mask[len(prompt):] = 1
        out.append((ids, mask))
    return out


def _source(target8, url, **settings) -> ServedFeatureSource:
    spec = ServedFeaturesSpec(source="served", url=url, **settings)
    return ServedFeatureSource(str(target8), spec, target_name="demo")


def _vocab(local) -> int:
    return int(local.config.vocab_size)


# ------------------------------------------------------------------------------------------------ the protocol
def test_reply_shapes_follow_sglang(served, local, rows):
    ids, _ = rows[0]
    t, w = ids.size, 3 * local.config.hidden_size
    base = {"input_ids": ids.tolist(), "return_hidden_states": True}
    one = _post(served.url, {**base, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    assert [len(one["meta_info"]["hidden_states"]), len(one["meta_info"]["hidden_states"][0])] == [1, t]
    assert {len(r) for r in one["meta_info"]["hidden_states"][0]} == {w}  # 3H: three layers, no final state
    # max_new_tokens 0: prefill-only, and SGLang's hidden_states[:finished_len] leaves nothing
    zero = _post(served.url, {**base, "sampling_params": {"max_new_tokens": 0}})
    assert zero["output_ids"] == [] and zero["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert zero["meta_info"]["hidden_states"] == []
    # three tokens: the prompt block, then one row per fed token (the last sampled token is never fed)
    three = _post(served.url, {**base, "sampling_params": {"max_new_tokens": 3, "temperature": 0,
                                                           "ignore_eos": True}})
    hs = three["meta_info"]["hidden_states"]
    assert len(hs) == 3 and len(hs[0]) == t and len(hs[1]) == w and len(hs[2]) == w
    extended = torch.tensor(ids.tolist() + three["output_ids"][:2])
    aux, _ = run_target(local, extended, aux_layer_ids(local.config.num_hidden_layers))
    decoded = torch.tensor([hs[1], hs[2]], dtype=torch.float32)
    torch.testing.assert_close(decoded, aux[0, t:t + 2], atol=1e-4, rtol=1e-4)
    last = _post(served.url, {**base, "return_hidden_states": "last", "sampling_params": {"max_new_tokens": 1}})
    assert len(last["meta_info"]["hidden_states"]) == w


def test_server_refuses_hidden_states_it_was_not_launched_for(target8):
    with serve_in_thread(str(target8)) as plain:
        req = urllib.request.Request(plain.url + "/generate", data=json.dumps(
            {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}, "return_hidden_states": True}).encode())
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req)
        assert err.value.code == 400 and "not configured to return hidden states" in err.value.read().decode()
        source = _source(target8, plain.url)
        with pytest.raises(ServedFeaturesError, match="not launched in aux-capture mode"):
            source.check_server()


def test_server_flag_checks_mirror_sglang(target8):
    with pytest.raises(AuxCaptureError, match="requires --enable-return-aux-hidden-states"):
        ModelServer(str(target8), return_aux_hidden_state_layer_ids=[1, 3, 4])
    with pytest.raises(AuxCaptureError, match="needs --speculative-algorithm EAGLE3"):
        ModelServer(str(target8), enable_return_aux_hidden_states=True)
    with pytest.raises(AuxCaptureError, match="out of range"):
        ModelServer(str(target8), enable_return_aux_hidden_states=True, speculative_algorithm="EAGLE3",
                    return_aux_hidden_state_layer_ids=[1, 3, 8])
    with pytest.raises(AuxCaptureError, match="would be the input of layer 8"):  # plus_one: 7 -> capture 8
        ModelServer(str(target8), enable_return_aux_hidden_states=True, speculative_algorithm="EAGLE3",
                    return_aux_hidden_state_layer_ids=[1, 3, 7])


def test_layer_id_rules_per_model_class():
    # llama/qwen: +1 always; the default is capture ids [2, L//2, L-3]
    assert capture_ids_from_flag(None, 36, "plus_one") == [2, 18, 33]
    assert capture_ids_from_flag([1, 17, 32], 36, "plus_one") == [2, 18, 33]
    # deepseek_v2.py (DeepSeek-V3/R1, Kimi-K2.5's language model): +1 only when the list starts with 1
    assert capture_ids_from_flag(None, 61, "deepseek") == [2, 30, 58]
    assert capture_ids_from_flag([1, 29, 57], 61, "deepseek") == [2, 30, 58]
    assert capture_ids_from_flag([2, 30, 58], 61, "deepseek") == [2, 30, 58]
    assert capture_ids_from_flag([30, 2, 58], 61, "deepseek") == [2, 30, 58]  # columns come out ascending
    assert capture_ids_from_flag([0, 29, 57], 61, "plus_one") == [1, 30, 58]
    # gpt_oss.py keeps ids as given only when max(ids) == L, which capture-only mode refuses at launch (>= L)
    assert capture_ids_from_flag([1, 30, 58], 64, "gpt_oss") == [2, 31, 59]
    with pytest.raises(AuxCaptureError, match="out of range"):
        capture_ids_from_flag([31, 63, 64], 64, "gpt_oss")
    for convention in ("plus_one", "deepseek", "gpt_oss"):
        for caps in ([2, 30, 58], [1, 30, 58], [5, 9, 59]):
            flag = flag_ids_for_capture(caps, convention)
            assert capture_ids_from_flag(flag, 61, convention) == caps, (convention, caps, flag)
    assert flag_ids_for_capture([1, 30, 58], "deepseek")[0] != 1  # a leading 1 would shift every id


def test_launch_flags(target8):
    kimi = AuxCapture(layer_ids=None, max_row_tokens=16384)
    assert kimi.server_args("sglang") == ["--speculative-algorithm", "EAGLE3", "--enable-return-aux-hidden-states",
                                          "--disable-radix-cache", "--chunked-prefill-size", "16384"]
    custom = AuxCapture(layer_ids=(58, 1, 30))
    assert custom.server_args("embedded", ["--speculative-algorithm", "EAGLE3"]) == [
        "--enable-return-aux-hidden-states", "--return-aux-hidden-state-layer-ids", "58", "1", "30"]
    # the embedded CLI takes the same flags as SGLang and reports what it captures in /server_info
    with launched_server(str(target8), aux_capture=AuxCapture(layer_ids=(0, 3, 5))) as srv:
        with urllib.request.urlopen(srv.url + "/server_info") as resp:
            info = json.loads(resp.read())
    assert "--enable-return-aux-hidden-states" in srv.command
    assert info["enable_return_aux_hidden_states"] is True and info["aux_capture_ids"] == [1, 4, 6]
    assert info["return_aux_hidden_state_layer_ids"] == [0, 3, 5] and info["speculative_algorithm"] is None


def test_sglang_command_passes_non_default_layer_ids(target8):
    """The sglang launch mode's command line for served features: ``--return-aux-hidden-state-layer-ids`` only
    when the catalog's ``aux_layer_ids`` (capture ids) differ from SGLang's default, written under the target's
    own layer-id rule (built, not run: no SGLang here)."""
    from eagle_assets.serving.launch import server_command

    def command(config, capture_ids, **kw):
        return server_command("/models/m", launch="sglang", port=30000, python="python",
                              aux_capture=AuxCapture.for_target(config, capture_ids, max_row_tokens=4096), **kw)

    qwen3 = json.loads((target8 / "config.json").read_text())  # 8 layers, +1 rule, default [2, 4, 5]
    cmd = command(qwen3, None)
    assert cmd == ["python", "-m", "sglang.launch_server", "--model-path", "/models/m", "--host", "127.0.0.1",
                   "--port", "30000", "--speculative-algorithm", "EAGLE3", "--enable-return-aux-hidden-states",
                   "--disable-radix-cache", "--chunked-prefill-size", "8192"]
    assert command(qwen3, [5, 2, 4]) == cmd  # the default set, in any order: no flag
    cmd = command(qwen3, [1, 3, 7])
    i = cmd.index("--return-aux-hidden-state-layer-ids")
    assert cmd[i + 1:i + 4] == ["0", "2", "6"] and "--return-aux-hidden-state-layer-ids" not in cmd[i + 4:]
    assert capture_ids_from_flag([0, 2, 6], 8, "plus_one") == [1, 3, 7]
    # DeepSeek-V3/R1 and Kimi-K2.5 (deepseek_v2.py's rule): ids as given, unless the list starts with 1
    deepseek = {"model_type": "deepseek_v3", "num_hidden_layers": 61}
    kimi = {"model_type": "kimi_k25", "text_config": {"model_type": "kimi_k2", "num_hidden_layers": 61}}
    for config in (deepseek, kimi):
        assert "--return-aux-hidden-state-layer-ids" not in command(config, [2, 30, 58])
        cmd = command(config, [3, 30, 57])
        i = cmd.index("--return-aux-hidden-state-layer-ids")
        assert cmd[i + 1:i + 4] == ["3", "30", "57"]
        cmd = command(config, [1, 30, 58])  # a leading 1 would shift every id: the largest goes first
        i = cmd.index("--return-aux-hidden-state-layer-ids")
        assert cmd[i + 1:i + 4] == ["58", "1", "30"]
        assert capture_ids_from_flag([58, 1, 30], 61, "deepseek") == [1, 30, 58]
    # the user's own flags win, and the API key is not on SGLang's command line (the supervisor hands it over)
    cmd = command(deepseek, [3, 30, 57], extra_args=["--tp", "8", "--chunked-prefill-size", "32768"],
                  api_key_env="EAGLE_ASSETS_TEST_KEY")
    assert cmd.count("--chunked-prefill-size") == 1 and cmd[cmd.index("--chunked-prefill-size") + 1] == "32768"
    assert "--api-key" not in cmd and "EAGLE_ASSETS_TEST_KEY" not in cmd
    with pytest.raises(AuxCaptureError, match="would be the input of layer 8"):  # no layer 8 to capture the input of
        AuxCapture.for_target(qwen3, [2, 4, 8])


# --------------------------------------------------------------------------------------- features vs local ones
def test_served_aux_hidden_states_equal_local_features(target8, served, local, rows):
    source = _source(target8, served.url, teacher="hard")
    assert source.capture_ids == aux_layer_ids(local.config.num_hidden_layers) == [2, 4, 5]
    got = list(served_features(rows, source))
    assert all(not isinstance(f, RefusedRow) for f in got)
    for (ids, mask), f in zip(rows, got):
        aux, _ = run_target(local, torch.from_numpy(ids), source.capture_ids)
        assert f.aux_hidden.dtype == torch.float32 and f.aux_hidden.shape == aux[0].shape
        torch.testing.assert_close(f.aux_hidden, aux[0], atol=1e-4, rtol=1e-4)
        q = teacher_positions(mask)
        np.testing.assert_array_equal(f.teacher_positions, q)
        np.testing.assert_array_equal(f.greedy.numpy(), ids[q + 1])  # hard labels: the row's own tokens
    # the rows are the target's own greedy output: the server's greedy agrees with every label
    assert source.stats.teacher_positions == sum(int(m[1:].sum()) for _, m in rows)
    assert source.stats.hard_label_disagreement == 0.0
    # another layer set through the flag, under the demo's (Qwen3: plus_one) rule
    with serve_in_thread(str(target8), enable_return_aux_hidden_states=True, speculative_algorithm="EAGLE3",
                         return_aux_hidden_state_layer_ids=[0, 2, 6]) as other:
        src = ServedFeatureSource(str(target8), ServedFeaturesSpec(source="served", url=other.url),
                                  capture_ids=[1, 3, 7])
        assert src.flag_layer_ids == [0, 2, 6]
        f = next(served_features(rows[:1], src))
        aux, _ = run_target(local, torch.from_numpy(rows[0][0]), [1, 3, 7])
        torch.testing.assert_close(f.aux_hidden, aux[0], atol=1e-4, rtol=1e-4)
        with pytest.raises(ServedFeaturesError, match=r"captures layers \[1, 3, 7\]"):
            _source(target8, other.url).check_server()  # expects the default [2, 4, 5]


def test_topk_teacher_matches_local_logprobs(target8, served, local, rows):
    k = 8
    source = _source(target8, served.url, teacher="topk", top_k=k)
    for (ids, mask), f in zip(rows, served_features(rows, source)):
        _, final = run_target(local, torch.from_numpy(ids), source.capture_ids)
        q = torch.from_numpy(teacher_positions(mask))
        logp = torch.log_softmax(head_logits(local, final[0, q]).double(), dim=-1)
        vals, top_ids = torch.topk(logp, k, dim=-1)
        torch.testing.assert_close(f.teacher_logprobs.double(), vals, atol=1e-4, rtol=1e-4)
        # ids agree except where two logprobs tie within float noise
        same = f.teacher_ids == top_ids
        assert bool(same[:, 0].all()) and float(same.double().mean()) > 0.98
        np.testing.assert_array_equal(f.greedy.numpy(), logp.argmax(-1).numpy())
        # the greedy id at every position, for acceptance simulation without the target
        np.testing.assert_array_equal(f.target_greedy, head_argmax(local, final[0]).numpy())


def _draft_vocab(rows, vocab_size, size):
    from eagle_assets.drafter.data.vocab import build_draft_vocab, count_completion_tokens

    return build_draft_vocab(count_completion_tokens(rows, vocab_size), vocab_size, size)


def test_full_vocab_topk_teacher_is_the_local_teacher(target8, served, local, rows):
    vocab = _draft_vocab(rows, _vocab(local), 256)
    source = _source(target8, served.url, teacher="topk", top_k=_vocab(local))
    feats = list(served_features(rows, source))
    in_draft = torch.from_numpy(vocab.t2d)
    draft_ids = torch.from_numpy(vocab.draft_token_ids)
    head = local.get_output_embeddings().weight.detach()[draft_ids].float()
    teachers = [teacher_positions(m) for _, m in rows]
    local_feats = []
    for ids, mask in rows:
        aux, final = run_target(local, torch.from_numpy(ids), source.capture_ids)
        q = torch.from_numpy(teacher_positions(mask))
        greedy = head_logits(local, final[0, q]).argmax(-1)
        local_feats.append((aux[0], final[0, q], greedy))
    want = supervision(teachers, local_feats, in_draft, head, None)
    got = served_supervision(teachers, feats, in_draft, target_to_draft_index(vocab.draft_token_ids,
                                                                              vocab.target_vocab_size))
    assert got.out_of_draft == want.out_of_draft
    torch.testing.assert_close(got.row, want.row)
    torch.testing.assert_close(got.position, want.position)
    torch.testing.assert_close(got.greedy, want.greedy)
    torch.testing.assert_close(got.teacher_p, want.teacher_p, atol=1e-5, rtol=1e-4)


def test_training_on_served_features_gives_the_local_drafter(target8, served, local, rows):
    """A few TTT optimizer steps from the same seed: local features vs features served over HTTP."""
    from eagle_assets.drafter.eagle3.model import DrafterConfig, Eagle3DraftModel
    from eagle_assets.drafter.eagle3.ttt_loss import ttt_loss
    from eagle_assets.drafter.features.local_cache import make_batches, pad, prepare_rows

    V = _vocab(local)
    vocab = _draft_vocab(rows, V, 256)
    prepared, _, _ = prepare_rows(rows, V, 4096)
    batches = make_batches(prepared, 256)
    capture = aux_layer_ids(local.config.num_hidden_layers)
    draft_ids = torch.from_numpy(vocab.draft_token_ids)
    in_draft = torch.from_numpy(vocab.t2d)
    head = local.get_output_embeddings().weight.detach()[draft_ids].float()
    embed = read_target_tensor(target8, "embed_tokens.weight").float()  # no model needed for the drafter
    torch.testing.assert_close(embed, local.get_input_embeddings().weight.detach().float())
    source = _source(target8, served.url, teacher="topk", top_k=V)
    cache = ServedFeatureCache(prepared, source, "memory", vocab.draft_token_ids, vocab.target_vocab_size)
    assert cache.usable() == list(range(len(prepared)))

    dconf = DrafterConfig.from_target(local.config, vocab.draft_vocab_size, capture)
    torch.manual_seed(0)
    init = {k: v.clone() for k, v in Eagle3DraftModel(dconf, embed_weight=embed).state_dict().items()}

    def train(served_path: bool) -> dict[str, torch.Tensor]:
        model = Eagle3DraftModel(dconf, embed_weight=embed, draft_token_ids=draft_ids).train()
        model.load_state_dict(init)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        for _ in range(2):
            for batch in batches:
                teachers = [prepared[i].teacher for i in batch]
                ids = pad([prepared[i].ids for i in batch])
                if served_path:
                    feats = cache.get(batch)
                    sup = cache.supervision(teachers, feats, in_draft)
                else:
                    feats = []
                    for i in batch:
                        aux, final = run_target(local, torch.from_numpy(prepared[i].ids), capture)
                        h = final[0, torch.from_numpy(prepared[i].teacher)]
                        feats.append((aux[0], h, head_logits(local, h).argmax(-1)))
                    sup = supervision(teachers, feats, in_draft, head, None)
                aux = torch.nn.utils.rnn.pad_sequence([f[0] for f in feats], batch_first=True)
                loss, _ = ttt_loss(model, aux, ids, sup, [0.8**i for i in range(3)], draft_ids)
                opt.zero_grad()
                loss.backward()
                opt.step()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    served_weights, local_weights = train(True), train(False)
    moved = max(float((local_weights[k] - w).abs().max()) for k, w in init.items())
    assert moved > 1e-3  # the steps changed the drafter far more than the tolerance below
    # the features differ by float32 rounding (our server computes in float64), which AdamW's normalized steps
    # carry into the weights at about 1e-5: 4 orders of magnitude below how far training moved them
    for name, w in local_weights.items():
        torch.testing.assert_close(served_weights[name], w, atol=1e-4, rtol=1e-4, msg=name)
        step = float((w - init[name]).norm())
        assert float((served_weights[name] - w).norm()) <= 1e-3 * max(step, 1e-6), name


# ------------------------------------------------------------------------------------------------- the shards
def test_shard_cache_round_trip_and_refusals(target8, served, rows, tmp_path):
    source = _source(target8, served.url, teacher="topk", top_k=4, shard_mb=0.1)
    first = list(served_features(rows, source, cache_dir=tmp_path))
    shards = sorted(tmp_path.glob("features-*.safetensors"))
    assert source.stats.shards_written == len(shards) >= 2
    requests = source.stats.requests
    again = list(served_features(rows, source, cache_dir=tmp_path))
    assert source.stats.requests == requests  # every shard verified and reused: no request sent
    assert source.stats.shards_reused == len(shards)
    for a, b in zip(first, again):
        assert torch.equal(a.aux_hidden, b.aux_hidden) and torch.equal(a.teacher_ids, b.teacher_ids)
        assert torch.equal(a.teacher_logprobs, b.teacher_logprobs) and torch.equal(a.greedy, b.greedy)

    # a flipped byte in the tensor data: the content hash refuses the shard, which is fetched and written again
    raw = bytearray(shards[0].read_bytes())
    raw[-9] ^= 0x40
    shards[0].write_bytes(bytes(raw))
    with pytest.raises(FeatureShardError, match="content hash mismatch"):
        verify_shard(shards[0], source.spec)
    third = list(served_features(rows, source, cache_dir=tmp_path))
    assert source.stats.shards_refused["hash_mismatch"] == 1 and source.stats.requests > requests
    verify_shard(shards[0], source.spec)
    assert all(torch.equal(a.aux_hidden, b.aux_hidden) for a, b in zip(first, third))

    # features of other layers are refused by name, whatever their hash says
    other = FeatureSpec(**{**source.spec.__dict__, "capture_ids": (1, 3, 7), "flag_layer_ids": (0, 2, 6)})
    with pytest.raises(FeatureShardError, match=r"capture layers \[2, 4, 5\].*this run uses \[1, 3, 7\]"):
        verify_shard(shards[0], other)

    # a NaN written with a matching hash (a bug upstream, not a bad disk) is refused by the finite check
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(shards[0]), framework="pt") as f:
        meta = f.metadata()
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    tensors["aux_hidden"][0, 0] = float("nan")
    meta["content_sha256"] = content_sha256(tensors)
    save_file(tensors, str(shards[0]), metadata=meta)
    with pytest.raises(FeatureShardError, match="non-finite values in aux_hidden"):
        verify_shard(shards[0], source.spec)


def test_refused_rows_are_counted_not_fatal(target8, served, rows):
    source = _source(target8, served.url, teacher="hard")
    ids, mask = rows[0]
    raw = json.dumps(_post(served.url, json.loads(source.request_body(ids, "r0")))).encode()
    reply = json.loads(raw)
    reply["meta_info"]["hidden_states"][0] = reply["meta_info"]["hidden_states"][0][3:]  # a cut prefill
    with pytest.raises(ReplyRefused, match="--chunked-prefill-size") as err:
        source.parse_features_reply("r0", ids, mask, json.dumps(reply).encode())
    assert err.value.reason == "short_prefill"
    reply = json.loads(raw)
    reply["meta_info"]["hidden_states"][0][2][5] = None  # how SGLang's orjson sends a NaN
    with pytest.raises(ReplyRefused) as err:
        source.parse_features_reply("r0", ids, mask, json.dumps(reply).encode())
    assert err.value.reason == "non_finite"
    reply = json.loads(raw)
    reply["meta_info"]["hidden_states"] = []
    with pytest.raises(ServedFeaturesError, match="max_new_tokens 0"):
        source.parse_features_reply("r0", ids, mask, json.dumps(reply).encode())
    # an invalid row (an id outside the vocab) is refused by the server with HTTP 400 and counted
    bad = (np.array([1, 2, 10**6, 3]), np.array([0, 0, 1, 1], dtype=np.int8))
    got = list(served_features([rows[1], bad, rows[2]], source))
    assert [type(g).__name__ for g in got] == ["RowFeatures", "RefusedRow", "RowFeatures"]
    assert source.stats.refused == {"bad_request": 1} and source.stats.rows_ok == 2


def test_feature_cache_modes_agree(target8, served, rows, tmp_path):
    from eagle_assets.drafter.features.local_cache import prepare_rows

    prepared, _, _ = prepare_rows(rows, 1 << 20, 4096)
    vocab = np.arange(64, dtype=np.int64)
    source = _source(target8, served.url, teacher="topk", top_k=3, shard_mb=0.1)
    caches = {mode: ServedFeatureCache(prepared, source, mode, vocab, 1 << 20,
                                       cache_dir=tmp_path if mode == "disk" else None)
              for mode in ("memory", "disk", "none")}
    batch = [3, 0, 5]
    want = caches["memory"].get(batch)
    for mode in ("disk", "none"):
        for (a, fa, ga), (b, fb, gb) in zip(want, caches[mode].get(batch)):
            assert torch.equal(a, b) and torch.equal(ga, gb) and torch.equal(fa.teacher_ids, fb.teacher_ids)
    # a renumbered view (how the trainer drops refused rows before batching) serves the same features
    view = caches["disk"].subset([5, 3])
    assert [len(r.ids) for r in view.rows] == [len(prepared[5].ids), len(prepared[3].ids)]
    assert torch.equal(view.get([1])[0][0], want[0][0]) and torch.equal(view.get([0])[0][0], want[2][0])


def test_workers_fill_one_cache_together(target8, served, rows, tmp_path):
    source = _source(target8, served.url, teacher="hard", shard_mb=0.05)  # ~35 tokens of 3H floats a shard
    parts = [list(served_features(rows, source, cache_dir=tmp_path, worker=w, workers=2)) for w in range(2)]
    assert min(len(p) for p in parts) >= 1 and sum(len(p) for p in parts) == len(rows)
    requests = source.stats.requests
    assert [f.row_id for f in served_features(rows, source, cache_dir=tmp_path)] == [str(i) for i in range(len(rows))]
    assert source.stats.requests == requests  # the union of both workers' shards is the whole cache


def test_source_without_url_until_a_server_is_launched(target8, served, rows):
    source = ServedFeatureSource(str(target8), ServedFeaturesSpec(source="served"))
    with pytest.raises(ServedFeaturesError, match="--enable-return-aux-hidden-states"):
        list(served_features(rows[:1], source))
    source.use_urls(served.url + "/generate")
    assert [type(f).__name__ for f in served_features(rows[:2], source)] == ["RowFeatures", "RowFeatures"]


class _FaultProxy:
    """An aiohttp proxy in front of the real server that spoils chosen replies (``script``: rid -> actions, one per
    attempt: ``short`` cuts the hidden-state block, ``503`` answers Service Unavailable, ``pass`` forwards)."""

    def __init__(self, upstream: str, script: dict[str, list[str]]):
        import asyncio
        import threading

        self.upstream, self.script, self.seen = upstream, {k: list(v) for k, v in script.items()}, []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    async def _generate(self, request):
        import aiohttp
        from aiohttp import web

        raw = await request.read()
        rid = json.loads(raw).get("rid")
        self.seen.append(rid)
        action = self.script.get(rid, []).pop(0) if self.script.get(rid) else "pass"
        if action == "503":
            return web.Response(status=503, text="busy")
        async with aiohttp.ClientSession() as session:
            async with session.post(self.upstream + "/generate", data=raw,
                                    headers={"Content-Type": "application/json"}) as resp:
                status, body = resp.status, await resp.read()
        if action == "short" and status == 200:
            reply = json.loads(body)
            reply["meta_info"]["hidden_states"][0] = reply["meta_info"]["hidden_states"][0][2:]
            body = json.dumps(reply).encode()
        return web.Response(status=status, body=body, content_type="application/json")

    async def _info(self, request):
        from aiohttp import web

        with urllib.request.urlopen(self.upstream + "/server_info") as resp:  # tiny, local: blocking is fine
            return web.Response(body=resp.read(), content_type="application/json")

    def __enter__(self):
        import asyncio

        from aiohttp import web

        self._thread.start()

        async def start():
            app = web.Application()
            app.router.add_post("/generate", self._generate)
            app.router.add_get("/server_info", self._info)
            self._runner = web.AppRunner(app, access_log=None)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            return site._server.sockets[0].getsockname()[1]

        self.url = f"http://127.0.0.1:{asyncio.run_coroutine_threadsafe(start(), self._loop).result(10)}"
        return self

    def __exit__(self, *exc):
        import asyncio

        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def test_bad_replies_are_retried_by_the_serving_client_then_refused(target8, served, rows):
    """HTTP, retries and backoff are the serving client's: a spoiled reply or a 503 is retried; a row whose replies
    stay unusable is refused with the reason after max_attempts, and the other rows are unaffected."""
    script = {"0": ["short"], "1": ["503", "503"], "2": ["short", "short", "short"]}
    with _FaultProxy(served.url, script) as proxy:
        source = _source(target8, proxy.url, teacher="hard", max_attempts=3, concurrency=2)
        got = list(served_features(rows[:4], source))
    assert [type(g).__name__ for g in got] == ["RowFeatures", "RowFeatures", "RefusedRow", "RowFeatures"]
    assert got[2].reason == "short_prefill" and "3 attempts" in got[2].detail
    assert "--chunked-prefill-size" in got[2].detail
    assert sorted(proxy.seen) == ["0", "0", "1", "1", "1", "2", "2", "2", "3"]
    assert source.stats.requests == 9 and source.stats.retries == 5
    assert source.stats.refused == {"short_prefill": 1} and source.stats.rows_ok == 3
    direct = list(served_features(rows[:2], _source(target8, served.url, teacher="hard")))
    assert all(torch.equal(a.aux_hidden, b.aux_hidden) for a, b in zip(got[:2], direct))
