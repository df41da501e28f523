"""Every drafter family side by side on the embedded default, through the pipeline's own ``drafter_comparison``
asset: the default catalog with ``training.compare`` naming EAGLE-3.1, a demo-sized MLA draft, DFlash and DSpark
beside its EAGLE-3 drafter, each trained from the same rows and recipe and measured on the same held-out rows and
suites (the table docs/drafters.md gives).

Usage: ``.venv/bin/python bench/compare_drafters.py --store STORE [--only NAME ...]``, where ``STORE`` is the
storage root of an ``eagle-assets run`` of the default catalog (``EAGLE_ASSETS_HOME``): the copy of the catalog
keeps its name (``default``), so the comparison reads that run's QC shards, draft vocab and drafter checkpoint and
writes ``STORE/default/drafter_comparison/``. Prints the comparison's ``report.md``. About 10 CPU-minutes for the
five compared drafters on one thread (DFlash's 15 drafts per block and DSpark's sampled evaluation take most).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import yaml
from bench_drafter_architectures import MLA_DEMO  # the MLA draft at demo size

REPO = Path(__file__).resolve().parents[1]
COMPARED = {
    # training.drafter again: its training seconds on this run's clock, and its tau again (training is seeded)
    "eagle3": {"architecture": "llama"},
    "eagle3.1": {"architecture": "llama", "fc_norm": True, "norm_output": True},
    "mla": {"architecture": "mla", **MLA_DEMO},
    "dspark": {"architecture": "dspark"},
    "dflash": {"architecture": "dflash"},
}


def catalog_copy(folder: Path, compared: dict) -> Path:
    """``folder/default.yaml``: the default catalog with absolute source paths and ``training.compare``."""
    base = yaml.safe_load((REPO / "catalogs" / "default.yaml").read_text())
    for spec in [*base["partitions"].values(), *base["evaluation"]["suites"].values()]:
        for source in spec["sources"]:
            source["path"] = str((REPO / "catalogs" / source["path"]).resolve())
    base["training"]["compare"] = compared
    path = folder / "default.yaml"
    path.write_text(yaml.safe_dump(base, sort_keys=False))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", required=True, help="storage root of an eagle-assets run of the default catalog")
    parser.add_argument("--only", nargs="*", choices=sorted(COMPARED), help="compare only these (default: all)")
    args = parser.parse_args()
    store = Path(args.store).resolve()
    if not (store / "default" / "drafter_checkpoint" / "checkpoint" / "config.json").exists():
        raise SystemExit(f"{store}/default has no drafter checkpoint: run `eagle-assets run` with "
                         f"EAGLE_ASSETS_HOME={store} first")
    import dagster as dg

    from eagle_assets.definitions import build_definitions

    compared = {k: v for k, v in COMPARED.items() if not args.only or k in args.only}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("DAGSTER_HOME", tmp)
        defs = build_definitions(catalog_copy(Path(tmp), compared), storage_root=store)
        started = time.perf_counter()
        asset = [a for a in defs.assets if isinstance(a, dg.AssetsDefinition)
                 and dg.AssetKey("drafter_comparison") in a.keys]
        with dg.DagsterInstance.ephemeral() as instance:
            result = dg.materialize(asset, instance=instance, resources=defs.resources, raise_on_error=False)
            if not result.success:
                raise SystemExit("drafter_comparison failed:\n" + "\n".join(
                    str(e.user_message) for e in instance.all_logs(result.run_id)[-20:]))
        check = {e.check_name: e for e in result.get_asset_check_evaluations()}["compared_exports"]
        print(f"drafter_comparison: {time.perf_counter() - started:.0f} s; compared_exports "
              f"{'passed' if check.passed else 'FAILED'}: {check.description}")
    print((store / "default" / "drafter_comparison" / "report.md").read_text())


if __name__ == "__main__":
    main()
