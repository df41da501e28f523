"""Stage 3, ``generations``: prompts -> raw ``output_ids`` + ``finish_reason`` from SGLang's native ``/generate``,
resumable by sample id (``run``); multi-turn on-policy rollout, every assistant turn regenerated (``rollout``), with
each reply turned into the assistant message a serving stack returns (``reply``). docs/multi_turn.md."""
