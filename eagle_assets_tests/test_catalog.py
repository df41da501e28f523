"""Catalog loading: the committed catalogs, path and env resolution, and validation errors that name the file,
the field and the fix."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from eagle_assets.catalog import CatalogError, default_catalog_path, load_catalog, repo_root
from eagle_assets.formats import Conversation, load_records

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"

MINIMAL = """
partitions:
  P1:
    sources: [{path: data/p1.jsonl, format: gsm8k}]
    sampling: {max_new_tokens: 64}
"""


def _write(tmp_path: Path, text: str, name: str = "cat.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _error(tmp_path: Path, text: str) -> CatalogError:
    with pytest.raises(CatalogError) as e:
        load_catalog(_write(tmp_path, text))
    return e.value


def test_default_catalog():
    cat = load_catalog(REPO / "catalogs" / "default.yaml")
    assert cat.training_partition_keys == ["B1_glaive", "B2_opencodeinstruct", "B4_mixturethoughts",
                                           "B5_openthoughts"]
    assert cat.partition_keys == [*cat.training_partition_keys, "eval-word_problems"]
    assert cat.target.model == "demo" and cat.target.is_demo
    assert cat.server.urls == [] and cat.server.launch == "embedded"
    fmts = {k: cat.partitions[k].sources[0].format for k in cat.training_partition_keys}
    assert fmts == {"B1_glaive": "glaive", "B2_opencodeinstruct": "opencodeinstruct", "B4_mixturethoughts": "messages",
                    "B5_openthoughts": "sharegpt"}
    assert {k: cat.partitions[k].sampling.max_new_tokens for k in cat.training_partition_keys} == {
        "B1_glaive": 256, "B2_opencodeinstruct": 512, "B4_mixturethoughts": 768, "B5_openthoughts": 768}
    assert all(cat.partitions[k].limit == 48 for k in cat.training_partition_keys)
    # the suite is a partition of its own, answered in both thinking modes, never a training dataset
    suite = cat.partition("eval-word_problems")
    assert suite.prompt_policy == "all_turns" and suite.enable_thinking == "both" and suite.key == "eval-word_problems"
    assert suite.resolved_sources() == [((REPO / "catalogs" / "demo_data" / "U1_word_problems.jsonl").resolve(),
                                         "gsm8k")]
    assert "eval-word_problems" not in cat.dataset_keys and cat.resolve("eval-word_problems") == (
        "eval-word_problems", None, 1)
    assert cat.evaluation.ks(cat.training.acceptance_k) == list(range(1, 9))
    paths = cat.partition("B1_glaive").resolved_sources(check_exists=False)
    assert paths == [((REPO / "catalogs" / "demo_data" / "B1_glaive.json").resolve(), "glaive")]
    assert cat.training.ttt_steps == 7 and cat.training.aux_layer_ids == [1, 2, 3]  # the 4-layer demo target


def test_shared_real_catalog_resolves_to_shared_data(monkeypatch):
    monkeypatch.delenv("EAGLE_SHARED_DATA", raising=False)
    cat = load_catalog(REPO / "catalogs" / "shared-real.yaml")
    assert cat.partition_keys == ["R1_glaive_toolcall", "R2_code_alpaca", "R3_numinamath", "R4_gsm8k", "R5_mtbench",
                                  "R6_bfcl"]
    if not SHARED.exists():
        pytest.skip("../shared/data is absent: cannot check that the sources exist")
    for key in cat.partition_keys:
        ((path, fmt),) = cat.partition(key).resolved_sources()
        assert path.is_file() and path.is_relative_to(SHARED.resolve())
    assert cat.partition("R3_numinamath").resolved_sources()[0][1] == "sharegpt"  # alias numina -> sharegpt


def test_env_expansion_and_relative_paths(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "p1.jsonl").write_text('{"question": "q", "answer": "a"}\n')
    monkeypatch.setenv("MY_SERVER", "http://10.0.0.5:30000")
    cat = load_catalog(_write(tmp_path, MINIMAL + "server: {url: ['${MY_SERVER}', '${OTHER:-http://10.0.0.6:30000}']}\n"))
    assert cat.server.urls == ["http://10.0.0.5:30000", "http://10.0.0.6:30000"]
    assert cat.partition("P1").resolved_sources() == [((tmp_path / "data" / "p1.jsonl").resolve(), "gsm8k")]
    assert cat.path == (tmp_path / "cat.yaml").resolve()
    spec = cat.partition("P1")  # defaults
    assert (spec.prompt_policy, spec.limit, spec.sampling.temperature, spec.thresholds.short_tokens) == (
        "last_user", None, 0.0, 300)


def test_missing_max_new_tokens_names_field_and_fix(tmp_path):
    e = _error(tmp_path, MINIMAL.replace("{max_new_tokens: 64}", "{temperature: 0.7}"))
    assert e.field == "partitions.P1.sampling.max_new_tokens"
    assert "required" in e.problem and "128" in e.fix
    assert str(tmp_path / "cat.yaml") in str(e)


@pytest.mark.parametrize(
    ("text", "field", "needle"),
    [
        (MINIMAL.replace("P1:", "../evil:"), "partitions", "no path separators"),
        (MINIMAL.replace("P1:", "'B 1':"), "partitions", "must match"),
        (MINIMAL.replace("format: gsm8k", "format: csv"), "partitions.P1.sources[0].format", "unknown format 'csv'"),
        (MINIMAL.replace("sampling:", "samplng:"), "partitions.P1.samplng", "did you mean 'sampling'"),
        (MINIMAL.replace("64}", "64, top_k: 0}"), "partitions.P1.sampling.top_k", "top_k must be -1"),
        (MINIMAL.replace("64}", "-5}"), "partitions.P1.sampling.max_new_tokens", "greater than 0"),
        (MINIMAL + "    thresholds: {max_share_short_warn: 0.5, max_share_short_error: 0.4}\n",
         "partitions.P1.thresholds", "warning level"),
        (MINIMAL + "    prompt_policy: random\n", "partitions.P1.prompt_policy", "last_user"),
        (MINIMAL + "    sources: []\n", "partitions.P1.sources", "at least 1"),
        (MINIMAL + "server: {url: '10.0.0.5:30000'}\n", "server.url", "not an http(s) URL"),
        (MINIMAL + "training: {aux_layer_ids: [1, 2]}\n", "training.aux_layer_ids", "three"),
        ("partitions: {}\n", "partitions", "at least 1"),
        (MINIMAL + "server: {url: '${UNSET_VAR_FOR_TEST}'}\n", "server.url", "UNSET_VAR_FOR_TEST is not set"),
        (MINIMAL + "target: {model: demo, profile: {think_begin: '<think>'}}\n", "target.profile",
         "unknown profile override(s) ['think_begin']"),
        (MINIMAL + "    thresholds: {max_share_by_reason: {missing_thinkend: {error: 0.1}}}\n",
         "partitions.P1.thresholds.max_share_by_reason", "unknown drop reason(s) ['missing_thinkend']"),
        (MINIMAL + "    thresholds: {max_share_by_reason: {empty_answer: {warn: 0.3, error: 0.1}}}\n",
         "partitions.P1.thresholds.max_share_by_reason.empty_answer", "warning level"),
        (MINIMAL + "    live: {warmup_rows: 0}\n", "partitions.P1.live.warmup_rows", "greater than 0"),
        (MINIMAL + "training: {mix: {weights: {P1: -1}}}\n", "training.mix.weights", "must be >= 0"),
        (MINIMAL + "training: {mix: {weights: {P2: 1.0}}}\n", "<top level>", "unknown partition(s) ['P2']"),
        (MINIMAL + "training: {mix: {bucket_caps: [{below_tokens: 300, max_share: 1.5}]}}\n",
         "training.mix.bucket_caps[0].max_share", "less than or equal to 1"),
        (MINIMAL + "evaluation: {k: [0, 3]}\n", "evaluation.k", "must be >= 1"),
        (MINIMAL + "evaluation: {position_buckets: [512, 256]}\n", "evaluation.position_buckets", "ascending"),
        (MINIMAL + "evaluation: {suites: {'a b': {sources: [{path: x.jsonl}]}}}\n", "evaluation.suites",
         "partition key 'eval-a b'"),
        (MINIMAL.replace("P1:", "eval-s:") + "evaluation: {suites: {s: {sources: [{path: x.jsonl}]}}}\n",
         "<top level>", "['eval-s'] are also dataset keys"),
        (MINIMAL + "evaluation: {suites: {s: {sources: [{path: x.jsonl}], thinking: sometimes}}}\n",
         "evaluation.suites.s.thinking", "'on', 'off', 'both' or 'default'"),
        (MINIMAL + "evaluation: {suites: {s: {sources: [{path: x.jsonl}], tau_warn: 0.5}}}\n",
         "evaluation.suites.s.tau_warn", "greater than or equal to 1"),
    ],
)
def test_validation_errors(tmp_path, monkeypatch, text, field, needle):
    monkeypatch.delenv("UNSET_VAR_FOR_TEST", raising=False)
    if "sources: []" in text:  # a duplicate key in YAML: the last one wins
        assert yaml.safe_load(text)["partitions"]["P1"]["sources"] == []
    e = _error(tmp_path, text)
    assert e.field == field, str(e)
    assert needle in str(e)


def test_file_level_errors(tmp_path):
    with pytest.raises(CatalogError, match="does not exist"):
        load_catalog(tmp_path / "nope.yaml")
    e = _error(tmp_path, "partitions:\n  P1: [unclosed\n")
    assert "invalid YAML" in e.problem and e.field.startswith("line ")
    e = _error(tmp_path, "- a\n- b\n")
    assert e.field == "<top level>"


def test_missing_source_and_unknown_partition(tmp_path):
    cat = load_catalog(_write(tmp_path, MINIMAL))
    with pytest.raises(CatalogError) as e:
        cat.partition("P1").resolved_sources()
    assert e.value.field == "partitions.P1.sources[0].path" and "p1.jsonl" in e.value.problem
    with pytest.raises(CatalogError, match=r"known partitions: \['P1'\]"):
        cat.partition("P2")


def test_default_catalog_path(monkeypatch, tmp_path):
    monkeypatch.delenv("EAGLE_ASSETS_CATALOG", raising=False)
    assert default_catalog_path() == repo_root() / "catalogs" / "default.yaml" == REPO / "catalogs" / "default.yaml"
    monkeypatch.setenv("EAGLE_ASSETS_CATALOG", str(tmp_path / "x.yaml"))
    assert default_catalog_path() == tmp_path / "x.yaml"


def test_default_catalog_sources_load():
    cat = load_catalog(REPO / "catalogs" / "default.yaml")
    for key in cat.training_partition_keys:
        ((path, fmt),) = cat.partition(key).resolved_sources(check_exists=False)
        if not path.exists():
            pytest.skip(f"{path} is not generated yet (python -m eagle_assets.demo.raw_samples writes it)")
        recs = list(load_records(path, fmt))
        good = [r for r in recs if isinstance(r, Conversation)]
        bad = [r for r in recs if not isinstance(r, Conversation)]
        assert len(recs) >= 48 and len(recs) - len(good) <= 2, (key, bad)


def test_the_readme_walkthrough_catalog_loads_and_asks_nothing_of_the_reader(tmp_path):
    """The README's "Bring your own data" catalog is valid as written, once its source path points at a file."""
    from pathlib import Path

    import yaml

    from eagle_assets.catalog import load_catalog

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = readme[readme.index("## Bring your own data"):].split("```yaml\n", 1)[1].split("```", 1)[0]
    source = tmp_path / "my_chat.jsonl"
    source.write_text('{"messages": [{"role": "user", "content": "Hi"}]}\n')
    suite = tmp_path / "my_eval.jsonl"
    suite.write_text('{"turns": "What is 2 + 2?"}\n')
    path = tmp_path / "mine.yaml"
    path.write_text("\n".join(l[3:] if l.startswith("   ") else l for l in block.splitlines())
                    .replace("/data/my_chat.jsonl", str(source)).replace("/data/my_eval.jsonl", str(suite)))
    catalog = load_catalog(path)
    assert catalog.partition_keys == ["my_chat", "eval-my_eval"] and catalog.target.model == "demo"
    assert catalog.training_partition_keys == ["my_chat"]
    # one suite, answered with thinking on and with thinking off
    assert list(catalog.evaluation.suites) == ["my_eval"]
    assert catalog.evaluation.suites["my_eval"].modes == ("on", "off")
    for key in catalog.partition_keys:
        assert catalog.partition(key).resolved_sources()  # every source path the reader replaces exists
    assert catalog.training.aux_layer_ids == [1, 2, 3] and catalog.warnings() == []
    assert catalog.evaluation is not None and catalog.evaluation.heldout  # the held-out table, suites or not
    assert yaml.safe_load(path.read_text())["partitions"]["my_chat"]["sources"][0]["format"] == "auto"


