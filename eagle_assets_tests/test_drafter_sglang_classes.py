"""Every drafter architecture this project exports, held to SGLang 0.5.23's own draft classes (in the SGLang CPU
venv, ``real_sglang``; skipped with the build's reason where it cannot be built).

For each case (the one-layer Llama draft as before; the same with the EAGLE-3.1 switches; a 2-layer Llama draft
with ``norm_before_fc`` and a sliding window; the MLA draft with the 3.1 switches; the MLA draft under yarn rotary
scaling): a drafter with random weights (norm weights too, so a weight in the wrong place shows) is exported by
``export_checkpoint``; ``sglang_cpu/draft_chains.py`` builds SGLang's class from the checkpoint's config through
transformers' ``AutoConfig``, runs its ``load_weights`` and asserts through the report that every parameter was
written (the shared ``embed_tokens`` aside) and every tensor consumed; then drafts chains of ``k`` tokens at
verification points of a real row (a chat prompt and the demo target's greedy reply, the target's own aux hidden
states) with SGLang's modules driven as its EAGLE worker drives them (that script's docstring says which modules
are SGLang's and which part is a line-by-line reference). The chains must equal ``Eagle3DraftModel.unroll``'s
(``feed_own_tokens``), token for token, and every step's draft logits within 1e-4 (float32 summation order; a
one-key difference in the attention window moves them by ~1e-2); a chain may part only at a step whose top-two
draft logits lie within 1e-4 (a float32 tie), and none did when this was written.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eagle_assets.drafter.data.vocab import build_draft_vocab
from eagle_assets.drafter.eagle3.export import export_checkpoint, serve_flags
from eagle_assets.drafter.eagle3.model import DraftArchitecture, DrafterConfig, Eagle3DraftModel, RMSNorm
from eagle_assets.drafter.features.local_capture import run_target
from eagle_assets_tests.real_sglang import run_sglang_driver

pytestmark = pytest.mark.slow(seconds=40)

CAPTURE = [1, 2, 3]
K = 4
MLA = dict(q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "mscale": 1.0,
        "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}
CASES = {
    "llama": (DraftArchitecture("llama"), {}),
    "llama_3.1": (DraftArchitecture("llama", fc_norm=True, norm_output=True), {}),
    "llama_2_layers_window": (DraftArchitecture("llama", num_hidden_layers=2, norm_before_fc=True, window=6), {}),
    "mla_3.1": (DraftArchitecture("mla", **MLA), {}),
    "mla_yarn": (DraftArchitecture("mla", fc_norm=False, norm_output=False, **MLA), {"rope_scaling": YARN}),
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    pass


@pytest.fixture(scope="module")
def row(demo_target):
    """(target, ids int64 [T], aux float32 [T, 3H]): a chat prompt and 40 tokens of the target's greedy reply."""
    tok = AutoTokenizer.from_pretrained(str(demo_target))
    target = AutoModelForCausalLM.from_pretrained(str(demo_target), dtype=torch.float32).eval()
    text = tok.apply_chat_template([{"role": "user", "content": "Write a function that reverses a list."}],
                                   add_generation_prompt=True, tokenize=False)
    prompt = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        ids = target.generate(prompt, max_new_tokens=40, do_sample=False, min_new_tokens=40)[0]
        aux, _ = run_target(target, ids, CAPTURE)
    return target, ids, aux[0]


