"""SGLang native ``/generate`` protocol: request/reply types, an async client, a local server and its launcher.

- ``protocol``: ``SamplingParams``, ``FinishReason``, ``GenerateReply``, ``parse_generate_reply`` and ``ReplyError``.
- ``client``: ``GenerateClient`` (aiohttp; retries, several servers, API key from an environment variable).
- ``engine``: ``DecodeEngine``, continuous batched greedy/sampled decoding of a transformers causal LM.
- ``server``: an aiohttp server speaking SGLang's native endpoints over ``DecodeEngine``
  (``python -m eagle_assets.serving.server``).
- ``launch``: ``launched_server``, start a server process (ours or ``sglang.launch_server``) and wait until ready.

Submodules are imported on demand so that importing the package does not import torch or aiohttp.
"""
