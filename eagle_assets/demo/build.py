"""Build (or reuse) the embedded demo target: a tiny Qwen3 trained on the synthetic transcripts.

``build_demo_target()`` returns a Hugging Face model directory (``config.json``, ``model.safetensors``,
``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json`` with the chat template, ``recipe.json``)
that ``AutoTokenizer`` / ``AutoModelForCausalLM.from_pretrained`` load and that any server speaking SGLang's
``/generate`` can serve. The directory name is the recipe hash, so a changed recipe (hyper-parameters, generator
version, or the source of the demo package) builds a new directory and never reuses stale weights.

The build: generate transcripts -> train the BPE -> train the model for a fixed number of optimizer steps in worker
processes pinned to one thread each (fixed, not time-boxed, and independent of load and thread settings, so the
weights' bytes depend only on the recipe) -> the quality gate: greedy replies to every committed demo prompt, as
the embedded server generates them; a model whose malformed share in a default-catalog partition exceeds that
partition's ``max_share_dropped_warn`` QC level, or with any reply at the default catalog's ``max_new_tokens``, is
kept aside as ``<hash>.rejected`` and the build raises
:class:`DemoTargetRejected`. On an idle 2-core machine it takes about three minutes (two workers in parallel);
with one core, twice the training time, same bytes.

The project ships the weights this build made (``eagle_assets/demo/target/``, :mod:`eagle_assets.demo.shipped`), so
users never run it: the bytes are reproducible on one kind of CPU only (:mod:`eagle_assets.demo.trainer`), and
shipping them gives every machine the same model. Run it after changing the recipe, then ship the result.

CLI: ``python -m eagle_assets.demo.build [--force] [--cache-root DIR] [--ship]`` prints the model directory;
``--ship`` copies a build that passed its gate into ``eagle_assets/demo/target/`` (commit it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from eagle_assets.demo import transcripts
from eagle_assets.demo.gate import gate_from_replies, select_gate_set
from eagle_assets.demo.recipe import (
    RECIPE_FILE,
    SHARDS,
    WORLD_SIZES,
    DemoRecipe,
    default_cache_root,
    recipe_hash,
    source_digest,
)
from eagle_assets.demo.rows import plan_steps, training_row
from eagle_assets.demo.tokenizer import EOS_TOKEN, PAD_TOKEN, train_demo_tokenizer
from eagle_assets.demo.transcripts import completion_text, generate_mixture


def _is_complete(path: Path, digest: str) -> bool:
    try:
        return json.loads((path / RECIPE_FILE).read_text())["recipe_hash"] == digest
    except (OSError, ValueError, KeyError):
        return False


class DemoTargetRejected(RuntimeError):
    """The built demo target failed its quality gate (see :func:`build_demo_target`); ``report`` holds the gate
    figures per kind and ``path`` the rejected directory kept for inspection."""

    def __init__(self, message: str, path: Path, report: dict[str, Any]):
        super().__init__(message)
        self.path = path
        self.report = report


def rejected_path(final: Path) -> Path:
    """Where a build of ``final`` that failed its gate is kept: ``<cache_root>/<name>.rejected``."""
    return final.with_name(final.name + ".rejected")


def _rejection(path: Path) -> DemoTargetRejected:
    meta = json.loads((path / RECIPE_FILE).read_text())
    gate = meta["gate"]
    lines = "\n  ".join(gate["failures"])
    return DemoTargetRejected(
        f"the embedded demo target built from recipe {meta['recipe_hash'][:16]} failed its quality gate on the "
        f"committed demo prompts (catalogs/demo_data, greedy, the default catalog's max_new_tokens):\n  {lines}\n"
        "A partition served by this model would fail its structure or truncation checks, so it is not used; "
        f"the rejected build is kept in {path} (recipe.json has the figures). {_rejection_cause(meta)} "
        "To run the pipeline now, point target.model in the catalog at a real model directory. "
        f"Delete {path} to retry the build.", path, gate["report"])


def _rejection_cause(meta: dict[str, Any]) -> str:
    """What a gate failure means: a recipe problem when these bytes are the shipped ones' recipe, else possibly
    this machine's arithmetic (the bytes are reproducible on one kind of CPU, see :mod:`eagle_assets.demo.trainer`)."""
    sha = meta.get("weights_sha256", "")
    return (f"These weights (sha256 {sha[:12]}...) come from this machine's arithmetic: the build gives the same "
            "bytes on one kind of CPU under torch 2.13.0, and another CPU gives other weights, which can fall on the "
            "wrong side of the gate. If you changed eagle_assets/demo/ or DemoRecipe, strengthen the change (more "
            "train_counts, see `python -m eagle_assets.demo.evaluate --model-dir DIR`) or build on another machine; "
            "the shipped target (eagle_assets/demo/target/) is unaffected.")


