"""Drafter quality benchmark: our trainer against SpecForge's, on the same rows and the same CPU budget.

One run trains two EAGLE-3 drafters for the catalog's target on the same training rows (the ``training_mix`` of a
finished pipeline run, or the training split of its QC shards) and measures both with the same simulation on the
same held-out test rows (SGLang's temperature-0 chain drafting, :func:`~eagle_assets.drafter.acceptance.
simulate_acceptance`, ``k = training.acceptance_k``), per partition with a 95% bootstrap interval over rows, plus
the catalog's unseen-source rows when they are cached:

- **ours**: :func:`~eagle_assets.drafter.train.train_drafter` with the catalog's recipe
  (:func:`~eagle_assets.drafter.recipe.config_from_catalog`), validation rows and early stopping included.
- **SpecForge**: SpecForge 0.2.0's own model class (``specforge.modeling.draft.llama3_eagle.LlamaForCausalLMEagle3``,
  the drafter SGLang serves), its own training step (``specforge.training.strategies.base.Eagle3TrainStrategy``
  over ``specforge.algorithms.eagle3.model.OnlineEagle3Model``: TTT unroll, ``0.8^i`` step weights, its loss
  normalisation) and its own optimizer (``specforge.optimizer.BF16Optimizer``: AdamW, grad-norm clip 0.5, 1.5%
  warm-up, cosine to 0), fed one row per step as SpecForge trains (``batch_size: 1``), in offline form (aux
  hidden states + the target's final hidden state, which its ``TargetHead`` turns into logits). Its peak lr and TTT
  length are the catalog's (``--ref-lr`` / ``--ref-ttt`` change them). It gets as many steps as fit in the CPU
  seconds our run used (measured on a calibration of ``--calibration-steps`` steps), and no early stopping.

Two things are changed in SpecForge to run it on CPU, and nothing else: its loss kernel is Triton
(``specforge.core.loss.LogSoftmaxLoss``, GPU only), so the step uses the reference implementation in the same file
(``specforge.core.loss._compute_loss``: the same value, ``-sum(mask * p * log_softmax(q)) / (B * T)``); and
``specforge.core.loss`` imports ``triton`` at the top, so that one import sees a stand-in module (no kernel of it
ever runs). ``TORCHDYNAMO_DISABLE=1`` makes its ``@torch.compile`` helpers run eagerly (no compiler on CPU).

SpecForge pins torch==2.11 and sglang==0.5.14, which clash with ours: it is installed without dependencies into
``<storage root>/bench-packages/`` on first use, at the version of the ``bench-reference`` extra in
pyproject.toml (what its modules import besides is in our own dependencies).

Usage: ``.venv/bin/python bench/bench_drafter_quality.py [--catalog catalogs/default.yaml] [--threads N]``, after
``eagle-assets run`` (it reads that run's QC shards, draft vocab and training mix). Prints the command line, both
recipes, a side-by-side table and the verdict; exit status 1 when our mean held-out tau is below the reference's.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
import tomllib
import types
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # before torch is imported: SpecForge's @torch.compile runs eagerly

import numpy as np  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from schedstat import runq_wait_s  # noqa: E402


def reference_requirement() -> str:
    """The SpecForge pin of pyproject.toml's ``bench-reference`` extra (the one place it is written)."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (req,) = [r for r in extras["bench-reference"] if r.lower().startswith("specforge")]
    return req


def install_reference(root: Path) -> Path:
    """``pip install --no-deps --target`` the pinned SpecForge into ``root`` once; returns the directory."""
    req = reference_requirement()
    target = root / "bench-packages" / req.replace("==", "-")
    if not (target / "specforge").is_dir():
        target.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), req],
                       check=True)
    return target


def import_specforge(path: Path) -> types.SimpleNamespace:
    """SpecForge's model class, training step, optimizer and batch contract, importable on a CPU-only host."""
    sys.path.insert(0, str(path))
    import torch._dynamo  # noqa: F401  (torch inspects a real triton when it loads dynamo: load it first)

    language = types.ModuleType("triton.language")
    language.constexpr = int
    stand_in = types.ModuleType("triton")
    stand_in.jit = lambda fn=None, **_kw: fn if fn is not None else (lambda f: f)
    stand_in.language = language
    stand_in.next_power_of_2 = lambda n: 1 << (int(n) - 1).bit_length()
    sys.modules["triton"], sys.modules["triton.language"] = stand_in, language
    try:
        import specforge.core.loss as loss
    finally:
        del sys.modules["triton"], sys.modules["triton.language"]
    import specforge.algorithms.eagle3.model as eagle3
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.modeling.target.target_head import TargetHead
    from specforge.optimizer import BF16Optimizer
    from specforge.runtime.contracts import TrainBatch
    from specforge.training.strategies.base import Eagle3TrainStrategy

    eagle3.LogSoftmaxLoss = types.SimpleNamespace(apply=loss._compute_loss)  # the Triton kernel's reference
    return types.SimpleNamespace(model_cls=LlamaForCausalLMEagle3, online=eagle3.OnlineEagle3Model,
                                 strategy=Eagle3TrainStrategy, optimizer=BF16Optimizer, head=TargetHead,
                                 batch=TrainBatch)


