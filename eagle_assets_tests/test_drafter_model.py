"""EAGLE-3 features and model: aux ids vs HF hidden states, TTT masks, serving equivalence, loss alignment."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiny_targets import tiny_qwen3

from eagle_assets.drafter.eagle3 import model as drafter_model
from eagle_assets.drafter.eagle3.model import DrafterConfig, Eagle3DraftModel
from eagle_assets.drafter.eagle3.ttt_loss import drafter_rows
from eagle_assets.drafter.features.local_capture import (
    aux_layer_ids,
    capture_to_layer_output_ids,
    layer_output_to_capture_ids,
    run_target,
    target_features,
)
from eagle_assets.drafter.features.teacher import soft_cross_entropy, teacher_positions

VOCAB = 300
LAYERS = 8


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    pass


@pytest.fixture(scope="module")
def target():
    # initializer_range 1.0: peaked next-token distributions, so greedy paths are stable
    return tiny_qwen3(VOCAB, LAYERS, initializer_range=1.0)


@pytest.fixture(scope="module")
def drafter(target):
    torch.manual_seed(1)
    config = DrafterConfig.from_target(target.config, draft_vocab_size=VOCAB, aux_capture_ids=aux_layer_ids(LAYERS))
    model = Eagle3DraftModel(
        # larger init than the default so the random drafter's outputs depend visibly on every input
        DrafterConfig(**{**config.to_dict(), "initializer_range": 0.3}),
        embed_weight=target.get_input_embeddings().weight,
    )
    return model.eval()


def test_aux_layer_ids_follow_sglang_capture_convention():
    assert aux_layer_ids(8) == [2, 4, 5]
    assert aux_layer_ids(32) == [2, 16, 29]
    assert aux_layer_ids(8, [5, 1, 3]) == [1, 3, 5]
    # config.json stores layer-output ids; SGLang adds 1 when it loads them
    assert capture_to_layer_output_ids([2, 4, 5]) == [1, 3, 4]
    assert layer_output_to_capture_ids([1, 3, 4]) == [2, 4, 5]


@pytest.mark.parametrize(
    "layers, ids, message",
    [(6, None, "not distinct"), (8, [0, 2, 4], "outside"), (8, [2, 4, 8], "outside"), (8, [2, 4], "exactly three")],
)
def test_aux_layer_ids_refuse_ids_sglang_cannot_capture(layers, ids, message):
    with pytest.raises(ValueError, match=message):
        aux_layer_ids(layers, ids)


def test_captured_aux_states_are_hf_hidden_states_at_the_capture_ids(target):
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))
    capture = aux_layer_ids(LAYERS)
    aux, final = run_target(target, ids, capture)
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    # hidden_states[c] == output of layer c-1 == input of layer c, for c < L
    expected = torch.cat([out.hidden_states[c] for c in capture], dim=-1)
    assert aux.shape == (2, 11, 3 * 64)
    torch.testing.assert_close(aux, expected)
    torch.testing.assert_close(F.linear(final, target.lm_head.weight), out.logits)


def test_target_features_return_draft_logits_only_for_kept_positions(target):
    ids = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(4))
    keep = torch.zeros(9, dtype=torch.bool)
    keep[[3, 4, 7]] = True
    draft_ids = torch.tensor([0, 5, 17, 299])
    aux, logits = target_features(target, ids, aux_layer_ids(LAYERS), keep, draft_ids)
    with torch.no_grad():
        full = target(ids.unsqueeze(0)).logits[0]
    assert aux.shape == (1, 9, 192) and logits.shape == (3, 4)
    torch.testing.assert_close(logits, full[[3, 4, 7]][:, draft_ids])


def test_no_ttt_step_sees_its_own_future(drafter):
    """Row p at step i may depend on target features of rows <= p and tokens x[1..p+i+1], never on anything later:
    at serving time the chain of row p has no target features past p and no tokens past its own drafts."""
    gen = torch.Generator().manual_seed(5)
    t, steps, cut = 16, 4, 9
    aux = torch.randn(1, t, 192, generator=gen)
    ids = torch.randint(0, VOCAB, (1, t), generator=gen)
    later_aux = aux.clone()
    later_aux[:, cut:] += torch.randn(1, t - cut, 192, generator=gen)
    later_ids = ids.clone()
    later_ids[:, cut:] = (later_ids[:, cut:] + 7) % VOCAB
    with torch.no_grad():
        base, _ = drafter.unroll(aux, ids, steps)
        aux_moved, _ = drafter.unroll(later_aux, ids, steps)
        ids_moved, _ = drafter.unroll(aux, later_ids, steps)
    for i in range(steps):
        by_aux = (base[i] - aux_moved[i]).abs().amax(-1)[0]
        assert by_aux[:cut].max() == 0, f"step {i}: a row saw target features of a later position"
        assert by_aux[cut] > 1e-4  # controls: the perturbation is visible where it is allowed to be
        by_ids = (base[i] - ids_moved[i]).abs().amax(-1)[0]
        blind = [p for p in range(t) if p + i + 1 < cut]
        assert by_ids[blind].max() == 0, f"step {i}: a row saw a token past its newest input"
        assert by_ids[cut - i - 1] > 1e-4


def reference_chain(drafter: Eagle3DraftModel, aux: torch.Tensor, ids: torch.Tensor, p: int, steps: int):
    """Serving-style decoding for one row: prefix rows 0..p causally, then `steps - 1` chained drafts that attend
    to the whole cached prefix plus their own chain (explicit KV concatenation, no masks)."""
    layer = drafter.layers[0]

    def run(tokens, hidden, positions, keys=None, values=None):
        cos, sin = drafter.rotary.cos_sin(positions)
        x = torch.cat([layer.input_layernorm(drafter.embed(tokens)), layer.hidden_norm(hidden)], -1)
        q, k, v = layer.self_attn.project(x, drafter.rotary, cos, sin)
        if keys is None:
            keys, values = k, v
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            keys, values = torch.cat([keys, k], 2), torch.cat([values, v], 2)
            attn = F.scaled_dot_product_attention(q, keys, values)
        h = hidden + layer.self_attn.finish(attn)
        return h + layer.mlp(layer.post_attention_layernorm(h)), keys, values

    out, keys, values = run(ids[:, 1 : p + 2], drafter.fc(aux[:, : p + 1]), torch.arange(p + 1)[None])
    outs = [out[:, p]]
    cur = out[:, p : p + 1]
    for i in range(1, steps):
        cur, keys, values = run(ids[:, p + i + 1 : p + i + 2], cur, torch.tensor([[p + i]]), keys, values)
        outs.append(cur[:, 0])
    return outs


def test_ttt_unroll_equals_serving_style_chain_decoding(drafter):
    drafter = copy.deepcopy(drafter).double()  # float64 so only a real mask difference can show
    gen = torch.Generator().manual_seed(6)
    t, steps = 14, 4
    aux = torch.randn(1, t, 192, generator=gen, dtype=torch.double)
    ids = torch.randint(0, VOCAB, (1, t), generator=gen)
    with torch.no_grad():
        hiddens, _ = drafter.unroll(aux, ids, steps)
        for p in (0, 4, t - steps - 1):
            for i, ref in enumerate(reference_chain(drafter, aux, ids, p, steps)):
                torch.testing.assert_close(hiddens[i][:, p], ref)


def test_row_start_skips_rows_without_changing_the_kept_ones(drafter):
    gen = torch.Generator().manual_seed(7)
    aux = torch.randn(2, 20, 192, generator=gen)
    ids = torch.randint(0, VOCAB, (2, 20), generator=gen)
    with torch.no_grad():
        full, _ = drafter.unroll(aux, ids, 3)
        part, _ = drafter.unroll(aux, ids, 3, row_start=8)
    for a, b in zip(full, part):
        torch.testing.assert_close(a[:, 8:], b, atol=1e-5, rtol=1e-5)


def test_greedy_feed_uses_the_drafters_own_tokens(drafter):
    gen = torch.Generator().manual_seed(8)
    aux = torch.randn(1, 10, 192, generator=gen)
    ids = torch.randint(0, VOCAB, (1, 10), generator=gen)
    with torch.no_grad():
        hiddens, drafts = drafter.unroll(aux, ids, 3, feed_own_tokens=True)
        fed = ids.clone()
        p = 2
        # teacher-forcing the drafter's own tokens reproduces the greedy chain of row p
        fed[0, p + 2] = drafts[0][0, p]
        fed[0, p + 3] = drafts[1][0, p]
        forced, _ = drafter.unroll(aux, fed, 3)
    for i in range(3):
        torch.testing.assert_close(forced[i][:, p], hiddens[i][:, p])
    assert drafts[0][0, p] == drafter.logits(hiddens[0][0, p]).argmax()


@pytest.mark.parametrize("row_offset, window, dv", [(0, -1, 4), (2, -1, 4), (2, 3, 6)])
def test_chain_attention_gradients_match_a_dense_softmax(row_offset, window, dv, monkeypatch):
    """Also with a sliding window (step 2: a query at row r, position r + 2, sees step-0 keys r - 1 .. r) and a
    value width other than the key width (MLA)."""
    monkeypatch.setattr(drafter_model, "ATTENTION_BLOCK", 3)  # several blocks on a short sequence
    gen = torch.Generator().manual_seed(9)
    b, h, t, d, n, step = 2, 2, 7, 4, 2, 2
    tq = t - row_offset

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.double, requires_grad=True)

    q, k0, v0 = rand(b, h, tq, d), rand(b, h, t, d), rand(b, h, t, dv)
    kd, vd = rand(b, h, tq, n, d), rand(b, h, tq, n, dv)
    chain = drafter_model._ChainAttention.apply
    assert torch.autograd.gradcheck(lambda *a: chain(*a, row_offset, step, window), (q, k0, v0, kd, vd))
    rows = torch.arange(row_offset, t)[:, None]
    cols = torch.arange(t)[None]
    hidden = (cols > rows) | ((cols < rows + step - window) if window >= 0 else torch.zeros_like(cols > rows))
    s = (q @ k0.transpose(-1, -2)).masked_fill(hidden, float("-inf"))
    w = torch.softmax(torch.cat([s, (q.unsqueeze(-2) * kd).sum(-1)], -1), -1)
    dense = w[..., :t] @ v0 + (w[..., t:, None] * vd).sum(-2)
    torch.testing.assert_close(chain(q, k0, v0, kd, vd, row_offset, step, window), dense)


def test_soft_cross_entropy_matches_the_autograd_formula():
    gen = torch.Generator().manual_seed(10)
    logits = torch.randn(5, 7, generator=gen, dtype=torch.double, requires_grad=True)
    p = torch.softmax(torch.randn(5, 7, generator=gen, dtype=torch.double), -1)
    assert torch.autograd.gradcheck(lambda x: soft_cross_entropy(x, p), (logits,))
    torch.testing.assert_close(soft_cross_entropy(logits, p), -(p * torch.log_softmax(logits, -1)).sum(-1))


def test_first_answer_token_is_supervised_and_each_step_shifts_by_one():
    # prompt = positions 0..2, completion = 3..5: the target's logits at q predict token q+1
    mask = np.array([0, 0, 0, 1, 1, 1], dtype=np.int8)
    teachers = teacher_positions(mask)
    assert teachers.tolist() == [2, 3, 4]  # q = 2 predicts x[3], the first answer token
    rows, taught = drafter_rows(teachers, 0)
    assert rows.tolist() == [1, 2, 3] and taught.tolist() == [2, 3, 4]  # row p embeds x[p+1], predicts x[p+2]
    rows, taught = drafter_rows(teachers, 2)
    assert rows.tolist() == [0, 1] and taught.tolist() == [3, 4]  # q - step - 1 >= 0 only


def test_teacher_position_logits_predict_the_next_row_token(target):
    """On a target-greedy row, argmax of the teacher at q is exactly x[q + 1] for every teacher position."""
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        row = target.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)[0]
    mask = np.zeros(row.numel(), dtype=np.int8)
    mask[6:] = 1
    q = torch.from_numpy(teacher_positions(mask))
    keep = torch.zeros(row.numel(), dtype=torch.bool)
    keep[q] = True
    _, logits = target_features(target, row, aux_layer_ids(LAYERS), keep, torch.arange(VOCAB))
    assert q[0] == 5
    assert torch.equal(logits.argmax(-1), row[q + 1])


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ],
)
def test_rotary_matches_transformers_llama_for_plain_and_scaled_rope(scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params = {"rope_type": "default", "rope_theta": 5e5} if scaling is None else {**scaling, "rope_theta": 5e5}
    llama = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=256,
                        rope_parameters=params)
    config = DrafterConfig.from_target(llama, draft_vocab_size=10, aux_capture_ids=(1, 2, 3))
    assert config.rope_theta == 5e5 and config.rope_scaling == (None if scaling is None else scaling)
    positions = torch.arange(200)[None]
    cos, sin = LlamaRotaryEmbedding(llama)(torch.zeros(1, 200, 16), positions)
    ours = drafter_model.Rotary(config).cos_sin(positions)
    torch.testing.assert_close(ours, (cos, sin))


def test_rope_settings_read_legacy_config_dicts():
    legacy = {"rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert drafter_model.rope_settings(legacy) == (1e6, {"type": "linear", "factor": 2.0})
    assert drafter_model.rope_settings({"rope_theta": 1e4, "rope_scaling": {"rope_type": "default"}}) == (1e4, None)
    assert drafter_model.rope_settings({}) == (10000.0, None)
