"""The demo target's quality gate: greedy replies to the committed prompts, each checked for the structure its kind
expects, and the rules a build must pass: per default-catalog partition, a malformed share no higher than that
partition's own ``max_share_dropped_warn`` QC level, and no reply at its cap."""

from __future__ import annotations

import hashlib
import json
import statistics
import threading
from dataclasses import dataclass
from importlib import metadata, resources
from pathlib import Path
from typing import Any

from eagle_assets.demo.recipe import DemoRecipe
from eagle_assets.demo.rows import encode_sample
from eagle_assets.demo.tokenizer import EOS_TOKEN, PAD_TOKEN
from eagle_assets.demo.transcripts import ALL_KINDS, KINDS, PARTITION_KIND, DemoSample

# Sources whose code decides the gate's replies or verdicts (besides the weights and the prompts).
_GATE_SOURCES = (("eagle_assets.demo", "gate.py"), ("eagle_assets.serving", "engine.py"))


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
    if (not isinstance(call, dict) or not isinstance(call.get("name"), str)
            or not isinstance(call.get("arguments"), dict)):
        return verdict("tool_call_json")
    return verdict("")


def generate_replies(model, tokenizer, prompts: list[list[int]], max_new_tokens: int | list[int],
                     temperature: float = 0.0, seed: int = 0) -> list[list[int]]:
    """Generate a reply per prompt (ids) with :class:`~eagle_assets.serving.engine.DecodeEngine`, the embedded
    server's own continuous-batching decoder, so a verdict here is a verdict on what the pipeline will generate.

    Args:
        model: a causal LM in eval mode; load it with ``load_causal_lm`` (float64 on CPU, as the server does) for
            replies that match the server's token for token.
        tokenizer: the target's tokenizer (its EOS ids join the model's, as in ``model_eos_ids``).
        prompts: prompt ids per request.
        max_new_tokens: one cap for all prompts or one per prompt.
        temperature: 0 means greedy; otherwise request ``i`` samples with seed ``seed + i`` (top-p 1, top-k off).

    Returns:
        The generated ids per prompt, up to and including the stop id, or ``max_new_tokens`` ids when none came.

    Raises:
        RuntimeError: the engine aborted a request (its forward failed); the message is the engine's.
    """
    from eagle_assets.serving.engine import DecodeEngine, EngineRequest, model_eos_ids
    from eagle_assets.serving.protocol import SamplingParams

    caps = list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * len(prompts)
    if len(caps) != len(prompts):
        raise ValueError(f"{len(caps)} max_new_tokens values for {len(prompts)} prompts; give one per prompt")
    if not prompts:
        return []
    results: dict[int, Any] = {}
    done = threading.Event()

    def on_done(result) -> None:  # runs in the engine thread
        results[int(result.rid)] = result
        if len(results) == len(prompts):
            done.set()

    engine = DecodeEngine(model, model_eos_ids(model, tokenizer), max_batch_size=max(1, len(prompts)),
                          batch_wait_s=0.0, seed=seed)
    requests = [EngineRequest(rid=str(i), input_ids=list(p), on_done=on_done,
                              params=SamplingParams(max_new_tokens=cap, temperature=temperature, top_p=1.0, top_k=-1,
                                                    seed=None if temperature <= 0 else seed + i))
                for i, (p, cap) in enumerate(zip(prompts, caps))]
    engine.start()
    try:
        engine.submit(requests)
        done.wait()
    finally:
        engine.stop()
    aborted = [r for r in results.values() if r.finish_reason.get("type") == "abort"]
    if aborted:
        raise RuntimeError(f"the decode engine aborted {len(aborted)} of {len(prompts)} requests: "
                           f"{aborted[0].finish_reason.get('message')}")
    return [results[i].output_ids for i in range(len(prompts))]


def evaluate_target(model_dir: Path, samples: list[DemoSample], max_new_tokens: int | dict[str, int] = 600,
                    temperature: float = 0.0, seed: int = 0, dtype: str = "auto") -> dict[str, Any]:
    """Generate for ``samples`` and summarize per kind (:func:`summarize_replies`).

    Args:
        model_dir: a demo target directory.
        samples: the prompts (their ``kind`` decides the cap and whether a tool call is expected).
        max_new_tokens: one cap, or a cap per kind.
        temperature, seed: see :func:`generate_replies`.
        dtype: as the embedded server's ``--dtype`` ("auto" = float64 on CPU, the replies the pipeline gets).
    """
    from transformers import AutoTokenizer

    from eagle_assets.serving.engine import load_causal_lm

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_causal_lm(str(model_dir), dtype=dtype)
    caps = {kind: max_new_tokens for kind in ALL_KINDS} if isinstance(max_new_tokens, int) else dict(max_new_tokens)
    prompts = [encode_sample(tokenizer, s)[0] for s in samples]
    replies = generate_replies(model, tokenizer, prompts, [caps[s.kind] for s in samples], temperature, seed)
    return summarize_replies(samples, replies, tokenizer, caps)


