"""Our block-drafter objectives held to SpecForge 0.2.0's own modules (issue 46): one training step's loss on the
same batch, weights and anchors equals ``OnlineDFlashModel`` / ``OnlineDSparkModel``'s within float tolerance.

SpecForge runs in the SGLang CPU venv (``sglang_cpu/setup_venv.sh`` installs it ``--no-deps`` beside SGLang), on
our exported draft (its ``config.json`` and tensors, loaded strictly by SpecForge's classes), through
``sglang_cpu/specforge_loss.py``; the only thing fixed on its side is the random anchor draw, set to ours. The
batch: two rows of random ids with holes in the loss mask (slots past a hole weigh nothing in DFlash and end the
block in DSpark), random target features and final hiddens, every anchor of each row (a row with fewer than the
other's gets dropped sentinel blocks).
"""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest
import torch

from eagle_assets.drafter.dflash.model import anchors_of, block_loss
from eagle_assets.drafter.dspark.model import dspark_loss
from eagle_assets.drafter.family import family_named
from eagle_assets_tests.real_sglang import STUB_DIR, sglang_env
from eagle_assets_tests.test_drafter_dflash import H, V
from eagle_assets_tests.test_drafter_dflash import _draft as dflash_draft
from eagle_assets_tests.test_drafter_dspark import _draft as dspark_draft


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    pass


def _batch(seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V - 1, (2, 16), generator=gen)
    mask = torch.zeros(2, 16, dtype=torch.long)
    mask[0, 4:] = 1
    mask[1, 2:8] = 1
    mask[1, 10:14] = 1
    return ids, mask, torch.randn(2, 16, 2 * H, generator=gen), torch.randn(2, 16, H, generator=gen)


def test_one_step_of_our_block_objectives_is_specforges(sglang_python, tmp_path):
    cases, ours = [], {}
    for name, model, seed in (("dflash", dflash_draft(), 5), ("dspark", dspark_draft(), 6)):
        ids, mask, hidden, last = _batch(seed)
        anchors, keep = anchors_of(mask)
        assert not keep.all()  # the shorter row has sentinel blocks
        if name == "dflash":
            loss, _ = block_loss(model, hidden, ids, mask, anchors, keep)
        else:
            loss, _ = dspark_loss(model, hidden, ids, mask, anchors, keep, last)
        ours[name] = float(loss)
        family_named(name).export(model, None, None, model.config.aux_capture_ids, tmp_path / name)
        np.savez(tmp_path / f"{name}.npz", ids=ids.numpy(), loss_mask=mask.numpy(), hidden=hidden.numpy(),
                 last_hidden=last.numpy(), embed=model.embed_weight.numpy(), lm_head=model.lm_head_weight.numpy(),
                 anchors=anchors.numpy(), keep=keep.numpy())
        cases.append({"name": name, "checkpoint": str(tmp_path / name), "inputs": str(tmp_path / f"{name}.npz")})
    (tmp_path / "cases.json").write_text(json.dumps({"cases": cases}))
    proc = subprocess.run([str(sglang_python), str(STUB_DIR / "specforge_loss.py"), str(tmp_path / "cases.json"),
                           str(tmp_path / "out.json")], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **sglang_env()})
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads((tmp_path / "out.json").read_text())
    for name in ("dflash", "dspark"):
        assert theirs[name]["loss"] == pytest.approx(ours[name], rel=1e-5, abs=1e-6), name