def build_demo_target(cache_root: Path | None = None, force: bool = False, recipe: DemoRecipe | None = None,
                      log: Callable[[str], None] | None = None, workers: int | None = None) -> Path:
    """Return the demo target's model directory, building it first when it is absent (or ``force``).

    The build trains in worker processes with one thread each (:mod:`eagle_assets.demo.trainer`), so the model's
    bytes depend only on the recipe, never on the machine's load or thread settings. Then a gate
    (``recipe.gate_prompts_per_kind``; default every committed demo prompt) generates greedy replies to the
    committed demo prompts as the embedded server does, and accepts the model only when each default-catalog
    partition's malformed share is within its own ``max_share_dropped_warn`` (``gate.gate_failures``) and no reply
    reaches the default catalog's ``max_new_tokens``; the figures go into ``recipe.json`` (``gate``).

    Args:
        cache_root: parent directory of built targets; default :func:`default_cache_root`.
        force: rebuild even when a complete (or a rejected) directory for this recipe exists; a complete one is
            replaced atomically.
        recipe: hyper-parameters; default ``DemoRecipe()``.
        log: progress callback (one line per phase); default prints to stderr.
        workers: training processes, 1 or 2 (the same bytes either way); default 2 when the machine has two
            cores or more.

    Returns:
        ``<cache_root>/<first 16 hex chars of the recipe hash>``: a Hugging Face model directory. A directory
        is only ever visible complete: the build writes into a temporary sibling and renames it into place, so a
        crashed or concurrent build never leaves a half-written target behind; concurrent callers wait on the
        lock file ``.<name>.lock`` beside it and build once.

    Raises:
        DemoTargetRejected: the model failed the gate (now, or in an earlier build of the same recipe, which is
            not repeated unless ``force``); the message lists the failed rules and what to do.
        RuntimeError: a training worker failed; the message holds the end of its stderr.
        OSError: the cache root is not writable (set ``EAGLE_ASSETS_HOME`` to a writable directory).
    """
    recipe = recipe or DemoRecipe()
    log = log or (lambda msg: print(f"[demo-target] {msg}", file=sys.stderr, flush=True))
    workers = workers or (SHARDS if (os.cpu_count() or 1) >= SHARDS else 1)
    digest = recipe_hash(recipe)
    final = Path(cache_root or default_cache_root()) / digest[:16]
    rejected = rejected_path(final)
    if not force and _is_complete(final, digest):
        return final
    if not force and _is_complete(rejected, digest):
        raise _rejection(rejected)
    final.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(final.parent / f".{final.name}.lock"):
        # Another process may have finished the same build while this one waited for the lock.
        if not force and _is_complete(final, digest):
            return final
        if not force and _is_complete(rejected, digest):
            raise _rejection(rejected)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        try:
            _build_into(tmp, recipe, digest, log, workers)
            # mkdtemp makes the directory 0700 and safetensors writes 0600; servers running as another user must
            # be able to read the target, as they can a normal model download.
            tmp.chmod(0o755)
            for f in tmp.iterdir():
                f.chmod(0o644)
            passed = not (json.loads((tmp / RECIPE_FILE).read_text()).get("gate") or {}).get("failures")
            dest = final if passed else rejected
            for old_dir in (dest, rejected) if passed else (dest,):
                if old_dir.exists():
                    old = old_dir.with_name(f".{old_dir.name}.old-{os.getpid()}-{time.time_ns()}")
                    old_dir.rename(old)
                    shutil.rmtree(old, ignore_errors=True)
            tmp.rename(dest)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    if not passed:
        raise _rejection(rejected)
    return final


