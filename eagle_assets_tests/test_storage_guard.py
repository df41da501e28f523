"""Issue 48, "Secrets and bounds": what the pipeline deletes under is never a symbolic link, every stage that writes or
deletes holds its folder's lock, and the files later stages read are written atomically.

- A folder the pipeline clears (a partition's folder, a regeneration's ``.regenerating`` staging folder) or a lock
  file that is a symbolic link to a folder of the user's files is refused, through a real Dagster instance, with a
  failure naming the link, and every user file stays (names and bytes). A linked storage root is fine.
- A second run of one partition's stage while the first holds the lock (held here, from the test) is refused with
  the busy message naming the folder, for ``raw_prompts``, ``tokenized_prompts``, ``qc_shards`` and the training side;
  ``length_report``, which every partition's run rewrites whole, waits for the other writer instead (then refuses);
  the lock file is in no content version (two materializations, one data version).
- A write that fails part way (the serializer raises after writing some bytes) leaves the previous draft vocab
  arrays and evaluation report as they were, with no temp file.
"""

from __future__ import annotations

import os
import pathlib
import threading
import time
from pathlib import Path

import dagster as dg
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from eagle_assets.catalog import load_catalog
from eagle_assets.cli import failure_lines
from eagle_assets.definitions import build_definitions
from eagle_assets.drafter.data.stage import draft_vocab_stage
from eagle_assets.drafter.evaluation.suites import EvaluationReport, Gate, write_report
from eagle_assets.generations.run import (
    GENERATION_SCHEMA,
    LOCK_FILE,
    STAGING_DIR,
    PartitionBusyError,
    exclusive_writer,
    promote_staged,
    run_generation,
)
from eagle_assets.generations.staging import choose_workdir
from eagle_assets.lineage.versions import directory_content_version
from eagle_assets.qc.qc_pass import QC_SCHEMA
from eagle_assets.storage.guard import SymlinkRefusedError, lock_file_name, refuse_symlink, stage_lock
from eagle_assets.storage.shards import Layout, clear_shards, write_npy_atomic

REPO_ROOT = Path(__file__).resolve().parents[1]
REFUSING = "http://127.0.0.1:9"  # nothing listens: no stage tested here sends a request
KEY = "B1_glaive"
CATALOG = "guard"


def _write_catalog(path: Path, target: Path) -> Path:
    base = yaml.safe_load((REPO_ROOT / "catalogs" / "default.yaml").read_text())
    base.pop("evaluation", None)
    base["target"]["model"] = str(target)
    base["server"]["url"] = REFUSING
    b1 = base["partitions"][KEY]
    b1["prompt_policy"] = "last_user"
    b1["sources"] = [{"path": str(REPO_ROOT / "catalogs" / "demo_data" / "B1_glaive.json"), "format": "glaive"}]
    b1["limit"] = 6
    base["partitions"] = {KEY: b1}
    path.write_text(yaml.safe_dump(base))
    return path


@pytest.fixture
def pipeline(demo_target, tmp_path):
    """The definitions of a one-partition catalog under ``tmp_path/store``, its layout and a folder of user files."""
    store = tmp_path / "store"
    catalog = _write_catalog(tmp_path / f"{CATALOG}.yaml", demo_target)
    user = tmp_path / "user_files"
    (user / "nested").mkdir(parents=True)
    (user / "notes.txt").write_text("my notes\n")
    (user / "shard-00000.parquet").write_bytes(b"not the pipeline's shard")  # named like one, on purpose
    (user / "qc_status.json").write_text("{}")
    (user / "nested" / "deep.bin").write_bytes(bytes(range(256)))
    return build_definitions(catalog, storage_root=store), Layout(store, CATALOG), user