def test_the_guide_catalog_example_is_a_valid_catalog():
    """The guide's catalog-format block uses only fields the schema knows (it drifted once: epochs 2, lr 3e-4)."""
    from pathlib import Path

    import yaml

    from eagle_assets.catalog import PartitionSpec, TrainingSpec

    text = (Path(__file__).resolve().parents[1] / "docs" / "guide.md").read_text()
    block = text[text.index("## The catalog format"):].split("```yaml\n", 1)[1].split("```", 1)[0]
    example = yaml.safe_load(block)
    training = TrainingSpec(**example["training"])
    assert training.features.source == "local" and training.launcher == "inline"
    assert all(PartitionSpec(**spec) for spec in example["partitions"].values())


def test_training_drafter_choice_resolves_per_target_class():
    """``training.drafter``: auto -> llama (3.1 switches off) for a Qwen3 target, mla (switches on, dims from its
    config) for a Kimi-K2.5 one; what SGLang would not serve is refused at catalog load."""
    from pydantic import ValidationError

    from eagle_assets.catalog import TrainingSpec
    from eagle_assets.drafter.eagle3.model import DrafterConfig
    from eagle_assets.drafter.training.recipe import config_from_catalog

    arch = config_from_catalog(TrainingSpec()).drafter
    qwen3 = {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 96, "vocab_size": 300,
             "model_type": "qwen3", "head_dim": 16}
    kimi = {"model_type": "kimi_k25", "text_config": {**qwen3, "model_type": "kimi_k2", "q_lora_rank": 48,
                                                        "kv_lora_rank": 32, "qk_nope_head_dim": 16,
                                                        "qk_rope_head_dim": 8, "v_head_dim": 16}}
    llama = DrafterConfig.from_target(qwen3, 100, [1, 2, 3], arch=arch)
    assert (llama.architecture, llama.fc_norm, llama.norm_output) == ("llama", False, False)
    mla = DrafterConfig.from_target(kimi, 100, [1, 2, 3], arch=arch)
    assert (mla.architecture, mla.fc_norm, mla.norm_output, mla.kv_lora_rank, mla.rotary_dim) == \
        ("mla", True, True, 32, 8)
    forced = config_from_catalog(TrainingSpec(drafter={"architecture": "llama", "num_hidden_layers": 2})).drafter
    assert DrafterConfig.from_target(kimi, 100, [1, 2, 3], arch=forced).num_hidden_layers == 2
    with pytest.raises(ValueError, match="an MLA draft needs"):
        DrafterConfig.from_target(qwen3, 100, [1, 2, 3], arch=config_from_catalog(
            TrainingSpec(drafter={"architecture": "mla"})).drafter)
    for bad, needle in (({"architecture": "mla", "window": 64}, "Llama draft only"),
                        ({"architecture": "mla", "num_hidden_layers": 2}, "exactly one layer"),
                        ({"architecture": "llama", "window": 4}, "shorter than the 7 draft steps")):
        with pytest.raises(ValidationError, match=needle):
            TrainingSpec(drafter=bad)


