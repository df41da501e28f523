"""Checkpoint export: exact SGLang names/shapes/config, validator refusals, safetensors-only reload."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tiny_targets import tiny_qwen3
from transformers import AutoConfig

from eagle_assets.drafter.data.vocab import build_draft_vocab
from eagle_assets.drafter.eagle3.export import (
    EXPECTED_KEYS,
    CheckpointError,
    export_checkpoint,
    load_drafter,
    validate_checkpoint,
)
from eagle_assets.drafter.eagle3.model import DraftArchitecture, DrafterConfig, Eagle3DraftModel
from eagle_assets.drafter.features.local_capture import aux_layer_ids

VOCAB, HIDDEN, LAYERS, DRAFT = 300, 64, 8, 120


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    pass


@pytest.fixture(scope="module")
def target():
    return tiny_qwen3(VOCAB, LAYERS, hidden_size=HIDDEN, bos_token_id=1, eos_token_id=2,
                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0})


@pytest.fixture(scope="module")
def vocab():
    counts = np.random.default_rng(0).integers(0, 50, VOCAB)
    return build_draft_vocab(counts, VOCAB, DRAFT)


@pytest.fixture(scope="module")
def drafter(target, vocab):
    torch.manual_seed(2)
    config = DrafterConfig.from_target(target.config, DRAFT, aux_layer_ids(LAYERS), intermediate_size=96)
    return Eagle3DraftModel(
        config,
        embed_weight=target.get_input_embeddings().weight,
        draft_token_ids=torch.from_numpy(vocab.draft_token_ids),
    ).eval()


@pytest.fixture()
def exported(tmp_path, drafter, target, vocab) -> Path:
    out = tmp_path / "ckpt"
    export_checkpoint(drafter, target.config, vocab, aux_layer_ids(LAYERS), out)
    return out


def test_export_writes_exactly_the_sglang_tensor_names_shapes_and_dtypes(exported, vocab):
    with safe_open(str(exported / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        tensors = {k: f.get_tensor(k) for k in keys}
    assert keys == set(EXPECTED_KEYS)
    assert not any("embed" in k for k in keys)
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    assert shapes == {
        "fc.weight": (HIDDEN, 3 * HIDDEN),
        "midlayer.self_attn.q_proj.weight": (4 * 16, 2 * HIDDEN),
        "midlayer.self_attn.k_proj.weight": (2 * 16, 2 * HIDDEN),
        "midlayer.self_attn.v_proj.weight": (2 * 16, 2 * HIDDEN),
        "midlayer.self_attn.o_proj.weight": (HIDDEN, 4 * 16),
        "midlayer.mlp.gate_proj.weight": (96, HIDDEN),
        "midlayer.mlp.up_proj.weight": (96, HIDDEN),
        "midlayer.mlp.down_proj.weight": (HIDDEN, 96),
        "midlayer.hidden_norm.weight": (HIDDEN,),
        "midlayer.input_layernorm.weight": (HIDDEN,),
        "midlayer.post_attention_layernorm.weight": (HIDDEN,),
        "norm.weight": (HIDDEN,),
        "lm_head.weight": (DRAFT, HIDDEN),
        "d2t": (DRAFT,),
        "t2d": (VOCAB,),
    }
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert all(v.dtype == torch.float32 for k, v in tensors.items() if k not in ("d2t", "t2d"))
    # SGLang: hot_token_id = d2t + arange(draft_vocab_size)
    hot = tensors["d2t"] + torch.arange(DRAFT)
    assert hot.tolist() == vocab.draft_token_ids.tolist()
    assert torch.equal(torch.nonzero(tensors["t2d"]).flatten(), hot)


def test_export_config_has_the_fields_sglang_reads(exported):
    cfg = json.loads((exported / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1
    assert cfg["tie_word_embeddings"] is False
    assert cfg["hidden_act"] == "silu"
    assert (cfg["hidden_size"], cfg["target_hidden_size"], cfg["intermediate_size"]) == (HIDDEN, HIDDEN, 96)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 16)
    assert (cfg["vocab_size"], cfg["draft_vocab_size"]) == (VOCAB, DRAFT)
    assert cfg["rope_theta"] == 500000.0 and cfg["rope_scaling"] is None
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 500000.0}
    assert cfg["max_position_embeddings"] == 512 and cfg["rms_norm_eps"] == 1e-6
    # capture ids [2, 4, 5] are stored as layer-output ids; SGLang adds 1 back
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True}
    assert cfg["torch_dtype"] == "float32"
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    hf = AutoConfig.from_pretrained(exported)  # what SGLang's config loader starts from
    assert type(hf).__name__ == "LlamaConfig"
    assert hf.draft_vocab_size == DRAFT and hf.eagle_config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert hf.tie_word_embeddings is False and hf.head_dim == 16


def sglang_param_names() -> set[str]:
    """Parameter names of SGLang's LlamaForCausalLMEagle3 (llama_eagle3.py) for a 1-layer, untied config."""
    return {
        "model.embed_tokens.weight",
        "model.fc.weight",
        "model.midlayer.self_attn.qkv_proj.weight",
        "model.midlayer.self_attn.o_proj.weight",
        "model.midlayer.mlp.gate_up_proj.weight",
        "model.midlayer.mlp.down_proj.weight",
        "model.midlayer.hidden_norm.weight",
        "model.midlayer.input_layernorm.weight",
        "model.midlayer.post_attention_layernorm.weight",
        "model.norm.weight",
        "lm_head.weight",
    }


