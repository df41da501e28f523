"""The Kubernetes Jobs dagster-k8s would create for our runs and steps, built by dagster-k8s's own code.

A real cluster cannot run here. What stands in for it is a fake Kubernetes API server on 127.0.0.1 (``FakeK8sApi``):
it accepts the Job objects POSTed to ``/apis/batch/v1/namespaces/<ns>/jobs``, records them and runs nothing. The
instance loads the run-launcher block of docs/scaling.md verbatim (plus a kubeconfig pointing at the fake server in
place of the in-cluster config); runs of our ``partition_job`` and ``training_job`` (built with
``EAGLE_ASSETS_EXECUTOR=k8s``) are launched by ``K8sRunLauncher.launch_run`` and their steps by the configured
``k8s_job_executor``'s ``K8sStepHandler.launch_step``, exactly as the daemon and a run pod would call them. The tests
read the Job objects the Kubernetes client sent.
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import dagster as dg
import pytest
import yaml
from dagster._core.instance.ref import InstanceRef

pytest.importorskip("dagster_k8s", reason="dagster-k8s is not installed (pip install -e '.[k8s]')")

from dagster._core.definitions.reconstruct import ReconstructableRepository  # noqa: E402
from dagster._core.execution.api import create_execution_plan  # noqa: E402
from dagster._core.execution.context.system import PlanData, PlanOrchestrationContext  # noqa: E402
from dagster._core.execution.context_creation_job import create_context_free_log_manager  # noqa: E402
from dagster._core.execution.retries import RetryMode  # noqa: E402
from dagster._core.executor.init import InitExecutorContext  # noqa: E402
from dagster._core.executor.step_delegating.step_handler.base import StepHandlerContext  # noqa: E402
from dagster._core.launcher import LaunchRunContext  # noqa: E402
from dagster._core.system_config.objects import ResolvedRunConfig  # noqa: E402
from dagster._grpc.types import ExecuteStepArgs  # noqa: E402

from eagle_assets.assets.k8s import API_KEY_SECRET, GPU_RESOURCE, server_gpus, step_k8s_config  # noqa: E402
from eagle_assets.catalog import load_catalog  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
K8S_BLOCK = re.compile(r"<!-- k8s-dagster-yaml:.*?-->\s*```yaml\n(.*?)```", re.S)
IMAGE = "registry.example.com/eagle-assets:0.1.0"
NAMESPACE = "eagle"
KEY_ENV = "SGLANG_API_KEY"


class FakeK8sApi:
    """Records the Jobs POSTed to it (``jobs``: list of (namespace, body dict)); answers 201 with the body."""

    def __init__(self):
        self.jobs: list[tuple[str, dict]] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                m = re.fullmatch(r"/apis/batch/v1/namespaces/([^/]+)/jobs", self.path.split("?")[0])
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if not m:
                    self._send(404, {"kind": "Status", "status": "Failure", "message": f"no route {self.path}"})
                    return
                job = json.loads(body)
                api.jobs.append((m.group(1), job))
                self._send(201, job)

            def _send(self, code: int, obj: dict) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):  # keep pytest output clean
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _catalog(tmp: Path, server: dict) -> Path:
    base = yaml.safe_load((REPO_ROOT / "catalogs" / "default.yaml").read_text())
    base.pop("evaluation", None)  # its suite is a partition of its own: test_evaluation_suites
    keys = ["B1_glaive", "B2_opencodeinstruct"]
    parts = {k: base["partitions"][k] for k in keys}
    for spec in parts.values():  # the demo data beside the repo's catalog
        for src in spec["sources"]:
            src["path"] = str((REPO_ROOT / "catalogs" / src["path"]).resolve())
    path = tmp / f"k8s-{len(list(tmp.glob('k8s-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump({"target": {"model": "demo"}, "server": server, "partitions": parts,
                                    "training": base["training"]}))
    return path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The fake API server and an instance whose dagster.yaml is the docs block with a kubeconfig for it."""
    tmp = tmp_path_factory.mktemp("k8s")
    api = FakeK8sApi()
    kubeconfig = tmp / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": api.url}}],
        "users": [{"name": "fake", "user": {"token": "not-a-secret"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": NAMESPACE}}],
    }))
    block = K8S_BLOCK.search((REPO_ROOT / "docs" / "scaling.md").read_text())
    assert block, "docs/scaling.md lost its <!-- k8s-dagster-yaml --> block"
    config = yaml.safe_load(block.group(1))
    launcher = config["run_launcher"]["config"]
    assert launcher.pop("load_incluster_config") is True  # what a cluster uses; the fake needs a kubeconfig
    launcher.update(load_incluster_config=False, kubeconfig_file=str(kubeconfig))
    home = tmp / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text(yaml.safe_dump(config))
    instance = dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home)))
    try:
        yield api, instance, tmp
    finally:
        instance.dispose()
        api.close()