@contextlib.contextmanager
def _build_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock so concurrent runs (several Dagster steps, a test session) build a target once;
    without ``fcntl`` (Windows) builds may duplicate work but still never expose a partial directory."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build_into(out: Path, recipe: DemoRecipe, digest: str, log: Callable[[str], None], workers: int) -> None:
    t0 = time.monotonic()
    corpus = generate_mixture(recipe.tokenizer_corpus_per_kind, recipe.seed + 10_000)
    bootstrap = train_demo_tokenizer(["bootstrap"], vocab_size=512)  # only its chat template is used here
    texts = [bootstrap.apply_chat_template(s.messages, tools=s.tools, add_generation_prompt=True, tokenize=False)
             + completion_text(s) for s in corpus]
    tokenizer = train_demo_tokenizer(texts, vocab_size=recipe.vocab_size)
    log(f"tokenizer: {len(tokenizer)} tokens ({time.monotonic() - t0:.1f}s)")

    samples = generate_mixture(dict(recipe.train_counts), recipe.seed)
    # rows: (ids, number of prompt ids, loss weight per later token, reply flag per later token)
    noise_rng = random.Random(f"repeat/{recipe.seed}")
    rows = [training_row(tokenizer, s, noise_rng, recipe) for s in samples]

    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    vocab = math.ceil(len(tokenizer) / recipe.vocab_multiple) * recipe.vocab_multiple
    config = dict(
        vocab_size=vocab, hidden_size=recipe.hidden_size, intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_hidden_layers, num_attention_heads=recipe.num_attention_heads,
        num_key_value_heads=recipe.num_key_value_heads, head_dim=recipe.head_dim,
        max_position_embeddings=recipe.max_position_embeddings, rope_theta=recipe.rope_theta,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id,
        attn_implementation="sdpa",
    )
    steps = plan_steps(rows, recipe, random.Random(recipe.seed))
    work = out / ".work"
    work.mkdir()
    (work / "job.json").write_text(json.dumps({
        "out": str(out), "config": config, "seed": recipe.seed, "lr": recipe.lr, "betas": [0.9, 0.98],
        "weight_decay": recipe.weight_decay, "grad_clip": recipe.grad_clip,
        "prompt_loss_weight": recipe.prompt_loss_weight, "steps": steps}))
    (work / "rows.json").write_text(json.dumps(rows))
    gate_set = select_gate_set(tokenizer, recipe)
    if gate_set is not None:
        (work / "gate.json").write_text(json.dumps({"prompts": gate_set[1], "caps": gate_set[2]}))
    log(f"training: {len(rows)} transcripts, {len(steps)} steps, {sum(len(r[0]) for r in rows)} tokens, "
        f"{workers} worker process(es)")
    figures = _run_workers(work, workers, log)

    # The chat template goes into tokenizer_config.json (not a side chat_template.jinja) because SGLang and
    # older transformers read it from there.
    tokenizer.save_pretrained(out, save_jinja_files=False)
    _portable_tokenizer_config(out / "tokenizer_config.json")
    gate: dict[str, Any] | None = None
    if gate_set is not None:
        gate = gate_from_replies(work, gate_set, tokenizer)
        for kind, r in gate["report"].items():
            log(f"gate {kind}: structure ok {r['ok']}/{r['n']}, {r['at_cap']} at the {r['cap']}-token cap, "
                f"reply tokens {r['min_tokens']}-{r['max_tokens']} (median {r['median_tokens']})")
    shutil.rmtree(work)
    (out / RECIPE_FILE).write_text(json.dumps({
        "recipe_hash": digest, "recipe": recipe.to_dict(), "generator_version": transcripts.GENERATOR_VERSION,
        "source_sha256": source_digest(), "tokenizer_size": len(tokenizer), **figures,
        "build_seconds": round(time.monotonic() - t0, 1), "gate": gate,
    }, indent=2) + "\n")
    log(f"done in {time.monotonic() - t0:.0f}s")


