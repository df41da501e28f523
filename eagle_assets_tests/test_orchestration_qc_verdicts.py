"""One QC verdict per partition in the Dagster UI, read in headless Chromium: three partitions answered by the
embedded target (one passes, one warns, one fails its blocking checks), run into a real instance, then shown by
``dagster dev`` on that instance as a user opens it (test_orchestration_live.py's deployment pattern, without the
backfill and the daemon's sensors, so it costs a minute).

What is asserted is what the pages show (text and icons in the DOM): ``qc_shards`` > Partitions with the failing
partition open (Dagster's own status says "Materialized (3)", since the files are on disk; its ``qc_verdict``
entry says failed with the blocking check and finding, and the ``qc_verdicts_as_of_this_run`` table gives every
partition its word), the asset's Overview (the newest run's table), and a check's Partitions tab with each
partition open in turn (Dagster's Passed / Failed tag, a warning icon for the WARN finding and a cancel icon for
the ERROR one, and the partition's verdict in the check's metadata). The screenshots go to
``$EAGLE_ASSETS_SCREENSHOTS`` when it is set (docs/screenshots/ comes from there).
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import pytest
import yaml
from dagster._core.instance.ref import InstanceRef

from eagle_assets_tests.test_orchestration_live import (
    BIN,
    CHROMIUM,
    REPO_ROOT,
    SCREENSHOT_DIR_ENV,
    Proc,
    _free_port,
    _start,
    _wait_http,
    dagster_ui_page,
)

pytestmark = [pytest.mark.slow(seconds=90), pytest.mark.timeout(600)]

PASSES, WARNS, FAILS = "chat_ok", "code_short", "chat_cut"
LOOSE = {"min_median_tokens": 0, "max_share_short_warn": 1.0, "max_share_short_error": 1.0,
         "max_share_truncated_warn": 1.0, "max_share_truncated_error": 1.0, "max_share_dropped_warn": 1.0,
         "max_share_dropped_error": 1.0}


def _catalog(root: Path, target: Path, server_url: str) -> Path:
    data = REPO_ROOT / "catalogs" / "demo_data"
    base = yaml.safe_load((REPO_ROOT / "catalogs" / "default.yaml").read_text())
    b1, b2 = base["partitions"]["B1_glaive"], base["partitions"]["B2_opencodeinstruct"]
    glaive = [{"path": str(data / "B1_glaive.json"), "format": "glaive"}]
    chat = {**b1, "prompt_policy": "last_user", "sources": glaive, "limit": 3}
    partitions = {
        # open levels: it passes whenever a reply comes back well-formed
        PASSES: {**chat, "thresholds": {**b1["thresholds"], **LOOSE}},
        # every code answer is under short_tokens (300) and the warn level is 0: response_length WARN, it trains
        WARNS: {**b2, "sources": [{"path": str(data / "B2_opencodeinstruct.jsonl"), "format": "opencodeinstruct"}],
                "limit": 3, "thresholds": {**b2["thresholds"], **LOOSE, "max_share_short_warn": 0.0}},
        # 6 tokens cut every reply inside its reasoning: token_structure and response_length ERROR at the
        # catalog's own levels, nothing kept
        FAILS: {**chat, "sampling": {**b1["sampling"], "max_new_tokens": 6}},
    }
    catalog = {"target": {"model": str(target)}, "server": {"url": server_url}, "partitions": partitions,
               "training": base["training"], "evaluation": None}
    path = root / "verdicts.yaml"
    path.write_text(yaml.safe_dump(catalog, sort_keys=False))
    return path


@dataclass
class Shown:
    base: str
    dev: Proc
    root: Path
    runs: dict[str, bool]


@pytest.fixture(scope="module")
def shown(demo_target, tmp_path_factory):
    """The three partitions run into a fresh instance (in this process, against one embedded server), then
    ``dagster dev`` on that instance."""
    from eagle_assets.definitions import PARTITION_JOB, build_definitions
    from eagle_assets.serving.launch import launched_server

    root = tmp_path_factory.mktemp("verdicts")
    home = root / "dagster_home"
    home.mkdir()
    shutil.copy(REPO_ROOT / "dagster.yaml", home / "dagster.yaml")
    workspace = Path(shutil.copy(REPO_ROOT / "workspace.yaml", root / "workspace.yaml"))
    instance = dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home)))
    runs = {}
    try:
        with launched_server(str(demo_target), log_dir=root / "server") as server:
            catalog = _catalog(root, demo_target, server.url)
            defs = build_definitions(catalog, storage_root=root / "store")
            job = defs.resolve_job_def(PARTITION_JOB)
            for key in (PASSES, WARNS, FAILS):
                runs[key] = job.execute_in_process(partition_key=key, instance=instance, raise_on_error=False).success
    finally:
        instance.dispose()
    env = {**os.environ, "DAGSTER_HOME": str(home), "EAGLE_ASSETS_CATALOG": str(catalog),
           "EAGLE_ASSETS_HOME": str(root / "store"), "PYTHONUNBUFFERED": "1"}
    port = _free_port()
    dev = _start([str(BIN / "dagster"), "dev", "-w", str(workspace), "-p", str(port)], env, root, root / "dev.log")
    try:
        yield Shown(f"http://127.0.0.1:{port}", dev, root, runs)
    finally:
        dev.stop()


def test_the_runs_end_as_their_verdicts_say(shown):
    """A failed verdict is a failed run (its blocking check stopped it); passed and warned runs succeed."""
    assert shown.runs == {PASSES: True, WARNS: True, FAILS: False}


def test_the_ui_shows_each_partitions_verdict(shown):
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (it drives Debian's chromium)")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM}: apt-get install chromium")
    expect = sync_api.expect
    shots = shown.root / "screenshots"
    shots.mkdir(exist_ok=True)
    _wait_http(shown.base + "/server_info")
    failed = "failed (token_structure: share_dropped = 1 > threshold 0.2; response_length: share_truncated = 1 > " \
             "threshold 0.1); kept 0 of 3 replies, 3 dropped"
    warned = "warned (response_length: share_under_short = 1 > threshold 0); kept 3 of 3 replies, 0 dropped"
    with dagster_ui_page(1500, 1200) as page:
        # qc_shards > Partitions, the failing partition open: Dagster's tag is "Materialized" (its files are on
        # disk), the verdict entry says failed and why, the table gives every partition its word
        page.goto(shown.base + f"/assets/qc_shards?view=partitions&partition={FAILS}")
        body = page.locator("body")
        expect(body).to_contain_text("3 Partitions Selected")
        # Dagster's own status: all three materialized (their files are on disk), none "Failed"
        expect(body).to_contain_text("Materialized (3)")
        expect(body).to_contain_text("Failed (0)")
        expect(body).to_contain_text(failed)
        # the table's rows by their cells: partition, verdict, blocking check, finding, kept, dropped, rows
        for cells in (f"{PASSES} passed 3 0 3", f"{WARNS} warned response_length: share_under_short = 1 > "
                      "threshold 0 3 0 3", f"{FAILS} failed token_structure token_structure: share_dropped = 1 "
                      "> threshold 0.2; response_length: share_truncated = 1 > threshold 0.1 0 3 3"):
            expect(page.get_by_role("row", name=cells, exact=True)).to_be_visible()
        page.get_by_role("row", name=f"{PASSES} passed 3 0 3", exact=True).scroll_into_view_if_needed()
        page.wait_for_timeout(500)
        page.screenshot(path=str(shots / "qc_partitions_verdicts.png"))

        # the asset's Overview: the newest run's table (chat_cut ran last), every partition's word at a glance
        page.goto(shown.base + "/assets/qc_shards?view=overview")
        expect(page.get_by_role("row", name=f"{WARNS} warned response_length: share_under_short = 1 > "
                                "threshold 0 3 0 3", exact=True)).to_be_visible()
        expect(page.get_by_role("row", name=f"{PASSES} passed 3 0 3", exact=True)).to_be_visible()
        expect(page.get_by_role("row", name=re.compile(rf"^{FAILS} failed token_structure "))).to_be_visible()
        page.get_by_role("row", name=f"{PASSES} passed 3 0 3", exact=True).scroll_into_view_if_needed()
        page.wait_for_timeout(500)
        page.screenshot(path=str(shots / "qc_overview_verdicts.png"))

        # response_length > Partitions: Dagster lists WARN and ERROR alike as failed; the open partition's tag
        # carries the severity's icon and the check's metadata the partition's verdict
        page.goto(shown.base + "/assets/qc_shards?view=checks&checkDetail=response_length")
        # the check's own tabs (below the asset's, which have a Partitions tab too)
        page.get_by_role("tablist").filter(has_text="Execution history").get_by_role(
            "tab", name="Partitions").click()
        for key, tag, icon, verdict in ((PASSES, "Passed", "check_circle", "passed; kept 3 of 3 replies"),
                                        (FAILS, "Failed", "cancel", failed),
                                        (WARNS, "Failed", "warning_outline", warned)):
            page.locator(f'[data-tooltip="{key}"]').last.click()  # the list's row (the first: the filter's tag)
            # the partition's detail panel: the innermost block holding its history button and its metadata
            detail = page.locator("div", has=page.get_by_text("View all historical executions")).filter(
                has_text="Metadata").last
            expect(detail).to_contain_text(verdict)
            expect(detail.get_by_text(tag, exact=True).first).to_be_visible()
            expect(detail.get_by_role("img", name=icon).first).to_be_visible()
            if key == FAILS:
                page.screenshot(path=str(shots / "check_partitions_failed.png"))
        page.wait_for_timeout(500)
        page.screenshot(path=str(shots / "check_partitions_warned.png"))
    if os.environ.get(SCREENSHOT_DIR_ENV):
        shutil.copytree(shots, os.environ[SCREENSHOT_DIR_ENV], dirs_exist_ok=True)
