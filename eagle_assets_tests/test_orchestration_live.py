"""The deployment as users run it (README): ``dagster dev`` on the repo's ``dagster.yaml`` (sqlite under a fresh
DAGSTER_HOME) and ``workspace.yaml``, so a real ``dagster-webserver`` and ``dagster-daemon`` share the one code
server ``dagster dev`` starts, the embedded demo target served over
HTTP with an API key, a ``dagster job backfill`` of every partition from the CLI, the inputs and automation sensors
ticking on the daemon, and the UI driven in headless Chromium.

One module-scoped deployment serves every test here, in file order: the backfill materializes both partitions, the
UI test reads their check results, then the target's chat template is edited: the inputs sensor observes it, the
UI shows what is unsynced, and the automation sensor materializes exactly that, down to a new drafter checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import pytest
import yaml
from dagster._core.execution.backfill import BulkActionStatus
from dagster._core.instance.ref import InstanceRef
from dagster._core.scheduler.instigation import InstigatorType, TickStatus

from eagle_assets.assets.schedules import IN_FLIGHT

pytestmark = [pytest.mark.slow(seconds=400), pytest.mark.timeout(600)]

REPO_ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
KEY_ENV = "EAGLE_TEST_SGLANG_API_KEY"
PLANTED_KEY = f"sk-planted-{uuid.uuid4().hex}"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]
SCREENSHOT_DIR_ENV = "EAGLE_ASSETS_SCREENSHOTS"  # set to keep the screenshots somewhere (CI artifacts, docs)
FINISHED = {dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    """A server process in its own process group (``start_new_session``), so stopping it stops the webserver, the
    daemon and the code server it started."""

    popen: subprocess.Popen
    log: Path

    def stop(self) -> None:
        pgid = self.popen.pid  # start_new_session: the group id is the leader's pid
        try:
            os.killpg(pgid, signal.SIGTERM)
            self.popen.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass  # already gone, or deaf to SIGTERM: SIGKILL below
        try:  # whatever outlived the leader (a code server, a run worker, a launched model server)
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait(timeout=10)


def _start(cmd: list[str], env: dict, cwd: Path, log: Path) -> Proc:
    fh = open(log, "wb")
    popen = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    fh.close()
    return Proc(popen, log)


@dataclass
class Deployment:
    root: Path
    home: Path
    store: Path
    workspace: Path
    env: dict
    data: Path
    instance: dg.DagsterInstance
    dev: Proc
    port: int
    target: Path

    def dagster(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        proc = subprocess.run([str(BIN / "dagster"), *args], env=self.env, cwd=self.root, capture_output=True,
                              text=True, timeout=timeout)
        assert proc.returncode == 0, f"dagster {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
        return proc

    def wait_runs(self, run_ids: list[str], timeout: float = 300) -> list[dg.DagsterRun]:
        deadline = time.monotonic() + timeout
        while True:
            runs = [self.instance.get_run_by_id(r) for r in run_ids]
            if all(r is not None and r.status in FINISHED for r in runs):
                return runs
            if time.monotonic() > deadline:
                raise AssertionError(f"runs not finished after {timeout} s: "
                                     f"{[(r.run_id[:8], r.status.value) for r in runs if r]}\n{self.logs_tail()}")
            time.sleep(1.0)

    def logs_tail(self) -> str:
        return f"--- {self.dev.log.name}\n{self.dev.log.read_text(errors='replace')[-6000:]}"

    def failure_report(self, run: dg.DagsterRun) -> str:
        events = [e for e in self.instance.all_logs(run.run_id) if e.dagster_event and e.dagster_event.is_failure]
        return f"run {run.run_id} {run.status}: " + "\n".join(str(e.dagster_event.event_specific_data)[:3000]
                                                             for e in events)


def _catalog(root: Path, target: Path) -> Path:
    data = root / "data"
    data.mkdir()
    shutil.copy(REPO_ROOT / "catalogs" / "demo_data" / "B1_glaive.json", data / "B1_glaive.json")
    shutil.copy(REPO_ROOT / "catalogs" / "demo_data" / "B2_opencodeinstruct.jsonl", data / "B2_code.jsonl")
    base = yaml.safe_load((REPO_ROOT / "catalogs" / "default.yaml").read_text())
    base.pop("evaluation", None)  # its suite is a partition of its own: test_evaluation_suites
    b1, b2 = base["partitions"]["B1_glaive"], base["partitions"]["B2_opencodeinstruct"]
    b1["prompt_policy"] = "last_user"  # one row per conversation: the counts below are per prompt
    # These tests are about orchestration, not about the demo target's quality (test_pipeline_e2e gates that):
    # open QC gates keep every run green as long as a reply comes back.
    loose = {"min_median_tokens": 0, "max_share_short_warn": 1.0, "max_share_short_error": 1.0,
             "max_share_truncated_warn": 1.0, "max_share_truncated_error": 1.0, "max_share_dropped_warn": 1.0,
             "max_share_dropped_error": 1.0}
    b1.update(sources=[{"path": "data/B1_glaive.json", "format": "glaive"}], limit=4,
              thresholds={**b1["thresholds"], **loose})
    # B2's response_length warns (every reply is under short_tokens and the warn level is 0): a WARN-severity result
    # of its partition, which blocks nothing
    b2.update(sources=[{"path": "data/B2_code.jsonl", "format": "opencodeinstruct"}], limit=4,
              thresholds={**b2["thresholds"], **loose, "max_share_short_warn": 0.0})
    catalog = {
        "target": {"model": str(target)},
        "server": {"url": None, "launch": "embedded", "api_key_env": KEY_ENV, "concurrency": 8},
        "partitions": {"B1_glaive": b1, "B2_code": b2},
        "training": {**base["training"], "epochs": 1, "max_length": 512, "batch_tokens": 2048,
                     "holdout_fraction": 0.25, "acceptance_max_positions": 16,
                     # both partitions are short: the default cap on short rows would leave no training row
                     "mix": {**base["training"]["mix"], "bucket_caps": []}},
    }
    path = root / "live.yaml"
    path.write_text(yaml.safe_dump(catalog, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def deployment(demo_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("live")
    home = root / "dagster_home"
    home.mkdir()
    shutil.copy(REPO_ROOT / "dagster.yaml", home / "dagster.yaml")
    workspace = Path(shutil.copy(REPO_ROOT / "workspace.yaml", root / "workspace.yaml"))
    target = root / "target"  # a copy: the automation tests edit its chat template
    shutil.copytree(demo_target, target)
    catalog = _catalog(root, target)
    env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "EAGLE_ASSETS_CATALOG": str(catalog),
        "EAGLE_ASSETS_HOME": str(root / "store"),
        "EAGLE_ASSETS_SENSOR_INTERVAL_S": "2",
        KEY_ENV: PLANTED_KEY,
        "PYTHONUNBUFFERED": "1",
    }
    # Create the sqlite schema once, before several processes open the fresh DAGSTER_HOME at the same moment
    # (concurrent first opens can stamp the schedule db twice).
    instance = dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home)))
    instance.get_runs(limit=1)
    port = _free_port()
    # `dagster dev` starts the code server once and points the webserver and the daemon at it, so the daemon's
    # workspace refresh (every 60 s) reconnects instead of starting a new code server each time, as it does when
    # `dagster-daemon run -w workspace.yaml` manages its own. No -h: the default bind address is what is tested.
    dev = _start([str(BIN / "dagster"), "dev", "-w", str(workspace), "-p", str(port)], env, root, root / "dev.log")
    dep = Deployment(root, home, root / "store" / "live", workspace, env, root / "data", instance, dev, port, target)
    try:
        yield dep
    finally:
        dev.stop()
        instance.dispose()


@pytest.fixture(scope="module")
def backfilled(deployment):
    """``dagster job backfill --all`` of partition_job, run by the daemon; returns the finished runs."""
    out = deployment.dagster("job", "backfill", "-w", str(deployment.workspace), "-j", "partition_job",
                             "--all", "--noprompt").stdout
    backfill_id = re.search(r"Launched backfill job `(\w+)`", out).group(1)
    runs = deployment.instance.get_runs(filters=dg.RunsFilter(tags={"dagster/backfill": backfill_id}))
    assert sorted(r.tags["dagster/partition"] for r in runs) == ["B1_glaive", "B2_code"]
    finished = deployment.wait_runs([r.run_id for r in runs])
    for run in finished:
        assert run.status == dg.DagsterRunStatus.SUCCESS, deployment.failure_report(run)
    return finished


def _step_window(instance: dg.DagsterInstance, run_id: str, step: str) -> tuple[float, float]:
    events = [e for e in instance.all_logs(run_id) if e.step_key == step and e.dagster_event]
    start = min(e.timestamp for e in events if e.dagster_event.event_type == dg.DagsterEventType.STEP_START)
    end = max(e.timestamp for e in events if e.dagster_event.event_type == dg.DagsterEventType.STEP_SUCCESS)
    return start, end


def _files(root: Path, skip_suffixes: tuple[str, ...] = ()):
    """(path, bytes) of every file of the deployment: DAGSTER_HOME (sqlite dbs, compute logs), the shards, the
    process logs.

    The daemon and webserver stay up while this reads, so sqlite's ``-wal``/``-journal`` files can be
    checkpointed away between the listing and the read; such a file is skipped (what it held is in its
    database file, which is read).
    """
    out = []
    for p in root.rglob("*"):
        if p.suffix in skip_suffixes:
            continue
        try:
            if p.is_file():
                out.append((p, p.read_bytes()))
        except FileNotFoundError:
            continue
    return out


def test_webserver_binds_loopback_only_by_default(deployment):
    port_hex = f":{deployment.port:04X} "
    deadline = time.monotonic() + 120
    listening: list[str] = []
    while not listening and time.monotonic() < deadline:
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[1].endswith(port_hex.strip()) and fields[3] == "0A":  # 0A = LISTEN
                    listening.append(fields[1])
        time.sleep(0.5)
    assert listening == ["0100007F" + port_hex.strip()], f"webserver listens on {listening}, not 127.0.0.1 only"


def test_cli_backfill_runs_both_partitions_at_once_on_sqlite(deployment, backfilled):
    inst = deployment.instance
    records = {r.dagster_run.tags["dagster/partition"]: r for r in
               inst.get_run_records(filters=dg.RunsFilter(run_ids=[r.run_id for r in backfilled]))}
    a, b = records["B1_glaive"], records["B2_code"]
    assert a.start_time < b.end_time and b.start_time < a.end_time, "the two partition runs did not overlap"
    # The pool "sglang" (limit 1 in dagster.yaml) lets one generations step talk to a server at a time.
    ga = _step_window(inst, a.dagster_run.run_id, "generations")
    gb = _step_window(inst, b.dagster_run.run_id, "generations")
    assert ga[1] <= gb[0] or gb[1] <= ga[0], f"generations steps overlapped: {ga} {gb}"
    qc = deployment.store / "qc_shards"
    statuses = [json.loads((qc / r.tags["dagster/partition"] / "qc_status.json").read_text()) for r in backfilled]
    assert all(q["passed"] and q["rows"] == 4 for q in statuses) and sum(q["kept"] for q in statuses) > 0
    locked = [str(p) for p, data in _files(deployment.root, (".parquet", ".png", ".npy", ".safetensors"))
              if b"database is locked" in data]
    assert not locked, f"'database is locked' in {locked}"


def test_planted_api_key_never_reaches_event_logs_metadata_or_files(deployment, backfilled):
    inst = deployment.instance
    key = PLANTED_KEY.encode()
    for run in backfilled:
        # The server demanded the key (launched with --api-key-env) and every request carried it.
        gen = inst.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("generations"),
                                  asset_partitions=[run.tags["dagster/partition"]]), limit=1).records[0]
        meta = gen.asset_materialization.metadata
        assert meta["succeeded"].value == 4 and meta["failed"].value == 0
        for entry in inst.all_logs(run.run_id):
            assert PLANTED_KEY not in dg.serialize_value(entry)
        assert PLANTED_KEY not in json.dumps(run.run_config) + json.dumps(run.tags)
    leaked = [str(p) for p, data in _files(deployment.root) if key in data]
    assert not leaked, f"the API key leaked into {leaked}"


ASSETS = ["raw_prompts", "tokenized_prompts", "generations", "qc_shards", "length_report", "draft_vocab",
          "training_mix", "drafter_checkpoint"]


@contextmanager
def dagster_ui_page(width: int, height: int):
    """A page of Debian's Chromium (headless, through playwright) at ``width`` x ``height``, the Dagster UI's
    first-visit newsletter dialog marked as seen, 60 s for every wait; the browser is closed on exit."""
    from playwright import sync_api

    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        try:
            ctx = browser.new_context(viewport={"width": width, "height": height})
            ctx.add_init_script("window.localStorage.setItem('communityNux', JSON.stringify('1'))")
            page = ctx.new_page()
            page.set_default_timeout(60_000)
            sync_api.expect.set_options(timeout=60_000)
            yield page
        finally:
            browser.close()


def _wait_http(url: str, timeout: float = 120) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} did not answer within {timeout} s")
        time.sleep(0.5)


def test_ui_in_chromium_shows_graph_and_partition_checks_and_launches_a_backfill(deployment, backfilled):
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (it drives Debian's chromium)")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM}: apt-get install chromium")
    expect = sync_api.expect
    dep = deployment
    shots = dep.root / "screenshots"
    shots.mkdir(exist_ok=True)
    base = f"http://127.0.0.1:{dep.port}"
    _wait_http(base + "/server_info")
    b1 = next(r for r in backfilled if r.tags["dagster/partition"] == "B1_glaive")
    with dagster_ui_page(1400, 1100) as page:
        # The asset graph: every asset of both jobs, grouped prompts -> generation -> quality -> drafter.
        page.goto(base + "/assets/qc_shards?view=lineage&lineageScope=neighbors&lineageDepth=10")
        for name in ASSETS:
            expect(page.get_by_text(name, exact=True).first).to_be_visible()
        page.wait_for_timeout(3000)  # materialization colors arrive with the next live-data poll
        page.screenshot(path=str(shots / "asset_graph.png"))

        # One partition's check results: the B1_glaive run, filtered to the qc_shards step.
        page.goto(base + f"/runs/{b1.run_id}?selection=qc_shards&logs=step%3Aqc_shards")
        body = page.locator("body")
        expect(body).to_contain_text("partition: B1_glaive")
        expect(body).to_contain_text("Check token_structure succeeded for materialization of qc_shards")
        expect(body).to_contain_text("Check response_length succeeded for materialization of qc_shards")
        page.screenshot(path=str(shots / "partition_checks.png"))

        # A check that warns is a warning of its partition, not a green "Passed"
        b2 = next(r for r in backfilled if r.tags["dagster/partition"] == "B2_code")
        page.goto(base + f"/runs/{b2.run_id}?selection=qc_shards&logs=step%3Aqc_shards")
        body = page.locator("body")
        expect(body).to_contain_text("partition: B2_code")
        expect(body).to_contain_text("Check response_length failed for materialization of qc_shards")
        expect(body).to_contain_text(re.compile(r"level\s*WARN"))  # the check's own level, in its metadata
        page.screenshot(path=str(shots / "partition_check_warn.png"))
        # the asset's Checks tab: the latest response_length result is B2_code's, a failure with a warning
        # icon, its WARN finding as the description, the partition named
        page.goto(base + "/assets/qc_shards?view=checks&checkDetail=response_length")
        body = page.locator("body")
        expect(body).to_contain_text("WARN: share_under_short = 1 > threshold 0")
        expect(body).to_contain_text(re.compile(r"Evaluation result.*Failed.*Partition\s*B2_code", re.DOTALL))
        # and the partition's verdict in words (qc.status: it warned, it trains)
        expect(body).to_contain_text(re.compile(r"warned \(response_length: share_under_short = 1 > threshold "
                                                r"0\); kept \d of 4 replies, \d dropped"))
        page.wait_for_timeout(1000)
        page.screenshot(path=str(shots / "check_warn.png"))

        # A backfill of all partitions from the UI, one run per partition (the asset's BackfillPolicy).
        page.goto(base + "/assets/raw_prompts")
        page.get_by_role("button", name="Materialize…").click()
        dialog = page.get_by_role("dialog")
        dialog.get_by_role("button", name="All", exact=True).click()
        expect(dialog).to_contain_text("2 partitions")
        expect(dialog).to_contain_text("Backfills in multiple runs, with a maximum of 1 partitions per run")
        page.screenshot(path=str(shots / "ui_backfill_dialog.png"))
        dialog.get_by_role("button", name="Launch backfill").click()
        created = page.get_by_text(re.compile(r"Created backfill \w+"))
        expect(created).to_be_visible()
        backfill_id = re.search(r"Created backfill (\w+)", created.inner_text()).group(1)
    if os.environ.get(SCREENSHOT_DIR_ENV):
        shutil.copytree(shots, os.environ[SCREENSHOT_DIR_ENV], dirs_exist_ok=True)

    # The daemon turns the backfill into one run per partition; the backfill's own status follows on a later
    # iteration of its 30 s loop, so the runs are what this waits for.
    deadline = time.monotonic() + 240
    while True:
        runs = dep.instance.get_runs(filters=dg.RunsFilter(tags={"dagster/backfill": backfill_id}))
        if len(runs) == 2 and all(r.status in FINISHED for r in runs):
            break
        assert time.monotonic() < deadline, f"UI backfill {backfill_id}: {[r.status for r in runs]}\n{dep.logs_tail()}"
        time.sleep(1.0)
    assert all(r.status == dg.DagsterRunStatus.SUCCESS for r in runs), [dep.failure_report(r) for r in runs]
    assert sorted(r.tags["dagster/asset_partition_range_start"] for r in runs) == ["B1_glaive", "B2_code"]
    assert all(r.tags["dagster/asset_partition_range_end"] == r.tags["dagster/asset_partition_range_start"]
               for r in runs)
    # and the backfill itself done: the automation test below starts its sensor next, and a backfill still "in
    # progress" over raw_prompts would hold back tokenized_prompts (~any_deps_in_progress) but not qc_shards,
    # splitting one chain of runs into two
    _wait("the UI backfill to complete", lambda: dep.instance.get_backfill(backfill_id).status
          in (BulkActionStatus.COMPLETED, BulkActionStatus.COMPLETED_SUCCESS), dep, timeout=180)


def _sensor_state(inst: dg.DagsterInstance, name: str):
    states = [s for s in inst.all_instigator_state(instigator_type=InstigatorType.SENSOR) if s.name == name]
    assert len(states) == 1, [s.name for s in states]
    return states[0]


def _next_tick(inst: dg.DagsterInstance, name: str, after: float, timeout: float = 90):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = _sensor_state(inst, name)
        ticks = inst.get_ticks(state.instigator_origin_id, state.selector_id, after=after,
                               statuses=[TickStatus.SUCCESS, TickStatus.SKIPPED, TickStatus.FAILURE])
        if ticks:
            return sorted(ticks, key=lambda t: t.timestamp)[0]
        time.sleep(0.5)
    raise AssertionError(f"no tick of {name} within {timeout} s")


def _graphql(dep: Deployment, query: str, variables: dict) -> dict:
    """A call to the webserver's GraphQL API, the one the UI's toggles and buttons use."""
    import urllib.request

    req = urllib.request.Request(f"http://127.0.0.1:{dep.port}/graphql",
                                 data=json.dumps({"query": query, "variables": variables}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        body = json.loads(resp.read())
    assert "errors" not in body, body
    return body["data"]


def _stop_sensor(dep: Deployment, name: str) -> None:
    state = _sensor_state(dep.instance, name)
    data = _graphql(dep, "mutation($o: String, $s: String) { stopSensor(jobOriginId: $o, jobSelectorId: $s) "
                         "{ __typename } }", {"o": state.instigator_origin_id, "s": state.selector_id})
    assert data["stopSensor"]["__typename"] == "StopSensorMutationResult", data


def _start_sensor(dep: Deployment, name: str) -> float:
    """Turn a sensor on as the UI's toggle does (GraphQL ``startSensor`` on the running webserver: no CLI process
    loading the code location again); returns the time just before."""
    t0 = time.time()
    data = _graphql(dep, "mutation($s: SensorSelector!) { startSensor(sensorSelector: $s) { __typename "
                         "... on PythonError { message } } }",
                    {"s": {"repositoryLocationName": "eagle_assets", "repositoryName": "__repository__",
                           "sensorName": name}})
    assert data["startSensor"]["__typename"] == "Sensor", data
    return t0


def _wait(what: str, predicate, dep: Deployment, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} not within {timeout} s\n{dep.logs_tail()}"
        time.sleep(1.0)


def _materializations(inst: dg.DagsterInstance, asset: str, partition: str | None = None) -> list:
    return inst.fetch_materializations(dg.AssetRecordsFilter(
        asset_key=dg.AssetKey(asset), asset_partitions=[partition] if partition else None), limit=1000).records


def _edit_chat_template(target: Path) -> None:
    """Put a fixed line in front of every rendered prompt: a real change of every prompt's ids."""
    jinja = target / "chat_template.jinja"
    if jinja.is_file():
        jinja.write_text("{{- 'Answer briefly.\\n' -}}" + jinja.read_text())
        return
    cfg_file = target / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["chat_template"] = "{{- 'Answer briefly.\\n' -}}" + cfg["chat_template"]
    cfg_file.write_text(json.dumps(cfg, indent=2))


