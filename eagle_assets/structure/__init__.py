"""Token structure of a reply: how each family's ``output_ids`` split into reasoning, answer and tool-call spans,
and the named reasons a reply is not well-formed (``segment``: ``segment_output``, ``segment_row``, ``DROP_REASONS``).
The one definition QC, the live monitor, multi-turn rollout and the generate client's structural checks share."""