def summarize_replies(samples: list[DemoSample], replies: list[list[int]], tokenizer,
                      caps: dict[str, int]) -> dict[str, Any]:
    """Per kind: ``{"n", "ok", "structure_rate", "at_cap", "cap", "median_tokens", "min_tokens", "max_tokens",
    "failures": {reason: count}, "examples": [last 160 characters of up to 2 failed replies]}``; ``at_cap``
    counts replies of ``cap`` tokens (cut off, or ending exactly there)."""
    report: dict[str, Any] = {}
    for kind in ALL_KINDS:
        pairs = [(r, check_reply(r, tokenizer, s.kind == "tool")) for s, r in zip(samples, replies) if s.kind == kind]
        if not pairs:
            continue
        lengths = [c.n_tokens for _, c in pairs]
        failures: dict[str, int] = {}
        for _, c in pairs:
            if not c.ok:
                failures[c.reason] = failures.get(c.reason, 0) + 1
        ok = sum(c.ok for _, c in pairs)
        report[kind] = {"n": len(pairs), "ok": ok, "structure_rate": round(ok / len(pairs), 4),
                        "at_cap": sum(n >= caps[kind] for n in lengths), "cap": caps[kind],
                        "median_tokens": statistics.median(lengths), "min_tokens": min(lengths),
                        "max_tokens": max(lengths), "failures": failures,
                        "examples": [tokenizer.decode(r, skip_special_tokens=False)[-160:]
                                     for r, c in pairs if not c.ok][:2]}
    return report


def _default_catalog_partitions() -> dict[str, Any]:
    """The shipped ``catalogs/default.yaml`` partition reading each turn-1 kind's demo file (``raw_samples.FILES``).

    Raises:
        FileNotFoundError: the repository's ``catalogs/default.yaml`` is absent (a non-editable install).
        KeyError: the default catalog has no partition reading one of the demo files.
    """
    from eagle_assets.catalog import load_catalog
    from eagle_assets.demo.raw_samples import FILES, default_out_dir

    catalog = load_catalog(default_out_dir().parent / "default.yaml")
    found: dict[str, Any] = {}
    for kind, name in FILES.items():
        for spec in catalog.partitions.values():
            if any(Path(src.path).name == name for src in spec.sources):
                found[kind] = spec
                break
        else:
            raise KeyError(f"catalogs/default.yaml has no partition reading demo_data/{name}")
    return found


def default_catalog_caps() -> dict[str, int]:
    """``sampling.max_new_tokens`` per demo kind in the shipped ``catalogs/default.yaml`` (the partition whose
    source file is that kind's demo file; the later turns of tool conversations, ``TURN_KINDS``, take the tool
    partition's), so the gate tests the caps the default run generates with.

    Raises:
        FileNotFoundError, KeyError: see :func:`_default_catalog_partitions`.
    """
    specs = _default_catalog_partitions()
    return {kind: specs[PARTITION_KIND[kind]].sampling.max_new_tokens for kind in ALL_KINDS}


def default_catalog_drop_levels() -> dict[str, float]:
    """``thresholds.max_share_dropped_warn`` (a fraction, 0..1) per turn-1 kind's partition in the shipped
    ``catalogs/default.yaml``: the malformed share at which that partition's own QC check starts to warn. The gate
    holds its replies to it; the default run's turn rows are not the gate's (B1's later turns follow the model's
    own calls), so a model just under the level can still warn there (AMD EPYC's weights: 5 of 126 gate replies,
    6 of 117 B1 rows in the run).

    Raises:
        FileNotFoundError, KeyError: see :func:`_default_catalog_partitions`.
    """
    return {kind: spec.thresholds.max_share_dropped_warn for kind, spec in _default_catalog_partitions().items()}


def gate_samples() -> list[DemoSample]:
    """Every well-formed prompt of the committed demo files (``catalogs/demo_data/*``), all kinds, file order:
    the turn-1 prompts of the four files, then the later turns of the B1 conversations
    (``raw_samples.turn_samples``: turn 2 after the recorded call result, turn 3 after a recorded follow-up),
    whose history holds the reference replies as a client sends them back."""
    from eagle_assets.demo.raw_samples import prompt_samples, turn_samples

    return [s for kind in KINDS for s in prompt_samples(kind)] + turn_samples()


