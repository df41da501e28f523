"""DSpark at a sampled request's temperature (SGLang 0.5.23's default DSPARK path): blocks drawn from the draft's
``q_j = softmax(z_j / T)`` and verified by rejection sampling, ``min(1, p_j / q_j)`` per draft
(``drafter.evaluation.sampled``: the seeded Monte Carlo over drawn blocks, each block's acceptance exact).

- A brute-force simulation of the rule on the demo target (600 walks; at every visit a block drawn by
  ``torch.multinomial``, a plain target forward on the drawn prefix, acceptance coins ``coin * q < p`` as SGLang's
  kernel compares) agrees with the expectation per point and in tau, within 4.5 standard errors of both Monte Carlos.
- As T -> 0 the expectation is the greedy walk's figure (``drafter.evaluation.acceptance``).
- SGLang's own code in its CPU venv (``sglang_cpu/dflash_blocks.py``): ``draft_markov_block`` at step temperature
  ``T`` draws from our ``q`` and its verifier reads our ``q``; ``resolve_draft_params`` drafts by argmax only at
  ``top_k = 1``; ``accept_draft_tokens`` with its defaults (the Triton rejection kernel, in Triton's interpreter)
  accepts our blocks as often as our expectation says, not as the target-only rule would.

The drafter is a DSpark draft on the demo target whose Markov head points each token of a row at
the token after it (a third of them at a wrong one), so that acceptance is neither 0 nor 1 at every point.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import numpy as np
import pytest
import torch

from eagle_assets.drafter.data.vocab import draft_vocab_from_arrays
from eagle_assets.drafter.evaluation.sampled import chain_probabilities, sampled_acceptance
from eagle_assets.serving.engine import sampling_probs
from eagle_assets_tests.real_sglang import run_sglang_driver

GAMMA, K, PROMPT, NEW = 4, 4, 6, 14
RANK = PROMPT + NEW  # the Markov head's rank: one dimension per distinct token of the row
BIAS = 8.0  # Markov bias of the row's successor: q(successor) ~ 0.66 at T = 1 over the demo target's 1536 tokens


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    pass


@pytest.fixture(scope="module")
def setup(demo_target):
    """``(target, drafter, vocab, row)``: the demo target, its greedy reply to a random prompt, the draft above."""
    from transformers import AutoModelForCausalLM

    from eagle_assets.drafter.dflash.family import draft_config
    from eagle_assets.drafter.dspark.family import build_model
    from eagle_assets.drafter.dspark.model import DSparkConfig
    from eagle_assets.drafter.family import DraftArchitecture

    target = AutoModelForCausalLM.from_pretrained(str(demo_target), dtype=torch.float32).eval()
    cfg = json.loads((demo_target / "config.json").read_text())
    v = cfg["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(5, v - 1, (1, PROMPT), generator=gen)
    with torch.no_grad():
        ids = target.generate(prompt, max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None)[0]
    base = draft_config(cfg, 0, [2, 3], None, DraftArchitecture("dspark", mask_token_id=0))
    torch.manual_seed(0)
    model = build_model(DSparkConfig(**{**asdict(base), "block_size": GAMMA, "markov_rank": RANK}),
                        target.get_input_embeddings().weight, None, target.get_output_embeddings().weight)
    with torch.no_grad():
        for p in model.parameters():
            (p.uniform_(0.5, 1.5) if p.dim() == 1 else p.normal_(0, 0.3))
        model.norm.weight.fill_(0.05)  # small base logits: the Markov bias decides
        w1, w2 = model.markov_head.markov_w1.weight, model.markov_head.markov_w2.weight
        w1.zero_()
        w2.zero_()
        slot = {tok: i for i, tok in enumerate(dict.fromkeys(ids.tolist()))}  # one latent dim per row token
        for t in range(len(ids) - 1):
            nxt = int(ids[t + 1]) if t % 3 else (int(ids[t + 1]) + 7) % v
            w1[int(ids[t]), slot[int(ids[t])]] = 1.0
            w2[nxt, slot[int(ids[t])]] = BIAS
    vocab = draft_vocab_from_arrays(np.zeros(v, dtype=np.int64), np.ones(v, dtype=bool))
    mask = np.zeros(len(ids), dtype=np.int8)
    mask[PROMPT:] = 1
    return target, model.eval(), vocab, (ids.numpy().astype(np.int64), mask)


@torch.no_grad()
def _coins(target, model, ids, n, walks, t, top_p, top_k, gen):
    """Brute force at point ``n`` for ``walks`` verifications: draw a block step by step (multinomial of
    ``softmax(step_logits / T)``), run the target on the prefix and the drafts, throw SGLang's coins
    (``coin * q < p``): the accepted counts, int64 ``[walks]``."""
    end = len(ids)
    lim = min(K, end - 1 - n, GAMMA)
    aux_ids = torch.as_tensor(ids)
    hidden = model.blocks(_aux(target, model, aux_ids), aux_ids[None], torch.tensor([[n]]),
                          torch.tensor([[True]]))[0, 0]  # the block anchored at ids[n]
    prev = torch.full((walks,), int(ids[n]))
    drafts, q = [], []
    for j in range(lim):
        dist = torch.softmax(model.step_logits(hidden[j].expand(walks, -1), prev).double() / t, -1)
        prev = torch.multinomial(dist.float(), 1, generator=gen)[:, 0]
        drafts.append(prev)
        q.append(dist.gather(1, prev[:, None])[:, 0])
    drafts, q = torch.stack(drafts, 1), torch.stack(q, 1)
    fed = torch.cat([aux_ids[: n + 1].expand(walks, -1), drafts[:, : lim - 1]], 1)
    hidden = target.model(input_ids=fed).last_hidden_state[:, n:n + lim]  # the LM head only where it is read
    p = sampling_probs(target.lm_head(hidden), t, top_p, top_k).gather(2, drafts[:, :, None])[..., 0]
    coin = torch.rand(walks, lim, generator=gen, dtype=torch.float64)
    return (coin * q < p).long().cumprod(1).sum(1)


_AUX = {}


def _aux(target, model, ids):
    from eagle_assets.drafter.features.local_capture import run_target

    key = (id(target), tuple(ids.tolist()), tuple(model.config.aux_capture_ids))
    if key not in _AUX:
        _AUX[key] = run_target(target, ids, model.config.aux_capture_ids)[0]
    return _AUX[key]


def test_the_expectation_equals_a_brute_force_simulation_of_sglangs_rule(setup):
    """Walks that throw coins (600 of them, fresh blocks at every visit) against the expectation (128 blocks per
    point): tau and, at every point visited by 150 walks or more, ``P(A >= j)``, within 4.5 standard errors."""
    target, model, vocab, row = setup
    t, top_p, top_k = 1.0, 0.95, 20  # the target's cuts apply to p; the draft's q ignores them
    chains = chain_probabilities(target, model, vocab, [row], K, t, top_p, top_k, draft_samples=128, seed=3)
    ours = sampled_acceptance(chains, K, t)
    reach, per = chains.reach(K), chains.reach_samples(K)
    reach_se = per.std(axis=1, ddof=1) / np.sqrt(per.shape[1])
    assert 0.2 < reach[:, 0].mean() < 0.9 and ours.tau_mc_se > 0  # neither trivial nor exact

    ids, end, walks = row[0], len(row[0]), 600
    gen = torch.Generator().manual_seed(11)
    at = np.full(walks, PROMPT)
    tokens, visits = np.zeros(walks), np.zeros(walks)
    checked = 0
    for n in range(PROMPT, end - 1):
        here = np.flatnonzero(at == n)
        if here.size == 0:
            continue
        accepted = _coins(target, model, ids, n, here.size, t, top_p, top_k, gen).numpy()
        tokens[here] += accepted + 1
        visits[here] += 1
        at[here] = n + accepted + 1
        if here.size >= 150:
            i = int(np.flatnonzero(chains.positions == n)[0])
            brute = np.array([(accepted >= j).mean() for j in range(1, K + 1)])
            se = np.sqrt(brute * (1 - brute) / here.size + reach_se[i] ** 2)
            assert np.all(np.abs(brute - reach[i]) <= 4.5 * se + 1e-9), (n, brute, reach[i], se)
            checked += 1
    assert checked >= 3
    tau = tokens.sum() / visits.sum()
    tau_se = np.sqrt(((tokens - tau * visits) ** 2).sum()) / visits.sum()  # ratio estimator over independent walks
    print(f"brute force tau {tau:.4f} +- {tau_se:.4f}; expectation {ours.tau:.4f} +- {ours.tau_mc_se:.4f}")
    assert abs(tau - ours.tau) <= 4.5 * np.hypot(tau_se, ours.tau_mc_se), (tau, tau_se, ours.tau, ours.tau_mc_se)
    # the point-mass rule (SGLANG_DSPARK_USE_GREEDY_DRAFT=1) is another figure, which the coins tell apart
    greedy_draft = sampled_acceptance(chain_probabilities(target, model, vocab, [row], K, t, top_p, top_k,
                                                          greedy_draft=True), K, t)
    assert greedy_draft.draft_samples == 1 and greedy_draft.tau_mc_se == 0.0
    assert abs(greedy_draft.tau - tau) > 3 * tau_se and abs(greedy_draft.tau - ours.tau) > 5 * ours.tau_mc_se


def test_the_monte_carlo_is_seeded_and_its_error_shrinks_with_the_draws(setup):
    target, model, vocab, row = setup
    args = (target, model, vocab, [row], K, 1.0)
    a, b = chain_probabilities(*args, draft_samples=16, seed=5), chain_probabilities(*args, draft_samples=16, seed=5)
    assert np.array_equal(a.probs, b.probs) and a.probs.shape[1] == 16
    other = chain_probabilities(*args, draft_samples=16, seed=6)
    assert not np.array_equal(a.probs, other.probs)
    many = chain_probabilities(*args, draft_samples=64, seed=5)
    se16, se64 = sampled_acceptance(a, K, 1.0).tau_mc_se, sampled_acceptance(many, K, 1.0).tau_mc_se
    assert 0 < se64 < se16
    # each drawn block's acceptance is exact: min(1, p / q) in [0, 1], non-increasing reach, 0 past the limit
    assert ((a.probs >= 0) & (a.probs <= 1)).all() and (np.diff(a.reach_samples(K), axis=2) <= 1e-12).all()
    # top_k = 1 drafts by argmax in SGLang (resolve_draft_params' greedy rows): one point-mass chain
    assert chain_probabilities(*args[:5], 1.0, top_k=1, draft_samples=16).draft_samples == 1


def test_as_the_temperature_goes_to_zero_the_expectation_is_the_greedy_figure(setup):
    from eagle_assets.drafter.evaluation.acceptance import simulate_acceptance

    target, model, vocab, row = setup
    greedy = simulate_acceptance(target, model, vocab, [row], k=K)
    assert 1.5 < greedy.tau < K + 1  # the oracle-ish draft accepts some drafts, not all
    cold = sampled_acceptance(chain_probabilities(target, model, vocab, [row], K, 1e-4, draft_samples=8), K, 1e-4)
    assert cold.draft_samples == 8 and cold.tau == pytest.approx(greedy.tau, abs=1e-9)
    assert cold.per_position_acceptance == pytest.approx(greedy.per_position_acceptance, abs=1e-9)
    assert cold.tau_mc_se == pytest.approx(0.0, abs=1e-9)


# --- SGLang's own sampling and verification, in its CPU venv ----------------------------------------------------

DRAWS, VERIFY_ROWS, T_SGLANG = 2000, 500, 1.0


@pytest.fixture(scope="module")
def sglang_sampled(setup, sglang_python, tmp_path_factory):
    """SGLang's draws of one block of our exported draft, and its default accept on blocks we drew (module
    docstring of ``sglang_cpu/dflash_blocks.py``)."""
    from eagle_assets.drafter.dspark.family import FAMILY as DSPARK
    from eagle_assets.drafter.dspark.sampling import draw_blocks

    target, model, _vocab, row = setup
    tmp = tmp_path_factory.mktemp("dspark_sampled")
    ids = torch.from_numpy(row[0])
    aux = _aux(target, model, ids)
    DSPARK.export(model, json.loads((target.config.to_json_string())), None, model.config.aux_capture_ids,
                  tmp / "ckpt")
    np.savez(tmp / "row.npz", aux=aux[0].numpy(), ids=row[0], embed=model.embed_weight.numpy(),
             lm_head=model.lm_head_weight.numpy())
    p = PROMPT + 2  # the block anchored at ids[p + 1]
    # blocks we draw at point n = p + 1 (VERIFY_ROWS of them), the target's logits on each, our step logits
    tokens, q = draw_blocks(model, aux, ids, GAMMA, T_SGLANG, VERIFY_ROWS, torch.Generator().manual_seed(1))
    drafts = torch.from_numpy(tokens[p])  # [R, g]
    n = p + 1
    with torch.no_grad():
        fed = torch.cat([ids[: n + 1].expand(VERIFY_ROWS, -1), drafts], 1)
        target_logits = target(input_ids=fed).logits[:, n:n + GAMMA + 1]  # before each draft, and the bonus row
        hidden = model.blocks(aux, ids[None], torch.tensor([[n]]), torch.tensor([[True]]))[0, 0]
        prev = torch.cat([ids[n].expand(VERIFY_ROWS, 1), drafts[:, :-1]], 1)
        step_logits = model.step_logits(hidden.expand(VERIFY_ROWS, -1, -1), prev)
    top_k, top_p = 30, 1.0
    np.savez(tmp / "verify.npz", candidates=torch.cat([ids[n].expand(VERIFY_ROWS, 1), drafts], 1).numpy(),
             target_logits=target_logits.reshape(-1, target_logits.shape[-1]).numpy(),
             step_logits=step_logits.numpy())
    case = {"name": "sampled", "checkpoint": str(tmp / "ckpt"), "inputs": str(tmp / "row.npz"), "positions": [p],
            "sampled": {"position": p, "temperature": T_SGLANG, "draws": DRAWS, "top_ks": [1, 2, 1 << 30]},
            "verify": {"inputs": str(tmp / "verify.npz"), "temperature": T_SGLANG, "top_k": top_k, "top_p": top_p,
                       "seed": 0}}
    out = run_sglang_driver(sglang_python, "dflash_blocks.py", [case], tmp)["sampled"]
    p_target = sampling_probs(target_logits[:, :GAMMA], T_SGLANG, top_p, top_k).gather(2, drafts[:, :, None])[..., 0]
    ours = {"p": p_target.numpy(), "q": q[p], "hidden": hidden, "anchor": ids[n]}
    return out, ours, model


@pytest.mark.slow(seconds=40)  # the SGLang venv's imports and the interpreted Triton kernel
def test_sglang_draws_dspark_blocks_from_our_q_and_verifies_against_it(sglang_sampled):
    out, ours, model = sglang_sampled
    sampled = out["sampled"]
    tokens = torch.tensor(sampled["tokens"])  # [DRAWS, g]
    # the verifier's q (SoftmaxTemp of the kept step logits) at SGLang's drawn tokens is ours for the same prefix
    prev = torch.cat([ours["anchor"].expand(DRAWS, 1), tokens[:, :-1]], 1)
    with torch.no_grad():
        dist = torch.softmax(model.step_logits(ours["hidden"].expand(DRAWS, -1, -1), prev).double() / T_SGLANG, -1)
    mine = dist.gather(2, tokens[:, :, None])[..., 0].numpy()
    assert np.abs(mine / np.asarray(sampled["q"]) - 1).max() < 1e-3  # its logits are ours within 1e-4
    # SGLang's slot-0 draws are samples of our q_0 (its Philox Gumbel-max): tokens binned by q_0 (the most likely
    # alone, then the rest in 4 bins of equal mass), every bin's share within 5 sigma
    q0 = dist[0, 0].numpy()
    order = np.argsort(-q0)
    rest = np.cumsum(q0[order[1:]]) / q0[order[1:]].sum()
    bins = np.r_[0, 1 + np.minimum((rest * 4).astype(int), 3)]  # bin of each token in q order
    want = np.bincount(bins, weights=q0[order], minlength=5)
    got = np.bincount(bins, weights=np.bincount(tokens[:, 0].numpy(), minlength=q0.shape[0])[order],
                      minlength=5) / DRAWS
    assert np.all(np.abs(got - want) <= 5 * np.sqrt(want * (1 - want) / DRAWS)), (got, want)
    # a request drafts by argmax only at top_k = 1; otherwise at its own temperature, whatever its top_k
    assert sampled["step_temperatures"] == {"1": 0.0, "2": T_SGLANG, str(1 << 30): T_SGLANG}


@pytest.mark.slow(seconds=40)  # the SGLang venv's imports and the interpreted Triton kernel
def test_sglang_accepts_our_blocks_by_rejection_sampling_as_our_expectation_says(sglang_sampled):
    """The same 500 blocks: SGLang's accepted counts (its coins) against ``sum_j prod_{i<=j} min(1, p_i / q_i)``
    per block, within 4.5 standard errors of the coins; the target-only rule (``prod p_i``) is far off."""
    out, ours, _model = sglang_sampled
    accepted = np.asarray(out["verify"]["accepted"])
    p, q = ours["p"], ours["q"]
    reach = np.cumprod(np.minimum(1.0, p / q), axis=1)  # [R, g]: P(A >= j | block)
    expected = reach.sum(1)
    # given the blocks, A's variance per block is sum_j (2j - 1) P(A >= j) - E[A]^2
    var = ((2 * np.arange(1, GAMMA + 1) - 1) * reach).sum(1) - expected ** 2
    se = np.sqrt(var.sum()) / len(accepted)
    assert abs(accepted.mean() - expected.mean()) <= 4.5 * se, (accepted.mean(), expected.mean(), se)
    for j in range(1, GAMMA + 1):
        got, want = (accepted >= j).mean(), reach[:, j - 1].mean()
        assert abs(got - want) <= 4.5 * np.sqrt(want * (1 - want) / len(accepted)) + 1e-9, (j, got, want)
    target_only = np.cumprod(p, axis=1).sum(1).mean()
    assert abs(accepted.mean() - target_only) > 10 * se


@pytest.mark.parametrize("family", ["eagle3", "dflash"])
def test_point_mass_families_keep_the_exact_target_probability_rule(setup, family):
    """EAGLE-3 and DFlash draft argmax at every temperature (no ``sample_drafts``): one chain per point, whatever
    ``draft_samples`` and ``seed`` say, each draft accepted with the target's probability of it (a plain forward on
    the prefix and the earlier drafts), no Monte Carlo error."""
    from eagle_assets.drafter.family import DraftArchitecture, family_named

    target, _model, vocab, row = setup
    cfg = json.loads(target.config.to_json_string())
    fam = family_named(family)
    torch.manual_seed(1)
    arch = DraftArchitecture("llama" if family == "eagle3" else "dflash", mask_token_id=0, block_size=5)
    config = fam.config_from_target(cfg, cfg["vocab_size"], [1, 2, 3] if family == "eagle3" else [2, 3], None, arch)
    drafter = fam.build_model(config, target.get_input_embeddings().weight.detach().float(),
                              torch.arange(cfg["vocab_size"]), target.get_output_embeddings().weight.detach().float())
    assert getattr(drafter, "sample_drafts", None) is None
    t, top_p, top_k = 1.5, 0.9, 40
    a = chain_probabilities(target, drafter, vocab, [row], K, t, top_p, top_k)
    b = chain_probabilities(target, drafter, vocab, [row], K, t, top_p, top_k, draft_samples=3, seed=9)
    assert a.draft_samples == b.draft_samples == 1 and np.array_equal(a.probs, b.probs)
    assert sampled_acceptance(a, K, t).tau_mc_se == 0.0
    ids = torch.from_numpy(row[0])
    chain = drafter.eval().draft_chain(_aux(target, drafter, ids), ids, K)
    with torch.no_grad():
        for i, (n, lim) in enumerate(zip(a.positions, a.limits)):
            fed = torch.cat([ids[: n + 1], torch.from_numpy(chain[n - 1, : lim - 1])])[None]
            logits = target(input_ids=fed).logits[0, n:n + lim]
            p = sampling_probs(logits, t, top_p, top_k)[torch.arange(lim), torch.from_numpy(chain[n - 1, :lim])]
            assert a.probs[i, 0, :lim] == pytest.approx(p.numpy(), abs=1e-6)
