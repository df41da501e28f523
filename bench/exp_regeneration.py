"""Experiment: a drafter trained on our regenerated responses vs one trained on the datasets' original responses.

Issue "EAGLE-3 drafter", item 7. Both arms use the same prompts (the training split of every partition that passed
QC), the same token budget (completion tokens, the smaller arm's total; each arm cut from a seeded shuffle), the same
training recipe (the catalog's ``training`` section, draft vocab built from the arm's own completion tokens) and
are measured on the same held-out rows: the target's own generations for held-out prompts, i.e. what the drafter
meets when serving. Tau is the simulated acceptance length (k = ``ttt_steps`` drafts per verification).

- regenerated: ``prompt_ids + output_ids`` exactly as the target produced them (the ``qc_shards`` rows).
- original: ``prompt_ids`` + the dataset's own reply (``raw_prompts.reference_reply``), rendered by the target's
  chat template as the assistant turn after the prompt and tokenized after the generation prompt, as a
  text-based trainer (SpecForge, speculators) builds its rows. A reply without reasoning gets the template's empty
  think block. Rows whose reply cannot be rendered are left out and counted.

Needs a materialized catalog (``eagle-assets run --skip-training`` first). Usage:
``.venv/bin/python bench/exp_regeneration.py [--catalog catalogs/default.yaml] [--holdout-fraction 0.25]``.
Takes ~5-15 min on 2 CPU cores with the default catalog (six drafter trainings of ~30k tokens).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from drafter_experiment import completion_tokens, train_and_measure  # noqa: E402

from eagle_assets.catalog import MixSpec, default_catalog_path, load_catalog  # noqa: E402
from eagle_assets.drafter.data.mix import MixCandidate, build_mix  # noqa: E402
from eagle_assets.drafter.data.splits import is_holdout  # noqa: E402
from eagle_assets.storage.shards import default_storage_root  # noqa: E402


def reference_reply_ids(tokenizer, messages: list, tools: list | None, reference: dict, eot_text: str,
                        enable_thinking: bool | None) -> list[int] | None:
    """Token ids of the dataset's reply rendered as the assistant turn after the prompt; None when the template's
    rendering of prompt + reply does not start with its rendering of the prompt (the reply cannot be aligned)."""
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    assistant = {"role": "assistant", "content": reference.get("content") or "",
                 "reasoning_content": reference.get("reasoning_content") or "\n"}
    if reference.get("tool_calls"):
        assistant["tool_calls"] = reference["tool_calls"]
    prompt = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs)
    full = tokenizer.apply_chat_template(messages + [assistant], tools=tools, tokenize=False, **kwargs)
    if not full.startswith(prompt):
        return None
    reply = full[len(prompt):]
    end = reply.find(eot_text)
    if end < 0:
        return None
    return tokenizer(reply[: end + len(eot_text)], add_special_tokens=False)["input_ids"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--catalog", type=Path, default=None)
    ap.add_argument("--storage-root", type=Path, default=None)
    ap.add_argument("--holdout-fraction", type=float, default=0.25,
                    help="share of each partition's prompts held out for measuring tau (default 0.25)")
    ap.add_argument("--out", type=Path, default=None, help="default: <storage>/experiments/regeneration")
    ap.add_argument("--dry-run", action="store_true",
                    help="build both arms, print them and one row of each; no training")
    ap.add_argument("--seeds", type=lambda v: [int(x) for x in v.split(",")], default=[0, 1, 2],
                    help="training seeds, comma-separated (default 0,1,2); each arm is trained once per seed")
    args = ap.parse_args(argv)

    from eagle_assets.assets.resources import PipelineSettings, TargetModel
    from eagle_assets.qc.status import passing_datasets
    from eagle_assets.target_model.profile import detect_profile
    from eagle_assets.target_model.tokenizer import load_tokenizer

    catalog_path = (args.catalog or default_catalog_path()).resolve()
    catalog = load_catalog(catalog_path)
    root = (args.storage_root or default_storage_root()).resolve()
    settings = PipelineSettings(catalog_path=str(catalog_path), storage_root=str(root))
    layout = settings.layout()
    keys, excluded = passing_datasets(settings.layout(), settings.catalog())
    if not keys:
        print(f"no partition of {catalog_path} has passing QC shards under {layout.base}: run "
              f"`eagle-assets run --catalog {catalog_path} --skip-training` first ({excluded})")
        return 2
    model_dir = TargetModel(model=catalog.target.model).resolve()
    tokenizer = load_tokenizer(model_dir)
    profile = detect_profile(tokenizer, catalog.target.profile or None)
    eot_text = tokenizer.decode([profile.end_of_turn_id])
    training = catalog.training
    regen, original, heldout, skipped = [], [], {}, {}
    for key in keys:
        spec = catalog.partitions[key]
        raw = {r["sample_id"]: r
               for r in pq.read_table(layout.base / "raw_prompts" / key / "prompts.parquet").to_pylist()}
        prompts = {r["sample_id"]: r["prompt_ids"]
                   for r in pq.read_table(layout.base / "tokenized_prompts" / key / "prompts.parquet").to_pylist()}
        qc = pq.read_table(layout.base / "qc_shards" / key / "shard-00000.parquet",
                           columns=["sample_id", "input_ids", "loss_mask"]).to_pylist()
        heldout[key] = []
        skipped[key] = 0
        for row in qc:
            sid = row["sample_id"]
            ids, mask = np.asarray(row["input_ids"], np.int32), np.asarray(row["loss_mask"], np.int8)
            if is_holdout(sid, args.holdout_fraction, training.seed):
                heldout[key].append((ids, mask))
                continue
            regen.append((key, sid, (ids, mask)))
            ref = json.loads(raw[sid]["reference_reply"]) if raw[sid]["reference_reply"] else None
            reply = ref and reference_reply_ids(tokenizer, json.loads(raw[sid]["messages"]),
                                                json.loads(raw[sid]["tools"]) if raw[sid]["tools"] else None,
                                                ref, eot_text, spec.enable_thinking)
            if not reply:
                skipped[key] += 1
                continue
            p = prompts[sid]
            original.append((key, sid, (np.asarray(p + reply, np.int32),
                                        np.asarray([0] * len(p) + [1] * len(reply), np.int8))))
    budget = min(completion_tokens([r for *_x, r in regen]), completion_tokens([r for *_x, r in original]))
    out = (args.out or layout.base / "experiments" / "regeneration").resolve()
    print(f"catalog {catalog_path.name}: partitions {keys}; held-out rows {({k: len(v) for k, v in heldout.items()})}; "
          f"original replies not renderable {skipped}; budget {budget} completion tokens per arm; seeds {args.seeds}")
    results: dict[str, list[dict]] = {"regenerated": [], "original": []}
    for seed in args.seeds:
        # The seed moves the rows cut at the budget, the drafter's initialization and its batch order; the
        # held-out rows stay the same for every run.
        spec = training.model_copy(update={"seed": seed})
        for name, rows in (("regenerated", regen), ("original", original)):
            by_id = {(k, s): r for k, s, r in rows}
            mix = build_mix([MixCandidate(k, s, completion_tokens([r])) for k, s, r in rows],
                            MixSpec(mode="concat", token_budget=budget, seed=seed), partitions=keys)
            arm = [by_id[(c.partition, c.sample_id)] for c in mix.selected]
            if args.dry_run:
                ids, mask = arm[0]
                print(f"{name}: {len(arm)} rows; first row's completion: "
                      f"{tokenizer.decode(ids[mask.astype(bool)])[:300]!r}")
                continue
            results[name].append(train_and_measure(model_dir, arm, heldout, spec, out / f"{name}-seed{seed}"))
        if args.dry_run:
            return 0
    print("\n| arm | seed | rows | completion tokens | " + " | ".join(f"tau {k}" for k in keys) + " | mean tau |")
    print("|---|---|---|---|" + "---|" * len(keys) + "---|")
    for name, runs in results.items():
        for seed, r in zip(args.seeds, runs):
            print(f"| {name} | {seed} | {r['train_rows']} | {r['train_tokens']} | "
                  + " | ".join(f"{r['tau'][k]:.3f}" for k in keys) + f" | {r['mean_tau']:.3f} |")
    summary = {name: {"mean_tau": float(np.mean([r["mean_tau"] for r in runs])),
                      "sd": float(np.std([r["mean_tau"] for r in runs], ddof=1)) if len(runs) > 1 else 0.0,
                      **{f"tau_{k}": float(np.mean([r["tau"][k] for r in runs])) for k in keys}}
               for name, runs in results.items()}
    for name, m in summary.items():
        print(f"{name}: mean tau {m['mean_tau']:.3f} (sd {m['sd']:.3f} over {len(args.seeds)} seeds); "
              + ", ".join(f"{k} {m[f'tau_{k}']:.3f}" for k in keys))
    gain = summary["regenerated"]["mean_tau"] / summary["original"]["mean_tau"] - 1
    print(f"\nregenerated vs original: mean tau {gain:+.1%}")
    (out / "summary.json").write_text(json.dumps({"budget": budget, "skipped": skipped, "seeds": args.seeds,
                                                  "runs": results, "summary": summary, "gain": gain}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
