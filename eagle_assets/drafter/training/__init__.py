"""The training loop any drafter family plugs into (``drafter.family.DraftFamily``), its recipe, state and launch."""
