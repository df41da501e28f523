"""The EAGLE-3 drafter family: Llama and MLA drafts (``model``), the TTT loss (``ttt_loss``), the checkpoint SGLang
0.5.23 loads with ``--speculative-algorithm EAGLE3`` (``export``), and the family entry (``family``)."""
