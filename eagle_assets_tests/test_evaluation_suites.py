"""The ``evaluation`` asset through real Dagster: suites run as ``eval-<suite>`` partitions (the embedded target
answers every prompt with thinking on and off, QC keeps the well-formed replies), a drafter trained on thinking
rows is measured on them, and the figures it reports are recomputed here from the stored rows by a walk of our own
(plain target forwards on every exact prefix: no reuse of the row's greedy ids, no 4-D mask, our own sampling
distribution and visit probabilities)."""

import json
from pathlib import Path

import dagster as dg
import numpy as np
import pytest
import torch
import yaml

from eagle_assets.definitions import PARTITION_JOB, build_definitions
from eagle_assets.storage.shards import read_shards
from eagle_assets_tests.dagster_runs import materialize_training

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA = REPO_ROOT / "catalogs" / "demo_data"
pytestmark = pytest.mark.slow(seconds=90)  # four partitions, one small training, the evaluation and its recomputation

# sampling of the word-problem suite: T = 1.0 with a top_k and a top_p, so the recomputation covers both cuts
SAMPLING = {"max_new_tokens": 256, "temperature": 1.0, "top_p": 0.9, "top_k": 12}


def _catalog(tmp: Path, server_url: str) -> Path:
    base = yaml.safe_load((REPO_ROOT / "catalogs" / "default.yaml").read_text())
    base["server"]["url"] = server_url
    parts = {}
    for key in ("B4_mixturethoughts", "B5_openthoughts"):
        spec = base["partitions"][key]
        spec["sources"] = [{"path": str(DATA / Path(spec["sources"][0]["path"]).name),
                            "format": spec["sources"][0]["format"]}]
        spec["limit"] = 12 if key == "B4_mixturethoughts" else 16  # B5's 16: the overlapping suite's source
        parts[key] = spec
    base["partitions"] = parts
    base["training"].update({"train_tokens": 32000, "holdout_fraction": 0.25, "holdout_rows": 4, "validation_rows": 0,
                             "eval_every_tokens": 0, "patience": 0, "unseen_eval": None})
    base["training"]["mix"]["bucket_caps"] = []
    # thinking on is what the drafter trained on (the demo target's default); off is what it never saw
    words = base["evaluation"]["suites"]["word_problems"]
    words.update({"sources": [{"path": str(DATA / "U1_word_problems.jsonl"), "format": "gsm8k"}], "limit": 12,
                  "sampling": SAMPLING, "tau_warn": 1.3, "min_tau_margin": 0.2})
    # QC fails this suite whatever the replies (every reply is under short_tokens, the error level is 0): its
    # figures stand on a failed QC, which the report, the gates and the CLI must say (thresholds never change
    # which replies QC keeps, so the figures below are the same as under the catalog's levels)
    words["thresholds"] = {**words["thresholds"], "short_tokens": 100000, "max_share_short_warn": 0.0,
                           "max_share_short_error": 0.0}
    # B5's source again: a suite's limit picks its own records (keyed by its name), so some of them are B5's
    # training rows
    seen = {"description": "B5's source again", "sources": [parts["B5_openthoughts"]["sources"][0]], "limit": 16,
            "thinking": "default", "sampling": {"max_new_tokens": 768, "temperature": 0.0},
            "thresholds": parts["B5_openthoughts"]["thresholds"]}
    base["evaluation"] = {"k": [1, 3, 7], "heldout": True, "position_buckets": [128, 256],
                          "suites": {"words": words, "seen": seen}}
    path = tmp / "catalog.yaml"
    path.write_text(yaml.safe_dump(base))
    return path


@pytest.fixture(scope="module")
def evaluated(demo_target, tmp_path_factory, one_thread):
    from eagle_assets.serving.launch import launched_server

    tmp = tmp_path_factory.mktemp("suites")
    with launched_server(str(demo_target), log_dir=tmp / "server") as server, \
            dg.DagsterInstance.ephemeral() as instance:
        defs = build_definitions(_catalog(tmp, server.url), storage_root=tmp / "store")
        job = defs.resolve_job_def(PARTITION_JOB)
        for key in ("B4_mixturethoughts", "B5_openthoughts", "eval-words", "eval-seen"):
            run = job.execute_in_process(partition_key=key, instance=instance, raise_on_error=False)
            assert run.success == (key != "eval-words"), key  # the words suite's blocking check fails (above)
    trained, logs = materialize_training(defs)
    assert trained.success, logs[-20:]
    result, logs = materialize_training(defs, ("evaluation",))
    assert result.success, logs[-20:]
    return defs, trained, result, tmp / "store" / "catalog"


