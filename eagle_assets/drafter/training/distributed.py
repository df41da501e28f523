"""Data-parallel drafter training: N processes (``torchrun``) share every global batch of the built-in trainer.

Why DDP and not FSDP: the drafter is one decoder layer plus ``fc`` and its lm_head (tens of MB for an 8B-class
target, a few hundred for a 1T-class one); its weights, gradients and AdamW moments fit on every device many
times over, so sharding them (FSDP) would only add an all-gather before every forward and a reduce-scatter after
every backward. What costs memory and time is the frozen target's forward, and each rank already does that for its
own rows only. :class:`torch.nn.parallel.DistributedDataParallel` keeps a full replica per rank and all-reduces
the gradients (bucketed, overlapped with the backward), which is all the drafter needs.

What stays the same as one process, by construction:

- **The global batch.** Every rank builds the same batches from the same rows
  (``features.local_cache.make_batches``), plans the same steps and draws the same epoch order; rank ``r`` of
  ``W`` takes rows ``batch[r::W]`` of each batch (:meth:`DataParallel.shard`; rows are sorted longest first, so
  the strided split balances tokens). The
  step a run takes does not depend on ``W``, and so neither do the weights (up to float rounding: the features
  and the drafter run on smaller padded batches, and the gradient is summed in another order).
- **The loss.** One process takes, per TTT step ``i``, the mean soft cross-entropy over that step's supervised
  positions of the whole batch (``ttt_loss``). Here each rank sums its positions' cross-entropy and divides by
  the *global* count of step ``i`` (one all-reduce of the per-step counts before the drafter runs), and the
  backward runs on ``W`` times that, because DDP averages gradients over ranks: the averaged gradient is the
  gradient of the one-process loss. Gradient clipping then sees the global norm on every rank. A block family
  (DFlash, DSpark) divides its rank's weighted sum by the global batch's weighted block slots the same way
  (its ``loss_counts``), over the blocks the loop drew once for the whole global batch (its ``draw_anchors``):
  every rank draws what one process draws, so torch's generator stays the same on every rank.
- **Metrics.** Per-step cross-entropy sums, correct argmaxes and out-of-draft counts are all-reduced, so every
  rank logs the losses and accuracies one process would.
- **Validation, early stopping, export.** Rank 0 scores the validation rows (learning curve, simulated tau) and
  broadcasts the point; every rank applies the same early-stopping decision. Rank 0 alone writes training states,
  exports the checkpoint and writes ``training_metrics.json``.
- **Resume.** The training state lives in one directory that every rank reads (a shared file system on several
  nodes): rank 0 loads it first (and clears a state written for other inputs), then the others load the same
  committed state; a rank that resumed a different step stops the run (:class:`DistributedError`).

Backends: ``gloo`` for CPU tensors, ``nccl`` for CUDA tensors (:func:`default_backend`). The built-in trainer
computes on CPU today (no device placement), so it runs with ``gloo``; ``nccl`` is accepted only where the
trainer's tensors are on CUDA.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence, TypeVar

import torch
from torch import nn

from eagle_assets.drafter.family import TrainBatch

T = TypeVar("T")

#: torchrun's environment (``torch.distributed.run``): a process is a rank of a job when these are set.
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
BACKENDS = ("gloo", "nccl")


class DistributedError(RuntimeError):
    """The ranks of a data-parallel run disagree (a different resumed step, a state directory not shared)."""


def default_backend(device: torch.device) -> str:
    """``nccl`` for a CUDA device, else ``gloo`` (the backends ``torch.distributed`` supports for each)."""
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass
class DataParallel:
    """This process's place in a data-parallel run (``world == 1``: a single process, every method a no-op).

    Attributes:
        rank / world: this process's rank and the number of processes.
        device: where the trainer's tensors live (CPU today; see the module docstring).
        backend: the ``torch.distributed`` backend of the process group (None for a single process).
    """

    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")
    backend: str | None = None

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that logs, saves training states and exports."""
        return self.rank == 0

    # -- collectives ---------------------------------------------------------------------------------------------

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def all_sum(self, values: Sequence[float], dtype: torch.dtype = torch.float64) -> list[float]:
        """Element-wise sum of ``values`` over the ranks (float64 by default: exact for counts below 2^53)."""
        if self.world == 1:
            return list(values)
        t = torch.tensor(list(values), dtype=dtype, device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
        return t.tolist()

    def from_main(self, compute: Callable[[], T]) -> T:
        """``compute()`` on rank 0, its result sent to every rank (``broadcast_object_list``: picklable results,
        within the job's own process group). An exception on rank 0 ends the job (torchrun stops the others)."""
        if self.world == 1:
            return compute()
        box: list[Any] = [compute() if self.is_main else None]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather(self, value: T) -> list[T]:
        """Every rank's picklable ``value``, in rank order (``all_gather_object``); ``[value]`` for one process."""
        if self.world == 1:
            return [value]
        out: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(out, value)
        return out

    def main_first(self, fn: Callable[[], None]) -> None:
        """``fn()`` on rank 0, then on the other ranks (all at once), then every rank goes on together: for steps
        with side effects on shared files that rank 0 must settle first (loading or clearing a training state)."""
        if self.is_main:
            fn()
        self.barrier()
        if not self.is_main:
            fn()
        self.barrier()

    def check_same(self, what: str, value: int) -> None:
        """Raise :class:`DistributedError` unless every rank passes the same integer ``value``."""
        if self.world == 1:
            return
        # one MAX all-reduce of (v, -v) gives the largest and (negated) the smallest value of any rank
        t = torch.tensor([value, -value], dtype=torch.int64, device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        high, low = t[0].item(), -t[1].item()
        if high != low:
            raise DistributedError(
                f"the ranks disagree on {what} (rank {self.rank} has {value}; values range from {low} to {high}); "
                "every rank must see the same state directory (a shared file system) and the same inputs"
            )

    # -- the data-parallel step ----------------------------------------------------------------------------------

    def shard(self, batch: Sequence[int]) -> list[int]:
        """This rank's rows of a global batch: ``batch[rank::world]`` (may be empty when the batch has fewer
        rows than there are ranks)."""
        return list(batch[self.rank :: self.world])

    def owned_rows(self, batches: Sequence[Sequence[int]]) -> list[int] | None:
        """Every row this rank ever trains on (its shard of each batch), sorted; None for a single process (all
        rows). The batches are fixed for the run, only their order changes, so each rank's target features are
        computed for these rows only."""
        if self.world == 1:
            return None
        return sorted(i for b in batches for i in self.shard(b))

    def wrap(self, model: nn.Module) -> nn.Module | None:
        """The DDP-wrapped TTT objective of ``model`` (None for a single process). DDP broadcasts rank 0's
        parameters and buffers here, so call it on every rank at the same point, after any resume."""
        if self.world == 1:
            return None
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(_Objective(model), broadcast_buffers=False)

    def batch_loss(
        self,
        loss: Callable[..., tuple[torch.Tensor, list[tuple[int, float, int]]]],
        model: nn.Module,
        objective: nn.Module | None,
        batch: TrainBatch | None,
        weights: Sequence[float],
        counts: Callable[[TrainBatch, int], list[int]],
    ) -> tuple[torch.Tensor, float, list[tuple[int, float, int]], int]:
        """The loss of this rank's shard of a global batch, and the global batch's metrics.

        Args:
            loss: the drafter family's ``batch_loss`` (``drafter.family.DraftFamily``).
            model: the drafter; objective: :meth:`wrap`'s module (None for a single process).
            batch: this rank's shard (``drafter.family.TrainBatch``); None for an empty shard.
            weights: per step its loss weight.
            counts: the family's ``loss_counts`` (per step, the positions the loss normalizes by). Summed over
                the ranks, they are the
                ``normalizer`` each rank's ``loss`` divides by, and the global batch's per-step position counts.

        Returns:
            ``(loss to backward, weighted loss of the global batch, per step (supervised positions, summed CE,
            correct argmaxes) of the global batch, out-of-draft positions of the global batch)``. The loss has no
            gradient when the global batch supervises nothing (every rank then skips the step).
        """
        sup = batch.supervision if batch is not None else None
        if self.world == 1:
            total, per_step = loss(model, batch, weights)
            return total, float(total.detach()), per_step, sup.out_of_draft
        k = len(weights)
        local = [int(c) for c in counts(batch, k)] + [sup.out_of_draft] if batch is not None \
            else [0] * (k + 1)
        summed = [int(c) for c in self.all_sum(local, dtype=torch.int64)]
        n_global, out_of_draft = summed[:k], summed[k]
        if not any(n_global):
            return torch.zeros(()), 0.0, [(0, 0.0, 0)] * k, out_of_draft
        total, per_step = objective(loss, batch, weights, n_global)
        # each rank's loss is its share of the global batch's: their sum is the one-process loss
        sums = self.all_sum([float(total.detach())] + [ce for _, ce, _ in per_step] + [c for _, _, c in per_step])
        per_step = [(n_global[i], sums[1 + i], int(sums[1 + k + i])) for i in range(k)]
        return total * self.world, float(sums[0]), per_step, out_of_draft


class _Objective(nn.Module):
    """The family's batch loss as a module's ``forward``, so DDP sees the drafter's forward and can reduce its
    gradients."""

    def __init__(self, drafter: nn.Module):
        super().__init__()
        self.drafter = drafter

    def forward(self, loss, batch, weights, normalizer):
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        # Every parameter takes part in every backward (DDP waits for a gradient of each): a rank with an empty
        # shard, or with no position at some TTT step, contributes exact zeros.
        zero = sum(p.sum() for p in params) * 0.0
        if batch is None:
            return zero, [(0, 0.0, 0)] * len(weights)
        total, per_step = loss(self.drafter, batch, weights, normalizer=normalizer)
        return total + zero, per_step


def from_environment(backend: str | None = None, timeout_s: float = 1800.0) -> DataParallel:
    """Join the ``torchrun`` job this process belongs to (a single-process :class:`DataParallel` outside one).

    Reads ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` (``torch.distributed.run`` sets them, with
    ``MASTER_ADDR``/``MASTER_PORT``) and initializes the default process group with the ``env://`` rendezvous.

    Args:
        backend: ``gloo`` or ``nccl``; None = :func:`default_backend` of the trainer's device (CPU: ``gloo``).
        timeout_s: seconds a collective waits for the other ranks before failing (torch's default is 30 min).

    Raises:
        ValueError: an unknown backend, or ``nccl`` while the trainer computes on CPU.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or "RANK" not in os.environ:
        return DataParallel()
    device = torch.device("cpu")  # the built-in trainer places nothing on an accelerator (module docstring)
    chosen = backend or default_backend(device)
    if chosen not in BACKENDS:
        raise ValueError(f"unknown torch.distributed backend {chosen!r}; use one of {list(BACKENDS)}")
    if chosen == "nccl" and device.type != "cuda":
        raise ValueError("backend nccl needs CUDA tensors, but the built-in drafter trainer computes on CPU; use "
                         "--backend gloo (the default)")
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(chosen, init_method="env://", timeout=timedelta(seconds=timeout_s))
    return DataParallel(rank=torch.distributed.get_rank(), world=torch.distributed.get_world_size(), device=device,
                        backend=chosen)


def shutdown(parallel: DataParallel) -> None:
    """Wait for every rank (rank 0 may still be exporting), then leave the process group."""
    if parallel.world > 1 and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
