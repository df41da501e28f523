"""Kubernetes: one pod per step, with the resources each asset needs (dagster-k8s ``k8s_job_executor``).

Set ``EAGLE_ASSETS_EXECUTOR=k8s`` in the code location's environment (the Helm user deployment in docs/scaling.md)
and every run -- ``partition_job``, ``training_job``, a backfill, an automation run -- executes each step as its own
Kubernetes Job, built by dagster-k8s from the run launcher's settings (image, env, secrets, the shared volume) and,
per step, from :func:`step_k8s_config` (the executor's ``per_step_k8s_config``, keyed by op name, which dagster-k8s
merges over the step's ``dagster-k8s/config`` op tags: ``K8sStepHandler._get_container_context``):

- ``drafter_checkpoint``: GPUs (``nvidia.com/gpu``), a memory-backed ``/dev/shm``, the GPU taint tolerated: one
  for the inline trainer, ``training.nproc_per_node`` with ``training.launcher: torchrun`` (one per rank, with
  :data:`CPU_PER_GPU` CPUs and :data:`MEMORY_GI_PER_GPU` GiB each; :func:`training_gpus`). The built-in trainer
  computes on CPU today (``eagle_assets.drafter.training.distributed``), so what its processes use is the CPUs.
- ``generations``: GPUs only when the catalog launches SGLang in the step (``server.url`` null, ``launch: sglang``),
  as many as the server's ``--tp`` x ``--dp`` in ``server.extra_args``; an HTTP client on CPU when it connects to a
  fleet (``server.url``) or launches the embedded CPU server. The pod gets the API key, when the catalog names
  one (``server.api_key_env``), from the Secret :data:`API_KEY_SECRET` (key = the variable's name); no other
  step sees it.
- ``tokenized_prompts``, ``qc_shards``: CPU and memory (tokenizer, vocab-sized scans).
- ``raw_prompts``, ``length_report``, ``dataset_qc``, ``draft_vocab``, ``training_mix``: a small CPU request.

A chunk of a dataset (catalog ``chunks``) is a partition like any other: each chunk's run gets the same per-step
pods, so the chunks of one dataset run as parallel runs, each with its own pods, as the run queue allows.
- the observations of ``assets.inputs``: the run launcher's default resources.

Resources are computed from the catalog because the GPU need of ``generations`` depends on it; the values are
per-run executor config, so the Launchpad can override one run's. Without ``EAGLE_ASSETS_EXECUTOR`` (the
default ``in_process``) nothing here is used.
"""

from __future__ import annotations

import os
import re

import dagster as dg

from eagle_assets.catalog import Catalog

EXECUTOR_ENV = "EAGLE_ASSETS_EXECUTOR"
EXECUTOR_KINDS = ("in_process", "k8s")
API_KEY_SECRET = "eagle-sglang-api-key"
GPU_RESOURCE = "nvidia.com/gpu"
GPU_TOLERATION = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
# Per step pod: requests are what the scheduler reserves; memory limits are twice that (OOM kill, not node pressure).
SMALL_CPU = {"requests": {"cpu": "500m", "memory": "2Gi"}, "limits": {"memory": "4Gi"}}
TOKENIZER_CPU = {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "16Gi"}}
CLIENT_CPU = {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "8Gi"}}
CPU_PER_GPU, MEMORY_GI_PER_GPU = 8, 64
SMALL_STEPS = ("raw_prompts", "length_report", "dataset_qc", "draft_vocab", "training_mix")
TOKENIZER_STEPS = ("tokenized_prompts", "qc_shards")
TRAINING_GPUS = 1  # the inline trainer: one process


def executor_kind(kind: str | None = None) -> str:
    """``kind``, else ``$EAGLE_ASSETS_EXECUTOR``, else ``in_process``; raises ``ValueError`` naming the accepted
    values."""
    kind = kind or os.environ.get(EXECUTOR_ENV, "").strip() or "in_process"
    if kind not in EXECUTOR_KINDS:
        raise ValueError(f"${EXECUTOR_ENV}={kind!r}: use one of {list(EXECUTOR_KINDS)} (k8s = one Kubernetes "
                         "Job per step, needs dagster-k8s and the K8sRunLauncher)")
    return kind


