"""Stage 5: the drafter, in rooms by concern, in the order the data passes through them.

- ``data/``: which QC rows the drafter trains and is tested on (``splits``, ``mix``, ``turn_mix``), the draft vocab
  (``vocab``: ``d2t``/``t2d``) and the Dagster-free bodies of ``draft_vocab`` and ``training_mix`` (``stage``).
- ``features/``: what the target gives the drafter for a row: aux hidden states captured locally
  (``local_capture``, ``local_cache``) or served by SGLang (``served_client``, ``served_cache``, ``shard_format``),
  behind one ``source``; the teacher signal (``teacher``: teacher positions, the target's distribution, soft
  cross-entropy) and the target's own weights (``target_weights``).
- ``family``: what a drafter family gives the training loop and the evaluation (:class:`~eagle_assets.drafter.family.
  DraftFamily`: build the model, the loss of a batch, export, load, draft for evaluation) and the registry of
  families by name (one entry per family folder).
- ``eagle3/``: the EAGLE-3 family (Llama and MLA drafts, EAGLE-3.1 switches; the TTT loss; the SGLang export).
- ``evaluation/``: acceptance as SGLang verifies drafts (``acceptance``: the greedy walk; ``sampled``: the exact
  expectation at a temperature), the held-out groups (``heldout``), the suites and their report (``suites``) and the
  ``acceptance_length`` verdict (``verdict``).
- ``training/``: the loop any family plugs into (``loop``), its recipe and step plan (``recipe``), resumable state
  (``state``), data parallelism (``distributed``), the learning curve and the torchrun entry point (``command``).

Evaluation sits below training: the loop measures validation tau with the evaluation's walk. Domain code only (no
Dagster). Formats follow SGLang ``python/sglang/srt/models/llama_eagle3.py`` (and ``kimi_k25_eagle3.py`` for MLA
drafts; docs/drafters.md) and the EAGLE-3 paper (arXiv 2503.01840); training follows SpecForge's TTT recipe
(``specforge/algorithms/eagle3/model.py``); the family-as-folder layout follows SpecForge 0.2.0's
``specforge/modeling/draft/<family>.py`` + ``registry.py``, without its provider indirection.
"""