def test_training_compare_trains_each_entry_with_the_training_section_and_refuses_what_cannot_train(tmp_path):
    """``training.compare``: each entry is the training section with its drafter (and aux ids) swapped in, every
    cross-field rule applied to it at load, named ``training.compare.<label>``; the comparison asset joins
    ``training_job`` and ``evaluation_job``; what cannot be measured side by side is refused."""
    import dagster as dg

    from eagle_assets.definitions import EVALUATION_JOB, TRAINING_JOB, build_definitions

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "p1.jsonl").write_text('{"question": "2+2?"}\n')
    text = MINIMAL + ("training:\n  aux_layer_ids: [1, 2, 3]\n  compare:\n"
                      "    spark: {architecture: dspark, block_size: 3}\n"
                      "    flash5: {architecture: dflash, aux_layer_ids: [1, 2, 3, 4, 5]}\n"
                      "    three_one: {architecture: llama, fc_norm: true, norm_output: true}\n")
    cat = load_catalog(_write(tmp_path, text))
    spark, flash, three = (cat.training.for_compared(k) for k in ("spark", "flash5", "three_one"))
    assert (spark.drafter.architecture, spark.drafter.block_size, spark.aux_layer_ids) == ("dspark", 3, [1, 2, 3])
    assert flash.aux_layer_ids == [1, 2, 3, 4, 5] and three.drafter.fc_norm and three.compare == {}
    assert (spark.lr, spark.train_tokens, spark.mix) == (cat.training.lr, cat.training.train_tokens,
                                                         cat.training.mix)
    defs = build_definitions(tmp_path / "cat.yaml", storage_root=tmp_path / "store")
    compared = dg.AssetKey("drafter_comparison")
    assert compared in defs.resolve_job_def(TRAINING_JOB).asset_layer.selected_asset_keys
    assert compared in defs.resolve_job_def(EVALUATION_JOB).asset_layer.selected_asset_keys
    plain = build_definitions(_write(tmp_path, MINIMAL, "plain.yaml"), storage_root=tmp_path / "store")
    assert compared not in plain.resolve_job_def(TRAINING_JOB).asset_layer.selected_asset_keys
    for entry, needle in (("x: {architecture: auto}", "training.compare.x: architecture auto"),
                          ("x: {architecture: dflash, fc_norm: true}", r"training.compare.x: \['fc_norm'\] are "
                                                                       "EAGLE-3 settings"),
                          ("x: {architecture: llama, aux_layer_ids: [1, 2]}", "training.compare.x does not train.*"
                                                                              "three non-negative"),
                          ("../x: {architecture: llama}", "names a folder"),
                          ("drafter: {architecture: llama}", "'drafter' is taken"),
                          ("report.md: {architecture: llama}", "'report.md' is taken"),
                          ("x: {architecture: llama, lr: 0.001}",
                           "training.compare.x.lr: is a training setting, not a field of a training.compare entry")):
        err = _error(tmp_path, MINIMAL + f"training:\n  compare:\n    {entry}\n")
        assert re.search(needle, str(err)), str(err)
    err = _error(tmp_path, MINIMAL + "evaluation: null\ntraining:\n  compare: {x: {architecture: dspark}}\n")
    assert "training.compare measures each drafter with the evaluation section" in str(err)


