"""Stage 1, ``raw_prompts``: source records -> normalized conversations, one Arrow row each, with the partition's
deterministic sample and chunk (``write``), and the row schema and record walk (``rows``). Malformed records go to
``rejects.parquet`` with a reason."""
