"""Experiment: a drafter trained on the balanced training mix vs one trained on the unbalanced concatenation.

Issue "Catch it at sample 42", item 4. The situation the mix exists for: short-answer datasets with many rows
beside long-reasoning ones with few. On the embedded default this script

1. writes the four demo datasets with ``--short-records`` records for the short partitions (B1 function calling,
   B2 code) and the default 50 for the long-reasoning ones (B4 math, B5 reasoning), from the same generator stream
   as ``catalogs/demo_data`` (``eagle_assets.demo.raw_samples``),
2. runs them through the pipeline (``eagle-assets run --skip-training`` on a catalog that is the default one with
   those sources and limits; storage ``<storage>/exp_training_mix``),
3. builds two training sets with the same token budget from the training split of every partition: "balanced"
   (the catalog's ``training.mix``: equal partition weights, at most 30% of tokens from rows under 300 tokens) and
   "concat" (the shuffled concatenation, cut at the budget: partitions weigh what their rows happen to hold),
4. trains a drafter on each (the catalog's training recipe) and measures tau on the held-out target generations of
   the long-reasoning partitions and of the short ones.

Usage: ``.venv/bin/python bench/exp_training_mix.py [--short-records 250] [--budget 30000]``. Takes ~10-20 min on
2 CPU cores (generation of ~600 rows, then six drafter trainings of 30k tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import yaml  # noqa: E402
from drafter_experiment import train_and_measure  # noqa: E402

from eagle_assets.catalog import load_catalog  # noqa: E402
from eagle_assets.drafter.data.mix import build_mix, mix_table_markdown  # noqa: E402
from eagle_assets.storage.shards import default_storage_root  # noqa: E402

SHORT = ("B1_glaive", "B2_opencodeinstruct")
LONG = ("B4_mixturethoughts", "B5_openthoughts")


def write_catalog(work: Path, short_records: int, holdout_fraction: float) -> Path:
    """The default catalog with its sources in ``work/data`` (short partitions enlarged) and every row used."""
    from eagle_assets.demo.raw_samples import FILES, write_raw_samples

    data = work / "data"
    write_raw_samples(data, n_records={"tool": short_records, "code": short_records})
    catalog = yaml.safe_load((REPO / "catalogs" / "default.yaml").read_text())
    names = {"B1_glaive": FILES["tool"], "B2_opencodeinstruct": FILES["code"],
             "B4_mixturethoughts": FILES["math"], "B5_openthoughts": FILES["reasoning"]}
    for key, part in catalog["partitions"].items():
        part["sources"][0]["path"] = str(data / names[key])
        part["limit"] = short_records + 2 if key in SHORT else 52
    catalog["training"]["holdout_fraction"] = holdout_fraction
    path = work / "exp_training_mix.yaml"
    path.write_text(yaml.safe_dump(catalog, sort_keys=False))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--short-records", type=int, default=250, help="records of each short partition (B1, B2)")
    ap.add_argument("--budget", type=int, default=30_000, help="completion tokens of each training set")
    ap.add_argument("--holdout-fraction", type=float, default=0.25)
    ap.add_argument("--storage-root", type=Path, default=None)
    ap.add_argument("--seeds", type=lambda v: [int(x) for x in v.split(",")], default=[0, 1, 2],
                    help="seeds, comma-separated (default 0,1,2); each training set is built and trained per seed")
    args = ap.parse_args(argv)

    from eagle_assets.assets.resources import PipelineSettings, TargetModel
    from eagle_assets.drafter.data.splits import load_split_rows, mix_candidates
    from eagle_assets.qc.status import passing_datasets

    root = (args.storage_root or default_storage_root()).resolve()
    work = root / "experiments" / "training_mix"
    work.mkdir(parents=True, exist_ok=True)
    catalog_path = write_catalog(work, args.short_records, args.holdout_fraction)
    print(f"catalog {catalog_path}; generating (rows already generated are reused)", flush=True)
    subprocess.run([sys.executable, "-m", "eagle_assets.cli", "run", "--catalog", str(catalog_path),
                    "--skip-training"], check=True, cwd=REPO, stdout=subprocess.DEVNULL,
                   env={**os.environ, "EAGLE_ASSETS_HOME": str(root)})
    catalog = load_catalog(catalog_path)
    settings = PipelineSettings(catalog_path=str(catalog_path), storage_root=str(root))
    keys, excluded = passing_datasets(settings.layout(), settings.catalog())
    if set(keys) != set(SHORT + LONG):
        print(f"partitions excluded by QC: {excluded}; the experiment needs all four")
        return 2
    candidates = mix_candidates(settings.layout(), settings.catalog(), keys)
    layout, catalog = settings.layout(), settings.catalog()
    rows = {(k, s): (ids, mask) for s, ids, mask, k in load_split_rows(layout, catalog, keys, "train")}
    heldout: dict[str, list] = {k: [] for k in keys}
    for _s, ids, mask, k in load_split_rows(layout, catalog, keys, "test"):
        heldout[k].append((ids, mask))
    model_dir = TargetModel(model=catalog.target.model).resolve()
    print(f"held-out rows: { {k: len(v) for k, v in heldout.items()} }; seeds {args.seeds}", flush=True)
    results: dict[str, list[dict]] = {"balanced": [], "concat": []}
    for seed in args.seeds:
        # The seed moves the mix's row order, the drafter's initialization and its batch order; the held-out rows
        # stay the same for every run.
        spec = catalog.training.model_copy(update={"seed": seed})
        mixes = {
            "balanced": build_mix(candidates, catalog.training.mix.model_copy(
                update={"token_budget": args.budget, "seed": seed}), keys),
            "concat": build_mix(candidates, catalog.training.mix.model_copy(
                update={"mode": "concat", "token_budget": args.budget, "seed": seed}), keys),
        }
        for name, mix in mixes.items():
            if seed == args.seeds[0]:
                print(f"\n{name} mix, seed {seed} ({mix.tokens} tokens):\n{mix_table_markdown(mix)}", flush=True)
            train = [rows[(c.partition, c.sample_id)] for c in mix.selected]
            r = train_and_measure(model_dir, train, heldout, spec, work / f"{name}-seed{seed}")
            r["short_token_share"] = round(mix.share(mix.after, bucket="<300"), 4)
            r["tau_long"] = round(float(np.mean([r["tau"][k] for k in LONG])), 4)
            r["tau_short"] = round(float(np.mean([r["tau"][k] for k in SHORT])), 4)
            results[name].append(r)
    print("\n| training set | seed | tokens | share <300 | " + " | ".join(f"tau {k}" for k in keys)
          + " | tau long (B4, B5) | tau short (B1, B2) |")
    print("|---|---|---|---|" + "---|" * len(keys) + "---|---|")
    for name, runs in results.items():
        for seed, r in zip(args.seeds, runs):
            print(f"| {name} | {seed} | {r['train_tokens']} | {r['short_token_share']:.1%} | "
                  + " | ".join(f"{r['tau'][k]:.3f}" for k in keys) + f" | {r['tau_long']:.3f} | {r['tau_short']:.3f} |")
    summary = {}
    for name, runs in results.items():
        summary[name] = {f: float(np.mean([r[f] for r in runs])) for f in ("tau_long", "tau_short")}
        summary[name].update({f"{f}_sd": float(np.std([r[f] for r in runs], ddof=1)) if len(runs) > 1 else 0.0
                              for f in ("tau_long", "tau_short")})
        m = summary[name]
        print(f"{name}: tau long {m['tau_long']:.3f} (sd {m['tau_long_sd']:.3f}), tau short {m['tau_short']:.3f} "
              f"(sd {m['tau_short_sd']:.3f}) over {len(args.seeds)} seeds")
    b, c = summary["balanced"], summary["concat"]
    print(f"\nbalanced vs concat: tau long {b['tau_long'] / c['tau_long'] - 1:+.1%}, "
          f"tau short {b['tau_short'] / c['tau_short'] - 1:+.1%}")
    (work / "summary.json").write_text(json.dumps({"runs": results, "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
