"""The drafter trainer's target features (aux hidden states, teacher, target greedy ids), lowest module first:

- :mod:`~eagle_assets.drafter.features.local_capture`: the layer-id numberings (capture vs layer-output ids) and
  running the target in this process to capture its aux hidden states, final hidden states and lm_head logits.
- :mod:`~eagle_assets.drafter.features.local_cache`: training rows as the trainer holds them (checked and cut
  rows, length-sorted batches) and :class:`~eagle_assets.drafter.features.local_cache.FeatureCache`, the locally
  captured features of every row, computed once.
- :mod:`~eagle_assets.drafter.features.shard_format`: the on-disk format of served features (verified safetensors
  shards: write, verify, read rows).
- :mod:`~eagle_assets.drafter.features.served_client`: the client of an SGLang server in aux-capture mode (the
  requests, reply parsing and refusals of one row's features).
- :mod:`~eagle_assets.drafter.features.served_cache`: served features as the trainer uses them (streamed or kept
  in shards, the per-split cache and the teacher built from served top-K).
- :mod:`~eagle_assets.drafter.features.source`: the catalog's ``training.features`` switch, choosing the local or
  the served source and giving the trainer one interface to both.
"""