class SpecForgeArm:
    """SpecForge's drafter, step and optimizer on our rows (see the module docstring)."""

    def __init__(self, sf, target, model_dir: Path, vocab, dconf, lr: float, ttt: int, total_steps: int):
        from transformers import LlamaConfig

        cfg = LlamaConfig(hidden_size=dconf.hidden_size, intermediate_size=dconf.intermediate_size,
                          num_attention_heads=dconf.num_attention_heads, num_key_value_heads=dconf.num_key_value_heads,
                          head_dim=dconf.head_dim, vocab_size=dconf.vocab_size,
                          max_position_embeddings=dconf.max_position_embeddings, rms_norm_eps=dconf.rms_norm_eps,
                          rope_theta=dconf.rope_theta, hidden_act="silu", tie_word_embeddings=False)
        cfg.draft_vocab_size = dconf.draft_vocab_size
        cfg.target_hidden_size = dconf.target_hidden_size
        torch.manual_seed(0)
        self.draft = sf.model_cls(cfg, attention_backend="sdpa").float()
        self.draft.load_embedding(str(model_dir))
        self.draft.freeze_embedding()
        self.draft.t2d.copy_(torch.from_numpy(vocab.t2d))
        self.draft.d2t.copy_(torch.from_numpy(vocab.d2t))
        head = sf.head(str(model_dir))
        head.fc.weight.data.copy_(target.get_output_embeddings().weight.detach().float())
        head.freeze_weights()
        self.strategy = sf.strategy(sf.online(self.draft, length=ttt, attention_backend="sdpa"), target_head=head)
        self.optimizer = sf.optimizer(self.draft, lr=lr, total_steps=max(1, total_steps))
        self.batch_cls = sf.batch

    def step(self, aux: torch.Tensor, final: torch.Tensor, ids: np.ndarray, mask: np.ndarray) -> float:
        t = ids.size
        batch = self.batch_cls(sample_ids=["row"], strategy="eagle3", tensors={
            "input_ids": torch.from_numpy(ids.astype(np.int64))[None],
            "attention_mask": torch.ones(1, t, dtype=torch.long),
            "loss_mask": torch.from_numpy(mask.astype(np.float32))[None], "hidden_state": aux, "target": final,
        }, metadata={"target_repr": "hidden_state"})
        out = self.strategy.forward_loss(batch)
        out.loss.backward()
        self.optimizer.step()
        return float(out.loss.detach())

    def as_ours(self, dconf, vocab, target):
        """The trained weights in our :class:`Eagle3DraftModel` (SGLang's names: the same keys, embedding shared)."""
        from eagle_assets.drafter.eagle3.export import WEIGHT_KEYS
        from eagle_assets.drafter.eagle3.model import Eagle3DraftModel, canonical_name

        theirs = {k: v.detach().float() for k, v in self.draft.state_dict().items() if k in WEIGHT_KEYS}
        missing = set(WEIGHT_KEYS) - set(theirs)
        if missing:
            raise RuntimeError(f"SpecForge's drafter lacks SGLang weights {sorted(missing)}")
        state = {canonical_name(k): v for k, v in theirs.items()}  # SpecForge's midlayer.* is our layers.0.*
        model = Eagle3DraftModel(dconf, embed_weight=target.get_input_embeddings().weight.float(),
                                 draft_token_ids=torch.from_numpy(vocab.draft_token_ids))
        model.load_state_dict(state, strict=True)
        return model.eval()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--catalog", type=Path, default=REPO / "catalogs" / "default.yaml")
    ap.add_argument("--storage-root", type=Path, default=None, help="default: $EAGLE_ASSETS_HOME or ./.eagle_assets")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads for both arms (default: the catalog's training.threads, else torch's)")
    ap.add_argument("--ref-lr", type=float, default=None, help="SpecForge arm's peak lr (default: the catalog's)")
    ap.add_argument("--ref-ttt", type=int, default=None, help="SpecForge arm's TTT length (default: the catalog's)")
    ap.add_argument("--calibration-steps", type=int, default=20)
    args = ap.parse_args(argv)
    print("$ " + shlex.join([sys.executable, *sys.argv]), flush=True)

    from transformers import AutoModelForCausalLM

    from eagle_assets.assets.resources import PipelineSettings, TargetModel
    from eagle_assets.drafter.data.splits import load_split_rows, mixed_training_rows
    from eagle_assets.drafter.data.vocab import draft_vocab_from_arrays
    from eagle_assets.drafter.eagle3.export import load_drafter
    from eagle_assets.drafter.evaluation.heldout import evaluate_groups
    from eagle_assets.drafter.evaluation.verdict import unseen_eval_rows
    from eagle_assets.drafter.features.local_capture import run_target
    from eagle_assets.drafter.training.loop import train_drafter
    from eagle_assets.drafter.training.recipe import config_from_catalog
    from eagle_assets.qc.status import passing_datasets
    from eagle_assets.storage.shards import default_storage_root

    root = (args.storage_root or default_storage_root()).resolve()
    settings = PipelineSettings(catalog_path=str(args.catalog.resolve()), storage_root=str(root))
    catalog = settings.catalog()
    t = catalog.training
    threads = args.threads or t.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    keys, excluded = passing_datasets(settings.layout(), settings.catalog())
    if not keys:
        print(f"no partition with passing QC under {root} ({excluded}); run `eagle-assets run` first")
        return 2
    vocab_dir = settings.layout().base / "draft_vocab"
    vocab = draft_vocab_from_arrays(np.load(vocab_dir / "d2t.npy"), np.load(vocab_dir / "t2d.npy"))
    train = [(ids, mask) for _s, ids, mask, _k in mixed_training_rows(settings.layout(), settings.catalog(), keys)]
    validation = [(ids, mask)
                  for _s, ids, mask, _k in load_split_rows(settings.layout(), settings.catalog(), keys, "validation")]
    test = load_split_rows(settings.layout(), settings.catalog(), keys, "test")
    groups = {k: [(ids, mask) for _s, ids, mask, p in test if p == k] for k in keys}
    model_dir = TargetModel(model=catalog.target.model).resolve()
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    target.requires_grad_(False)
    work = root / "bench" / "drafter_quality"
    unseen = None
    if t.unseen_eval is not None:
        unseen = unseen_eval_rows(settings.catalog(), target, model_dir, settings.layout().base / "drafter_checkpoint" /
                                  "unseen_eval", lambda line: print("  " + line, flush=True))
    if unseen:
        groups["unseen source"] = unseen
    n_tok = sum(ids.size for ids, _ in train)
    print(f"target {model_dir}; {len(train)} training rows ({n_tok} tokens), {len(validation)} validation rows, "
          f"test rows {[len(g) for g in groups.values()]} ({list(groups)}); {threads} threads", flush=True)

    # -- ours ---------------------------------------------------------------------------------------------------
    config = config_from_catalog(t, num_threads=threads)
    print(f"\nours: {config}", flush=True)
    cpu0, wall0, wait0 = time.process_time(), time.perf_counter(), runq_wait_s()
    ours = train_drafter(model_dir, train, vocab, config, work / "ours", validation_rows=validation)
    ours_cpu, ours_wall = time.process_time() - cpu0, time.perf_counter() - wall0
    ours_wait = runq_wait_s() - wait0
    print(f"ours: {len(ours.steps)} steps ({len(ours.steps) / ours.plan.batches_per_epoch:.2f} epochs, "
          f"{sum(s.tokens for s in ours.steps)} tokens), stopped early {ours.stopped_early}, "
          f"{ours_cpu:.0f} CPU-s, {ours_wall:.0f} s wall (run-queue wait {ours_wait / max(ours_wall, 1e-9):.2f} s/s)",
          flush=True)
    ours_model, _ = load_drafter(ours.checkpoint_dir, target)

    # -- SpecForge -----------------------------------------------------------------------------------------------
    sf = import_specforge(install_reference(root))
    ref_lr = args.ref_lr if args.ref_lr is not None else t.lr
    ref_ttt = args.ref_ttt if args.ref_ttt is not None else t.ttt_steps
    capture = list(ours.aux_capture_ids)
    cpu0 = time.process_time()
    feats = []
    for ids, mask in train:
        aux, final = run_target(target, torch.from_numpy(ids.astype(np.int64)), capture)
        feats.append((aux, final, ids.astype(np.int64), mask))
    feature_cpu = time.process_time() - cpu0
    budget = max(1.0, ours_cpu - feature_cpu)  # both arms pay for the features once
    def order(epoch: int) -> np.ndarray:
        return np.random.default_rng([0, epoch]).permutation(len(feats))

    probe = SpecForgeArm(sf, target, model_dir, vocab, ours.drafter_config, ref_lr, ref_ttt, 10**6)
    cpu0 = time.process_time()
    for i in order(0)[: args.calibration_steps]:
        probe.step(*feats[int(i)])
    per_step = (time.process_time() - cpu0) / min(args.calibration_steps, len(feats))
    steps = max(1, int(budget / per_step))
    print(f"\nSpecForge {reference_requirement()}: lr {ref_lr}, TTT {ref_ttt}, batch 1 row, {steps} steps "
          f"({steps / len(feats):.2f} epochs) in the {budget:.0f} CPU-s ours used besides feature extraction "
          f"({per_step:.3f} CPU-s per step)", flush=True)
    arm = SpecForgeArm(sf, target, model_dir, vocab, ours.drafter_config, ref_lr, ref_ttt, steps)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    losses = []
    for s in range(steps):
        epoch, pos = divmod(s, len(feats))
        losses.append(arm.step(*feats[int(order(epoch)[pos])]))
    ref_cpu, ref_wall = time.process_time() - cpu0 + feature_cpu, time.perf_counter() - wall0
    print(f"SpecForge: {steps} steps, loss {np.mean(losses[:10]):.3f} -> {np.mean(losses[-10:]):.3f}, "
          f"{ref_cpu:.0f} CPU-s with features, {ref_wall:.0f} s wall", flush=True)
    ref_model = arm.as_ours(ours.drafter_config, vocab, target)

    # -- the same measurement for both ------------------------------------------------------------------------------
    k = t.acceptance_k
    ours_eval = evaluate_groups(target, ours_model, vocab, groups, k=k, max_positions=t.acceptance_max_positions)
    ref_eval = evaluate_groups(target, ref_model, vocab, groups, k=k, max_positions=t.acceptance_max_positions)
    held = [g for g in groups if g != "unseen source"]

    def cell(r) -> str:
        lo, hi = r.tau_ci95 or (float("nan"), float("nan"))
        return f"{r.tau:.3f} [{lo:.2f}, {hi:.2f}]"

    from eagle_assets.drafter.evaluation.acceptance import mean_tau_over_groups

    o_mean, o_ci = mean_tau_over_groups({g: (ours_eval.groups[g].row_verifications, ours_eval.groups[g].row_tokens)
                                         for g in held})
    r_mean, r_ci = mean_tau_over_groups({g: (ref_eval.groups[g].row_verifications, ref_eval.groups[g].row_tokens)
                                         for g in held})
    print(f"\nsimulated tau (k={k}, SGLang chain drafting at temperature 0), 95% bootstrap interval over rows:")
    print("| rows | test rows | ours | SpecForge | ours / SpecForge |")
    print("|---|---:|---:|---:|---:|")
    for g in groups:
        o, r = ours_eval.groups[g], ref_eval.groups[g]
        print(f"| {g} | {len(groups[g])} | {cell(o)} | {cell(r)} | {o.tau / max(r.tau, 1e-9):.3f} |")
    print(f"| mean over held-out partitions | {sum(len(groups[g]) for g in held)} | {o_mean:.3f} [{o_ci[0]:.2f}, "
          f"{o_ci[1]:.2f}] | {r_mean:.3f} [{r_ci[0]:.2f}, {r_ci[1]:.2f}] | {o_mean / max(r_mean, 1e-9):.3f} |")
    print(f"| training CPU-s (features included) | | {ours_cpu:.0f} | {ref_cpu:.0f} | {ours_cpu / ref_cpu:.3f} |")
    for name, ev in (("ours", ours_eval), ("SpecForge", ref_eval)):
        pos = ev.groups[held[0]].per_position_acceptance if held else []
        print(f"{name} per-position acceptance ({held[0] if held else '-'}): {[round(a, 3) for a in pos]}")
    verdict = o_mean >= r_mean
    print(f"\nours {'>=' if verdict else '<'} SpecForge on the mean held-out tau ({o_mean:.3f} vs {r_mean:.3f})")
    return 0 if verdict else 1


if __name__ == "__main__":
    raise SystemExit(main())