@pytest.fixture(scope="module")
def sglang_chains(sglang_python, row, tmp_path_factory):
    """{case: (our drafter, SGLang's report)} for every case in :data:`CASES`."""
    target, ids, aux = row
    tmp = tmp_path_factory.mktemp("sglang_classes")
    vocab_size = target.config.vocab_size
    counts = np.random.default_rng(0).integers(1, 100, vocab_size)
    counts[ids.numpy()] += 1000  # the row's tokens are in the draft vocab
    vocab = build_draft_vocab(counts, vocab_size, 256)
    inputs = tmp / "row.npz"
    np.savez(inputs, ids=ids.numpy(), aux=aux.numpy(), embed=target.get_input_embeddings().weight.detach().numpy())
    positions = list(range(4, ids.numel() - K - 1, 5))
    drafters, cases = {}, []
    for i, (name, (arch, overrides)) in enumerate(CASES.items()):
        config = DrafterConfig.from_target(target.config, 256, CAPTURE, arch=arch)
        config = dataclasses.replace(config, initializer_range=0.15, **overrides)
        torch.manual_seed(i)
        drafter = Eagle3DraftModel(config, embed_weight=target.get_input_embeddings().weight,
                                   draft_token_ids=torch.from_numpy(vocab.draft_token_ids)).eval()
        with torch.no_grad():
            for module in drafter.modules():
                if isinstance(module, RMSNorm):
                    module.weight.uniform_(0.5, 1.5)
        export_checkpoint(drafter, target.config, vocab, CAPTURE, tmp / name)
        drafters[name] = drafter
        cases.append({"name": name, "checkpoint": str(tmp / name), "inputs": str(inputs), "positions": positions,
                      "k": K, "window": config.window})
    report = run_sglang_driver(sglang_python, "draft_chains.py", cases, tmp)
    return {name: (drafters[name], report[name], positions) for name in CASES}


@pytest.mark.parametrize("case", list(CASES))
def test_sglang_loads_every_parameter_of_the_exported_drafter(sglang_chains, case):
    drafter, report, _ = sglang_chains[case]
    want = "Eagle3DeepseekV2ForCausalLM" if drafter.config.architecture == "mla" else "LlamaForCausalLMEagle3"
    assert report["class"] == want
    assert report["untouched"] == ["model.embed_tokens.weight"]  # shared from the target at serving time
    assert report["consumed"] == report["tensors"], report
    if drafter.config.window is not None:  # SGLang put --speculative-draft-window-size on every layer
        assert report["window"] == [drafter.config.window] * drafter.config.num_hidden_layers


@pytest.mark.parametrize("case", list(CASES))
def test_sglang_drafts_the_chains_our_drafter_drafts(sglang_chains, row, case):
    drafter, report, positions = sglang_chains[case]
    _, ids, aux = row
    with torch.no_grad():
        hiddens, drafts = drafter.unroll(aux[None], ids[None], K, feed_own_tokens=True)
        logits = [drafter.logits(h[0]) for h in hiddens]  # [T, draft_vocab] per step
    ours = [[int(drafts[i][0, p]) for i in range(K)] for p in positions]
    theirs = report["chains"]
    equal, gap = 0, 0.0
    for j, (p, a, b, margins) in enumerate(zip(positions, ours, theirs, report["margins"])):
        if a != b:
            first = next(i for i in range(K) if a[i] != b[i])
            assert margins[first] < 1e-4, (case, p, a, b, margins)  # only a float32 tie may part them
            continue
        equal += 1
        for i in range(K):  # along an equal chain, every step's draft logits
            gap = max(gap, float((logits[i][p] - torch.tensor(report["logits"][j][i])).abs().max()))
    assert equal == len(positions), (case, equal, len(positions))
    assert gap < 1e-4, (case, gap)
    assert len({tuple(c) for c in ours}) > 1  # the chains are not one constant sequence


def test_serve_flags_name_every_flag_the_draft_needs(sglang_chains, tmp_path):
    drafter, _, _ = sglang_chains["llama_2_layers_window"]
    ckpt = tmp_path / "ckpt"
    flags = serve_flags(ckpt, 7)
    assert flags[:4] == ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(ckpt)]
    assert "--speculative-draft-window-size" not in flags  # no checkpoint there: nothing to read
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"speculative_draft_window_size": drafter.config.window}))
    flags = serve_flags(ckpt, 7)
    assert flags[flags.index("--speculative-num-steps") + 1] == "7"
    assert flags[flags.index("--speculative-num-draft-tokens") + 1] == "8"
    assert flags[-2:] == ["--speculative-draft-window-size", "6"]