def _files(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (dotfiles too), by relative path, with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _materialize(defs: dg.Definitions, name: str, partition: str | None = KEY, run_config: dict | None = None):
    assets = [a for a in defs.assets if isinstance(a, dg.AssetsDefinition)]
    with dg.DagsterInstance.ephemeral() as instance:
        return dg.materialize(assets, selection=[name], instance=instance, resources=defs.resources,
                              partition_key=partition, run_config=run_config or {}, raise_on_error=False)


def _only_failure(result, step: str) -> str:
    assert not result.success
    [line] = [line for line in failure_lines(result) if line.startswith(f"  step {step} FAILED -- ")]
    return line


def _write_shard(folder: Path, sample_id: str) -> None:
    """One generations shard of one row in ``folder``."""
    row = {"sample_id": sample_id, "output_ids": [1, 2], "finish_reason": "stop", "matched_stop": 2,
           "completion_tokens": 2, "prompt_tokens": 3, "latency_s": 0.1, "attempts": 1, "sampling_params": "{}"}
    pq.write_table(pa.Table.from_pylist([row], schema=GENERATION_SCHEMA), folder / "shard-00000.parquet")


# --- symbolic links -------------------------------------------------------------------------------------------------

def test_a_regeneration_into_a_linked_staging_folder_is_refused_and_every_user_file_stays(pipeline):
    defs, layout, user = pipeline
    gens = layout.stage_dir("generations", KEY)
    _write_shard(gens, "s0")
    stored = _files(gens)
    before = _files(user)
    link = gens / STAGING_DIR
    os.symlink(user, link)
    result = _materialize(defs, "generations", run_config={"ops": {"generations": {"config": {"regenerate": True}}}})
    line = _only_failure(result, "generations")
    assert f"{link} is a symbolic link (to {user})" in line and "nothing was deleted" in line, line
    assert "Replace the link by a real folder" in line
    assert _files(user) == before  # names and bytes: nothing deleted, no lock written into it
    assert link.is_symlink() and {k: v for k, v in _files(gens).items() if not k.startswith(STAGING_DIR)} == stored


@pytest.mark.parametrize("stage", ["raw_prompts", "qc_shards"])
def test_a_linked_partition_folder_is_refused_and_every_user_file_stays(pipeline, stage):
    defs, layout, user = pipeline
    before = _files(user)
    link = layout.stage_dir(stage) / KEY
    os.symlink(user, link)
    line = _only_failure(_materialize(defs, stage), stage)
    assert f"{link} is a symbolic link" in line and "nothing was deleted" in line, line
    assert _files(user) == before and link.is_symlink()


def test_a_linked_lock_file_is_refused_and_not_followed(pipeline):
    defs, layout, user = pipeline
    before = _files(user)
    lock = layout.stage_dir("qc_shards", KEY) / lock_file_name("qc_shards")
    os.symlink(user / "notes.txt", lock)
    line = _only_failure(_materialize(defs, "qc_shards"), "qc_shards")
    assert f"{lock} is a symbolic link (to {user / 'notes.txt'})" in line and "nothing was deleted" in line, line
    assert _files(user) == before
    # a dangling link is not followed either: no file is created where it points
    gens = layout.stage_dir("generations", KEY)
    os.symlink(user / "created_through_the_link", gens / LOCK_FILE)
    with pytest.raises(SymlinkRefusedError, match="is a symbolic link"):
        run_generation([("s0", [1, 2])], gens, None, None, None)
    assert _files(user) == before


def test_a_linked_storage_root_is_fine_and_links_below_it_are_refused(tmp_path):
    disk = tmp_path / "other_disk"
    disk.mkdir()
    root = tmp_path / "root_link"
    os.symlink(disk, root)  # data kept on another disk: the root itself may be a link
    layout = Layout(root, "cat")
    folder = layout.stage_dir("qc_shards", "k")
    assert (disk / "cat" / "qc_shards" / "k").is_dir() and refuse_symlink(folder, root) == folder
    with layout.lock("qc_shards", "k"):
        assert (folder / ".qc_shards.lock").is_file()
    user = tmp_path / "user"
    user.mkdir()
    os.symlink(user, disk / "cat" / "draft_vocab")  # a stage folder under the root: refused, nothing created in it
    with pytest.raises(SymlinkRefusedError) as refused:
        layout.stage_dir("draft_vocab")
    assert refused.value.path == root / "cat" / "draft_vocab" and list(user.iterdir()) == []
    os.symlink(user, disk / "cat" / "qc_shards" / "linked")  # the partition folder, the stage folder above is real
    with pytest.raises(SymlinkRefusedError, match="linked is a symbolic link"):
        layout.stage_dir("qc_shards", "linked")


def test_clearing_and_promoting_refuse_linked_folders_and_keep_the_users_files(tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    _write_shard(user, "u")
    (user / "failures.parquet").write_bytes(b"mine")
    before = _files(user)
    os.symlink(user, tmp_path / "link")
    with pytest.raises(SymlinkRefusedError, match="nothing was deleted"):
        clear_shards(tmp_path / "link", extra=["failures.parquet"])
    out = tmp_path / "gen"
    out.mkdir()
    _write_shard(out, "s0")
    os.symlink(user, out / STAGING_DIR)
    with pytest.raises(SymlinkRefusedError, match=STAGING_DIR):
        promote_staged(out)
    with pytest.raises(SymlinkRefusedError, match=STAGING_DIR):
        choose_workdir(out, {"sha256": "x", "inputs": {}}, True, True)
    with pytest.raises(SymlinkRefusedError), exclusive_writer(out / STAGING_DIR):
        pass
    assert _files(user) == before and (out / "shard-00000.parquet").exists()


# --- one writer per stage folder ------------------------------------------------------------------------------------

@pytest.mark.parametrize("stage,partition", [("raw_prompts", KEY), ("tokenized_prompts", KEY), ("qc_shards", KEY),
                                             ("draft_vocab", None), ("training_mix", None)])
def test_a_second_run_of_a_busy_stage_is_refused_with_the_folder_and_what_to_do(pipeline, stage, partition):
    defs, layout, _ = pipeline
    if stage == "tokenized_prompts":
        assert _materialize(defs, "raw_prompts").success
    folder = layout.stage_dir(stage, partition)
    (folder / "kept.bin").write_bytes(b"the first run's working file")
    with stage_lock(folder, stage):  # the first run, as another process would hold it
        line = _only_failure(_materialize(defs, stage, partition), stage)
    assert f"another process is writing {stage} into {folder}" in line, line
    assert f"(it holds {folder / lock_file_name(stage)})" in line and "Wait for it to finish" in line
    assert (folder / "kept.bin").read_bytes() == b"the first run's working file"
    with pytest.raises(PartitionBusyError), layout.lock(stage, partition), layout.lock(stage, partition):
        pass  # the lock is exclusive within one process too


def test_length_report_waits_for_another_runs_report_then_writes_and_refuses_after_its_wait(pipeline, monkeypatch):
    import eagle_assets.assets.qc as qc_assets

    defs, layout, _ = pipeline
    folder = layout.stage_dir("length_report")
    held = stage_lock(folder, "length_report")  # another partition's run, writing the report
    held.__enter__()
    releaser = threading.Timer(1.0, held.__exit__, (None, None, None))
    releaser.start()
    started = time.monotonic()
    result = _materialize(defs, "length_report", None)
    releaser.join()
    assert result.success and time.monotonic() - started >= 1.0 and (folder / "report.md").is_file()
    monkeypatch.setattr(qc_assets, "LENGTH_REPORT_WAIT_S", 0.3)
    with stage_lock(folder, "length_report"):
        line = _only_failure(_materialize(defs, "length_report", None), "length_report")
    assert f"another process is writing length_report into {folder}" in line and "(waited 0.3 s for it)" in line


def test_the_lock_file_changes_no_data_version(pipeline):
    defs, layout, _ = pipeline
    versions = {}
    for run in range(2):
        for stage in ("raw_prompts", "tokenized_prompts"):
            result = _materialize(defs, stage)
            assert result.success
            [event] = result.asset_materializations_for_node(stage)
            versions.setdefault(stage, []).append(event.tags["dagster/data_version"])
    for stage, (first, second) in versions.items():
        folder = layout.stage_dir(stage, KEY)
        assert (folder / lock_file_name(stage)).is_file()
        assert first == second == directory_content_version(folder, ("prompts.parquet", "rejects.parquet")), stage
        assert sorted(p.name for p in folder.iterdir()) == sorted(
            [lock_file_name(stage), "prompts.parquet", "rejects.parquet"])


# --- atomic writes --------------------------------------------------------------------------------------------------

def _half_then_raise(real):
    """A serializer that writes part of its output, then fails (a full disk, a kill)."""
    def broken(target, *args, **kwargs):
        real(target, *args, **kwargs)
        if hasattr(target, "truncate"):
            target.truncate(max(target.tell() // 2, 1))
        raise OSError("No space left on device")
    return broken


def _qc_shard(folder: Path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows = [{"sample_id": f"s{i}", "input_ids": rng.integers(0, 40, 8).tolist(), "loss_mask": [0] * 3 + [1] * 5,
             "n_prompt_tokens": 3, "reasoning_tokens": 0, "answer_tokens": 5, "tool_call_tokens": 0, "flags": []}
            for i in range(40)]
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=QC_SCHEMA), folder / "shard-00000.parquet")


def test_a_draft_vocab_write_that_fails_part_way_leaves_the_previous_arrays(tmp_path, monkeypatch, demo_target):
    catalog = load_catalog(_write_catalog(tmp_path / f"{CATALOG}.yaml", demo_target))
    layout = Layout(tmp_path / "store", CATALOG)
    _qc_shard(layout.base / "qc_shards" / KEY, seed=0)
    draft_vocab_stage(layout, catalog, [KEY], {}, 40)
    out = layout.stage_dir("draft_vocab")
    before = _files(out)
    assert set(before) == {"d2t.npy", "t2d.npy", "token_counts.npy", "summary.json"}
    _qc_shard(layout.base / "qc_shards" / KEY, seed=1)  # other counts: the new arrays would differ
    monkeypatch.setattr(np, "save", _half_then_raise(np.save))
    with pytest.raises(OSError, match="No space left"):
        draft_vocab_stage(layout, catalog, [KEY], {}, 40)
    assert _files(out) == before  # every array of the previous vocab, no temp file
    monkeypatch.undo()
    draft_vocab_stage(layout, catalog, [KEY], {}, 40)
    assert _files(out)["token_counts.npy"] != before["token_counts.npy"]


def test_npy_files_are_the_bytes_np_save_writes(tmp_path):
    arrays = {tmp_path / "a.npy": np.arange(7, dtype=np.int64), tmp_path / "b.npy": np.array([True, False])}
    write_npy_atomic(arrays)
    for path, array in arrays.items():
        np.save(tmp_path / "ref.npy", array)
        assert path.read_bytes() == (tmp_path / "ref.npy").read_bytes()


def _report(tau: float) -> EvaluationReport:
    record = {"suite": "s", "thinking": "off", "temperature": 0.0, "k": 1, "tau": tau, "rows": 3, "ci_low": None,
              "ci_high": None, "per_position": [0.5], "position_buckets": []}
    gate = Gate("s", "off", "OK", tau, 1, 1.0, 1.5, 3, f"s / off: tau {tau}")
    return EvaluationReport([record], [gate], {}, {}, 1.0)


def test_an_evaluation_report_write_that_fails_part_way_leaves_the_previous_report(tmp_path, monkeypatch):
    out = tmp_path / "evaluation"
    write_report(_report(1.5), out, [1])
    before = _files(out)
    assert set(before) == {"report.json", "report.md", "tau_vs_k.png"}
    real = pathlib.Path.write_bytes

    def write_half(self, data):  # the PNG, written after report.json and report.md
        real(self, data[: len(data) // 2])
        raise OSError("No space left on device")

    monkeypatch.setattr(pathlib.Path, "write_bytes", write_half)
    with pytest.raises(OSError, match="No space left"):
        write_report(_report(2.5), out, [1])
    monkeypatch.undo()
    assert _files(out) == before  # report.json, report.md and the PNG of the previous report, no temp file
    write_report(_report(2.5), out, [1])
    assert _files(out)["report.json"] != before["report.json"]
