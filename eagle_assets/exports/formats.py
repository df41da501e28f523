"""The trainers' pre-tokenized input formats: where each one reads its rows and what it does to them.

Both trainers take one JSON object per row with ``input_ids`` (token ids of the whole sequence, prompt then
completion) and ``loss_mask`` (0/1 per token, 1 = supervised) and pass them through without a tokenizer or a chat
template; they differ in where they read them from. Sources, read at the versions named:

speculators (vllm-project/speculators; PyPI 0.9.0; the pass-through came with PR 964, commit ``db424646``)
    ``speculators prepare-data --data PATH`` -> ``speculators.data_generation.preprocessing.load_raw_dataset``:
    PATH is one ``.json``/``.jsonl`` file or a directory whose ``*.json``/``*.jsonl`` files (recursive, sorted)
    are loaded together with Hugging Face ``datasets``' JSON builder. ``build_speculator_training_dataset`` sees
    both ``input_ids`` and ``loss_mask`` columns and calls ``_passthrough_pretokenized``: each row is clipped to
    ``--seq-length`` (default 8192), dropped when no supervised token is left in that window or fewer than
    ``--minimum-valid-tokens``, and refused (ValueError) when the two lists differ in length; every other column
    is removed. The dataset is shuffled (``--seed``) and saved with ``save_to_disk`` for ``speculators train``,
    whose ``speculators.train.data.ArrowDataset`` sends ``input_ids`` unchanged to vLLM's completions endpoint
    for the hidden states (``build_client_item``: text-only rows carry no ``messages``) and uses ``loss_mask`` as
    stored.

SpecForge (sgl-project/SpecForge; PyPI 0.2.0, built 2026-08-10, and HEAD ``a6b6b023``)
    ``specforge train`` with ``data.prompts_path=FILE`` (``specforge/config/schema.py::DataConfig``: exactly one
    of ``train_data_path``, ``prompts_path``, ``hidden_states_path``) ->
    ``specforge.data.prompt_builder.prepare_prompt_tasks``: FILE is ONE JSON-array or JSON-lines file (not a
    directory); when its first record has ``input_ids`` and ``loss_mask`` every record is taken as pre-tokenized
    (``_prompt_from_record``: integer ids, a 0/1 mask of the same length, non-empty), clipped to
    ``data.max_length`` (default 2048) and skipped when fewer than the algorithm's minimum loss tokens remain
    (EAGLE-3: 1); other keys are ignored and the file order is kept. The rows then go to SpecForge's patched
    SGLang capture server as ids. The git commit that set ``version.txt`` to 0.2.0 (``73e6f808``, 2025-12-23)
    did not have this path: it took only ``conversations`` (ShareGPT) or preformatted ``text`` and re-derived the
    loss mask from a chat-template regex; a SpecForge that old cannot read these exports, only a text export.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class TrainerFormat:
    """Where one trainer reads pre-tokenized rows.

    Attributes:
        name: the trainer (``speculators`` / ``specforge``); the asset is ``<name>_export``.
        layout: ``shards`` = a directory of ``shard-NNNNN.jsonl`` files (the trainer reads the directory);
            ``file`` = one JSONL file (the trainer takes a single path).
        data_path: what to point the trainer at, relative to the export directory.
        max_length_option: the trainer's option that clips rows, and ``default_max_length`` its default (tokens).
        verified_with: the package version whose own loader the tests run on this format.
        train_hint: how to hand the export to the trainer (``{data}`` = absolute data path, ``{max}`` = longest row).
    """

    name: str
    layout: Literal["shards", "file"]
    data_path: str
    max_length_option: str
    default_max_length: int
    verified_with: str
    train_hint: str


SPECULATORS = TrainerFormat(
    name="speculators",
    layout="shards",
    data_path="data",
    max_length_option="--seq-length",
    default_max_length=8192,
    verified_with="speculators==0.9.0",
    train_hint="speculators prepare-data --model <target> --data {data} --seq-length {max} --output <prepared>",
)

SPECFORGE = TrainerFormat(
    name="specforge",
    layout="file",
    data_path="prompts.jsonl",
    max_length_option="data.max_length",
    default_max_length=2048,
    verified_with="specforge==0.2.0",
    train_hint="specforge train -c <recipe>.yaml data.train_data_path= data.prompts_path={data} "
               "data.max_length={max}",
)

FORMATS: dict[str, TrainerFormat] = {f.name: f for f in (SPECULATORS, SPECFORGE)}
