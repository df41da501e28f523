"""SGLang native ``/generate`` protocol: request/reply types, an async client, a local server, a Dagster resource.

- ``protocol``: ``SamplingParams``, ``FinishReason``, ``GenerateReply``, ``parse_reply`` and ``ReplyError``.
- ``client``: ``GenerateClient`` (aiohttp; retries, several servers, API key from an environment variable).
- ``engine``: ``DecodeEngine``, continuous batched greedy/sampled decoding of a transformers causal LM.
- ``server``: an aiohttp server speaking SGLang's native endpoints over ``DecodeEngine``
  (``python -m eagle_assets.serving.server``).
- ``launch``: ``launched_server``, start a server process (ours or ``sglang.launch_server``) and wait until ready.
- ``resource``: ``SGLangServerResource``, the only Dagster-aware module here.
- ``tiny_model``: ``write_tiny_causal_lm``, a random tiny Qwen3 + tokenizer for serving tests and benchmarks.
- ``stub_server``: a model-free ``/generate`` with deterministic replies and scripted faults (client benchmarks,
  fault drills, kill tests).

Submodules are imported on demand so that importing the package does not import torch or aiohttp.
"""
