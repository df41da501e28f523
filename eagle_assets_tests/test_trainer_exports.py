"""The training mix exported for speculators and SpecForge, and read back by those projects' own loaders.

speculators 0.9.0 pins transformers<=5.19 and specforge 0.2.0 pins torch==2.11.0 and sglang==0.5.14; neither can
share this venv with our pins. The ``trainer_packages`` fixture installs exactly those two releases from PyPI with
``pip install --no-deps --target <tmp>`` and imports their loader modules from there (what those modules import
besides is in our ``test`` extra). Where PyPI cannot be reached the two loader tests skip and say why; the export
tests need nothing from outside.

Upstream of ``training_mix`` the QC shards are written here in their real schema (``QC_SCHEMA``) from rows rendered
with a real byte-level BPE tokenizer (the demo target's, trained on the spot), so the test runs in seconds and can
plant rows a trainer must never see: a loss mask of the wrong length, a row without loss tokens, and a row whose
ids are not the tokenizer's canonical encoding of their text (a re-tokenized text export would change it).
"""

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import yaml

from eagle_assets.definitions import build_definitions
from eagle_assets.drafter.data.splits import is_holdout, mixed_training_rows
from eagle_assets.exports import SPECFORGE, SPECULATORS, ExportError, export_mixed_rows, verify_export
from eagle_assets.qc.qc_pass import QC_SCHEMA
from eagle_assets.qc.status import QC_STATUS_FILE
from eagle_assets.storage.shards import shard_paths, write_json_atomic

REPO_ROOT = Path(__file__).resolve().parents[1]
TRAINER_PACKAGES = ("speculators==0.9.0", "specforge==0.2.0")
PARTITIONS = ("B1_glaive", "B4_mixturethoughts")
SEED, HOLDOUT = 0, 0.25
WORDS = "the quick brown fox jumps over lazy dogs while seven wizards quietly judge boxing matches".split()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The demo target's tokenizer recipe (byte-level BPE, Qwen3 control tokens and chat template), saved."""
    from eagle_assets.demo.tokenizer import train_demo_tokenizer

    texts = [" ".join(WORDS[i:] + WORDS[:i]) + ". Sure, the answer is 42." for i in range(len(WORDS))] * 4
    tok = train_demo_tokenizer(texts, vocab_size=400)
    path = tmp_path_factory.mktemp("tokenizer")
    tok.save_pretrained(path)
    return tok, path


def _row(tok, sid: str, i: int, canonical: bool = True) -> dict:
    prompt = tok.apply_chat_template([{"role": "user", "content": " ".join(WORDS[i % 5: i % 5 + 4]) + "?"}],
                                     add_generation_prompt=True, tokenize=True)["input_ids"]
    if canonical:
        reasoning = tok.encode(" ".join(WORDS[: 3 + i % 7]), add_special_tokens=False)
    else:  # one id per character: decodes to plain text that the tokenizer would encode as far fewer ids
        reasoning = [tok.convert_tokens_to_ids(c) for c in "Sure"]
    answer = tok.encode(f" the answer is {i}", add_special_tokens=False)
    output = reasoning + [tok.convert_tokens_to_ids("</think>")] + answer + [tok.eos_token_id]
    return {"sample_id": sid, "input_ids": prompt + output, "loss_mask": [0] * len(prompt) + [1] * len(output),
            "n_prompt_tokens": len(prompt), "reasoning_tokens": len(reasoning), "answer_tokens": len(answer),
            "tool_call_tokens": 0, "flags": []}


def _training_ids(prefix: str, n: int) -> list[str]:
    """``n`` sample ids that the catalog's held-out split leaves in training (so the mix can take them)."""
    out, i = [], 0
    while len(out) < n:
        sid = f"{prefix}-{i:03d}"
        if not is_holdout(sid, HOLDOUT, SEED):
            out.append(sid)
        i += 1
    return out


def _write_qc(store: Path, tok) -> None:
    for p, key in enumerate(PARTITIONS):
        part = [_row(tok, f"{key}-{i:03d}", i + p) for i in range(10)]
        if key == "B4_mixturethoughts":
            odd, bad_len, no_loss = _training_ids("odd", 3)
            part.append(_row(tok, odd, 3, canonical=False))
            broken = _row(tok, bad_len, 4)
            broken["loss_mask"] = broken["loss_mask"][:-1]
            part.append(broken)
            silent = _row(tok, no_loss, 5)
            silent["loss_mask"] = [0] * len(silent["loss_mask"])
            part.append(silent)
        out = store / "qc_shards" / key
        out.mkdir(parents=True)
        pq.write_table(pa.Table.from_pylist(part, schema=QC_SCHEMA), out / "shard-00000.parquet")
        write_json_atomic({"partition": key, "passed": True, "kept": len(part), "rows": len(part),
                           "token_structure": "OK", "response_length": "OK"}, out / QC_STATUS_FILE)