def test_a_suite_is_a_partition_never_trained_on(tmp_path):
    """A suite resolves as partition ``eval-<suite>`` with its own spec (``all_turns``, its thinking modes), is a
    Dagster partition key after the datasets', and is neither a dataset nor a training partition."""
    (tmp_path / "q.jsonl").write_text('{"turns": ["hi", "and then?"]}\n')
    cat = load_catalog(_write(tmp_path, MINIMAL + (
        "evaluation:\n  suites:\n    mt: {sources: [{path: q.jsonl, format: mtbench}], thinking: off,\n"
        "         sampling: {max_new_tokens: 32, temperature: 0.7}, limit: 5}\n")))
    assert cat.partition_keys == ["P1", "eval-mt"] and cat.training_partition_keys == ["P1"]
    assert cat.dataset_keys == ["P1"] and cat.dataset_partition_keys("eval-mt") == ["eval-mt"]
    spec = cat.partition("eval-mt")
    assert (spec.key, spec.dataset, spec.prompt_policy, spec.enable_thinking, spec.limit) == (
        "eval-mt", "eval-mt", "all_turns", False, 5)
    assert spec.resolved_sources() == [((tmp_path / "q.jsonl").resolve(), "mtbench")]
    assert cat.evaluation.suites["mt"].modes == ("off",) and cat.evaluation.ks(7) == [1, 2, 3, 4, 5, 6, 7, 8]
    with pytest.raises(CatalogError, match="no such partition"):
        cat.partition("eval-other")