def _checks(result) -> dict:
    return {e.check_name: e for e in result.get_asset_check_evaluations()}


def _suite_rows(store: Path, suite: str, mode: str) -> list[tuple[np.ndarray, int]]:
    """``(input_ids, n_prompt_tokens)`` of a suite's stored QC rows of one thinking mode, by sample id."""
    t = read_shards(store / "qc_shards" / f"eval-{suite}", ["sample_id", "input_ids", "n_prompt_tokens"]).to_pylist()
    t = sorted((r for r in t if r["sample_id"].split(":")[-2] == mode), key=lambda r: r["sample_id"])
    return [(np.asarray(r["input_ids"], np.int64), r["n_prompt_tokens"]) for r in t]


def _models(store: Path, demo_target: Path):
    from transformers import AutoModelForCausalLM

    from eagle_assets.drafter.eagle3.export import load_drafter

    target = AutoModelForCausalLM.from_pretrained(demo_target, dtype="float32").eval()
    drafter, _ = load_drafter(store / "drafter_checkpoint" / "checkpoint", target)
    return target, drafter.eval()


@torch.no_grad()
def _chain(target, drafter, ids: np.ndarray, k: int) -> np.ndarray:
    """``[T, k]``: the drafter's chain after each position (row ``n - 1`` drafts tokens ``n + 1 ..``)."""
    from eagle_assets.drafter.features.local_capture import run_target

    x = torch.from_numpy(ids)
    aux, _ = run_target(target, x, drafter.config.aux_capture_ids)
    _, drafts = drafter.unroll(aux, x[None], k, feed_own_tokens=True)
    return torch.stack([d[0] for d in drafts], dim=-1).numpy()


@torch.no_grad()
def _logits(target, prefix: list[int]) -> np.ndarray:
    return target(torch.tensor([prefix])).logits[0].double().numpy()


@torch.no_grad()
def _batch_logits(target, prefixes: list[list[int]]) -> list[np.ndarray]:
    """Each prefix's logits, the prefixes right-padded into one batch (causal attention never sees the padding)."""
    width = max(len(p) for p in prefixes)
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prefixes])
    out = target(ids).logits.double().numpy()
    return [out[i, : len(p)] for i, p in enumerate(prefixes)]


def _distribution(logits: np.ndarray, t: float, top_p: float, top_k: int) -> np.ndarray:
    """softmax(logits / t) cut to the top_k largest, then to the smallest head whose mass reaches top_p."""
    x = logits / t
    keep = x >= np.sort(x)[-top_k]
    p = np.where(keep, np.exp(x - x.max()), 0.0)
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    before = np.cumsum(p[order]) - p[order]
    cut = np.zeros_like(p, dtype=bool)
    cut[order[before >= top_p]] = True
    p[cut] = 0.0
    return p / p.sum()


def _record(store: Path, **want) -> dict:
    records = json.loads((store / "evaluation" / "report.json").read_text())["records"]
    found = [r for r in records if all(r[k] == v for k, v in want.items())]
    assert len(found) == 1, (want, len(found))
    return found[0]


def test_greedy_tau_is_an_exact_walk_over_the_stored_rows(evaluated, demo_target):
    """Greedy tau at k=3 on the thinking-on rows, walked with a target forward on every exact prefix."""
    _defs, _trained, _result, store = evaluated
    target, drafter = _models(store, demo_target)
    k, tokens, verifications = 3, 0, 0
    rows = _suite_rows(store, "words", "on")
    for ids, n_prompt in rows:
        chain = _chain(target, drafter, ids, k)
        n, end = n_prompt, len(ids)
        while n <= end - 2:
            accepted: list[int] = []
            for j in range(min(k, end - 1 - n)):
                want = int(_logits(target, ids[: n + 1].tolist() + accepted)[-1].argmax())
                if int(chain[n - 1, j]) != want:
                    break
                accepted.append(want)
            tokens += len(accepted) + 1
            verifications += 1
            n += len(accepted) + 1
    r = _record(store, suite="words", thinking="on", k=k, temperature=0.0)
    assert r["rows"] == len(rows) > 0 and r["verifications"] == verifications
    assert r["tau"] == round(tokens / verifications, 6)


