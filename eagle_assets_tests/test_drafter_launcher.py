"""``drafter_checkpoint`` with ``training.launcher: torchrun``: a real Dagster instance materializes
``draft_vocab``, ``training_mix`` and ``drafter_checkpoint``; the checkpoint is trained by 2 gloo processes under
torchrun launched through Dagster Pipes (``PipesSubprocessClient``), and the training command's log lines and
summary appear in the run's event log.

The QC shards are written directly (a tiny random Qwen3 target cannot generate well-formed replies, and the
partition pipeline is tested elsewhere); everything from ``draft_vocab`` on is the real code.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from safetensors.torch import load_file
from tiny_targets import tiny_qwen3

from eagle_assets.definitions import build_definitions
from eagle_assets.drafter.training.command import read_config, read_draft_vocab, read_rows
from eagle_assets.drafter.training.loop import train_drafter
from eagle_assets_tests.dagster_runs import materialize_training

pytestmark = pytest.mark.slow(seconds=85)  # its share of a parallel session: scheduled early (conftest)

VOCAB, LAYERS, ROWS = 300, 8, 24
ATOL = 1e-5  # see test_drafter_ddp.py


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    pass


def write_qc_partition(directory: Path, n: int, seed: int) -> None:
    """A passing partition's QC output: one shard of ``n`` rows and its ``qc_status.json``."""
    gen = np.random.default_rng(seed)
    records = []
    for i in range(n):
        t = int(gen.integers(16, 41))
        prompt = int(gen.integers(4, t // 2))
        records.append({"sample_id": f"s{i:03d}", "input_ids": gen.integers(0, VOCAB, t).astype(np.int32).tolist(),
                        "loss_mask": [0] * prompt + [1] * (t - prompt), "n_prompt_tokens": prompt})
    schema = pa.schema([("sample_id", pa.string()), ("input_ids", pa.list_(pa.int32())),
                        ("loss_mask", pa.list_(pa.int8())), ("n_prompt_tokens", pa.int32())])
    directory.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(records, schema=schema), directory / "shard-00000.parquet")
    (directory / "qc_status.json").write_text(json.dumps({"passed": True, "kept": n}))


def write_catalog(tmp: Path, target_dir: Path, **training) -> Path:
    """A one-partition catalog on ``target_dir`` training with the torchrun launcher at 2 processes."""
    (tmp / "source.jsonl").write_text("")  # the partition's source; never read here
    catalog = {
        "target": {"model": str(target_dir)},
        "partitions": {"P1": {"sources": [{"path": str(tmp / "source.jsonl"), "format": "messages"}],
                              "sampling": {"max_new_tokens": 32}}},
        # validation scored at the end only, so the exported (best) weights are those of the last step
        "training": {"draft_vocab_size": 200, "ttt_steps": 3, "epochs": 2, "lr": 1.0e-2, "batch_tokens": 96,
                     "holdout_fraction": 0.25, "validation_rows": 2, "eval_every_tokens": 0, "acceptance_k": 3,
                     "acceptance_max_positions": 16, "threads": 1, "warmup_steps": 2,
                     "mix": {"bucket_caps": []}, "launcher": "torchrun", "nproc_per_node": 2, **training},
    }
    path = tmp / "catalog.yaml"
    path.write_text(yaml.safe_dump(catalog))
    return path


def test_kubernetes_training_pod_gets_one_gpu_per_torchrun_process(tmp_path):
    from eagle_assets.assets.k8s import CPU_PER_GPU, GPU_RESOURCE, step_k8s_config, training_gpus
    from eagle_assets.catalog import load_catalog

    four = load_catalog(write_catalog(tmp_path, tmp_path, nproc_per_node=4))
    resources = step_k8s_config(four)["drafter_checkpoint"]["container_config"]["resources"]
    assert training_gpus(four) == 4 and resources["limits"][GPU_RESOURCE] == "4"
    assert resources["requests"]["cpu"] == str(4 * CPU_PER_GPU)
    inline = load_catalog(write_catalog(tmp_path, tmp_path, launcher="inline"))
    assert step_k8s_config(inline)["drafter_checkpoint"]["container_config"]["resources"]["limits"][GPU_RESOURCE] == "1"


@pytest.fixture(scope="module")
def materialized(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("launcher")
    target_dir = tmp / "target"
    tiny_qwen3(VOCAB, LAYERS, initializer_range=1.0).save_pretrained(target_dir)
    path = write_catalog(tmp, target_dir)
    store = tmp / "store"
    write_qc_partition(store / "catalog" / "qc_shards" / "P1", ROWS, seed=1)
    defs = build_definitions(path, storage_root=store)
    result, logs = materialize_training(defs)
    return {"result": result, "logs": logs, "stage": store / "catalog" / "drafter_checkpoint", "target": target_dir}


def test_torchrun_launcher_materializes_the_checkpoint_with_logs_in_the_run(materialized):
    result, logs = materialized["result"], materialized["logs"]
    assert result.success, "\n".join(logs[-30:])
    launch = [m for m in logs if m.startswith("launching 2 training process(es): ")]
    assert launch and "torch.distributed.run --standalone --nproc_per_node=2 -m eagle_assets.drafter.training.command" \
        in launch[0]
    # rank 0's lines came through Dagster Pipes into this run's event log
    assert any("data-parallel training on 2 process(es), backend gloo" in m for m in logs)
    assert any(m.startswith("step ") and "loss" in m for m in logs)
    assert any(m.startswith("eval at ") for m in logs)
    reported = [m for m in logs if m.startswith("training command reported ")]
    assert len(reported) == 1 and json.loads(reported[0].split(" ", 3)[3])["world_size"] == 2
    meta = result.asset_materializations_for_node("drafter_checkpoint")[0].metadata
    assert meta["steps"].value == meta["planned_steps"].value > 0
    handed = read_rows([materialized["stage"] / "train_inputs" / "validation.parquet"])
    assert meta["validation_rows"].value == len(handed) > 0 and "learning_curve" in meta
    assert meta["train_rows"].value == len(read_rows([materialized["stage"] / "train_inputs" / "train.parquet"]))
    checks = {e.asset_check_evaluation_data.check_name: e.asset_check_evaluation_data for e in result.all_events
              if e.event_type_value == "ASSET_CHECK_EVALUATION"}
    assert checks["export_contract"].passed
    assert "acceptance_length" in checks
    assert (materialized["stage"] / "checkpoint" / "provenance.json").is_file()


def test_torchrun_checkpoint_has_the_weights_of_an_inline_run(materialized, tmp_path):
    """The inputs the step handed the command, trained in this process: the same weights (tolerance as in
    test_drafter_ddp.py)."""
    assert materialized["result"].success
    inputs = materialized["stage"] / "train_inputs"
    config = read_config(inputs / "config.json")
    assert config.num_threads == 1 and config.lr == 1.0e-2
    inline = train_drafter(materialized["target"], read_rows([inputs / "train.parquet"]),
                           read_draft_vocab(inputs / "draft_vocab"), config, tmp_path / "ckpt",
                           validation_rows=read_rows([inputs / "validation.parquet"]))
    ref = load_file(str(inline.checkpoint_dir / "model.safetensors"))
    got = load_file(str(materialized["stage"] / "checkpoint" / "model.safetensors"))
    assert set(ref) == set(got)
    diff = max(float((ref[k].float() - got[k].float()).abs().max()) for k in ref if ref[k].is_floating_point())
    assert diff < ATOL
    assert torch.equal(ref["d2t"], got["d2t"])


def test_torchrun_with_served_features_fetches_each_row_once_and_matches_an_inline_run(tmp_path):
    """``launcher: torchrun`` with ``features: served``: the 2 ranks get the features spec, no rank loads the target,
    each fetches only the rows it trains on (so every training row is in exactly one rank's feature shards, and the
    validation rows in rank 0's), and the weights are those of an inline served run of the same inputs (tolerance
    as above). The server is our embedded one in aux-capture mode, in a thread of this process."""
    from safetensors import safe_open

    from eagle_assets.drafter.features.shard_format import row_key
    from eagle_assets.drafter.training.command import read_features
    from eagle_assets.serving.server import serve_in_thread

    target_dir = tmp_path / "target"
    tiny_qwen3(VOCAB, LAYERS, initializer_range=1.0).save_pretrained(target_dir)
    with serve_in_thread(str(target_dir), enable_return_aux_hidden_states=True,
                         speculative_algorithm="EAGLE3") as server:
        path = write_catalog(tmp_path, target_dir, features={"source": "served", "url": server.url,
                                                             "teacher": "topk", "top_k": VOCAB})
        store = tmp_path / "store"
        write_qc_partition(store / "catalog" / "qc_shards" / "P1", ROWS, seed=2)
        defs = build_definitions(path, storage_root=store)
        result, logs = materialize_training(defs)
        assert result.success, "\n".join(logs[-30:])
        assert any("features served" in m for m in logs)
        stage = store / "catalog" / "drafter_checkpoint"
        inputs = stage / "train_inputs"
        features = read_features(inputs / "features.json")
        assert features.source == "served" and features.urls == [server.url]
        train = read_rows([inputs / "train.parquet"])
        validation = read_rows([inputs / "validation.parquet"])
        keys = []
        for shard in sorted((stage / "features").glob("features-*.safetensors")):
            with safe_open(str(shard), framework="pt") as f:
                keys += json.loads(f.metadata()["row_keys"])
        # every row fetched once: by the rank that trains on it (validation rows: by rank 0, which scores them)
        assert sorted(keys) == sorted(row_key(np.asarray(i, np.int64), np.asarray(m)) for i, m in train + validation)
        assert any(m.startswith(f"served features: {len(train)} of {len(train)} train rows fetched over 2 ranks")
                   for m in logs)
        checks = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
        assert checks["export_contract"] is True and "acceptance_length" in checks

        inline = train_drafter(target_dir, train, read_draft_vocab(inputs / "draft_vocab"),
                               read_config(inputs / "config.json"), tmp_path / "ckpt", validation_rows=validation,
                               features=features.model_copy(update={"cache_dir": str(tmp_path / "inline")}))
    ref = load_file(str(inline.checkpoint_dir / "model.safetensors"))
    got = load_file(str(stage / "checkpoint" / "model.safetensors"))
    assert set(ref) == set(got)
    diff = max(float((ref[k].float() - got[k].float()).abs().max()) for k in ref if ref[k].is_floating_point())
    assert diff < ATOL