def test_every_catalog_gets_an_evaluation_unless_it_says_null_or_serves_its_features(tmp_path):
    """No ``evaluation`` section: the defaults (held-out rows at k = 1..8, no suites), so the evaluation asset and
    ``evaluation_job`` exist; ``evaluation: null`` has none, and neither has a catalog whose features are served
    (the asset runs the target in its own process) unless it asks for one."""
    import dagster as dg

    from eagle_assets.definitions import EVALUATION_JOB, TRAINING_JOB, build_definitions

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "p1.jsonl").write_text('{"question": "2+2?"}\n')
    plain = load_catalog(_write(tmp_path, MINIMAL))
    assert plain.evaluation.heldout and plain.evaluation.suites == {} and plain.suite_keys == []
    assert plain.evaluation.ks(plain.training.acceptance_k) == list(range(1, 9))
    defs = build_definitions(tmp_path / "cat.yaml", storage_root=tmp_path / "store")
    evaluation = dg.AssetKey("evaluation")
    assert evaluation in defs.resolve_job_def(TRAINING_JOB).asset_layer.selected_asset_keys
    assert defs.resolve_job_def(EVALUATION_JOB).asset_layer.selected_asset_keys == {evaluation}
    assert load_catalog(_write(tmp_path, MINIMAL + "evaluation: null\n", "off.yaml")).evaluation is None
    served = MINIMAL + "training: {features: served}\n"
    assert load_catalog(_write(tmp_path, served, "served.yaml")).evaluation is None
    asked = served + "evaluation: {k: [7]}\n"
    assert load_catalog(_write(tmp_path, asked, "asked.yaml")).evaluation.k == [7]


