"""Build (or reuse) the embedded demo target: a tiny Qwen3 trained on the synthetic transcripts.

``build_demo_target()`` returns a Hugging Face model directory (``config.json``, ``model.safetensors``,
``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json`` with the chat template, ``recipe.json``)
that ``AutoTokenizer`` / ``AutoModelForCausalLM.from_pretrained`` load and that any server speaking SGLang's
``/generate`` can serve. The directory name is the recipe hash, so a changed recipe (hyper-parameters, generator
version, or the source of the demo package) builds a new directory and never reuses stale weights.

The build: generate transcripts -> train the BPE -> train the model for a fixed number of optimizer steps in worker
processes pinned to one thread each (fixed, not time-boxed, and independent of load and thread settings, so the
weights' bytes depend only on the recipe) -> the quality gate: greedy replies to every committed demo prompt, as
the embedded server generates them; a model with a structure rate under 98% for a kind, or any reply at the
default catalog's ``max_new_tokens``, is kept aside as ``<hash>.rejected`` and the build raises
:class:`DemoTargetRejected`. On an idle 2-core machine it takes about three minutes (two workers in parallel);
with one core, twice the training time, same bytes.

A build whose weights equal (sha256) those of a build whose gate ran, with the same gate inputs, takes that
recorded verdict (:mod:`eagle_assets.demo.gate_reference`) instead of regenerating the replies: the bytes are the
same, so is the verdict; it saves about a minute on an idle 2-core machine and two on a loaded one.

CLI: ``python -m eagle_assets.demo.build [--force] [--cache-root DIR] [--regate] [--record-gate-reference]`` prints
the model directory.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import random
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from eagle_assets.demo import gate_reference, transcripts
from eagle_assets.demo.tokenizer import EOS_TOKEN, PAD_TOKEN, train_demo_tokenizer
from eagle_assets.demo.trainer import SHARDS, WORLD_SIZES
from eagle_assets.demo.transcripts import DemoSample, completion_text, generate_mixture

# Files whose source is part of the recipe: editing any of them invalidates cached targets.
_RECIPE_FILES = ("transcripts.py", "tokenizer.py", "build.py", "trainer.py", "chat_template.jinja")
RECIPE_FILE = "recipe.json"


@dataclass(frozen=True)
class DemoRecipe:
    """Everything the demo target's weights depend on (besides the source files hashed with it).

    Model shape: 4 layers (capture ids ``[1, 2, 3]``, set in ``catalogs/default.yaml``: SGLang's default
    ``[2, L//2, L-3]`` collides below 7 layers). 8 layers (default ids ``[2, 4, 5]``) passed the gate as well but
    cost 1.6x the training time (204 s against 123 s on an idle 2-core machine) and twice the decode time of every
    generation; 4 passed it with every committed prompt well-formed and none at a cap. ``vocab_multiple`` pads ``config.vocab_size`` past ``len(tokenizer)`` as real checkpoints do (Qwen3: 151,936
    embedding rows for 151,669 tokens), so consumers must not assume the two are equal.

    Training (about 800 AdamW steps over 1,700 transcripts, 642k tokens; about 130 CPU seconds in each of two
    worker processes, see :mod:`eagle_assets.demo.trainer`): ``train_counts`` fresh transcripts per kind, each seen once, in
    length-sorted batches of at most ``batch_tokens`` padded tokens (two shards of half that); linear warmup, then
    cosine decay to ``min_lr_ratio * lr``. The loss covers prompt tokens at ``prompt_loss_weight`` (prompts are
    made of the same templated sentences, so they teach the language at no extra forward cost) and reply tokens at
    ``reply_weights[kind]`` (default 1; a tool reply is short and depends on the request, so it gets more gradient
    than its token count would give it). In a ``counter_repeat_prob`` share of transcripts one count-down line is
    written twice with the copy excluded from the loss (:func:`encode_training_sample`), which teaches the model to
    recover from its own miscounts instead of looping.

    Conversations in turns (issue 13): a ``tool_result`` transcript is a whole tool chain in one row (the call,
    its recorded result, the answer that uses it: :func:`encode_tool_chain`), so it teaches the turn-1 call as
    well; ``follow_up`` transcripts are turn 3 (a second user question after the answer). The mix moved tool
    transcripts from 600 single calls to 100 single calls + 300 chains + 200 follow-ups (400 calls, 300 answers
    from a result, 200 follow-up answers). With 340 math transcripts (the single-turn recipe's count) in that mix
    the gate saw 48/50 math replies well-formed (a stray ``</think>`` / ``<|im_end|>`` inside the count-down) and
    every tool, ``tool_result`` and ``follow_up`` reply well-formed; 420 math transcripts with 260 chains and 160
    follow-ups fixed math (50/50) but left one follow-up reply of 26 with two ``</think>``; so 420 math and the
    full 300 + 200, about 13% more tokens than the single-turn recipe's 717 steps.

    Other arithmetic (issue 12): the bytes are the same on every x86-64 CPU with AVX2
    (:mod:`eagle_assets.demo.trainer`); any other arithmetic gives other weights, and the gate decides on those.
    Built with the workers' kernels swapped, as another machine's arithmetic would do (measured 2026-12-02 on one
    Xeon): MKL's ``COMPATIBLE`` branch and ATen's AVX2 (the build): 276/276 well-formed; MKL's AVX2 branch: tool_result 48/50,
    rejected; MKL's and ATen's AVX-512: follow_up 25/26, rejected; the machine that recorded the earlier reference
    (MKL's AVX2 branch there): 276/276. Two richer mixes did not make it robust: 400 chains + 300 follow-ups at
    reply weight 3 (12% more tokens) passed ``COMPATIBLE`` (reasoning 49/50) and AVX2 but not AVX-512 (follow_up
    25/26); 400 + 500 failed math under ``COMPATIBLE`` (42/50). So about half of foreign arithmetic misses the gate
    by one or two replies: outside x86-64 with AVX2 (an ARM laptop) the build may be rejected, and its message says
    why and what to do.

    Why 1024-token batches: with the same transcripts, 2048-token batches (365 steps) left the model one or two
    structure failures short of the gate per 50 reasoning prompts, and 1.5 times the transcripts at 2048 tokens
    (547 steps, a third more compute) passed it; 1024-token batches (717 steps, the least compute of the three)
    passed it on the committed prompts and on 200 fresh ones (generator seed 7) with no failure at all. A tiny
    model gains more from more updates than from larger ones.

    ``gate_prompts_per_kind``: how many committed demo prompts per kind the build's quality gate generates for
    (None = all of them; 0 = no gate, only for test recipes whose weights are not meant to be served).
        """

    seed: int = 0
    train_counts: tuple[tuple[str, int], ...] = (("tool", 100), ("code", 340), ("math", 420), ("reasoning", 340),
                                                 ("tool_result", 300), ("follow_up", 200))
    reply_weights: tuple[tuple[str, float], ...] = (("tool", 2.0), ("tool_result", 2.0), ("follow_up", 2.0))
    counter_repeat_prob: float = 0.3
    tokenizer_corpus_per_kind: int = 150
    vocab_size: int = 2048
    vocab_multiple: int = 64
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 4096
    batch_tokens: int = 1024
    lr: float = 3e-3
    warmup_steps: int = 40
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.01
    prompt_loss_weight: float = 0.25
    grad_clip: float = 1.0
    gate_prompts_per_kind: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _source_digest() -> str:
    h = hashlib.sha256()
    pkg = resources.files("eagle_assets.demo")
    for name in _RECIPE_FILES:
        h.update(name.encode() + b"\x00" + pkg.joinpath(name).read_bytes() + b"\x00")
    return h.hexdigest()


def recipe_hash(recipe: DemoRecipe | None = None) -> str:
    """sha256 (hex) of the recipe, the transcript generator version and the demo package's source files."""
    recipe = recipe or DemoRecipe()
    payload = {"recipe": recipe.to_dict(), "generator_version": transcripts.GENERATOR_VERSION,
               "source_sha256": _source_digest()}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def default_cache_root() -> Path:
    """``$EAGLE_ASSETS_HOME/demo-target``; ``EAGLE_ASSETS_HOME`` defaults to ``<cwd>/.eagle_assets``."""
    home = os.environ.get("EAGLE_ASSETS_HOME") or str(Path.cwd() / ".eagle_assets")
    return Path(home).expanduser() / "demo-target"


def demo_target_path(cache_root: Path | None = None, recipe: DemoRecipe | None = None) -> Path:
    """Where the target for ``recipe`` lives (or will live) under ``cache_root``; nothing is built."""
    return Path(cache_root or default_cache_root()) / recipe_hash(recipe)[:16]


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
    """What a gate failure means: a recipe problem when these bytes are the recorded ones, else this machine's
    arithmetic (the bytes are reproducible on x86-64 CPUs with AVX2, see :mod:`eagle_assets.demo.trainer`)."""
    sha = meta.get("weights_sha256", "")
    change = ("if you changed eagle_assets/demo/ or DemoRecipe, revert or strengthen the change (more train_counts, "
              "see `python -m eagle_assets.demo.evaluate --model-dir DIR`)")
    if sha in gate_reference.load_references():
        return (f"These are the weights recorded in eagle_assets/demo/gate_reference.json (sha256 {sha[:12]}...), "
                f"so this is a recipe problem, not your machine's: {change}; otherwise report it with that "
                "recipe.json.")
    return (f"These weights (sha256 {sha[:12]}...) are not the ones recorded in eagle_assets/demo/"
            "gate_reference.json: the build gives the same bytes on x86-64 CPUs with AVX2 under torch 2.13.0, and "
            "this machine's arithmetic differs (another CPU, an ARM laptop, another torch or MKL), which gives other "
            f"weights that can fall on the wrong side of the gate. {change[0].upper()}{change[1:]}; otherwise report "
            "it with that recipe.json and the output of `lscpu`.")


def build_demo_target(cache_root: Path | None = None, force: bool = False, recipe: DemoRecipe | None = None,
                      log: Callable[[str], None] | None = None, workers: int | None = None,
                      regate: bool | None = None, reference_path: Path | None = None) -> Path:
    """Return the demo target's model directory, building it first when it is absent (or ``force``).

    The build trains in worker processes with one thread each (:mod:`eagle_assets.demo.trainer`), so the model's
    bytes depend only on the recipe, never on the machine's load or thread settings. Then a gate
    (``recipe.gate_prompts_per_kind``; default every committed demo prompt) generates greedy replies to the
    committed demo prompts as the embedded server does, and accepts the model only when every kind has a
    structure rate of at least ``evaluate.GATE_MIN_STRUCTURE_RATE`` and no reply reaches the default catalog's
    ``max_new_tokens``; the figures go into ``recipe.json`` (``gate``). When the trained weights' sha256 and the
    gate's inputs equal those of a build whose gate ran (``reference_path``, :mod:`eagle_assets.demo.gate_reference`)
    that verdict is taken instead of regenerating the replies (``gate.verified_by`` says so).

    Args:
        cache_root: parent directory of built targets; default :func:`default_cache_root`.
        force: rebuild even when a complete (or a rejected) directory for this recipe exists; a complete one is
            replaced atomically.
        recipe: hyper-parameters; default ``DemoRecipe()``.
        log: progress callback (one line per phase); default prints to stderr.
        workers: training processes, 1 or 2 (the same bytes either way); default 2 when the machine has two
            cores or more.
        regate: run the gate even when a reference verdict for these weights exists; default
            ``EAGLE_ASSETS_DEMO_REGATE`` set to 1.
        reference_path: the recorded gate verdicts; default the package's ``gate_reference.json``.

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
    if regate is None:
        regate = os.environ.get("EAGLE_ASSETS_DEMO_REGATE", "") == "1"
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
            _build_into(tmp, recipe, digest, log, workers, regate, reference_path)
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


def encode_sample(tokenizer, sample: DemoSample) -> tuple[list[int], list[int]]:
    """(prompt ids, reply ids) of a transcript, tokenized the way the pipeline does it.

    The prompt is the chat template with ``add_generation_prompt=True`` tokenized once (it ends with ``<think>``);
    the reply is :func:`completion_text` tokenized on its own and ends with ``<|im_end|>``. Because the prompt
    ends with a control token, the concatenation equals what greedy generation produces token by token.
    """
    text = tokenizer.apply_chat_template(sample.messages, tools=sample.tools, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    reply = tokenizer(completion_text(sample), add_special_tokens=False)["input_ids"]
    return prompt, reply


_COUNTER_LINE = re.compile(r"^\d+ to go: ")


def encode_tool_chain(tokenizer, second: DemoSample) -> tuple[list[int], int, list[tuple[int, int, bool]]]:
    """(ids, number of turn-1 prompt ids, spans) of a whole tool chain in one training row: turn 1's prompt, its
    reply (the call), the call's result, the generation prompt, then turn 2's reply (``second``, a
    ``tool_result`` sample).

    The template keeps turn 1's reasoning in turn 2's prompt (it is after the last user turn), so turn 2's prompt
    is exactly turn 1's prompt + turn 1's reply + ``"\n"`` + the result turn + the generation prompt: one row
    teaches both replies, each exactly as generated and as ``all_turns`` renders it back. ``spans`` are
    ``(start, end, is_reply)`` over ``ids[n_prompt:]``: the two replies (True) and the result turn between them
    (False, a prompt part). Each part is tokenized on its own; the parts meet at control tokens, so the ids equal
    the tokenization of the whole text (checked).

    Raises:
        ValueError: the template does not render turn 2's prompt as that extension of turn 1's (a template
            change that breaks this, e.g. one that drops reasoning inside a tool chain).
    """
    first = second.features["first"]

    def render(sample: DemoSample) -> str:
        return tokenizer.apply_chat_template(sample.messages, tools=sample.tools, add_generation_prompt=True,
                                             tokenize=False)

    p1, c1, p2 = render(first), completion_text(first), render(second)
    if not p2.startswith(p1 + c1):
        raise ValueError("the demo chat template does not render a tool chain's turn-2 prompt as turn 1's prompt "
                         "+ turn 1's reply + the result; encode the turns as separate rows")
    def enc(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    prompt, reply1, between, reply2 = enc(p1), enc(c1), enc(p2[len(p1 + c1):]), enc(completion_text(second))
    if prompt + reply1 + between != enc(p2):
        raise ValueError("a tool chain's parts tokenize differently from its whole turn-2 prompt")
    a, b = len(reply1), len(reply1) + len(between)
    return (prompt + reply1 + between + reply2, len(prompt),
            [(0, a, True), (a, b, False), (b, b + len(reply2), True)])


def training_row(tokenizer, sample: DemoSample, rng: random.Random, recipe: "DemoRecipe"
                 ) -> tuple[list[int], int, list[float], list[bool]]:
    """(ids, number of prompt ids, loss weight per later id, reply flag per later id) of one training transcript.

    A ``tool_result`` sample is its whole chain (:func:`encode_tool_chain`: the call at the ``tool`` reply weight,
    the result turn at ``prompt_loss_weight``, the answer at its own weight); every other sample is its prompt and
    reply (:func:`encode_training_sample`, with the masked repeated count line). Weights come from
    ``recipe.reply_weights`` (default 1.0).
    """
    weight = dict(recipe.reply_weights)
    if sample.kind == "tool_result":
        ids, n_prompt, spans = encode_tool_chain(tokenizer, sample)
        w: list[float] = []
        flags: list[bool] = []
        for (start, end, is_reply), kind in zip(spans, ("tool", None, "tool_result")):
            w += [weight.get(kind, 1.0) if is_reply else recipe.prompt_loss_weight] * (end - start)
            flags += [is_reply] * (end - start)
        return ids, n_prompt, w, flags
    ids, n_prompt, learn = encode_training_sample(tokenizer, sample, rng, recipe.counter_repeat_prob)
    kind_w = weight.get(sample.kind, 1.0)
    return ids, n_prompt, [kind_w if flag else 0.0 for flag in learn], list(learn)


def encode_training_sample(tokenizer, sample: DemoSample, rng: random.Random,
                           repeat_prob: float) -> tuple[list[int], int, list[bool]]:
    """(ids, number of prompt ids, per-reply-token "learn" flags) of one training transcript.

    With probability ``repeat_prob`` one count-down line ("7 to go: ...") of the reasoning is written twice and the
    tokens of the copy are flagged False (no loss). The line after the copy still counts down from the copied
    value, so the model learns that the next count depends on the last count it wrote, not on how many lines it
    has written: a model that repeats a count by mistake (likeliest at "1 to go") still reaches "0 to go" and
    closes its reasoning instead of looping until ``max_new_tokens``. Half of the repeats hit the last
    count-down line, where a loop costs most.
    """
    prompt, reply = encode_sample(tokenizer, sample)
    lines = sample.reasoning.split("\n")
    counters = [i for i, line in enumerate(lines) if _COUNTER_LINE.match(line)]
    if not counters or rng.random() >= repeat_prob:
        return prompt + reply, len(prompt), [True] * len(reply)
    at = counters[-1] if rng.random() < 0.5 else rng.choice(counters)
    full = completion_text(sample)
    head = "\n" + "\n".join(lines[:at + 1]) + "\n"
    copy = lines[at] + "\n"
    assert full.startswith(head)
    parts = [(head, True), (copy, False), (full[len(head):], True)]
    ids: list[int] = []
    learn: list[bool] = []
    for text, flag in parts:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        learn += [flag] * len(piece)
    return prompt + ids, len(prompt), learn


def _plan_steps(rows: list[tuple[list[int], int, list[float], list[bool]]], recipe: DemoRecipe,
                rng: random.Random) -> list[dict[str, Any]]:
    """The optimizer steps: ``[{"shards": [rows of shard 0, rows of shard 1], "lr", "weighted_tokens"}]``.

    Rows are shuffled, sorted by length within windows of 64 (little padding, random order) and packed into shards
    of at most ``batch_tokens / 2`` padded tokens; two consecutive shards (of similar lengths, so two workers
    finish together) make one step, and the steps are shuffled. Everything here is fixed by the recipe and seed.
    ``weighted_tokens`` counts the step's target tokens with a non-zero loss weight (the loss divisor). The
    learning rate warms up linearly for ``warmup_steps``, then decays along a cosine to ``min_lr_ratio * lr``.
    """
    order = list(range(len(rows)))
    rng.shuffle(order)
    budget = recipe.batch_tokens // SHARDS
    pairs: list[list[list[int]]] = []
    window = 64
    for start in range(0, len(order), window):
        chunk = sorted(order[start:start + window], key=lambda i: len(rows[i][0]))
        shards: list[list[int]] = []
        cur: list[int] = []
        longest = 0
        for i in chunk:
            n = len(rows[i][0])
            if cur and max(longest, n) * (len(cur) + 1) > budget:
                shards.append(cur)
                cur, longest = [], 0
            cur.append(i)
            longest = max(longest, n)
        if cur:
            shards.append(cur)
        pairs += [(shards[j:j + SHARDS] + [[]] * SHARDS)[:SHARDS] for j in range(0, len(shards), SHARDS)]
    rng.shuffle(pairs)
    total = len(pairs)

    def lr_at(step: int) -> float:
        if step < recipe.warmup_steps:
            return recipe.lr * (step + 1) / recipe.warmup_steps
        progress = (step - recipe.warmup_steps) / max(1, total - recipe.warmup_steps)
        return recipe.lr * (recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    def weighted(i: int) -> int:
        ids, n_prompt, reply_w = rows[i][:3]
        return max(0, n_prompt - 1) * (recipe.prompt_loss_weight > 0) + sum(w > 0 for w in reply_w)

    return [{"shards": pair, "lr": lr_at(n), "weighted_tokens": sum(weighted(i) for shard in pair for i in shard)}
            for n, pair in enumerate(pairs)]


def _build_into(out: Path, recipe: DemoRecipe, digest: str, log: Callable[[str], None], workers: int,
                regate: bool = False, reference_path: Path | None = None) -> None:
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
    steps = _plan_steps(rows, recipe, random.Random(recipe.seed))
    work = out / ".work"
    work.mkdir()
    (work / "job.json").write_text(json.dumps({
        "out": str(out), "config": config, "seed": recipe.seed, "lr": recipe.lr, "betas": [0.9, 0.98],
        "weight_decay": recipe.weight_decay, "grad_clip": recipe.grad_clip,
        "prompt_loss_weight": recipe.prompt_loss_weight, "steps": steps}))
    (work / "rows.json").write_text(json.dumps(rows))
    gate_set = _gate_set(tokenizer, recipe)
    references: dict[str, Any] = {}
    if gate_set is not None:
        from eagle_assets.demo.evaluate import GATE_MIN_STRUCTURE_RATE

        inputs_sha = gate_reference.gate_inputs_digest(tokenizer, gate_set[1], gate_set[2], GATE_MIN_STRUCTURE_RATE)
        references = {} if regate else {
            sha: entry for sha, entry in gate_reference.load_references(reference_path).items()
            if gate_reference.matching_reference({sha: entry}, sha, inputs_sha)}
        (work / "gate.json").write_text(json.dumps({"prompts": gate_set[1], "caps": gate_set[2],
                                                    "reference_weights_sha256": sorted(references)}))
    log(f"training: {len(rows)} transcripts, {len(steps)} steps, {sum(len(r[0]) for r in rows)} tokens, "
        f"{workers} worker process(es)")
    figures = _run_workers(work, workers, log)

    # The chat template goes into tokenizer_config.json (not a side chat_template.jinja) because SGLang and
    # older transformers read it from there.
    tokenizer.save_pretrained(out, save_jinja_files=False)
    _portable_tokenizer_config(out / "tokenizer_config.json")
    gate: dict[str, Any] | None = None
    if gate_set is not None:
        weights_sha = figures["weights_sha256"]
        if weights_sha in references:
            gate = gate_reference.reference_gate(references[weights_sha], weights_sha)
            recorded = references[weights_sha].get("recorded", {})
            log(f"gate: the weights (sha256 {weights_sha[:12]}...) and the gate inputs equal those of the build "
                f"gated at {recorded.get('at', '?')} (eagle_assets/demo/gate_reference.json), so its verdict "
                "stands (EAGLE_ASSETS_DEMO_REGATE=1 runs it again)")
        else:
            gate = _gate_from_replies(work, gate_set, tokenizer)
        for kind, r in gate["report"].items():
            log(f"gate {kind}: structure ok {r['ok']}/{r['n']}, {r['at_cap']} at the {r['cap']}-token cap, "
                f"reply tokens {r['min_tokens']}-{r['max_tokens']} (median {r['median_tokens']})")
    shutil.rmtree(work)
    (out / RECIPE_FILE).write_text(json.dumps({
        "recipe_hash": digest, "recipe": recipe.to_dict(), "generator_version": transcripts.GENERATOR_VERSION,
        "source_sha256": _source_digest(), "tokenizer_size": len(tokenizer), **figures,
        "build_seconds": round(time.monotonic() - t0, 1), "gate": gate,
    }, indent=2) + "\n")
    log(f"done in {time.monotonic() - t0:.0f}s")


def _gate_from_replies(work: Path, gate_set, tokenizer) -> dict[str, Any]:
    """recipe.json's ``gate`` from the workers' ``gate-<rank>.json`` files: the report per kind, the failed rules,
    examples, the gate inputs' digest and each reply's digest (gate order)."""
    from eagle_assets.demo.evaluate import GATE_MIN_STRUCTURE_RATE, gate_failures, summarize_replies

    samples_g, _, caps = gate_set
    replies: list[list[int]] = [[] for _ in samples_g]
    for f in sorted(work.glob("gate-*.json")):
        part = json.loads(f.read_text())
        for i, r in zip(part["index"], part["output_ids"]):
            replies[i] = r
    report = summarize_replies(samples_g, replies, tokenizer, dict(zip((s.kind for s in samples_g), caps)))
    return {"min_structure_rate": GATE_MIN_STRUCTURE_RATE, "failures": gate_failures(report),
            "report": {k: {key: v for key, v in r.items() if key != "examples"} for k, r in report.items()},
            "examples": {k: r["examples"] for k, r in report.items() if r["examples"]},
            "inputs_sha256": gate_reference.gate_inputs_digest(tokenizer, gate_set[1], caps, GATE_MIN_STRUCTURE_RATE),
            "reply_sha256": [gate_reference.reply_digest(r) for r in replies]}


def record_gate_reference(model_dir: Path, reference_path: Path | None = None, regenerate: bool = False,
                          workers: int | None = None, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Record the gate verdict of the built target ``model_dir`` for its weights in ``reference_path`` (default:
    the package's ``gate_reference.json``); returns the entry. See :mod:`eagle_assets.demo.gate_reference`.

    The verdict is the one its build generated replies for; when the build took its verdict from a reference
    (``gate.verified_by``) or ``regenerate`` is set, every gate reply is generated again first, in ``workers``
    processes with the build's environment.

    Raises:
        ValueError: ``model_dir`` was built by a recipe without a gate (``gate_prompts_per_kind == 0``).
        RuntimeError: a gate worker failed.
    """
    from transformers import AutoTokenizer

    log = log or (lambda msg: print(f"[demo-target] {msg}", file=sys.stderr, flush=True))
    model_dir = Path(model_dir)
    meta = json.loads((model_dir / RECIPE_FILE).read_text())
    gate = meta.get("gate")
    if regenerate or not gate or "verified_by" in gate or "reply_sha256" not in gate:
        fields = {f.name for f in dataclasses.fields(DemoRecipe)}
        recipe = DemoRecipe(**{k: tuple(tuple(x) for x in v) if isinstance(v, list) else v
                               for k, v in meta["recipe"].items() if k in fields})
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        gate_set = _gate_set(tokenizer, recipe)
        if gate_set is None:
            raise ValueError(f"{model_dir} was built by a recipe without a gate (gate_prompts_per_kind = 0)")
        workers = workers or (SHARDS if (os.cpu_count() or 1) >= SHARDS else 1)
        work = Path(tempfile.mkdtemp(prefix=".gate-", dir=model_dir.parent))
        try:
            (work / "job.json").write_text(json.dumps({"out": str(model_dir)}))
            (work / "gate.json").write_text(json.dumps({"prompts": gate_set[1], "caps": gate_set[2]}))
            _run_workers(work, workers, log, extra_args=("--gate-only",))
            gate = _gate_from_replies(work, gate_set, tokenizer)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    weights_sha = hashlib.sha256((model_dir / "model.safetensors").read_bytes()).hexdigest()
    path = Path(reference_path or gate_reference.default_reference_path())
    entry = gate_reference.record(path, weights_sha, gate, meta["recipe_hash"])
    log(f"recorded the gate of weights {weights_sha[:12]}... in {path}: failures {gate['failures'] or 'none'}")
    return entry


def _gate_set(tokenizer, recipe: DemoRecipe):
    """(samples, prompt ids, caps) of the gate: the committed demo prompts under the default catalog's caps,
    ``recipe.gate_prompts_per_kind`` per kind (None = all); None when the recipe has no gate."""
    if recipe.gate_prompts_per_kind == 0:
        return None
    from eagle_assets.demo.evaluate import default_catalog_caps, gate_samples

    caps = default_catalog_caps()
    per_kind: dict[str, int] = {}
    samples = []
    for s in gate_samples():
        per_kind[s.kind] = per_kind.get(s.kind, 0) + 1
        if recipe.gate_prompts_per_kind is None or per_kind[s.kind] <= recipe.gate_prompts_per_kind:
            samples.append(s)
    return samples, [encode_sample(tokenizer, s)[0] for s in samples], [caps[s.kind] for s in samples]


def _worker_env() -> dict[str, str]:
    """The workers' environment: one thread everywhere, MKL's vendor-neutral ``COMPATIBLE`` branch and the AVX2
    code paths of ATen and oneDNN (see :mod:`eagle_assets.demo.trainer`), whatever the caller's settings."""
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = "1"
    env.update(MKL_CBWR="COMPATIBLE", ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2", MKL_DYNAMIC="FALSE",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return env


def _run_workers(work: Path, workers: int, log: Callable[[str], None], extra_args: tuple[str, ...] = ()
                 ) -> dict[str, Any]:
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
                [sys.executable, "-m", "eagle_assets.demo.trainer", str(work), str(rank), str(world), *extra_args],
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
    parser.add_argument("--regate", action="store_true",
                        help="run the gate even when gate_reference.json has a verdict for the built weights")
    parser.add_argument("--record-gate-reference", action="store_true",
                        help="after the build, record its gate verdict for these weights in "
                             "eagle_assets/demo/gate_reference.json (after a recipe or decoder change); with "
                             "--regate the replies are generated again first")
    args = parser.parse_args(argv)
    try:
        path = build_demo_target(args.cache_root, force=args.force, regate=args.regate or None)
    except DemoTargetRejected as exc:
        print(exc, file=sys.stderr)
        if not args.record_gate_reference:
            return 1
        path = exc.path
    if args.record_gate_reference:
        record_gate_reference(path, regenerate=args.regate)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