def test_every_exported_weight_lands_on_an_sglang_parameter(exported):
    """Replays the name mapping of LlamaForCausalLMEagle3.load_weights; SGLang skips names it cannot place."""
    params = sglang_param_names()
    stacked = [(".qkv_proj", ".q_proj"), (".qkv_proj", ".k_proj"), (".qkv_proj", ".v_proj"),
               (".gate_up_proj", ".gate_proj"), (".gate_up_proj", ".up_proj")]
    filled = set()
    for name in load_file(str(exported / "model.safetensors")):
        if "d2t" in name or "t2d" in name:
            continue
        for packed, shard in stacked:
            if shard in name:
                name = name.replace(shard, packed)
                break
        placed = name if name in params else f"model.{name}"
        assert placed in params, f"{name} would be skipped silently by SGLang"
        filled.add(placed)
    assert params - filled == {"model.embed_tokens.weight"}  # shared from the target at serving time


def test_load_drafter_rebuilds_the_same_model_from_safetensors(exported, drafter, target, vocab):
    loaded, loaded_vocab = load_drafter(exported, target)
    assert np.array_equal(loaded_vocab.d2t, vocab.d2t) and np.array_equal(loaded_vocab.t2d, vocab.t2d)
    assert loaded.config.aux_capture_ids == (2, 4, 5)
    gen = torch.Generator().manual_seed(3)
    aux = torch.randn(1, 12, 3 * HIDDEN, generator=gen)
    ids = torch.randint(0, VOCAB, (1, 12), generator=gen)
    with torch.no_grad():
        a, da = drafter.unroll(aux, ids, 3, feed_own_tokens=True)
        b, db = loaded.unroll(aux, ids, 3, feed_own_tokens=True)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y)
    assert all(torch.equal(x, y) for x, y in zip(da, db))
    bare, _ = load_drafter(exported)
    with pytest.raises(RuntimeError, match="attach_embedding"):
        bare.unroll(aux, ids, 1)