def test_a_legacy_unseen_eval_becomes_a_suite_and_says_so(tmp_path):
    """``training.unseen_eval`` (the old side path) loads as the evaluation suite ``unseen``: a partition of its
    own, greedy, its thinking from ``enable_thinking``; a note names what it became. A suite that already reads its
    sources measures them: then it is only dropped, with a note. Held-back cases: an existing suite named
    ``unseen`` and an invalid legacy spec are refused naming the field."""
    (tmp_path / "u.jsonl").write_text('{"question": "2+2?", "answer": "4"}\n')
    legacy = ("training:\n  unseen_eval: {description: word problems, sources: [{path: u.jsonl, format: gsm8k}],\n"
              "                enable_thinking: false, max_new_tokens: 96, limit: 7}\n")
    cat = load_catalog(_write(tmp_path, MINIMAL + legacy))
    assert cat.partition_keys == ["P1", "eval-unseen"] and cat.training_partition_keys == ["P1"]
    suite = cat.evaluation.suites["unseen"]
    assert (suite.description, suite.thinking, suite.limit) == ("word problems", "off", 7)
    assert (suite.sampling.max_new_tokens, suite.sampling.temperature) == (96, 0.0)
    assert cat.partition("eval-unseen").resolved_sources() == [((tmp_path / "u.jsonl").resolve(), "gsm8k")]
    assert [w for w in cat.warnings() if "is now the evaluation suite 'unseen'" in w]
    assert not hasattr(cat.training, "unseen_eval")

    measured = legacy + ("evaluation:\n  suites:\n    words: {sources: [{path: u.jsonl, format: gsm8k}]}\n")
    cat = load_catalog(_write(tmp_path, MINIMAL + measured, "measured.yaml"))
    assert list(cat.evaluation.suites) == ["words"]
    assert [w for w in cat.warnings() if "measured by the evaluation suite words" in w and "dropped" in w]
    quiet = load_catalog(_write(tmp_path, MINIMAL + "training: {unseen_eval: null}\n", "null.yaml"))
    assert not (quiet.evaluation and quiet.evaluation.suites)
    assert not [w for w in quiet.warnings() if "unseen_eval" in w]

    taken = legacy + ("evaluation:\n  suites:\n    unseen: {sources: [{path: q.jsonl, format: mtbench}]}\n")
    with pytest.raises(CatalogError, match=r"training.unseen_eval.*already has one"):
        load_catalog(_write(tmp_path, MINIMAL + taken, "taken.yaml"))
    with pytest.raises(CatalogError, match=r"training.unseen_eval.*max_new_token"):
        load_catalog(_write(tmp_path, MINIMAL + "training:\n  unseen_eval: {sources: [{path: u.jsonl}], "
                                                "max_new_token: 9}\n", "typo.yaml"))


def test_block_drafters_train_on_served_features_and_under_torchrun_but_dspark_not_on_served(tmp_path):
    """DFlash and DSpark train under ``launcher: torchrun``, DFlash also on ``features: served`` with any number of
    target layers (the three-id rule is EAGLE-3's); DSpark on served features is refused, saying why."""
    from eagle_assets.catalog import TrainingSpec

    flash = TrainingSpec(drafter={"architecture": "dflash"}, features="served", launcher="torchrun",
                         nproc_per_node=2, aux_layer_ids=[1, 3, 4, 5, 6])
    assert (flash.features.source, flash.launcher, flash.aux_layer_ids) == ("served", "torchrun", [1, 3, 4, 5, 6])
    assert TrainingSpec(drafter={"architecture": "dspark"}, launcher="torchrun").launcher == "torchrun"
    with pytest.raises(ValueError, match="a dspark drafter trains with features: local: its L1 term .* never that "
                                         "state"):
        TrainingSpec(drafter={"architecture": "dspark"}, features={"source": "served", "teacher": "topk"})
    with pytest.raises(ValueError, match="three non-negative layer ids \\(an EAGLE-3 drafter"):
        TrainingSpec(aux_layer_ids=[1, 3, 4, 5, 6])
