"""Run in the SGLang 0.5.23 CPU venv, where SpecForge 0.2.0 is installed beside it (test-only): the training loss
SpecForge's own modules compute for an exported DFlash or DSpark draft on a given batch.

    python specforge_loss.py CASES.json OUT.json

``CASES.json``: ``{"cases": [{"name", "checkpoint", "inputs": npz with ids [b, S] int64, loss_mask [b, S],
hidden [b, S, K*H] float32, last_hidden [b, S, H] (DSpark), embed [V, H], lm_head [V, H], anchors [b, N] int64,
keep [b, N] bool}]}``. The draft is SpecForge's ``DFlashDraftModel`` / ``DSparkDraftModel`` built from the
checkpoint's ``config.json`` (transformers' ``AutoConfig``, SDPA attention) with the checkpoint's tensors loaded
strictly; the loss is ``OnlineDFlashModel.forward`` / ``OnlineDSparkModel.forward`` (their defaults: ``loss_type``
dflash; DSpark's 0.1 / 0.9 / 1.0) over the target's embedding and LM head. The one thing replaced: the random anchor
draw (``_sample_anchor_positions``, SpecForge's global torch RNG) returns the case's anchors, so both sides
compute the same blocks. ``OUT.json``: per case the loss and its accuracy.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch


def main(cases_path, out_path):
    from safetensors.torch import load_file
    from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel, OnlineDSparkModel
    from specforge.modeling.draft.dflash import DFlashDraftModel
    from specforge.modeling.draft.dspark import DSparkDraftModel
    from transformers import AutoConfig

    results = {}
    for case in json.loads(open(cases_path).read())["cases"]:
        config = AutoConfig.from_pretrained(case["checkpoint"])
        config._attn_implementation = "sdpa"
        dspark = config.architectures == ["DSparkDraftModel"]
        draft = (DSparkDraftModel if dspark else DFlashDraftModel)(config).float()
        draft.load_state_dict(load_file(os.path.join(case["checkpoint"], "model.safetensors")), strict=True)
        data = np.load(case["inputs"])
        t = {k: torch.from_numpy(data[k]) for k in data.files}
        embed = torch.nn.Embedding.from_pretrained(t["embed"].float())
        head = torch.nn.Linear(t["lm_head"].shape[1], t["lm_head"].shape[0], bias=False)
        head.weight.data = t["lm_head"].float()
        dcfg = config.dflash_config
        cls = OnlineDSparkModel if dspark else OnlineDFlashModel
        online = cls(draft, head, embed, mask_token_id=dcfg["mask_token_id"], block_size=dcfg["block_size"],
                     attention_backend="sdpa", num_anchors=int(t["anchors"].shape[1]))
        online._sample_anchor_positions = lambda *_a, **_k: (t["anchors"].long(), t["keep"].bool())
        args = (t["ids"].long(), t["hidden"].float(), t["loss_mask"].float())
        with torch.no_grad():
            loss, accuracy, _metrics = (online(*args, target_last_hidden_states=t["last_hidden"].float())
                                        if dspark else online(*args))
        results[case["name"]] = {"loss": float(loss), "accuracy": float(accuracy)}
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
