"""Stage 2, ``tokenized_prompts``: conversations -> ``prompt_ids`` through the target's chat template
(``write``), the prompts file later stages read by sample id (``prompts_file``), and the multi-turn conversation walk:
turn row ids, thinking modes and which messages each turn's prompt holds (``walk``)."""
