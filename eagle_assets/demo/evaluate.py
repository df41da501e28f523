"""``python -m eagle_assets.demo.evaluate``: how well a target writes the demo reply structure (reasoning, one
``</think>``, an answer, ``<|im_end|>``) per kind, on the committed prompts or fresh ones from the generator.

The measuring itself is :mod:`eagle_assets.demo.gate`. This is a self-check of the demo model, not the pipeline's
quality checks (those live in ``eagle_assets.qc``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from eagle_assets.demo.gate import default_catalog_caps, evaluate_target, gate_failures, gate_samples
from eagle_assets.demo.transcripts import ALL_KINDS


def main(argv: list[str] | None = None) -> int:
    from eagle_assets.demo.shipped import demo_target
    from eagle_assets.demo.transcripts import generate_samples

    parser = argparse.ArgumentParser(prog="python -m eagle_assets.demo.evaluate",
                                     description="structure rate and reply lengths of the demo target per kind")
    parser.add_argument("--model-dir", type=Path, default=None, help="default: build or reuse the demo target")
    parser.add_argument("--fresh-seed", type=int, default=None,
                        help="prompts from this generator seed instead of the committed demo files")
    parser.add_argument("--per-kind", type=int, default=50)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: the default catalog's caps")
    parser.add_argument("--dtype", default="auto", help="as the embedded server's --dtype (auto = float64 on CPU)")
    args = parser.parse_args(argv)
    model_dir = args.model_dir or demo_target()
    if args.fresh_seed is None:
        everything = gate_samples()
        samples = [s for kind in ALL_KINDS for s in [t for t in everything if t.kind == kind][:args.per_kind]]
    else:
        samples = [s for kind in ALL_KINDS for s in generate_samples(kind, args.per_kind, args.fresh_seed)]
    caps = args.max_new_tokens or default_catalog_caps()
    report = evaluate_target(model_dir, samples, caps, args.temperature, dtype=args.dtype)
    json.dump({"report": report, "gate_failures": gate_failures(report)}, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