def _worker_env() -> dict[str, str]:
    """The workers' environment: one thread everywhere, MKL's vendor-neutral ``COMPATIBLE`` branch and the AVX2
    code paths of ATen and oneDNN (see :mod:`eagle_assets.demo.trainer`), whatever the caller's settings."""
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = "1"
    env.update(MKL_CBWR="COMPATIBLE", ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2", MKL_DYNAMIC="FALSE",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return env


def _run_workers(work: Path, workers: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Train in ``workers`` processes (1 or 2: same bytes, see :mod:`eagle_assets.demo.trainer`); returns
    ``train.json``. When two workers fail (gloo cannot start, for example) the build retries with one.

    Raises:
        RuntimeError: the single-worker run failed too; the message holds the end of its stderr.
    """
    import subprocess
    import threading

    world = workers if workers in WORLD_SIZES else 1
    while True:
        for stale in ("store", "train.json"):
            (work / stale).unlink(missing_ok=True)
        for f in work.glob("gate-*.json"):
            f.unlink()
        procs = []
        errs = []
        for rank in range(world):
            err = open(work / f"worker-{rank}.err", "w+")
            errs.append(err)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "eagle_assets.demo.trainer", str(work), str(rank), str(world)],
                stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL, stderr=err, text=True,
                env=_worker_env(), cwd=str(work)))

        def forward(stream) -> None:
            for line in stream:
                log(line.rstrip())

        reader = threading.Thread(target=forward, args=(procs[0].stdout,), daemon=True)
        reader.start()
        # A worker that dies leaves its peer waiting in an all-reduce: stop the peer at once.
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs):
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                break
            time.sleep(0.2)
        for p in procs:
            p.wait()
        reader.join(timeout=5)
        codes = [p.returncode for p in procs]
        tails = []
        for rank, err in enumerate(errs):
            err.seek(0)
            tails.append(err.read()[-3000:])
            err.close()
        if all(c == 0 for c in codes):
            return json.loads((work / "train.json").read_text()) if (work / "train.json").exists() else {}
        detail = next((t for t, c in zip(tails, codes) if c not in (0, -9)), tails[0])
        if world > 1:
            log(f"{world} training workers failed (exit codes {codes}); retrying in one process (same weights, "
                f"about twice the time). Their stderr ended with: {detail.strip()[-500:]}")
            world = 1
            continue
        raise RuntimeError(f"the demo target's training worker failed (exit code {codes[0]}); its stderr ended "
                           f"with:\n{detail}")


def _portable_tokenizer_config(path: Path) -> None:
    """transformers 5 writes ``"tokenizer_class": "TokenizersBackend"``, a class transformers 4.x (which SGLang
    pins) does not know; ``PreTrainedTokenizerFast`` loads the same tokenizer.json in both."""
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle_assets.demo.build", description=__doc__.split("\n")[0])
    parser.add_argument("--force", action="store_true", help="rebuild even when a cached target exists")
    parser.add_argument("--cache-root", type=Path, default=None, help="default: $EAGLE_ASSETS_HOME/demo-target")
    parser.add_argument("--ship", action="store_true",
                        help="copy the build (it passed its gate) into eagle_assets/demo/target/, the weights every "
                             "machine serves; commit them")
    args = parser.parse_args(argv)
    try:
        path = build_demo_target(args.cache_root, force=args.force)
    except DemoTargetRejected as exc:
        print(exc, file=sys.stderr)
        return 1
    if args.ship:
        from eagle_assets.demo.shipped import ship

        path = ship(path)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
