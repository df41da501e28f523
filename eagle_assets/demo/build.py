"""Build (or reuse) the embedded demo target: a tiny Qwen3 trained on the synthetic transcripts.

``build_demo_target()`` returns a Hugging Face model directory (``config.json``, ``model.safetensors``,
``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json`` with the chat template, ``recipe.json``)
that ``AutoTokenizer`` / ``AutoModelForCausalLM.from_pretrained`` load and that any server speaking SGLang's
``/generate`` can serve. The directory name is the recipe hash, so a changed recipe (hyper-parameters, generator
version, or the source of the demo package) builds a new directory and never reuses stale weights.

The build runs on CPU in about two minutes on 2 cores: generate transcripts -> train the BPE -> train the model
for a fixed number of optimizer steps (fixed, not time-boxed, so the weights depend only on the recipe and seed).

CLI: ``python -m eagle_assets.demo.build [--force] [--cache-root DIR]`` prints the model directory.
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

from eagle_assets.demo import transcripts
from eagle_assets.demo.tokenizer import EOS_TOKEN, PAD_TOKEN, train_demo_tokenizer
from eagle_assets.demo.transcripts import DemoSample, completion_text, generate_mixture

# Files whose source is part of the recipe: editing any of them invalidates cached targets.
_RECIPE_FILES = ("transcripts.py", "tokenizer.py", "build.py", "chat_template.jinja")
RECIPE_FILE = "recipe.json"


@dataclass(frozen=True)
class DemoRecipe:
    """Everything the demo target's weights depend on (besides the source files hashed with it).

    Model shape: 8 layers so SGLang's default EAGLE-3 capture ids ``[2, L//2, L-3]`` = ``[2, 4, 5]`` are distinct;
    ``vocab_multiple`` pads ``config.vocab_size`` past ``len(tokenizer)`` as real checkpoints do (Qwen3: 151,936
    embedding rows for 151,669 tokens), so consumers must not assume the two are equal.

    Training (~340 AdamW steps, about 100 s on 2 cores): ``train_counts`` fresh transcripts per kind, each seen
    once, in length-sorted batches of at most ``batch_tokens`` padded tokens; linear warmup, then cosine decay to
    ``min_lr_ratio * lr``. The loss covers prompt tokens at ``prompt_loss_weight`` (prompts are made of the same
    templated sentences, so they teach the language at no extra forward cost) and reply tokens at
    ``reply_weights[kind]`` (default 1; a tool reply is short and depends on the request, so it gets more gradient
    than its token count would give it). In a ``counter_repeat_prob`` share of transcripts one count-down line is
    written twice with the copy excluded from the loss (:func:`encode_training_sample`), which teaches the model to
    recover from its own miscounts instead of looping.
    """

    seed: int = 0
    train_counts: tuple[tuple[str, int], ...] = (("tool", 600), ("code", 340), ("math", 340), ("reasoning", 340))
    reply_weights: tuple[tuple[str, float], ...] = (("tool", 2.0),)
    counter_repeat_prob: float = 0.3
    tokenizer_corpus_per_kind: int = 150
    vocab_size: int = 2048
    vocab_multiple: int = 64
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 8
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 4096
    batch_tokens: int = 2048
    lr: float = 3e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.01
    prompt_loss_weight: float = 0.25
    grad_clip: float = 1.0
    threads: int = 2

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


def build_demo_target(cache_root: Path | None = None, force: bool = False, recipe: DemoRecipe | None = None,
                      log: Callable[[str], None] | None = None) -> Path:
    """Return the demo target's model directory, building it first when it is absent (or ``force``).

    Args:
        cache_root: parent directory of built targets; default :func:`default_cache_root`.
        force: rebuild even when a complete directory for this recipe exists (it is replaced atomically).
        recipe: hyper-parameters; default ``DemoRecipe()``.
        log: progress callback (one line per phase); default prints to stderr.

    Returns:
        ``<cache_root>/<first 16 hex chars of the recipe hash>``: a Hugging Face model directory. A directory
        is only ever visible complete: the build writes into a temporary sibling and renames it into place, so a
        crashed or concurrent build never leaves a half-written target behind; concurrent callers wait on the
        lock file ``.<name>.lock`` beside it and build once.

    Raises:
        OSError: the cache root is not writable (set ``EAGLE_ASSETS_HOME`` to a writable directory).
    """
    recipe = recipe or DemoRecipe()
    log = log or (lambda msg: print(f"[demo-target] {msg}", file=sys.stderr, flush=True))
    digest = recipe_hash(recipe)
    final = Path(cache_root or default_cache_root()) / digest[:16]
    if not force and _is_complete(final, digest):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(final.parent / f".{final.name}.lock"):
        # Another process may have finished the same build while this one waited for the lock.
        if not force and _is_complete(final, digest):
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        try:
            _build_into(tmp, recipe, digest, log)
            # mkdtemp makes the directory 0700 and safetensors writes 0600; servers running as another user must
            # be able to read the target, as they can a normal model download.
            tmp.chmod(0o755)
            for f in tmp.iterdir():
                f.chmod(0o644)
            if final.exists():
                old = final.with_name(f".{final.name}.old-{os.getpid()}-{time.time_ns()}")
                final.rename(old)
                shutil.rmtree(old, ignore_errors=True)
            tmp.rename(final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
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


def _batches(rows: list[tuple[list[int], int, list[float]]], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Row indices grouped into batches of similar length (sorted within shuffled windows) under a padded-token
    budget, so little compute goes to padding while batch order stays random."""
    order = list(range(len(rows)))
    rng.shuffle(order)
    batches: list[list[int]] = []
    window = 64
    for start in range(0, len(order), window):
        chunk = sorted(order[start:start + window], key=lambda i: len(rows[i][0]))
        cur: list[int] = []
        longest = 0
        for i in chunk:
            n = len(rows[i][0])
            if cur and max(longest, n) * (len(cur) + 1) > batch_tokens:
                batches.append(cur)
                cur, longest = [], 0
            cur.append(i)
            longest = max(longest, n)
        if cur:
            batches.append(cur)
    rng.shuffle(batches)
    return batches