def _catalog(tmp: Path) -> Path:
    base = yaml.safe_load((REPO_ROOT / "catalogs" / "default.yaml").read_text())
    base.pop("evaluation", None)  # its suite is a partition of its own: test_evaluation_suites
    parts = {k: base["partitions"][k] for k in PARTITIONS}
    for spec in parts.values():
        for src in spec["sources"]:
            src["path"] = str(REPO_ROOT / "catalogs" / src["path"])
    base["partitions"] = parts
    base["training"].update({"holdout_fraction": HOLDOUT, "seed": SEED})
    base["training"]["mix"] = {"mode": "balanced", "token_budget": None, "weights": {}, "bucket_caps": [], "seed": 0}
    path = tmp / "catalog.yaml"
    path.write_text(yaml.safe_dump(base))
    return path


def _materialize(defs, instance, names, run_config=None):
    assets = [a for a in defs.assets if isinstance(a, dg.AssetsDefinition)]
    return dg.materialize(assets, selection=list(names), instance=instance, resources=defs.resources,
                          run_config=run_config or {})


@pytest.fixture(scope="module")
def exported(tokenizer, tmp_path_factory):
    """A real Dagster instance materializing ``training_mix`` and both exports (4 rows per speculators shard)."""
    tok, _ = tokenizer
    tmp = tmp_path_factory.mktemp("exports")
    store = tmp / "store" / "catalog"
    _write_qc(store, tok)
    defs = build_definitions(_catalog(tmp), storage_root=tmp / "store")
    with dg.DagsterInstance.ephemeral() as instance:
        result = _materialize(defs, instance, ("training_mix", "speculators_export", "specforge_export"),
                              {"ops": {"speculators_export": {"config": {"rows_per_shard": 4}}}})
        assert result.success
        yield {"defs": defs, "instance": instance, "store": store, "result": result}


def _expected(exported) -> list[tuple[str, str, list[int], list[int]]]:
    """What the drafter trains on (``mixed_training_rows``), less the rows planted for quarantine."""
    settings = exported["defs"].resources["settings"]
    rows = mixed_training_rows(settings.layout(), settings.catalog(), list(PARTITIONS))
    return [(k, sid, ids.tolist(), mask.tolist()) for sid, ids, mask, k in rows
            if len(ids) == len(mask) and mask.sum() > 0]


def _read_jsonl(files) -> list[tuple[str, str, list[int], list[int]]]:
    out = []
    for f in files:
        for line in Path(f).read_text().splitlines():
            r = json.loads(line)
            assert list(r) == ["input_ids", "loss_mask", "partition", "sample_id"]
            out.append((r["partition"], r["sample_id"], r["input_ids"], r["loss_mask"]))
    return out


