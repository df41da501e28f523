"""The DFlash block-drafter family (SGLang 0.5.23 ``--speculative-algorithm DFLASH``): the draft and its SpecForge
0.2.0 objective (``model``), the checkpoint SGLang loads (``export``), and the family entry (``family``)."""