def _recon_repo(tmp: Path, catalog: Path) -> ReconstructableRepository:
    """Our definitions for ``catalog`` with the k8s executor, as a code location with the image ``IMAGE``."""
    module = tmp / f"defs_{catalog.stem.replace('-', '_')}.py"
    module.write_text(
        "from eagle_assets.definitions import build_definitions\n"
        f"defs = build_definitions({str(catalog)!r}, storage_root={str(tmp / 'store')!r}, executor='k8s')\n")
    return ReconstructableRepository.for_file(str(module), "defs", working_directory=str(tmp),
                                              container_image=IMAGE)


def _launch(api: FakeK8sApi, instance: dg.DagsterInstance, repo: ReconstructableRepository, job_name: str,
            partition: str | None) -> tuple[dict, dict[str, dict]]:
    """Launch a run of ``job_name`` and each of its steps; returns the run pod's Job and the step Jobs by step."""
    recon_job = repo.get_reconstructable_job(job_name)
    job_def = recon_job.get_definition()
    tags = {"dagster/partition": partition} if partition else {}
    plan = create_execution_plan(recon_job, run_config={}, tags=tags)
    run = instance.create_run_for_job(job_def=job_def, execution_plan=plan, run_config={}, tags=tags,
                                      job_code_origin=recon_job.get_python_origin())
    before = len(api.jobs)
    instance.run_launcher.launch_run(LaunchRunContext(dagster_run=run, workspace=None))
    [(ns, run_job)] = api.jobs[before:]
    assert ns == NAMESPACE
    # The run pod would now execute the job with its executor: build that executor as Dagster does.
    resolved = ResolvedRunConfig.build(job_def, {})
    executor = job_def.executor_def.executor_creation_fn(InitExecutorContext(
        job=recon_job, executor_def=job_def.executor_def, executor_config=resolved.execution.execution_engine_config,
        instance=instance))
    plan_context = PlanOrchestrationContext(
        plan_data=PlanData(job=recon_job, dagster_run=run, instance=instance, execution_plan=plan,
                           raise_on_error=True, retry_mode=RetryMode.DISABLED),
        log_manager=create_context_free_log_manager(instance, run), executor=executor, output_capture=None)
    steps: dict[str, dict] = {}
    for step in plan.steps:
        before = len(api.jobs)
        ctx = StepHandlerContext(instance=instance, plan_context=plan_context, steps=plan.steps,
                                 execute_step_args=ExecuteStepArgs(recon_job.get_python_origin(), run.run_id,
                                                                   [step.key]), dagster_run=run)
        list(executor._step_handler.launch_step(ctx))  # noqa: SLF001 - the handler the executor delegates to
        [(ns, step_job)] = api.jobs[before:]
        assert ns == NAMESPACE
        steps[step.key] = step_job
    return run_job, steps


def _container(job: dict) -> dict:
    [container] = job["spec"]["template"]["spec"]["containers"]
    return container


def _env(job: dict) -> dict[str, dict]:
    return {e["name"]: e for e in _container(job).get("env") or []}


def _gpus(job: dict) -> int:
    limits = (_container(job).get("resources") or {}).get("limits") or {}
    return int(limits.get(GPU_RESOURCE, 0))


