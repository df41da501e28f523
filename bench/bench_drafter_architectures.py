"""Drafter architectures side by side on the embedded default: the Llama draft as today, the same with the
EAGLE-3.1 switches (``fc_norm``, ``norm_output``), a 2-layer Llama draft, and a demo-sized MLA draft (the
``Eagle3DeepseekV2ForCausalLM`` layout SGLang serves for Kimi-K2.x / DeepSeek-V3 targets), each trained by the
``drafter_checkpoint`` asset on the same QC shards with the default catalog's recipe and measured by its
``acceptance_length`` check on the same held-out rows.

Printed per architecture: held-out tau per partition with its 95% bootstrap CI, the mean, training seconds (the
trainer's own clock: optimizer steps, CPU, one thread) and the exported parameter count (the shared embedding
not included).

Usage: ``.venv/bin/python bench/bench_drafter_architectures.py --qc STORE/default/qc_shards [--jobs 2] [--seeds 0 1 2]
[--variants NAME ...]``, where
``STORE`` is the storage root of an ``eagle-assets run`` of the default catalog (its ``qc_shards`` are copied, so
that run is left as it was). About 2 CPU-minutes per architecture; ``--jobs 2`` trains two at once on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
MLA_DEMO = {"q_lora_rank": 64, "kv_lora_rank": 32, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
            "v_head_dim": 32}
VARIANTS = {
    "llama (today)": {"architecture": "llama"},
    "llama + 3.1 switches": {"architecture": "llama", "fc_norm": True, "norm_output": True},
    "llama, 2 layers": {"architecture": "llama", "num_hidden_layers": 2},
    "mla (demo dims, 3.1)": {"architecture": "mla", **MLA_DEMO},
}


def run_one(name: str, drafter: dict, qc: Path, out: Path, seed: int) -> None:
    """Materialize draft_vocab, training_mix and drafter_checkpoint for one variant; write its figures as JSON."""
    import dagster as dg

    from eagle_assets.definitions import build_definitions

    catalog = yaml.safe_load((REPO / "catalogs" / "default.yaml").read_text())
    for spec in catalog["partitions"].values():
        for src in spec["sources"]:
            src["path"] = str((REPO / "catalogs" / src["path"]).resolve())
    catalog["training"]["drafter"] = drafter
    catalog["training"]["seed"] = seed
    path = out / "default.yaml"
    path.write_text(yaml.safe_dump(catalog))
    shutil.copytree(qc, out / "store" / "default" / "qc_shards")
    defs = build_definitions(path, storage_root=out / "store")
    wanted = {dg.AssetKey(k) for k in ("draft_vocab", "training_mix", "drafter_checkpoint")}
    with dg.DagsterInstance.ephemeral() as instance:
        result = dg.materialize([a for a in defs.assets if isinstance(a, dg.AssetsDefinition) and a.keys & wanted],
                                instance=instance, resources=defs.resources, raise_on_error=False)
    if not result.success:
        raise SystemExit(f"{name}: the run failed")
    meta = {}
    for event in result.get_asset_materialization_events():
        if event.asset_key == dg.AssetKey("drafter_checkpoint"):
            meta = {k: v.value for k, v in event.materialization.metadata.items()}
    check = next(e for e in result.get_asset_check_evaluations() if e.check_name == "acceptance_length")
    cmeta = {k: v.value for k, v in check.metadata.items()}
    figures = {"name": name, "drafter": meta["drafter_architecture"], "parameters": meta["parameters"],
               "train_seconds": meta["train_seconds"], "steps": meta["steps"], "mean_tau": cmeta["mean_tau"],
               "mean_tau_ci95": cmeta["mean_tau_ci95"], "per_partition": cmeta["per_partition"]}
    (out / "figures.json").write_text(json.dumps(figures))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--qc", required=True, type=Path, help="qc_shards folder of a default-catalog run")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="training.seed values (default 0)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:  # one variant, in its own process
        run_one(args.variant, VARIANTS[args.variant], args.qc, args.out, args.seed)
        return
    print("$ " + shlex.join([sys.executable, *sys.argv]), flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-arch-"))

    def one(item: tuple[int, tuple[str, int]]) -> tuple[tuple[str, int], dict]:
        i, (name, seed) = item
        out = tmp / f"v{i}"
        out.mkdir()
        with open(out / "log.txt", "w") as log:
            proc = subprocess.run([sys.executable, __file__, "--qc", str(args.qc), "--variant", name, "--out",
                                   str(out), "--seed", str(seed)], stdout=subprocess.DEVNULL, stderr=log)
        if proc.returncode != 0:
            raise SystemExit(f"{name} failed: {(out / 'log.txt').read_text()[-2000:]}")
        return (name, seed), json.loads((out / "figures.json").read_text())

    runs = [(name, seed) for name in args.variants for seed in args.seeds]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = dict(pool.map(one, enumerate(runs)))
    parts = sorted(next(iter(results.values()))["per_partition"])
    head = ["drafter", "seed", "params", "train s", "mean tau (95% CI)"] + [f"tau {p}" for p in parts]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for (name, seed), r in results.items():
        lo, hi = r["mean_tau_ci95"]
        cells = [r["drafter"], str(seed), f"{r['parameters']:,}", f"{r['train_seconds']:.0f}",
                 f"{r['mean_tau']:.3f} ({lo:.2f}-{hi:.2f})"]
        for p in parts:
            g = r["per_partition"][p]
            ci = g.get("tau_ci95") or [float("nan")] * 2
            cells.append(f"{g['tau']:.2f} ({ci[0]:.2f}-{ci[1]:.2f})")
        print("| " + " | ".join(cells) + " |")
    if len(args.seeds) > 1:
        print("\nmean over seeds " + " ".join(map(str, args.seeds)) + ":")
        for name in args.variants:
            taus = [results[(name, seed)]["mean_tau"] for seed in args.seeds]
            print(f"  {name}: mean tau {sum(taus) / len(taus):.3f} (seeds: {', '.join(f'{t:.3f}' for t in taus)})")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
