"""Measure whether a target writes the demo reply structure: reasoning, one ``</think>``, an answer, ``<|im_end|>``.

Used by the demo tests and to report the demo target's quality (``python -m eagle_assets.demo.evaluate``). This is
a self-check of the demo model, not the pipeline's quality gate (that lives in ``eagle_assets.quality``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle_assets.demo.tokenizer import EOS_TOKEN, PAD_TOKEN
from eagle_assets.demo.transcripts import KINDS, DemoSample


@dataclass(frozen=True)
class ReplyCheck:
    """Verdict on one generated reply.

    Attributes:
        ok: True when the reply has exactly one ``</think>``, no ``<think>``, a non-empty answer after it (for tool
            prompts: one balanced ``<tool_call>`` block holding JSON with a ``name`` and ``arguments`` object, for
            other prompts: no tool call), and ends with a stop id.
        reason: "" when ok, else the first failed rule (``no_stop``, ``think_end_count``, ``think_start``,
            ``empty_answer``, ``tool_call_missing``, ``tool_call_json``, ``unexpected_tool_call``).
        n_tokens: reply length in tokens, stop token included.
        n_reasoning_tokens: tokens before ``</think>`` (whole reply when it is missing).
    """

    ok: bool
    reason: str
    n_tokens: int
    n_reasoning_tokens: int


def check_reply(output_ids: list[int], tokenizer, expect_tool_call: bool) -> ReplyCheck:
    """Judge one reply (the ids generated after a prompt ending with ``<think>``, stop token included)."""
    ids = list(output_ids)
    ids_of = tokenizer.convert_tokens_to_ids
    think_start, think_end = ids_of("<think>"), ids_of("</think>")
    call_start, call_end = ids_of("<tool_call>"), ids_of("</tool_call>")
    stops = {ids_of(EOS_TOKEN), ids_of(PAD_TOKEN)}
    n_reason = ids.index(think_end) if think_end in ids else len(ids)

    def verdict(reason: str) -> ReplyCheck:
        return ReplyCheck(ok=not reason, reason=reason, n_tokens=len(ids), n_reasoning_tokens=n_reason)

    if not ids or ids[-1] not in stops or any(t in stops for t in ids[:-1]):
        return verdict("no_stop")
    if ids.count(think_end) != 1:
        return verdict("think_end_count")
    if think_start in ids:
        return verdict("think_start")
    answer = ids[n_reason + 1:-1]
    if not tokenizer.decode(answer, skip_special_tokens=False).strip():
        return verdict("empty_answer")
    n_calls = answer.count(call_start)
    if not expect_tool_call:
        return verdict("unexpected_tool_call" if n_calls or call_end in answer else "")
    if n_calls != 1 or answer.count(call_end) != 1 or answer.index(call_start) > answer.index(call_end):
        return verdict("tool_call_missing")
    body = tokenizer.decode(answer[answer.index(call_start) + 1:answer.index(call_end)], skip_special_tokens=False)
    try:
        call = json.loads(body)
    except ValueError:
        return verdict("tool_call_json")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(call.get("arguments"), dict):
        return verdict("tool_call_json")
    return verdict("")


def generate_replies(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                     seed: int = 0, batch_size: int = 16) -> list[list[int]]:
    """Generate a reply per prompt (ids) with ``model.generate``; returns the new ids up to and including the first
    stop id (or ``max_new_tokens`` ids when none came). ``temperature`` 0 means greedy."""
    import torch

    eos, pad = tokenizer.convert_tokens_to_ids(EOS_TOKEN), tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    # Longest first keeps padding small inside each batch.
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    torch.manual_seed(seed)
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(idx):
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]):] = 1
        kwargs: dict[str, Any] = {"do_sample": temperature > 0}
        if temperature > 0:
            kwargs.update(temperature=temperature, top_p=1.0, top_k=0)
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                 eos_token_id=[eos, pad], pad_token_id=pad, **kwargs)
        for r, i in enumerate(idx):
            new = gen[r, width:].tolist()
            cut = next((j for j, t in enumerate(new) if t in (eos, pad)), None)
            out[i] = new if cut is None else new[:cut + 1]
    return out


def evaluate_target(model_dir: Path, samples: list[DemoSample], max_new_tokens: int = 600, temperature: float = 0.0,
                    seed: int = 0, batch_size: int = 16) -> dict[str, Any]:
    """Generate for ``samples`` and summarize per kind: ``{kind: {"n", "structure_rate", "median_tokens",
    "min_tokens", "max_tokens", "failures": {reason: count}}}``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle_assets.demo.build import encode_sample

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [encode_sample(tokenizer, s)[0] for s in samples]
    replies = generate_replies(model, tokenizer, prompts, max_new_tokens, temperature, seed, batch_size)
    report: dict[str, Any] = {}
    for kind in KINDS:
        checks = [check_reply(r, tokenizer, s.kind == "tool") for s, r in zip(samples, replies) if s.kind == kind]
        if not checks:
            continue
        lengths = [c.n_tokens for c in checks]
        failures: dict[str, int] = {}
        for c in checks:
            if not c.ok:
                failures[c.reason] = failures.get(c.reason, 0) + 1
        report[kind] = {"n": len(checks), "structure_rate": sum(c.ok for c in checks) / len(checks),
                        "median_tokens": statistics.median(lengths), "min_tokens": min(lengths),
                        "max_tokens": max(lengths), "failures": failures}
    return report


def main(argv: list[str] | None = None) -> int:
    from eagle_assets.demo.build import build_demo_target
    from eagle_assets.demo.raw_samples import prompt_samples

    parser = argparse.ArgumentParser(prog="python -m eagle_assets.demo.evaluate",
                                     description="structure rate and reply lengths of the demo target per kind")
    parser.add_argument("--model-dir", type=Path, default=None, help="default: build or reuse the demo target")
    parser.add_argument("--per-kind", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-new-tokens", type=int, default=600)
    args = parser.parse_args(argv)
    model_dir = args.model_dir or build_demo_target()
    samples = [s for kind in KINDS for s in prompt_samples(kind)[:args.per_kind]]
    report = evaluate_target(model_dir, samples, args.max_new_tokens, args.temperature)
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