AUTOMATION: dict[str, object] = {}


def test_chat_template_edit_is_observed_and_shown_unsynced_in_chromium(deployment, backfilled):
    """The inputs sensor on the daemon observes an edited chat template; the UI marks the assets that read it."""
    from eagle_assets.assets.automation import unsynced
    from eagle_assets.definitions import build_definitions

    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (it drives Debian's chromium)")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM}: apt-get install chromium")
    dep, inst = deployment, deployment.instance
    graph = build_definitions(dep.env["EAGLE_ASSETS_CATALOG"], dep.env["EAGLE_ASSETS_HOME"]).resolve_asset_graph()
    # Both sensors tick once on the unchanged deployment: nothing to do. Automation's first evaluation is its
    # baseline; it is then stopped so that the unsynced state stays on screen until it is turned on again.
    t0 = _start_sensor(dep, "automation_sensor")
    baseline = _next_tick(inst, "automation_sensor", t0)
    assert not baseline.run_ids, baseline
    _stop_sensor(dep, "automation_sensor")
    t1 = _start_sensor(dep, "inputs_sensor")
    _next_tick(inst, "inputs_sensor", t1)  # the first observation of training_settings (no run reads it yet)
    assert unsynced(inst, graph) == {}

    _edit_chat_template(dep.target)
    stale = _wait("chat template observed", lambda: unsynced(inst, graph), dep, timeout=120)
    assert set(stale) == {(a, k) for a in ("tokenized_prompts", "qc_shards") for k in ("B1_glaive", "B2_code")}
    assert all(causes == ["has a new dependency data version: target_tokenizer"] for causes in stale.values())
    AUTOMATION["edited_at"] = time.time()

    shots = dep.root / "screenshots"
    shots.mkdir(exist_ok=True)
    base = f"http://127.0.0.1:{dep.port}"
    _wait_http(base + "/server_info")
    with dagster_ui_page(1400, 1100) as page:
        # Dagster shows staleness of a partitioned asset per partition: the partition's detail panel.
        page.goto(base + "/assets/tokenized_prompts?view=partitions&partition=B1_glaive")
        sync_api.expect(page.locator("body")).to_contain_text("B1_glaive")
        tag = page.get_by_text(re.compile(r"Unsynced \(1\)")).first
        sync_api.expect(tag).to_be_visible()
        tag.hover()  # the tag's popover names the cause
        sync_api.expect(page.get_by_text("1 upstream data version change")).to_be_visible()
        sync_api.expect(page.locator("body")).to_contain_text(
            re.compile(r"1 upstream data version change\s*target_tokenizer\s*has a new data version"))
        page.wait_for_timeout(500)
        page.screenshot(path=str(shots / "ui_unsynced.png"))
    if os.environ.get(SCREENSHOT_DIR_ENV):
        shutil.copytree(shots, os.environ[SCREENSHOT_DIR_ENV], dirs_exist_ok=True)


def test_automation_on_the_daemon_materializes_exactly_what_changed(deployment, backfilled):
    """With the automation sensor on again, the daemon re-runs tokenization, generation and QC of both partitions,
    then the report and training, and nothing else; provenance.json in the new checkpoint names its run."""
    from eagle_assets.assets.automation import unsynced
    from eagle_assets.assets.provenance import PROVENANCE_FILE
    from eagle_assets.definitions import build_definitions

    if "edited_at" not in AUTOMATION:
        pytest.skip("the chat template is edited by the UI test above")
    dep, inst = deployment, deployment.instance
    graph = build_definitions(dep.env["EAGLE_ASSETS_CATALOG"], dep.env["EAGLE_ASSETS_HOME"]).resolve_asset_graph()
    counts = {a: len(_materializations(inst, a)) for a in ASSETS}
    t0 = _start_sensor(dep, "automation_sensor")

    def settled():
        busy = inst.get_runs(dg.RunsFilter(statuses=list(IN_FLIGHT)))
        return not busy and len(_materializations(inst, "drafter_checkpoint")) > counts["drafter_checkpoint"] \
            and not unsynced(inst, graph)

    _wait("automation to materialize the edit and train", settled, dep, timeout=500)
    _stop_sensor(dep, "automation_sensor")
    _stop_sensor(dep, "inputs_sensor")
    runs = [r for r in inst.get_runs() if inst.get_run_record_by_id(r.run_id).create_timestamp.timestamp() >= t0]
    assert runs and all(r.status == dg.DagsterRunStatus.SUCCESS for r in runs), [dep.failure_report(r) for r in runs]
    assert all(r.tags.get("dagster/from_automation_condition") == "true" or "dagster/backfill" in r.tags
               for r in runs), [r.tags for r in runs]
    new = {a: len(_materializations(inst, a)) - counts[a] for a in ASSETS}
    # Exactly what read the chat template, and what reads that: per partition once, the rest once.
    assert new == {"raw_prompts": 0, "tokenized_prompts": 2, "generations": 2, "qc_shards": 2,
                   "length_report": 1, "draft_vocab": 1, "training_mix": 1, "drafter_checkpoint": 1}, new

    ckpt = dep.store / "drafter_checkpoint" / "checkpoint"
    provenance = json.loads((ckpt / PROVENANCE_FILE).read_text())
    train_run = _materializations(inst, "drafter_checkpoint")[0].run_id
    assert provenance["run"]["run_id"] == train_run
    inputs = {(e["asset"], e["partition"]): e for e in provenance["inputs"]}
    for key in ("B1_glaive", "B2_code"):
        qc = _materializations(inst, "qc_shards", key)[0]
        assert inputs[("qc_shards", key)]["run_id"] == qc.run_id
    tokenizer_obs = inst.get_latest_data_version_record(dg.AssetKey("target_tokenizer"), is_source=True)
    assert inputs[("target_tokenizer", None)]["data_version"] == \
        tokenizer_obs.asset_observation.tags["dagster/data_version"]
    assert PLANTED_KEY not in json.dumps(provenance)