def test_exports_hold_exactly_the_rows_the_drafter_trains_on_in_mix_order(exported):
    store, result = exported["store"], exported["result"]
    expected = _expected(exported)
    assert len(expected) >= 10 and any(sid.startswith("odd-") for _k, sid, _i, _m in expected)
    shards = sorted((store / "speculators_export" / "data").glob("shard-*.jsonl"))
    assert [p.name for p in shards] == [f"shard-{i:05d}.jsonl" for i in range(-(-len(expected) // 4))]
    assert _read_jsonl(shards) == expected
    assert _read_jsonl([store / "specforge_export" / "prompts.jsonl"]) == expected
    for name in ("speculators_export", "specforge_export"):
        meta = result.asset_materializations_for_node(name)[0].metadata
        assert meta["dagster/row_count"].value == meta["verified_rows"].value == len(expected)
        assert meta["loss_tokens"].value == sum(sum(m) for *_r, m in expected)
        assert meta["max_tokens"].value == max(len(i) for _k, _s, i, _m in expected)
        assert meta["rejected"].value == {"loss_mask_length_mismatch": 1, "no_loss_tokens": 1}
        rejects = pq.read_table(store / name / "rejects.parquet").to_pylist()
        assert sorted(r["reason"] for r in rejects) == ["loss_mask_length_mismatch", "no_loss_tokens"]
        summary = json.loads((store / name / "summary.json").read_text())
        assert summary["files"] and all(len(f["sha256"]) == 64 for f in summary["files"])
        assert summary["provenance"]["partitions"] == list(PARTITIONS)


def test_reexport_replaces_the_shard_directory_whole(exported):
    store = exported["store"]
    result = _materialize(exported["defs"], exported["instance"], ("speculators_export",),
                          {"ops": {"speculators_export": {"config": {"rows_per_shard": 1000}}}})
    assert result.success
    out = store / "speculators_export"
    assert [p.name for p in (out / "data").iterdir()] == ["shard-00000.jsonl"]  # the 4-row shards are gone
    # no staging left behind; the one dotfile is the export's lock (storage.guard.stage_lock), an empty file
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == [".speculators_export.lock"]
    assert (out / ".speculators_export.lock").stat().st_size == 0
    assert _read_jsonl([out / "data" / "shard-00000.jsonl"]) == _expected(exported)


def test_verify_export_names_a_changed_row_and_a_stale_mix_is_refused(exported, tmp_path):
    store = exported["store"]
    qc = {k: shard_paths(store / "qc_shards" / k) for k in PARTITIONS}
    mix = store / "training_mix" / "mix.parquet"
    copy = tmp_path / "specforge_export"
    shutil.copytree(store / "specforge_export", copy)
    assert verify_export(mix, qc, copy, SPECFORGE) == []
    assert verify_export(mix, qc, store / "speculators_export", SPECULATORS) == []
    lines = (copy / "prompts.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    first["input_ids"][-2] += 1
    lines[0] = json.dumps(first)
    (copy / "prompts.jsonl").write_text("\n".join(lines[1:] + lines[:1]) + "\n")
    assert verify_export(mix, qc, copy, SPECFORGE) == [f"{first['partition']}/{first['sample_id']}: input_ids differ"]

    # A QC shard that lost a mixed row (re-run QC) makes the mix stale: refused, the old export left as it was.
    key, sid = first["partition"], first["sample_id"]
    table = pq.read_table(qc[key][0])
    pruned = tmp_path / "qc" / "shard-00000.parquet"
    pruned.parent.mkdir()
    pq.write_table(table.filter(pc.not_equal(table.column("sample_id"), sid)), pruned)
    before = (copy / "prompts.jsonl").read_bytes()
    with pytest.raises(ExportError, match="re-materialize training_mix"):
        export_mixed_rows(mix, {**qc, key: [pruned]}, copy, SPECFORGE)
    assert (copy / "prompts.jsonl").read_bytes() == before


@pytest.fixture(scope="module")
def trainer_packages(tmp_path_factory):
    """speculators 0.9.0 and specforge 0.2.0 from PyPI, without their dependencies, importable for this module."""
    target = tmp_path_factory.mktemp("trainer-packages")
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
           "--target", str(target), *TRAINER_PACKAGES]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.skip(f"pip install --no-deps {' '.join(TRAINER_PACKAGES)} took over 300 s (is PyPI reachable?)")
    if proc.returncode != 0:
        pytest.skip(f"cannot install {' '.join(TRAINER_PACKAGES)} from PyPI with --no-deps, so their loaders "
                    f"cannot read our exports here: {proc.stderr.strip()[-500:]}")
    sys.path.insert(0, str(target))
    yield target
    sys.path.remove(str(target))


def test_speculators_own_loader_sees_exactly_our_ids_and_loss_mask(exported, trainer_packages, tokenizer,
                                                                     tmp_path, monkeypatch):
    import datasets.config

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    from speculators.cli.prepare_data import prepare_data
    from speculators.train.data import ArrowDataset, build_client_item

    tok, tok_dir = tokenizer
    expected = _expected(exported)
    longest = max(len(ids) for _k, _s, ids, _m in expected)
    summary = json.loads((exported["store"] / "speculators_export" / "summary.json").read_text())
    # What `speculators prepare-data --model <target> --data <export>/data --seq-length <longest>` runs, then the
    # dataset `speculators train` reads (ArrowDataset over the saved output).
    prepare_data(model=str(tok_dir), data=[summary["data_path"]], output=str(tmp_path / "prepared"),
                 seq_length=longest, num_preprocessing_workers=1, seed=0)
    dataset = ArrowDataset(max_len=longest, datapath=str(tmp_path / "prepared"))
    seen = Counter()
    for i in range(len(dataset)):
        item = dataset.data[i]
        sent = build_client_item(item)  # the request body for vLLM's hidden states: ids, no messages to re-render
        assert set(sent) == {"input_ids"} and sent["input_ids"] == item["input_ids"].tolist()
        seen[(tuple(item["input_ids"].tolist()), tuple(item["loss_mask"].tolist()))] += 1
    assert seen == Counter((tuple(ids), tuple(mask)) for _k, _s, ids, mask in expected)  # speculators shuffles
    assert sorted(dataset.approx_lengths) == sorted(len(ids) for _k, _s, ids, _m in expected)
    odd = next(ids for _k, sid, ids, _m in expected if sid.startswith("odd-"))
    assert tok.encode(tok.decode(odd), add_special_tokens=False) != odd  # a text round trip would have changed it


def test_specforge_own_loader_sees_exactly_our_ids_and_loss_mask_in_order(exported, trainer_packages):
    from specforge.algorithms.common.defaults import one_loss_token
    from specforge.config.schema import DataConfig
    from specforge.data.prompt_builder import prepare_prompt_tasks

    expected = _expected(exported)
    summary = json.loads((exported["store"] / "specforge_export" / "summary.json").read_text())
    data = DataConfig(prompts_path=summary["data_path"], max_length=max(len(i) for _k, _s, i, _m in expected))
    # As specforge/training/assembly.py::_prepare_prompts calls it for data.prompts_path (EAGLE-3: one loss token).
    tasks = prepare_prompt_tasks(data.prompts_path, None, chat_template=data.chat_template,
                                 max_length=data.max_length, is_preformatted=data.is_preformatted,
                                 train_only_last_turn=data.train_only_last_turn, cache_dir=None, cache_key=None,
                                 num_proc=1, min_loss_tokens=one_loss_token(None), max_prompts=data.max_prompts)
    assert [t["payload"] for t in tasks] == [{"input_ids": ids, "loss_mask": mask} for _k, _s, ids, mask in expected]