def test_bfloat16_export_and_overwrite_in_place(tmp_path, drafter, target, vocab):
    out = tmp_path / "ckpt"
    export_checkpoint(drafter, target.config, vocab, aux_layer_ids(LAYERS), out)
    report = export_checkpoint(drafter, target.config, vocab, aux_layer_ids(LAYERS), out, dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert report.tensors["fc.weight"][1] == "bfloat16" and report.tensors["d2t"][1] == "int64"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary leftovers


def test_export_refuses_a_vocab_the_drafter_was_not_trained_with(tmp_path, drafter, target):
    other = build_draft_vocab({i: 1 for i in range(DRAFT)}, VOCAB, DRAFT)
    with pytest.raises(CheckpointError, match="different draft vocab"):
        export_checkpoint(drafter, target.config, other, aux_layer_ids(LAYERS), tmp_path / "x")
    assert not (tmp_path / "x").exists()


def rewrite_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is ...:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


def rewrite_tensors(path: Path, drop=(), **changes) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    for key in drop:
        tensors.pop(key)
    tensors.update(changes)
    save_file(tensors, str(path / "model.safetensors"))


@pytest.mark.parametrize(
    "break_it, message",
    [
        (lambda p: rewrite_tensors(p, drop=["d2t"]), "missing tensor d2t"),
        (lambda p: rewrite_tensors(p, **{"embed_tokens.weight": torch.zeros(VOCAB, HIDDEN)}),
         "stray tensor embed_tokens.weight"),
        (lambda p: rewrite_tensors(p, d2t=torch.zeros(DRAFT, dtype=torch.int32)), "d2t must be int64"),
        (lambda p: rewrite_tensors(p, **{"lm_head.weight": torch.zeros(VOCAB, HIDDEN)}), "lm_head.weight has shape"),
        (lambda p: rewrite_tensors(p, d2t=torch.arange(DRAFT, dtype=torch.int64) * 5), "d2t/t2d"),
        (lambda p: rewrite_config(p, draft_vocab_size=32000), "draft_vocab_size 32000 exceeds"),
        (lambda p: rewrite_config(p, draft_vocab_size=None), "draft_vocab_size must be a positive integer"),
        (lambda p: rewrite_config(p, tie_word_embeddings=True), "tie_word_embeddings must be false"),
        (lambda p: rewrite_config(p, num_hidden_layers=0), "num_hidden_layers"),
        (lambda p: rewrite_config(p, num_hidden_layers=2), "missing tensor layers.1.self_attn.q_proj.weight"),
        (lambda p: rewrite_config(p, fc_norm=True), "missing tensor fc_norm.0.weight"),
        (lambda p: rewrite_config(p, architectures=["Eagle3DeepseekV2ForCausalLM"]), "model_type is 'llama'"),
        (lambda p: rewrite_config(p, architectures=["LlamaForCausalLM"]), "architectures"),
        (lambda p: rewrite_config(p, eagle_config=...), "eagle_config is missing"),
        (lambda p: rewrite_config(p, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 1, 4],
                                                    "use_aux_hidden_state": True}), "three distinct"),
        (lambda p: rewrite_config(p, target_hidden_size=128), "target_hidden_size 128"),
        (lambda p: rewrite_config(p, torch_dtype="bfloat16"), "config torch_dtype is bfloat16"),
        (lambda p: save_file({"extra.weight": torch.zeros(2)}, str(p / "extra.safetensors")), "stray tensor extra"),
        (lambda p: (p / "config.json").write_text("{not json"), "not valid JSON"),
        (lambda p: (p / "model.safetensors").unlink(), "no \\*.safetensors"),
    ],
)
def test_validator_refuses_checkpoints_sglang_would_mishandle(exported, break_it, message):
    validate_checkpoint(exported)
    break_it(exported)
    with pytest.raises(CheckpointError, match=message):
        validate_checkpoint(exported)


def test_validator_checks_the_checkpoint_against_its_target(exported, target):
    report = validate_checkpoint(exported, target_config=target.config)
    assert report.aux_capture_ids == [2, 4, 5] and report.aux_layer_output_ids == [1, 3, 4]
    smaller = {**target.config.to_dict(), "vocab_size": 299, "num_hidden_layers": 4}
    with pytest.raises(CheckpointError) as err:
        validate_checkpoint(exported, target_config=smaller)
    assert "vocab_size 300 differs" in str(err.value) and "4-layer target" in str(err.value)


def test_a_checkpoint_from_before_the_architecture_fields_loads_and_resumes(exported, drafter, target):
    """Pre-3.1 exports: no fc_norm / norm_output / norm_before_fc / bias / window keys in config.json, layer 0 under
    ``midlayer.*``; and a training state that names it ``model.midlayer.*``: both are read as today's one-layer
    Llama draft (the state's fingerprint keeps its drafter dict: the new fields are left out at their defaults)."""
    from eagle_assets.drafter.training.state import restore_tensors, state_tensors

    rewrite_config(exported, fc_norm=..., norm_output=..., norm_before_fc=..., bias=...,
                   speculative_draft_window_size=...)
    loaded, _ = load_drafter(exported, target)
    assert loaded.config == drafter.config and loaded.config.to_dict() == drafter.config.to_dict()
    assert not set(drafter.config.to_dict()) & {"architecture", "fc_norm", "norm_output", "num_hidden_layers"}
    for name, w in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], w), name

    optimizer = torch.optim.AdamW(list(drafter.parameters()), lr=1e-3)
    old = {k.replace("model.layers.0.", "model.midlayer.").replace("best.layers.0.", "best.midlayer."): v
           for k, v in state_tensors(drafter, optimizer, dict(drafter.state_dict())).items()}
    assert any(k.startswith("model.midlayer.") for k in old)
    fresh, _ = load_drafter(exported, target)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    why, best = restore_tensors(fresh, torch.optim.AdamW(list(fresh.parameters()), lr=1e-3),
                                list(fresh.parameters()), old)
    assert why is None and set(best) == set(drafter.state_dict())
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in drafter.state_dict().items())