def _check_common(job: dict) -> None:
    """What every pod (run and step) gets from the run launcher block."""
    pod = job["spec"]["template"]["spec"]
    container = _container(job)
    assert container["image"] == IMAGE
    assert container["imagePullPolicy"] == "IfNotPresent"
    assert pod["serviceAccountName"] == "eagle-runner"
    env = _env(job)
    assert env["EAGLE_ASSETS_CATALOG"]["value"] == "/catalogs/production.yaml"
    assert env["EAGLE_ASSETS_HOME"]["value"] == "/mnt/eagle"
    assert env["EAGLE_ASSETS_EXECUTOR"]["value"] == "k8s"
    assert env["DAGSTER_HOME"]["value"] == "/opt/dagster/dagster_home"
    assert env["DAGSTER_PG_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "dagster-postgresql-secret", "key": "postgresql-password"}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["eagle-data"]["mountPath"] == "/mnt/eagle"
    assert mounts["catalogs"]["readOnly"] is True
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["eagle-data"]["persistentVolumeClaim"] == {"claimName": "eagle-data"}
    assert volumes["catalogs"]["configMap"]["name"] == "eagle-catalogs"
    assert all("value" in e or "valueFrom" in e for e in container["env"])  # no literal secret anywhere


def test_partition_run_and_steps_on_a_gpu_server_launch(cluster):
    api, instance, tmp = cluster
    catalog = _catalog(tmp, {"url": None, "launch": "sglang", "api_key_env": KEY_ENV,
                             "extra_args": ["--tp", "2", "--mem-fraction-static", "0.8"]})
    assert server_gpus(load_catalog(catalog)) == 2
    run_job, steps = _launch(api, instance, _recon_repo(tmp, catalog), "partition_job", "B1_glaive")

    _check_common(run_job)
    assert run_job["metadata"]["labels"]["app.kubernetes.io/component"] == "run_worker"
    assert run_job["metadata"]["labels"]["dagster/job"] == "partition_job"
    assert _container(run_job)["args"][:3] == ["dagster", "api", "execute_run"]
    assert _container(run_job)["resources"] == {"requests": {"cpu": "250m", "memory": "1Gi"},
                                                "limits": {"memory": "2Gi"}}
    assert _gpus(run_job) == 0 and KEY_ENV not in _env(run_job)

    assert set(steps) == {"partition_inputs", "global_inputs", "raw_prompts", "tokenized_prompts", "generations",
                          "qc_shards", "length_report"}
    for key, job in steps.items():
        _check_common(job)
        assert _env(job)["DAGSTER_RUN_STEP_KEY"]["value"] == key
        assert job["metadata"]["labels"]["dagster/op"] == key
        assert _container(job)["args"][:3] == ["dagster", "api", "execute_step"]

    gen = steps["generations"]
    assert _gpus(gen) == 2  # --tp 2: the launched SGLang server's tensor-parallel size
    assert _container(gen)["resources"]["requests"] == {"cpu": "16", "memory": "128Gi"}
    assert {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"} in gen["spec"]["template"]["spec"][
        "tolerations"]
    assert {m["mountPath"] for m in _container(gen)["volumeMounts"]} >= {"/dev/shm", "/mnt/eagle"}
    assert _env(gen)[KEY_ENV]["valueFrom"]["secretKeyRef"] == {"name": API_KEY_SECRET, "key": KEY_ENV}
    # Only the step that talks to the server sees its key; only it and training get GPUs.
    assert [k for k, j in steps.items() if KEY_ENV in _env(j)] == ["generations"]
    assert [k for k, j in steps.items() if _gpus(j)] == ["generations"]
    qc = _container(steps["qc_shards"])["resources"]
    assert qc == {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "16Gi"}}
    assert _container(steps["raw_prompts"])["resources"]["requests"] == {"cpu": "500m", "memory": "2Gi"}
    # The observation steps get the run launcher's defaults.
    assert _container(steps["partition_inputs"])["resources"] == _container(run_job)["resources"]


def test_training_run_and_steps_and_a_fleet_catalog(cluster):
    api, instance, tmp = cluster
    catalog = _catalog(tmp, {"url": "http://sglang-router.eagle.svc:30000", "api_key_env": KEY_ENV})
    assert server_gpus(load_catalog(catalog)) == 0
    repo = _recon_repo(tmp, catalog)
    _run_job, steps = _launch(api, instance, repo, "training_job", None)
    # every catalog has the evaluation asset (its held-out table; catalog.load.with_default_evaluation)
    assert set(steps) == {"global_inputs", "draft_vocab", "training_mix", "drafter_checkpoint", "evaluation"}
    for job in steps.values():
        _check_common(job)
    train = steps["drafter_checkpoint"]
    assert _gpus(train) == 1
    assert _container(train)["resources"]["requests"] == {"cpu": "8", "memory": "64Gi"}
    shm = {v["name"]: v for v in train["spec"]["template"]["spec"]["volumes"]}["dshm"]
    assert shm["emptyDir"] == {"medium": "Memory"}
    assert [k for k, j in steps.items() if _gpus(j)] == ["drafter_checkpoint"]
    assert not [k for k, j in steps.items() if KEY_ENV in _env(j)]

    # Against a fleet, generations is an HTTP client on CPU, and still the only pod with the key.
    _run_job, steps = _launch(api, instance, repo, "partition_job", "B2_opencodeinstruct")
    gen = steps["generations"]
    assert _gpus(gen) == 0 and _container(gen)["resources"]["requests"] == {"cpu": "2", "memory": "4Gi"}
    assert "tolerations" not in gen["spec"]["template"]["spec"] or not gen["spec"]["template"]["spec"]["tolerations"]
    assert [k for k, j in steps.items() if KEY_ENV in _env(j)] == ["generations"]


def test_step_config_follows_the_catalog_and_the_default_executor_is_in_process(tmp_path):
    from eagle_assets.definitions import build_definitions

    catalog = _catalog(tmp_path, {"url": None, "launch": "sglang", "extra_args": ["--tp-size=4", "--dp", "2"]})
    loaded = load_catalog(catalog)
    assert server_gpus(loaded) == 8
    assert step_k8s_config(loaded)["generations"]["container_config"]["resources"]["limits"][GPU_RESOURCE] == "8"
    assert "env" not in step_k8s_config(loaded)["generations"]["container_config"]  # no api_key_env: no key
    embedded = load_catalog(_catalog(tmp_path, {"url": None, "launch": "embedded"}))
    assert server_gpus(embedded) == 0
    defs = build_definitions(catalog, storage_root=tmp_path / "store")
    assert defs.resolve_job_def("partition_job").executor_def.name == "in_process"
    with pytest.raises(ValueError, match="EAGLE_ASSETS_EXECUTOR"):
        build_definitions(catalog, storage_root=tmp_path / "store", executor="ray")
