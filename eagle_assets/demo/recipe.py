"""The demo target's recipe: every setting its weights depend on, and the hash that names a build (the recipe, the
transcript generator version and the recipe's source files)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from eagle_assets.demo import transcripts

# Files whose source is part of the recipe: editing any of them invalidates cached targets.
_RECIPE_FILES = ("transcripts.py", "tokenizer.py", "recipe.py", "rows.py", "build.py", "trainer.py",
                 "chat_template.jinja")
RECIPE_FILE = "recipe.json"
SHARDS = 2
# Workers that may add their shard gradients with one all-reduce: one (both shards in turn) or SHARDS.
WORLD_SIZES = (1, SHARDS)


@dataclass(frozen=True)
class DemoRecipe:
    """Everything the demo target's weights depend on (besides the source files hashed with it).

    Model shape: 4 layers (capture ids ``[1, 2, 3]``, set in ``catalogs/default.yaml``: SGLang's default
    ``[2, L//2, L-3]`` collides below 7 layers). 8 layers (default ids ``[2, 4, 5]``) passed the gate as well but
    cost 1.6x the training time (204 s against 123 s on an idle 2-core machine) and twice the decode time of every
    generation; 4 passed it with every committed prompt well-formed and none at a cap. ``vocab_multiple`` pads
    ``config.vocab_size`` past ``len(tokenizer)`` as real checkpoints do (Qwen3: 151,936 embedding rows for 151,669
    tokens), so consumers must not assume the two are equal.

    Training (about 800 AdamW steps over 1,700 transcripts, 642k tokens; about 130 CPU seconds in each of two worker
    processes, see :mod:`eagle_assets.demo.trainer`): ``train_counts`` fresh transcripts per kind, each seen once, in
    length-sorted batches of at most ``batch_tokens`` padded tokens (two shards of half that); linear warmup, then
    cosine decay to ``min_lr_ratio * lr``. The loss covers prompt tokens at ``prompt_loss_weight`` (prompts are made of
    the same templated sentences, so they teach the language at no extra forward cost) and reply tokens at
    ``reply_weights[kind]`` (default 1; a tool reply is short and depends on the request, so it gets more gradient than
    its token count would give it). In a ``counter_repeat_prob`` share of transcripts one count-down line is written
    twice with the copy excluded from the loss (:func:`encode_training_sample`), which teaches the model to recover from
    its own miscounts instead of looping.

    Conversations in turns (issue 13): a ``tool_result`` transcript is a whole tool chain in one row (the call,
    its recorded result, the answer that uses it: :func:`encode_tool_chain`), so it teaches the turn-1 call as
    well; ``follow_up`` transcripts are turn 3 (a second user question after the answer). The mix moved tool
    transcripts from 600 single calls to 100 single calls + 300 chains + 200 follow-ups (400 calls, 300 answers
    from a result, 200 follow-up answers). With 340 math transcripts (the single-turn recipe's count) in that mix
    the gate saw 48/50 math replies well-formed (a stray ``</think>`` / ``<|im_end|>`` inside the count-down) and
    every tool, ``tool_result`` and ``follow_up`` reply well-formed; 420 math transcripts with 260 chains and 160
    follow-ups fixed math (50/50) but left one follow-up reply of 26 with two ``</think>``; so 420 math and the
    full 300 + 200, about 13% more tokens than the single-turn recipe's 717 steps.

    Other arithmetic (issue 12): the bytes are the same on one kind of CPU at any load
    (:mod:`eagle_assets.demo.trainer`); other arithmetic gives other weights, and the gate decides on those. An AMD EPYC
    builds ``3f72ee27...``: tool 50/50, tool_result 47/50, follow_up 24/26 (B1: 5 of 126 malformed, 4.0%), reasoning
    49/50, code and math 50/50; under the per-partition gate (``gate.gate_failures``: no more than the partition's own
    QC warn level, 5%) it passes, under the earlier 98%-per-kind rule it failed. Built with the workers' kernels
    swapped, as another machine's arithmetic would do (measured 2026-12-02 on one Xeon): MKL's ``COMPATIBLE`` branch and
    ATen's AVX2 (the build): 276/276 well-formed; MKL's AVX2 branch: tool_result 48/50, rejected; MKL's and ATen's
    AVX-512: follow_up 25/26, rejected; the machine that recorded the earlier reference (MKL's AVX2 branch there):
    276/276. Two richer mixes did not make it robust: 400 chains + 300 follow-ups at reply weight 3 (12% more tokens)
    passed ``COMPATIBLE`` (reasoning 49/50) and AVX2 but not AVX-512 (follow_up 25/26); 400 + 500 failed math under
    ``COMPATIBLE`` (42/50). So about half of foreign arithmetic misses the gate by one or two replies: outside x86-64
    with AVX2 (an ARM laptop) the build may be rejected, and its message says why and what to do.

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


def source_digest() -> str:
    """sha256 (hex) of the recipe's source files (``_RECIPE_FILES``), in order."""
    h = hashlib.sha256()
    pkg = resources.files("eagle_assets.demo")
    for name in _RECIPE_FILES:
        h.update(name.encode() + b"\x00" + pkg.joinpath(name).read_bytes() + b"\x00")
    return h.hexdigest()


def recipe_hash(recipe: DemoRecipe | None = None) -> str:
    """sha256 (hex) of the recipe, the transcript generator version and the demo package's source files."""
    recipe = recipe or DemoRecipe()
    payload = {"recipe": recipe.to_dict(), "generator_version": transcripts.GENERATOR_VERSION,
               "source_sha256": source_digest()}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def default_cache_root() -> Path:
    """``$EAGLE_ASSETS_HOME/demo-target``; ``EAGLE_ASSETS_HOME`` defaults to ``<cwd>/.eagle_assets``."""
    home = os.environ.get("EAGLE_ASSETS_HOME") or str(Path.cwd() / ".eagle_assets")
    return Path(home).expanduser() / "demo-target"


def demo_target_path(cache_root: Path | None = None, recipe: DemoRecipe | None = None) -> Path:
    """Where the target for ``recipe`` lives (or will live) under ``cache_root``; nothing is built."""
    return Path(cache_root or default_cache_root()) / recipe_hash(recipe)[:16]