def gate_failures(report: dict[str, Any], drop_levels: dict[str, float] | None = None) -> list[str]:
    """One line per failed rule; empty when the gate passes. The rules:

    - per default-catalog partition (its turn-1 kind with the later turns, ``transcripts.PARTITION_KIND``), the
      share of malformed replies must not exceed ``drop_levels[kind]`` (default
      :func:`default_catalog_drop_levels`): above it, that partition's QC would warn or fail on the default run;
    - no kind may have a reply at its cap (a loop the pipeline's truncation checks would stop the partition for).

    Raises:
        KeyError: ``report`` holds a kind whose partition has no level in ``drop_levels``.
    """
    levels = default_catalog_drop_levels() if drop_levels is None else drop_levels
    groups: dict[str, list[str]] = {}
    for kind in report:
        groups.setdefault(PARTITION_KIND[kind], []).append(kind)
    out = []
    for partition_kind, kinds in groups.items():
        n = sum(report[k]["n"] for k in kinds)
        bad = n - sum(report[k]["ok"] for k in kinds)
        level = levels[partition_kind]
        if bad > level * n:
            detail = "; ".join(f"{k} {report[k]['ok']}/{report[k]['n']} ok, failures {report[k]['failures']}"
                               for k in kinds)
            out.append(f"{'+'.join(kinds)}: {bad} of {n} replies malformed ({bad / n:.1%}; the default catalog's "
                       f"max_share_dropped_warn for this partition is {level:.0%}): {detail}")
    for kind, r in report.items():
        if r["at_cap"]:
            out.append(f"{kind}: {r['at_cap']} of {r['n']} replies reach the {r['cap']}-token cap (the gate allows "
                       f"none); e.g. ...{r['examples'][0]!r}" if r["examples"] else
                       f"{kind}: {r['at_cap']} of {r['n']} replies reach the {r['cap']}-token cap "
                       "(the gate allows none)")
    return out


def gate_from_replies(work: Path, gate_set, tokenizer) -> dict[str, Any]:
    """recipe.json's ``gate`` from the workers' ``gate-<rank>.json`` files: the report per kind, the failed rules,
    examples, the gate inputs' digest and each reply's digest (gate order)."""
    samples_g, _, caps = gate_set
    replies: list[list[int]] = [[] for _ in samples_g]
    for f in sorted(work.glob("gate-*.json")):
        part = json.loads(f.read_text())
        for i, r in zip(part["index"], part["output_ids"]):
            replies[i] = r
    report = summarize_replies(samples_g, replies, tokenizer, dict(zip((s.kind for s in samples_g), caps)))
    levels = default_catalog_drop_levels()
    return {"drop_levels": levels, "failures": gate_failures(report, levels),
            "report": {k: {key: v for key, v in r.items() if key != "examples"} for k, r in report.items()},
            "examples": {k: r["examples"] for k, r in report.items() if r["examples"]},
            "inputs_sha256": gate_inputs_digest(tokenizer, gate_set[1], caps, levels),
            "reply_sha256": [reply_digest(r) for r in replies]}


def select_gate_set(tokenizer, recipe: DemoRecipe):
    """(samples, prompt ids, caps) of the gate: the committed demo prompts under the default catalog's caps,
    ``recipe.gate_prompts_per_kind`` per kind (None = all); None when the recipe has no gate."""
    if recipe.gate_prompts_per_kind == 0:
        return None
    caps = default_catalog_caps()
    per_kind: dict[str, int] = {}
    samples = []
    for s in gate_samples():
        per_kind[s.kind] = per_kind.get(s.kind, 0) + 1
        if recipe.gate_prompts_per_kind is None or per_kind[s.kind] <= recipe.gate_prompts_per_kind:
            samples.append(s)
    return samples, [encode_sample(tokenizer, s)[0] for s in samples], [caps[s.kind] for s in samples]


def gate_inputs_digest(tokenizer, prompts: list[list[int]], caps: list[int], drop_levels: dict[str, float]) -> str:
    """sha256 (hex) of everything besides the weights that decides the gate's outcome: the prompt ids and caps in
    order, the malformed-share level per partition (``gate.default_catalog_drop_levels``), the tokenizer's
    vocabulary, the decoder's and the checker's source files and the torch and transformers versions."""
    h = hashlib.sha256()
    h.update(json.dumps({"prompts": prompts, "caps": caps, "drop_levels": sorted(drop_levels.items()),
                         "vocab": sorted(tokenizer.get_vocab().items()),
                         "torch": metadata.version("torch"), "transformers": metadata.version("transformers")},
                        separators=(",", ":")).encode())
    for package, name in _GATE_SOURCES:
        h.update(name.encode() + b"\x00" + resources.files(package).joinpath(name).read_bytes() + b"\x00")
    return h.hexdigest()


def reply_digest(output_ids: list[int]) -> str:
    """sha256 (hex) of one reply's ids as int32 little-endian bytes."""
    import array
    import sys

    buf = array.array("i", output_ids)
    if sys.byteorder != "little":
        buf.byteswap()
    return hashlib.sha256(buf.tobytes()).hexdigest()