def test_sampled_tau_is_the_exact_expectation_under_sglang_verification(evaluated, demo_target):
    """tau at T=1.0 (top_k, top_p) recomputed: every point's acceptance probabilities from a plain forward over
    its prefix and its own drafts (right-padded batches, no 4-D mask), the visit probabilities of the random walk,
    expected tokens over expected verifications. Stated error: float rounding of the forwards (1e-6)."""
    _defs, _trained, _result, store = evaluated
    target, drafter = _models(store, demo_target)
    k, temp = 7, SAMPLING["temperature"]
    tokens = verifications = 0.0
    reach_sum = np.zeros(k)
    for ids, n_prompt in _suite_rows(store, "words", "on"):
        chain = _chain(target, drafter, ids, k)
        end = len(ids)
        visit = np.zeros(end + 1)
        visit[n_prompt] = 1.0
        points = list(range(n_prompt, end - 1))
        drafts = {n: [int(chain[n - 1, j]) for j in range(min(k, end - 1 - n))] for n in points}
        logits = {}
        for start in range(0, len(points), 32):  # every point's prefix and its own drafts, 32 to a forward
            batch = points[start:start + 32]
            for n, lg in zip(batch, _batch_logits(target, [ids[: n + 1].tolist() + drafts[n][:-1] for n in batch])):
                logits[n] = lg[n:]
        for n in points:
            lim = len(drafts[n])
            p = [_distribution(logits[n][j], temp, SAMPLING["top_p"], SAMPLING["top_k"])[drafts[n][j]]
                 for j in range(lim)]
            reach = np.cumprod(p)  # P(A >= j)
            verifications += visit[n]
            tokens += visit[n] * (1.0 + reach.sum())
            reach_sum[:lim] += visit[n] * reach
            exactly = np.append(1.0, reach) - np.append(reach, 0.0)  # P(A = a), a = 0..lim
            for a, pa in enumerate(exactly):
                if n + a + 1 <= end - 2:
                    visit[n + a + 1] += visit[n] * pa
    r = _record(store, suite="words", thinking="on", k=k, temperature=temp)
    assert r["tau"] == pytest.approx(tokens / verifications, rel=1e-6, abs=1e-6)
    assert r["per_position"] == pytest.approx(list(reach_sum / verifications), abs=1e-5)
    assert 1.0 < r["tau"] < k + 1 and r["ci_low"] < r["tau"] < r["ci_high"]


def test_thinking_off_is_flagged_while_thinking_on_passes(evaluated):
    _defs, _trained, result, store = evaluated
    checks = _checks(result)
    on, off = checks["tau_words_on"], checks["tau_words_off"]
    assert on.passed, on.description
    assert not off.passed and off.severity == dg.AssetCheckSeverity.ERROR, off.description
    assert "thinking off" in off.description
    tau_on = _record(store, suite="words", thinking="on", k=7, temperature=0.0)["tau"]
    tau_off = _record(store, suite="words", thinking="off", k=7, temperature=0.0)["tau"]
    assert tau_off <= 1.2 < 1.3 <= tau_on  # error at or under 1 + min_tau_margin, warn under tau_warn
    # the same figures in the UI's table and on disk beside the plot
    md = (store / "evaluation" / "report.md").read_text()
    assert "| words (QC failed) | off | 0 |" in md and "| words (QC failed) | on | 1 |" in md
    assert (store / "evaluation" / "tau_vs_k.png").read_bytes()[:4] == b"\x89PNG"


def test_overlap_with_training_rows_is_counted(evaluated):
    """Every suite row whose prompt ids are those of a training-split row of the trained partitions."""
    from eagle_assets.catalog import load_catalog
    from eagle_assets.drafter.data.splits import row_splits

    defs, _trained, result, store = evaluated
    catalog = load_catalog(defs.resources["settings"].catalog_path)
    b5 = read_shards(store / "qc_shards" / "B5_openthoughts", ["sample_id", "input_ids", "n_prompt_tokens"]).to_pylist()
    split = row_splits([r["sample_id"] for r in b5], catalog.training)
    trained = {tuple(r["input_ids"][: r["n_prompt_tokens"]]) for r in b5 if split[r["sample_id"]] == "train"}
    seen = read_shards(store / "qc_shards" / "eval-seen", ["input_ids", "n_prompt_tokens"]).to_pylist()
    expected = sum(tuple(r["input_ids"][: r["n_prompt_tokens"]]) in trained for r in seen)
    report = json.loads((store / "evaluation" / "report.json").read_text())
    assert report["overlap_rows"] == {"words": 0, "seen": expected} and expected >= 3
    check = _checks(result)["tau_seen_default"]
    assert f"{expected} rows share prompt ids with training rows" in check.description
    assert check.metadata["overlap_rows"].value == expected