def _flag_value(args: list[str], names: tuple[str, ...]) -> int:
    """The integer after (or ``=`` in) the last of ``names`` in ``args``; 1 when absent."""
    value = 1
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args) and re.fullmatch(r"\d+", args[i + 1]):
                value = int(args[i + 1])
            elif arg.startswith(name + "=") and re.fullmatch(r"\d+", arg.split("=", 1)[1]):
                value = int(arg.split("=", 1)[1])
    return value


def server_gpus(catalog: Catalog) -> int:
    """GPUs the ``generations`` step needs for the server it launches: 0 unless it launches SGLang, else SGLang's
    tensor-parallel x data-parallel size from ``server.extra_args`` (``--tp``/``--tp-size``/
    ``--tensor-parallel-size``, ``--dp``/``--dp-size``/``--data-parallel-size``; SGLang's ``server_args.py``)."""
    server = catalog.server
    if server.urls or server.launch != "sglang":
        return 0
    args = list(server.extra_args)
    tp = _flag_value(args, ("--tp", "--tp-size", "--tensor-parallel-size"))
    dp = _flag_value(args, ("--dp", "--dp-size", "--data-parallel-size"))
    return tp * dp


def training_gpus(catalog: Catalog) -> int:
    """GPUs of the ``drafter_checkpoint`` pod: :data:`TRAINING_GPUS` inline, one per process under torchrun."""
    t = catalog.training
    return int(t.nproc_per_node) if t.launcher == "torchrun" else TRAINING_GPUS


def _gpu_step(gpus: int) -> dict:
    memory = f"{MEMORY_GI_PER_GPU * gpus}Gi"
    return {
        "container_config": {
            "resources": {"requests": {"cpu": str(CPU_PER_GPU * gpus), "memory": memory},
                          "limits": {GPU_RESOURCE: str(gpus), "memory": memory}},
            # NCCL and the DataLoader workers share tensors through /dev/shm, which is 64 MiB in a default pod.
            "volume_mounts": [{"name": "dshm", "mount_path": "/dev/shm"}],
        },
        "pod_spec_config": {"tolerations": [GPU_TOLERATION],
                            "volumes": [{"name": "dshm", "empty_dir": {"medium": "Memory"}}]},
    }


def step_k8s_config(catalog: Catalog) -> dict[str, dict]:
    """``per_step_k8s_config`` of the executor: op name -> dagster-k8s user-defined config (``container_config``,
    ``pod_spec_config``) of that step's pod, for ``catalog``."""
    steps: dict[str, dict] = {name: {"container_config": {"resources": SMALL_CPU}} for name in SMALL_STEPS}
    steps.update({name: {"container_config": {"resources": TOKENIZER_CPU}} for name in TOKENIZER_STEPS})
    gpus = server_gpus(catalog)
    generations = _gpu_step(gpus) if gpus else {"container_config": {"resources": CLIENT_CPU}}
    key_env = catalog.server.api_key_env
    if key_env:
        generations["container_config"]["env"] = [
            {"name": key_env, "value_from": {"secret_key_ref": {"name": API_KEY_SECRET, "key": key_env}}}]
    steps["generations"] = generations
    steps["drafter_checkpoint"] = _gpu_step(training_gpus(catalog))
    return steps


def build_executor(catalog: Catalog, kind: str | None = None) -> dg.ExecutorDefinition:
    """The executor of every job and of the Definitions: ``in_process`` (one process per run) or the dagster-k8s
    ``k8s_job_executor`` configured with :func:`step_k8s_config` (``kind`` defaults to :func:`executor_kind`)."""
    kind = executor_kind(kind)
    if kind == "in_process":
        return dg.in_process_executor
    from dagster_k8s import k8s_job_executor

    return k8s_job_executor.configured({"per_step_k8s_config": step_k8s_config(catalog)}, name="k8s_job_executor")
