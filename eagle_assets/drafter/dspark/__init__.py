"""The DSpark block-drafter family (SGLang 0.5.23 ``--speculative-algorithm DSPARK``): DFlash's backbone with a
Markov head and a confidence head (``model``), exported through DFlash's checkpoint code with DSpark's config, and
the family entry (``family``)."""
