"""What ``eagle-assets run`` prints tells what ran, as a user reads it: three runs of the CLI on one small catalog
(a real Dagster instance in a fresh ``DAGSTER_HOME``, the embedded target served over HTTP, real Parquet), then the
UI command it printed, run as printed.

1. against the live server: partition ``few`` (code prompts cut at 170 tokens: QC drops most replies) and
   ``counted`` (a file with a broken line 6 and duplicates, cut to a ``limit`` sample);
2. the same catalog pointed at a dead URL: nothing is pending, so no server is asked, and the summary says so;
3. the dead URL with other sampling settings for ``few`` alone: generations fails, QC does not run, and no QC line
   of the earlier runs is printed as if it had.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

pytestmark = pytest.mark.slow(seconds=60)  # its share of a parallel session: scheduled early (conftest)

REPO_ROOT = Path(__file__).resolve().parents[1]
REFUSING = "http://127.0.0.1:9"  # the discard port: nothing listens there, connections are refused
DISTINCT = [f"Write one sentence about the number {i}." for i in range(20)]


def _counted_source(path: Path) -> Path:
    """27 records: 20 distinct prompts, a broken line 6 and 6 duplicates (of lines 2, 4, 7, 8, 9 and 10)."""
    lines = [json.dumps({"prompt": p}) for p in DISTINCT[:5]] + ["{not json"] \
        + [json.dumps({"prompt": p}) for p in DISTINCT[5:]] + [json.dumps({"prompt": DISTINCT[i]})
                                                                for i in (1, 3, 5, 6, 7, 8)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _catalog(path: Path, url: str, target: Path, few_tokens: int = 170) -> Path:
    base = yaml.safe_load((REPO_ROOT / "catalogs" / "default.yaml").read_text())
    base.pop("evaluation", None)
    base["target"]["model"] = str(target)
    base["server"]["url"] = url
    few = base["partitions"]["B2_opencodeinstruct"]
    few["sources"] = [{"path": str(REPO_ROOT / "catalogs" / "demo_data" / "B2_opencodeinstruct.jsonl"),
                       "format": "opencodeinstruct"}]
    few["limit"] = 10
    few["sampling"]["max_new_tokens"] = few_tokens
    few["live"]["fail_fast"] = False
    # most replies are cut inside their reasoning: WARN, never ERROR, so the partition passes with few rows
    few["thresholds"].update(short_tokens=32, max_share_dropped_error=1.0, max_share_truncated_warn=0.5,
                             max_share_truncated_error=1.0)
    counted = json.loads(json.dumps(few))
    counted["sources"] = [{"path": str(_counted_source(path.parent / "counted.jsonl")), "format": "auto"}]
    counted["limit"] = 4
    counted["sampling"]["max_new_tokens"] = 8
    base["partitions"] = {"few": few, "counted": counted}
    path.write_text(yaml.safe_dump(base))
    return path


@pytest.fixture(scope="module")
def runs(demo_target, tmp_path_factory):
    from eagle_assets.cli import main
    from eagle_assets.serving.launch import launched_server

    tmp = tmp_path_factory.mktemp("cli_summary")
    home, store, catalog = tmp / "home", tmp / "store", tmp / "summ.yaml"
    home.mkdir()
    (home / "dagster.yaml").write_text((REPO_ROOT / "dagster.yaml").read_text())
    out: dict = {"home": home, "store": store / "summ", "catalog": catalog}

    def cli(*args) -> str:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            out.setdefault("rc", []).append(main(["run", "--catalog", str(catalog), "--skip-training", *args]))
        return printed.getvalue()

    with launched_server(str(demo_target), log_dir=tmp / "server") as server, pytest.MonkeyPatch.context() as mp:
        mp.setenv("DAGSTER_HOME", str(home))
        mp.setenv("EAGLE_ASSETS_HOME", str(store))
        mp.setenv("EAGLE_ASSETS_CATALOG", str(catalog))  # the CLI sets it; the context puts the old value back
        _catalog(catalog, server.url, demo_target)
        out["live"] = cli()
        out["few_rows"] = pq.read_table(out["store"] / "qc_shards" / "few" / "rows.parquet",
                                        columns=["kept", "drop_reason"]).to_pylist()
    with pytest.MonkeyPatch.context() as mp:  # the server is gone
        mp.setenv("DAGSTER_HOME", str(home))
        mp.setenv("EAGLE_ASSETS_HOME", str(store))
        mp.setenv("EAGLE_ASSETS_CATALOG", str(catalog))
        _catalog(catalog, REFUSING, demo_target)
        out["dead_idle"] = cli()
        _catalog(catalog, REFUSING, demo_target, few_tokens=171)  # other settings: `few` must generate again
        out["dead_failed"] = cli("--partitions", "few")
    return out


def _block(text: str, key: str) -> list[str]:
    """The status line of partition ``key`` and the indented lines under it."""
    lines = text.splitlines()
    [start] = [i for i, line in enumerate(lines) if line.startswith(f"partition {key}: ")]
    end = start + 1
    while end < len(lines) and lines[end].startswith("  "):
        end += 1
    return lines[start:end]


def test_a_partition_whose_qc_drops_most_replies_says_kept_and_dropped(runs):
    rows = runs["few_rows"]
    kept = sum(r["kept"] for r in rows)
    reasons = Counter(r["drop_reason"] for r in rows if not r["kept"])
    assert len(rows) == 10 and kept < 5, rows  # the case: most replies dropped
    status, *lines = _block(runs["live"], "few")
    warnings = [line for line in lines if " WARN: " in line]
    plural = "" if len(warnings) == 1 else "s"
    assert warnings and status.startswith(
        f"partition few: ok with {len(warnings)} warning{plural} (QC kept {kept} of 10 replies) in "), status
    by_reason = ", ".join(f"{r} {n}" for r, n in sorted(reasons.items(), key=lambda c: (-c[1], c[0])))
    assert (f"  qc_shards: kept {kept} of 10 replies, dropped {10 - kept} ({by_reason}; see "
            f"{runs['store'] / 'qc_shards' / 'few' / 'rows.parquet'}, docs/token-structure.md names each reason)"
            in lines), lines
    assert lines[2].startswith("  generations: 10 replies generated in this run (10 requests to http://127.0.0.1:")
    # one finding per line, each under its own level
    assert "  check qc_shards.token_structure WARN: share_dropped = " + f"{(10 - kept) / 10:.4g} > threshold 0.05" \
        in lines, lines
    assert all(line.count("WARN:") + line.count("ERROR:") == 1 for line in lines if line.startswith("  check "))


def test_counts_add_up_and_every_position_a_person_reads_is_1_based(runs):
    status, raw, *_ = _block(runs["live"], "counted")
    rejects_path = runs["store"] / "raw_prompts" / "counted" / "rejects.parquet"
    # 27 records read = 7 set aside + 20 usable; 4 of those 20 sampled (limit 4)
    assert raw == (f"  raw_prompts: read 27 records; 7 set aside (duplicate 6, bad_json 1; see {rejects_path}); "
                   "4 of the other 20 usable sampled (limit 4)"), raw
    rejects = pq.read_table(rejects_path).to_pylist()
    broken = [r for r in rejects if r["reason"] == "bad_json"]
    assert [(r["source_row"], r["source_line"]) for r in broken] == [(5, 6)]  # the file's line 6
    assert broken[0]["detail"].startswith("line 6: not valid JSON")
    first_dup = next(r for r in rejects if r["reason"] == "duplicate")
    assert (first_dup["source_line"], first_dup["detail"]) == (
        22, f"same record as source_line 2 of {runs['store'].parent.parent / 'counted.jsonl'} (kept)")
    assert all(r["source_line"] == r["source_row"] + 1 for r in rejects)


def test_a_dead_url_with_nothing_pending_is_not_called_fine(runs):
    text = runs["dead_idle"]
    assert runs["rc"][1] == 0
    for key in ("few", "counted"):
        status, *lines = _block(text, key)
        assert re.match(rf"partition {key}: ok with \d+ warnings? \(nothing pending; server not contacted; QC kept ",
                        status), status
        done = 10 if key == "few" else 4
        assert (f"  generations: nothing pending ({done} replies already generated by earlier runs); server not "
                "contacted") in lines, lines
    assert REFUSING not in text  # no line names a server as if it had answered


def test_after_a_failed_generations_step_no_qc_line_of_an_earlier_run_is_printed(runs):
    text = runs["dead_failed"]
    assert runs["rc"][2] == 1
    status, *lines = _block(text, "few")
    assert status.startswith("partition few: FAILED in ")
    assert lines[0].startswith(f"  step generations FAILED -- server {REFUSING} is not serving: ")
    assert lines[1] == "  not run: qc_shards, length_report (a step before them failed)"
    assert not any(line.startswith(("  qc_shards:", "  check qc_shards.")) for line in lines), lines
    assert (runs["store"] / "qc_shards" / "few" / "rows.parquet").exists()  # the earlier run's QC rows are still there
    assert "partition counted" not in text
    assert ("length report: not refreshed (no partition of this command reached it); the last one is "
            f"{runs['store'] / 'length_report' / 'report.md'}") in text
    assert "| partition | span |" not in text  # the earlier run's table is not printed as this run's


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _graphql(port: int, query: str) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/graphql", data=json.dumps({"query": query}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        return json.loads(reply.read())["data"]


def test_the_printed_ui_command_runs_as_printed(runs, tmp_path):
    """The command the first run printed, from another folder, with none of the variables it sets and without
    the venv on PATH: the webserver answers, shows this catalog's runs, and loads the code location."""
    lines = runs["live"].splitlines()
    [at] = [i for i, line in enumerate(lines) if line.startswith("see the runs in the UI")]
    command = lines[at + 1].strip()
    words = shlex.split(command)
    assert words[:3] == ["cd", str(runs["home"]), "&&"]
    assert {"DAGSTER_HOME=" + str(runs["home"]), "EAGLE_ASSETS_CATALOG=" + str(runs["catalog"]),
            "EAGLE_ASSETS_HOME=" + str(runs["store"].parent)} <= set(words)
    dagster = next(w for w in words if w.endswith("/dagster"))
    assert Path(dagster).is_absolute() and os.access(dagster, os.X_OK)
    assert words[-3:] == ["dev", "-w", str(REPO_ROOT / "workspace.yaml")]
    port = _free_port()
    env = {k: v for k, v in os.environ.items()
           if k not in ("DAGSTER_HOME", "EAGLE_ASSETS_CATALOG", "EAGLE_ASSETS_HOME", "VIRTUAL_ENV")}
    env["PATH"] = "/usr/bin:/bin"
    log = tmp_path / "dev.log"
    with open(log, "wb") as fh:
        dev = subprocess.Popen(["bash", "-c", f"{command} -p {port}"], cwd=tmp_path, env=env, stdout=fh,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline, runs_seen, location = time.monotonic() + 180, None, None
        while time.monotonic() < deadline and dev.poll() is None:
            try:
                if runs_seen is None:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=5).read()
                    found = _graphql(port, "{ runsOrError { __typename ... on Runs { results { runId } } } }")
                    runs_seen = len(found["runsOrError"]["results"])
                entries = _graphql(port, "{ workspaceOrError { ... on Workspace { locationEntries { name loadStatus "
                                         "locationOrLoadError { __typename ... on PythonError { message } } } } } }")
                [entry] = entries["workspaceOrError"]["locationEntries"]
                if entry["loadStatus"] == "LOADED":
                    location = entry["locationOrLoadError"]
                    break
            except OSError:
                pass
            time.sleep(1)
        output = log.read_text(errors="replace")
        assert dev.poll() is None, output
        # the CLI's three commands ran 2 + 2 + 1 partition runs into this instance
        assert runs_seen == 5, (runs_seen, output)
        assert location is not None and location["__typename"] == "RepositoryLocation", (location, output)
        assert "will not be used" not in output  # run from DAGSTER_HOME: no dagster.yaml is ignored
    finally:  # the process group this test started: the shell, dagster dev, its webserver, daemon and code server
        with contextlib.suppress(ProcessLookupError):
            os.killpg(dev.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            dev.wait(timeout=20)
        with contextlib.suppress(ProcessLookupError):  # whatever outlived the shell, or was deaf to SIGTERM
            os.killpg(dev.pid, signal.SIGKILL)
        dev.wait(timeout=10)


def test_a_check_with_a_warn_and_an_error_finding_gives_one_line_per_level():
    from eagle_assets.cli import _ok, finding_lines

    both = finding_lines("  check qc_shards.response_length",
                         "WARN: share_under_short = 1 > threshold 0.9; ERROR: share_truncated = 1 > threshold 0.1",
                         "ERROR")
    assert both == ["  check qc_shards.response_length WARN: share_under_short = 1 > threshold 0.9",
                    "  check qc_shards.response_length ERROR: share_truncated = 1 > threshold 0.1"]
    empty = finding_lines("  check qc_shards.token_structure", "the partition is empty: no generated rows to check "
                          "(see its rejects.parquet); ERROR: count = 0 < threshold 1", "ERROR")
    assert empty == ["  check qc_shards.token_structure ERROR: the partition is empty: no generated rows to check "
                     "(see its rejects.parquet)", "  check qc_shards.token_structure ERROR: count = 0 < threshold 1"]
    assert finding_lines("  check raw_prompts.prompts_available", "partition P is empty", "WARN") == [
        "  check raw_prompts.prompts_available WARN: partition P is empty"]
    # a run that succeeded: an ERROR of a check that blocks nothing (an evaluation gate) is said, not hidden by "ok"
    assert _ok([]) == "ok" and _ok(both[:1]) == "ok with 1 warning"
    assert _ok(both + both[:1]) == "ok with 1 ERROR finding and 2 warnings"
