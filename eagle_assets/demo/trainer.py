"""The demo target's training loop, run in worker processes that :mod:`eagle_assets.demo.build` starts.

Reproducibility is the point of this module: the same recipe must give the same ``model.safetensors`` bytes
whatever the machine's load, the caller's thread settings, or how many cores there are. So:

- Every worker runs torch with ONE intra-op and one inter-op thread and ``torch.use_deterministic_algorithms``:
  a multi-threaded kernel splits its reductions by thread count, and a thread count that differs (another build,
  a busy machine, ``OMP_NUM_THREADS``) rounds differently; a tiny model trained from those weights can then tip
  into loops on some prompts (issue 12).
- The build starts workers with ``MKL_CBWR=COMPATIBLE``, ``ATEN_CPU_CAPABILITY=avx2`` and
  ``ONEDNN_MAX_CPU_ISA=AVX2``, so that every x86-64 machine with AVX2 takes the same kernels. ``COMPATIBLE`` is
  the one branch of MKL's conditional numerical reproducibility that holds across processor vendors: the ISA
  branches (``AVX2``, ``AVX512``) are "available only for Intel processors", elsewhere MKL silently takes its
  ``AUTO`` dispatch (oneMKL Developer Guide, "Specifying Code Branches"). With ``MKL_CBWR=AVX2`` an Intel Xeon
  with AVX-512 and AMX built other weights than an AVX2 machine from the same rows and step plan, and they failed
  the gate (tool_result 48/50). The price: MKL's SSE2 kernels take 2.7x the
  time of its AVX2 ones at the trainer's matrix shapes, and training takes 1.8x as long (126-137 CPU s per
  worker against 70). ATen's AVX2 kernels use exact IEEE operations only (no ``rcpps``/``rsqrtps``
  approximations). Measured, that is not enough across vendors: with these settings an AMD EPYC (AVX-512) builds
  other bytes (``3f72ee27...``) than the Intel Xeon that recorded ``991e7213...``, from the same rows and step
  plan (2026-12-04, twice, on two EPYC machines), so the bytes are reproducible on one kind of CPU, not on every
  x86-64. That is why the project ships the weights (``eagle_assets/demo/target/``): every machine serves the same
  bytes, and a rebuild is gated on its own replies.
- The gradient of a step is always the sum of exactly :data:`SHARDS` shard gradients, each computed on its own
  fixed rows (the plan in ``job.json``; nothing depends on timing). With two worker processes each computes one
  shard and gloo's all-reduce adds them (with two operands a sum has one rounding and ``a + b == b + a``); with
  one worker the same two shard gradients are computed in turn and added. The bits are the same either way, so
  two cores make the build about twice as fast without changing it.

Files in the work directory (written by the build): ``job.json`` (model config, optimizer settings, the step plan),
``rows.json`` (``[ids, n_prompt, weights, reply flags]`` per transcript) and, when the build gates the target,
``gate.json`` (``{"prompts": [[ids]...], "caps": [...]}``). Rank 0 saves the model into ``job["out"]`` and writes
``train.json``; every rank then generates the gate replies of its share of the prompts (``gate-<rank>.json``), with
the embedded server's decoder in float64 (:func:`eagle_assets.demo.gate.generate_replies`).
Rank 0 also writes the sha256 of ``model.safetensors`` into ``train.json``.

CLI (started by the build, not by hand): ``python -m eagle_assets.demo.trainer WORK_DIR RANK WORLD``; progress
lines on stdout (rank 0 only).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from eagle_assets.demo.recipe import SHARDS, WORLD_SIZES


def _log(rank: int, msg: str) -> None:
    if rank == 0:
        print(msg, flush=True)


def _shard_tensors(rows: list[list[Any]], shard: list[int], pad_id: int, prompt_loss_weight: float):
    """(ids [B, T] int64, weights [B, T-1] float32 per target token, reply mask [B, T-1] bool) of one shard.

    A row is ``[ids, n_prompt, weights of ids[n_prompt:], reply flags of ids[n_prompt:]]`` (the flags pick the
    tokens the logged reply loss averages: a multi-turn row has prompt parts between its replies)."""
    import torch

    width = max(len(rows[i][0]) for i in shard)
    ids = torch.full((len(shard), width), pad_id, dtype=torch.long)
    weights = torch.zeros((len(shard), width), dtype=torch.float32)
    for r, i in enumerate(shard):
        seq, n_prompt, reply_w = rows[i][:3]
        ids[r, :len(seq)] = torch.tensor(seq)
        weights[r, 1:n_prompt] = prompt_loss_weight
        weights[r, n_prompt:len(seq)] = torch.tensor(reply_w, dtype=torch.float32)
    is_reply = torch.zeros_like(weights, dtype=torch.bool)
    for r, i in enumerate(shard):
        seq, n_prompt, _, flags = rows[i]
        is_reply[r, n_prompt:len(seq)] = torch.tensor(flags, dtype=torch.bool)
    return ids, weights[:, 1:], is_reply[:, 1:]


def train(job: dict[str, Any], rows: list[list[Any]], rank: int, world: int):
    """Run the plan; returns the trained model (identical on every rank) and ``train.json``'s figures.

    Loss of a step: sum over both shards of ``nll * weight`` over target tokens, divided by the step's number of
    weighted target tokens (the same divisor for both shards, so the shard gradients add up to the step's).
    """
    import torch
    import torch.distributed as dist
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(job["seed"])
    model = Qwen3ForCausalLM(Qwen3Config(**job["config"]))
    model.train()
    params = [p for p in model.parameters()]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": job["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}], lr=job["lr"], betas=tuple(job["betas"]))
    sizes = [p.numel() for p in params]
    pad_id = job["config"]["pad_token_id"]
    steps = job["steps"]
    t0, cpu0 = time.monotonic(), time.process_time()
    reply_loss = float("nan")
    parent = os.getppid()
    for n, step in enumerate(steps):
        if os.getppid() != parent:  # the build that started this worker is gone: nobody will use the weights
            raise SystemExit(f"worker {rank}: the build process {parent} exited; stopping")
        for group in opt.param_groups:
            group["lr"] = step["lr"]
        denom = step["weighted_tokens"]
        partial = []  # this rank's shard gradients, flat, in shard order
        stats = torch.zeros(2, dtype=torch.float64)  # reply nll sum, reply tokens
        for s in range(SHARDS):
            if world > 1 and s != rank:
                continue
            flat = torch.zeros(sum(sizes), dtype=torch.float32)
            shard = step["shards"][s]
            if shard:
                ids, w, is_reply = _shard_tensors(rows, shard, pad_id, job["prompt_loss_weight"])
                # Right padding: real tokens never attend to pads, so the causal mask is all that is needed.
                logits = model(input_ids=ids).logits[:, :-1].float()
                nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                        reduction="none").view(ids.shape[0], -1)
                loss = (nll * w).sum() / denom
                model.zero_grad(set_to_none=True)
                loss.backward()
                flat += torch.cat([p.grad.reshape(-1) for p in params])
                stats += torch.tensor([float(nll.detach()[is_reply].double().sum()), float(is_reply.sum())],
                                      dtype=torch.float64)
            partial.append(flat)
        if world > 1:
            grad = partial[0]
            dist.all_reduce(grad)
            dist.all_reduce(stats)
        else:
            grad = partial[0] + partial[1]
        for p, chunk in zip(params, grad.split(sizes)):
            if p.grad is None:
                p.grad = torch.empty_like(p)
            p.grad.copy_(chunk.view_as(p))
        torch.nn.utils.clip_grad_norm_(params, job["grad_clip"])
        opt.step()
        reply_loss = float(stats[0] / max(1.0, float(stats[1])))
        if n % 20 == 0 or n == len(steps) - 1:
            _log(rank, f"step {n + 1}/{len(steps)} reply loss {reply_loss:.3f} ({time.monotonic() - t0:.0f}s)")
    return model, {"train_steps": len(steps), "final_reply_loss": round(reply_loss, 4),
                   "train_seconds": round(time.monotonic() - t0, 1),
                   "train_cpu_seconds_per_worker": round(time.process_time() - cpu0, 1), "workers": world}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    work, rank, world = Path(args[0]), int(args[1]), int(args[2])
    if world not in WORLD_SIZES or not 0 <= rank < world:
        raise SystemExit(f"rank {rank} of world {world}: the demo build runs 1 or {SHARDS} workers")
    import torch
    import torch.distributed as dist
    from transformers import GenerationConfig

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    torch.use_deterministic_algorithms(True)
    job = json.loads((work / "job.json").read_text())
    gate_file = work / "gate.json"
    rows = json.loads((work / "rows.json").read_text())
    if world > 1:
        dist.init_process_group("gloo", store=dist.FileStore(str(work / "store"), world), rank=rank,
                                world_size=world, timeout=timedelta(seconds=job.get("timeout_s", 900)))
    try:
        model, figures = train(job, rows, rank, world)
        out = Path(job["out"])
        if rank == 0:
            model.eval()
            eos_id, pad_id = job["config"]["eos_token_id"], job["config"]["pad_token_id"]
            model.generation_config = GenerationConfig(eos_token_id=[eos_id, pad_id], pad_token_id=pad_id,
                                                       bos_token_id=None, do_sample=False)
            model.save_pretrained(out, safe_serialization=True)
            figures["weights_sha256"] = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
            (work / "train.json").write_text(json.dumps(figures) + "\n")
        if world > 1:
            dist.barrier()
        if gate_file.exists():
            _gate_share(out, json.loads(gate_file.read_text()), rank, world, work)
    finally:
        if world > 1:
            dist.destroy_process_group()
    return 0


def _gate_share(model_dir: Path, gate: dict[str, Any], rank: int, world: int, work: Path) -> None:
    """Greedy replies to prompts ``rank::world`` of the gate, as the embedded server generates them (float64, so
    which prompts share a batch does not change any reply)."""
    from eagle_assets.demo.gate import generate_replies
    from eagle_assets.serving.engine import load_causal_lm

    t0, cpu0 = time.monotonic(), time.process_time()
    model = load_causal_lm(str(model_dir), dtype="auto")
    idx = list(range(rank, len(gate["prompts"]), world))
    replies = generate_replies(model, None, [gate["prompts"][i] for i in idx], [gate["caps"][i] for i in idx])
    (work / f"gate-{rank}.json").write_text(json.dumps({"index": idx, "output_ids": replies}) + "\n")
    _log(rank, f"gate replies: {len(idx)} of {len(gate['prompts'])} prompts in this worker "
               f"({time.monotonic() - t0:.0f}s, {time.process_time() - cpu0:.0f} CPU s)")


if __name__ == "__main__":
    raise SystemExit(main())