def test_heldout_greedy_tau_is_the_acceptance_length_figure(evaluated):
    """The held-out k=7 figure is the acceptance_length check's, for the same drafter and rows."""
    _defs, trained, _result, store = evaluated
    acceptance = _checks(trained)["acceptance_length"]
    r = _record(store, suite="heldout", thinking="default", k=7, temperature=0.0)
    assert round(r["tau"], 4) == round(acceptance.metadata["mean_tau"].value, 4)
    assert [r["k"] for r in json.loads((store / "evaluation" / "report.json").read_text())["records"]
            if r["suite"] == "heldout"] == [1, 3, 7]
    # acceptance by position in the sequence: the buckets split the same verifications, the training length
    # (max_length 2048) is an edge and no row reaches it
    assert sum(b["verifications"] for b in r["position_buckets"]) == r["verifications"]
    assert [b["from"] for b in r["position_buckets"]] == [0, 128, 256]
    assert not any(b["past_training_length"] for b in r["position_buckets"])


def test_a_suite_whose_qc_failed_is_marked_in_the_report_the_gates_and_the_cli(evaluated):
    """The words suite's QC failed (response_length ERROR): report.json says so with its kept / dropped replies as
    qc_status.json has them, report.md marks its rows and tables the verdicts, its gates' text and checks name it,
    and the lines the CLI prints above the report say it; the seen suite passed and carries no mark."""
    from eagle_assets.drafter.evaluation.suites import stands_on_lines

    _defs, _trained, result, store = evaluated
    status = json.loads((store / "qc_shards" / "eval-words" / "qc_status.json").read_text())
    assert status["verdict"] == "failed" and status["response_length"] == "ERROR"
    report = json.loads((store / "evaluation" / "report.json").read_text())
    words, seen = report["qc"]["words"], report["qc"]["seen"]
    assert (words["verdict"], words["blocking_check"], words["kept"], words["rows"]) == \
        ("failed", "response_length", status["kept"], status["rows"])
    assert words["dropped"] == status["rows"] - status["kept"] and words["kept"] > 0
    assert words["finding"] == "response_length: share_under_short = 1 > threshold 0"
    assert seen["verdict"] in ("passed", "warned") and seen["partition"] == "eval-seen"
    stands = (f"suite QC failed (response_length: share_under_short = 1 > threshold 0); kept {words['kept']} of "
              f"{words['rows']} replies, {words['dropped']} dropped")
    gates = {(g["suite"], g["thinking"]): g for g in report["gates"]}
    assert all(gates[("words", m)]["text"].endswith(stands) for m in ("on", "off"))
    assert "suite QC" not in gates[("seen", "default")]["text"]
    checks = _checks(result)
    assert checks["tau_words_off"].description.endswith(stands)
    assert checks["tau_words_on"].metadata["suite_qc"].value.startswith("failed (response_length")
    md = (store / "evaluation" / "report.md").read_text()
    assert (f"| words | eval-words | failed | {words['kept']} | {words['dropped']} | response_length: "
            "share_under_short = 1 > threshold 0 |") in md
    assert "| seen (QC" not in md and "| seen | default |" in md
    assert {k: v["verdict"] for k, v in report["heldout_qc"].items()} == \
        {"B4_mixturethoughts": "passed", "B5_openthoughts": "passed"}
    lines = stands_on_lines(report)  # suites by name, as report.json keeps them
    assert lines[1] == (f"suite words: QC failed (response_length: share_under_short = 1 > threshold 0); kept "
                        f"{words['kept']} of {words['rows']} replies, {words['dropped']} dropped; its figures are "
                        "on the replies QC kept")
    assert lines[0].startswith(f"suite seen: QC {seen['verdict']}")
    assert lines[2] == "held-out rows from: B4_mixturethoughts QC passed, B5_openthoughts QC passed"