@pytest.mark.parametrize("arch", [
    DraftArchitecture("llama", fc_norm=True, norm_output=True),
    DraftArchitecture("llama", num_hidden_layers=3, norm_before_fc=True, window=16),
    DraftArchitecture("mla", q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12),
])
def test_every_architecture_round_trips_through_its_checkpoint(tmp_path, target, vocab, arch):
    config = DrafterConfig.from_target(target.config, DRAFT, aux_layer_ids(LAYERS), intermediate_size=96, arch=arch)
    torch.manual_seed(4)
    model = Eagle3DraftModel(config, embed_weight=target.get_input_embeddings().weight,
                             draft_token_ids=torch.from_numpy(vocab.draft_token_ids)).eval()
    report = export_checkpoint(model, target.config, vocab, aux_layer_ids(LAYERS), tmp_path / "ckpt")
    names = set(report.tensors)
    if arch.architecture == "mla":
        assert report.config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
        assert report.config["model_type"] == "deepseek_v3" and report.config["rope_interleave"] is True
        assert {"layers.0.self_attn.q_a_proj.weight", "layers.0.self_attn.kv_a_proj_with_mqa.weight",
                "fc_norm.2.weight"} <= names
        assert AutoConfig.from_pretrained(tmp_path / "ckpt").kv_lora_rank == 16  # what SGLang's loader reads
    else:
        # a one-layer Llama draft keeps midlayer.* (what every SGLang release reads), deeper ones use layers.N.*
        assert any(n.startswith("midlayer.") for n in names) == (arch.num_hidden_layers == 1)
        assert (report.config["fc_norm"], report.config["norm_output"]) == (bool(arch.fc_norm), bool(arch.norm_output))
    if arch.num_hidden_layers > 1:
        assert report.tensors["layers.2.input_layernorm.weight"][0] == (HIDDEN,)  # SGLang builds it: written
        assert report.config["speculative_draft_window_size"] == 16
    loaded, _ = load_drafter(tmp_path / "ckpt", target)
    assert loaded.config == model.config
    gen = torch.Generator().manual_seed(5)
    aux = torch.randn(1, 20, 3 * HIDDEN, generator=gen)
    ids = torch.randint(0, VOCAB, (1, 20), generator=gen)
    with torch.no_grad():
        a, da = model.unroll(aux, ids, 3, feed_own_tokens=True)
        b, db = loaded.unroll(aux, ids, 3, feed_own_tokens=True)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and all(torch.equal(x, y) for x, y in zip(da, db))


def test_kimi_k25_target_gets_the_mla_drafter_sglang_serves_for_it(shared_data):
    """The real Kimi-K2.5 config.json (``tokenizers/kimi-k2.5``): ``auto`` picks the MLA draft with the 3.1 switches
    and the target's MLA dims and yarn rotary; the checkpoint it would export (shapes from the model built on the
    meta device, nothing allocated) has the names and shapes ``Eagle3DeepseekV2ForCausalLM`` loads."""
    from eagle_assets.drafter.eagle3.export import drafter_config_from_json, drafter_config_json, expected_tensors
    from eagle_assets.drafter.eagle3.model import mla_softmax_scale

    config = json.loads((shared_data / "tokenizers" / "kimi-k2.5" / "config.json").read_text())
    dconf = DrafterConfig.from_target(config, 32000, [2, 31, 58], arch=DraftArchitecture())
    assert (dconf.architecture, dconf.fc_norm, dconf.norm_output, dconf.num_hidden_layers) == ("mla", True, True, 1)
    assert (dconf.hidden_size, dconf.num_attention_heads, dconf.vocab_size) == (7168, 64, 163840)
    assert [getattr(dconf, n) for n in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                        "v_head_dim")] == [1536, 512, 128, 64, 128]
    assert dconf.rope_scaling["factor"] == 64.0 and dconf.rope_theta == 50000.0
    # SGLang: qk_head_dim ** -0.5 * yarn_get_mscale(64, mscale_all_dim=1) ** 2
    assert mla_softmax_scale(dconf) == pytest.approx(192 ** -0.5 * (0.1 * np.log(64.0) + 1.0) ** 2)
    shapes = expected_tensors(dconf)
    assert shapes["layers.0.self_attn.q_a_proj.weight"] == (1536, 2 * 7168)
    assert shapes["layers.0.self_attn.kv_a_proj_with_mqa.weight"] == (512 + 64, 2 * 7168)
    assert shapes["layers.0.self_attn.q_b_proj.weight"] == (64 * 192, 1536)
    assert shapes["layers.0.self_attn.kv_b_proj.weight"] == (64 * 256, 512)
    assert shapes["layers.0.self_attn.o_proj.weight"] == (7168, 64 * 128)
    assert shapes["fc.weight"] == (7168, 3 * 7168) and shapes["fc_norm.2.weight"] == (7168,)
    assert shapes["lm_head.weight"] == (32000, 7168) and shapes["t2d"] == (163840,)
    cfg = drafter_config_json(dconf)
    assert cfg["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and cfg["rope_interleave"] is True
    assert drafter_config_from_json(json.loads(json.dumps(cfg))) == dconf