def _build_into(out: Path, recipe: DemoRecipe, digest: str, log: Callable[[str], None]) -> None:
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    t0 = time.monotonic()
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(recipe.threads)
    try:
        corpus = generate_mixture(recipe.tokenizer_corpus_per_kind, recipe.seed + 10_000)
        bootstrap = train_demo_tokenizer(["bootstrap"], vocab_size=512)  # only its chat template is used here
        texts = [bootstrap.apply_chat_template(s.messages, tools=s.tools, add_generation_prompt=True, tokenize=False)
                 + completion_text(s) for s in corpus]
        tokenizer = train_demo_tokenizer(texts, vocab_size=recipe.vocab_size)
        log(f"tokenizer: {len(tokenizer)} tokens ({time.monotonic() - t0:.1f}s)")

        samples = generate_mixture(dict(recipe.train_counts), recipe.seed)
        # rows: (ids, number of prompt ids, loss weight per reply token)
        rows: list[tuple[list[int], int, list[float]]] = []
        reply_weight = dict(recipe.reply_weights)
        noise_rng = random.Random(f"repeat/{recipe.seed}")
        for s in samples:
            ids, n_prompt, learn = encode_training_sample(tokenizer, s, noise_rng, recipe.counter_repeat_prob)
            w = reply_weight.get(s.kind, 1.0)
            rows.append((ids, n_prompt, [w if flag else 0.0 for flag in learn]))

        pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
        eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
        vocab = math.ceil(len(tokenizer) / recipe.vocab_multiple) * recipe.vocab_multiple
        config = Qwen3Config(
            vocab_size=vocab, hidden_size=recipe.hidden_size, intermediate_size=recipe.intermediate_size,
            num_hidden_layers=recipe.num_hidden_layers, num_attention_heads=recipe.num_attention_heads,
            num_key_value_heads=recipe.num_key_value_heads, head_dim=recipe.head_dim,
            max_position_embeddings=recipe.max_position_embeddings, rope_theta=recipe.rope_theta,
            tie_word_embeddings=True, bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id,
            attn_implementation="sdpa",
        )
        torch.manual_seed(recipe.seed)
        model = Qwen3ForCausalLM(config)
        model.train()

        rng = random.Random(recipe.seed)
        batches = _batches(rows, recipe.batch_tokens, rng)
        decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=recipe.lr, betas=(0.9, 0.98))
        total = len(batches)

        def lr_at(step: int) -> float:
            if step < recipe.warmup_steps:
                return recipe.lr * (step + 1) / recipe.warmup_steps
            progress = (step - recipe.warmup_steps) / max(1, total - recipe.warmup_steps)
            return recipe.lr * (recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

        log(f"training: {len(rows)} transcripts, {total} steps, {sum(len(r[0]) for r in rows)} tokens")
        t_train = time.monotonic()
        for step, batch in enumerate(batches):
            width = max(len(rows[i][0]) for i in batch)
            ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            weights = torch.zeros((len(batch), width), dtype=torch.float32)
            is_reply = torch.zeros((len(batch), width), dtype=torch.bool)
            for r, i in enumerate(batch):
                seq, n_prompt, reply_w = rows[i]
                ids[r, :len(seq)] = torch.tensor(seq)
                weights[r, 1:n_prompt] = recipe.prompt_loss_weight
                weights[r, n_prompt:len(seq)] = torch.tensor(reply_w)
                is_reply[r, n_prompt:len(seq)] = torch.tensor(reply_w) > 0
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            # Right padding: real tokens never attend to pads, so the causal mask is all that is needed.
            logits = model(input_ids=ids).logits[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                    reduction="none").view(len(batch), width - 1)
            w = weights[:, 1:]
            # Normalized by the token count, not by the weights, so a batch of tool replies really pulls harder.
            loss = (nll * w).sum() / (w > 0).sum()
            reply_nll = nll[is_reply[:, 1:]].mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
            opt.step()
            if step % 10 == 0 or step == total - 1:
                log(f"step {step + 1}/{total} reply loss {reply_nll.item():.3f} ({time.monotonic() - t_train:.0f}s)")

        model.eval()
        model.generation_config = GenerationConfig(
            eos_token_id=[eos_id, pad_id], pad_token_id=pad_id, bos_token_id=None, do_sample=False,
        )
        model.save_pretrained(out, safe_serialization=True)
        # The chat template goes into tokenizer_config.json (not a side chat_template.jinja) because SGLang and
        # older transformers read it from there.
        tokenizer.save_pretrained(out, save_jinja_files=False)
        _portable_tokenizer_config(out / "tokenizer_config.json")
        (out / RECIPE_FILE).write_text(json.dumps({
            "recipe_hash": digest, "recipe": recipe.to_dict(), "generator_version": transcripts.GENERATOR_VERSION,
            "source_sha256": _source_digest(), "tokenizer_size": len(tokenizer), "train_steps": total,
            "final_reply_loss": round(float(reply_nll.item()), 4), "build_seconds": round(time.monotonic() - t0, 1),
        }, indent=2) + "\n")
        log(f"done in {time.monotonic() - t0:.0f}s")
    finally:
        torch.set_num_threads(prev_threads)


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
    args = parser.parse_args(argv)
    print(build_demo_target(args.cache_root, force=args.force))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
