"""Crash-safe, resumable state of a drafter training run (no pickles), and the fingerprint that decides whether a
saved state belongs to the run being started.

A run is a pure function of (config, data, vocab, target, thread count): batch order of epoch ``e`` is drawn from
``SeedSequence([seed, e])`` alone, the learning rate is a function of the step number alone, validation is a
forward pass, the drafter has no dropout and the loop draws no random numbers (its torch RNG stream is still saved
and restored so that a future random op stays reproducible). So a resumed run ends with exactly the weights of an
unbroken one (bitwise on CPU with the same thread count). See :class:`TrainState` for the files and the protocol.
"""

from __future__ import annotations

import hashlib
import json
import os
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from eagle_assets.drafter.data.vocab import DraftVocab
from eagle_assets.drafter.eagle3.model import DrafterConfig, canonical_name
from eagle_assets.drafter.features.local_cache import PreparedRow
from eagle_assets.drafter.training.learning_curve import CurvePoint, StepMetrics
from eagle_assets.drafter.training.recipe import TRAJECTORY_FIELDS, StepPlan, TrainConfig
from eagle_assets.storage.guard import refuse_symlink, stage_lock
from eagle_assets.storage.shards import atomic_file, fsync_path

#: format of the files :class:`TrainState` writes. Bump it whenever a code change alters the training trajectory
#: (loss, batching, initialization, optimizer, evaluation), so that states from the old code are not continued.
STATE_VERSION = 2


def _hash_tensors(items: Iterator[tuple[str, Any]]) -> str:
    """sha256 over ``(name, shape, dtype, raw bytes)`` of tensors / arrays, in the given order."""
    h = hashlib.sha256()
    for name, value in items:
        if isinstance(value, torch.Tensor):
            t = value.detach().to("cpu").contiguous()
            h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
            if t.numel():
                h.update(t.reshape(-1).view(torch.uint8).numpy())
        else:
            a = np.ascontiguousarray(value)
            h.update(f"{name}|{a.shape}|{a.dtype.str}|".encode())
            h.update(a.tobytes())
    return h.hexdigest()


def fingerprint(
    config: TrainConfig,
    dconf: DrafterConfig,
    rows: list[PreparedRow],
    validation: list[PreparedRow],
    draft_vocab: DraftVocab,
    target: nn.Module,
    plan: StepPlan,
) -> dict[str, Any]:
    """What a saved state must agree on to be continued: JSON-normalized trajectory config and step plan, drafter
    shape, and sha256 of the training rows and the validation rows (after truncation, in order), of the draft vocab
    and of every target parameter."""
    trajectory = {name: getattr(config, name) for name in TRAJECTORY_FIELDS}
    trajectory.update(resolved_warmup_steps=plan.warmup_steps, total_steps=plan.total_steps,
                      eval_every_steps=plan.eval_every_steps)
    return json.loads(json.dumps({
        "config": trajectory,
        "drafter": dconf.to_dict(),
        "data": _hash_tensors((f"row{i}", a) for i, r in enumerate(rows) for a in (r.ids, r.mask)),
        "validation": _hash_tensors((f"row{i}", a) for i, r in enumerate(validation) for a in (r.ids, r.mask)),
        "vocab": _hash_tensors([("d2t", draft_vocab.d2t), ("t2d", draft_vocab.t2d)]),
        "target": _hash_tensors(iter(target.named_parameters())),
    }))


def fingerprint_diff(old: Any, new: dict[str, Any]) -> str:
    """Human-readable differences between two fingerprints ('' when equal)."""
    if not isinstance(old, dict):
        return "it has no fingerprint"
    out = []
    old_cfg, new_cfg = old.get("config") or {}, new["config"]
    changed = [f"{k} {old_cfg.get(k)!r} -> {new_cfg.get(k)!r}" for k in new_cfg if old_cfg.get(k) != new_cfg.get(k)]
    if changed:
        out.append("config " + ", ".join(changed))
    if old.get("drafter") != new["drafter"]:
        keys = [k for k in new["drafter"] if (old.get("drafter") or {}).get(k) != new["drafter"][k]]
        out.append(f"drafter shape ({', '.join(keys)})")
    for key, what in (("data", "training rows"), ("validation", "validation rows"), ("vocab", "draft vocab"),
                      ("target", "target weights"), ("features", "served feature spec")):
        if old.get(key) != new.get(key):
            out.append(what)
    return "; ".join(out)


@dataclass
class Progress:
    """Everything of a run that a state must carry besides tensors (JSON-exact: floats round-trip via repr).

    ``loss_sum``/``correct``/``count`` accumulate the running epoch per TTT step; ``since_eval_loss`` /
    ``since_eval_steps`` the steps since the last evaluation; ``stopping`` is an :class:`EarlyStopping` record.
    """

    step: int
    epochs: list[dict[str, Any]]
    loss_sum: list[float]
    correct: list[float]
    count: list[float]
    loss_total: float
    out_of_draft: int
    tokens_done: int
    train_seconds: float
    steps: list[StepMetrics]
    curve: list[CurvePoint] = field(default_factory=list)
    since_eval_loss: float = 0.0
    since_eval_steps: int = 0
    stopping: dict[str, Any] | None = None
    eval_seconds: float = 0.0

    @classmethod
    def fresh(cls, k: int) -> "Progress":
        return cls(0, [], [0.0] * k, [0.0] * k, [0.0] * k, 0.0, 0, 0, 0.0, [])

    def new_epoch(self, k: int) -> None:
        self.loss_sum, self.correct, self.count, self.loss_total = [0.0] * k, [0.0] * k, [0.0] * k, 0.0

    def record(self) -> dict[str, Any]:
        return {
            "epochs": self.epochs, "loss_sum": self.loss_sum, "correct": self.correct, "count": self.count,
            "loss_total": self.loss_total, "out_of_draft": self.out_of_draft, "tokens_done": self.tokens_done,
            "train_seconds": self.train_seconds, "curve": [p.to_dict() for p in self.curve],
            "since_eval_loss": self.since_eval_loss, "since_eval_steps": self.since_eval_steps,
            "stopping": self.stopping, "eval_seconds": self.eval_seconds,
        }

    @classmethod
    def from_record(cls, step: int, record: dict[str, Any], steps: list[StepMetrics]) -> "Progress":
        return cls(
            step, record["epochs"], record["loss_sum"], record["correct"], record["count"], record["loss_total"],
            record["out_of_draft"], record["tokens_done"], record["train_seconds"], steps,
            [CurvePoint(**p) for p in record["curve"]], record["since_eval_loss"], record["since_eval_steps"],
            record["stopping"], record["eval_seconds"],
        )


@dataclass
class Snapshot:
    """A committed state as read back: steps done, the ``state.json`` record, its tensors and step metrics."""

    step: int
    record: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    steps: list[StepMetrics]


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` into a hidden sibling, fsync it, rename it over ``path``: readers see old or new, never half
    (``storage.shards.atomic_file`` with ``durable``)."""
    with atomic_file(path, durable=True) as tmp:
        write(Path(tmp))


class TrainState:
    """The resumable state of one training run, kept in a directory (no pickles; crash-safe).

    Files:
        ``state.json``: the commit record: :data:`STATE_VERSION`, the run fingerprint (see :func:`fingerprint`),
            optimizer steps done, the tensors file it goes with and that file's size, completed epoch summaries,
            the running epoch's accumulators and counters, the learning curve and the early-stopping record.
        ``tensors-<step>.safetensors``: drafter weights ``model.<name>`` (float32, the drafter's state names;
            a state written before multi-layer drafts holds ``midlayer.*``, read as ``layers.0.*``), the best
            validation weights so far ``best.<name>``
            (when there are validation rows), AdamW state ``optim.<param index>.<key>`` (``step`` float32 scalar,
            ``exp_avg`` and ``exp_avg_sq`` float32 shaped like the parameter; index = position in
            ``model.parameters()``) and the torch CPU RNG state ``rng.torch`` (uint8).
        ``steps.jsonl``: one :class:`StepMetrics` per line, appended; only the first ``step`` lines are valid.
        ``.lock``: ``flock``-ed while a run uses the directory.

    Save protocol: the tensors file is written under a temporary name, fsynced and renamed; the new metrics lines
    are appended and fsynced; then ``state.json`` is written the same way, and its rename is the commit. A save
    killed at any point leaves the previous ``state.json`` and the tensors file it names intact (older tensors
    files are deleted only after the commit; extra metrics lines are cut on load), so a half-written state is never
    loaded. Reading uses JSON and safetensors only (no ``torch.load``): a planted file cannot run code.
    """

    STATE = "state.json"
    STEPS = "steps.jsonl"

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lines = 0  # metrics lines already in steps.jsonl that belong to the committed state

    @contextmanager
    def lock(self) -> Iterator[None]:
        """Hold an exclusive ``flock`` on ``.lock`` for the block (the storage layer's ``stage_lock``).

        Raises:
            PartitionBusyError (a ``RuntimeError``): another process holds it.
            SymlinkRefusedError: the state directory or its ``.lock`` is a symbolic link (its files are deleted
                and replaced: through a link they would be the link target's).
        """
        busy = (f"another training run is using the state directory {self.path} (its .lock is held); "
                "wait for it to finish or pass a different state_dir")
        with stage_lock(self.path, "train_state", busy=busy, lock_name=".lock"):
            yield

    def load(self, fingerprint: dict[str, Any]) -> tuple[Snapshot | None, str | None]:
        """The committed state if it was written for ``fingerprint``.

        Returns:
            ``(snapshot, None)`` for a usable state, ``(None, None)`` when there is none, ``(None, reason)`` when
            there is one that must not be continued (other inputs, other format, unreadable).
        """
        path = self.path / self.STATE
        if not path.exists():
            self.clear()  # leftovers of a first save that died before its commit
            return None, None
        try:
            record = json.loads(path.read_text())
            version, step = record.get("version"), int(record["step"])
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            return None, f"its {self.STATE} is unreadable ({exc})"
        if version != STATE_VERSION:
            return None, f"it was written in state format {version}, this trainer writes format {STATE_VERSION}"
        diff = fingerprint_diff(record.get("fingerprint"), fingerprint)
        if diff:
            return None, f"it was written for other inputs (differences: {diff})"
        tensors_path = self.path / str(record.get("tensors_file"))
        try:
            size = tensors_path.stat().st_size
            if size != record.get("tensors_bytes"):
                return None, f"{tensors_path.name} has {size} bytes, the state records {record.get('tensors_bytes')}"
            tensors = load_file(str(tensors_path))
        except (OSError, SafetensorError) as exc:
            return None, f"its tensors file is unreadable ({exc})"
        steps: list[StepMetrics] = []
        try:
            with open(self.path / self.STEPS) as fh:
                for line in fh:
                    if len(steps) == step:
                        break
                    steps.append(StepMetrics(**json.loads(line)))
        except (OSError, ValueError, TypeError) as exc:
            return None, f"its {self.STEPS} is unreadable ({exc})"
        if len(steps) != step:
            return None, f"its {self.STEPS} has {len(steps)} steps, the state records {step}"
        # Lines past the commit come from a save that died before its commit: drop them before appending.
        self._rewrite_steps(steps)
        return Snapshot(step, record, tensors, steps), None

    def _rewrite_steps(self, steps: list[StepMetrics]) -> None:
        atomic_write(
            self.path / self.STEPS,
            lambda tmp: tmp.write_text("".join(json.dumps(asdict(m)) + "\n" for m in steps)),
        )
        self._lines = len(steps)

    def clear(self) -> None:
        """Remove every state file (``state.json`` first: from then on nothing here is resumable).

        Raises: ``SymlinkRefusedError`` when the state directory is a symbolic link (nothing removed)."""
        refuse_symlink(self.path)
        (self.path / self.STATE).unlink(missing_ok=True)
        fsync_path(self.path)
        for pattern in ("tensors-*.safetensors", self.STEPS, ".*.tmp-*"):
            for f in self.path.glob(pattern):
                f.unlink(missing_ok=True)
        self._lines = 0

    def save(
        self, step: int, tensors: dict[str, torch.Tensor], record: dict[str, Any], steps: list[StepMetrics]
    ) -> None:
        """Commit the state after ``step`` optimizer steps (``steps`` = the metrics of all of them)."""
        self.path.mkdir(parents=True, exist_ok=True)
        name = f"tensors-{step:09d}.safetensors"
        atomic_write(self.path / name, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))
        with open(self.path / self.STEPS, "a") as fh:
            fh.writelines(json.dumps(asdict(m)) + "\n" for m in steps[self._lines : step])
            fh.flush()
            os.fsync(fh.fileno())
        full = {**record, "version": STATE_VERSION, "step": step, "tensors_file": name,
                "tensors_bytes": (self.path / name).stat().st_size}
        atomic_write(self.path / self.STATE, lambda tmp: tmp.write_text(json.dumps(full) + "\n"))
        self._lines = step
        for old in self.path.glob("tensors-*.safetensors"):
            if old.name != name:
                old.unlink(missing_ok=True)


def state_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer, best: dict[str, torch.Tensor] | None
) -> dict[str, torch.Tensor]:
    """The tensors of a state: weights, best weights (if any), AdamW moments, the torch RNG state."""
    out = {f"model.{k}": v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    for k, v in (best or {}).items():
        out[f"best.{k}"] = v.detach().to("cpu").contiguous()
    for idx, entry in optimizer.state_dict()["state"].items():
        for key, value in entry.items():
            out[f"optim.{idx}.{key}"] = torch.as_tensor(value).detach().to("cpu").contiguous()
    out["rng.torch"] = torch.get_rng_state()
    return out


def restore_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer, params: list[nn.Parameter], tensors: dict[str, torch.Tensor]
) -> tuple[str | None, dict[str, torch.Tensor] | None]:
    """Load weights, optimizer state and RNG from a state's tensors.

    Returns:
        ``(None, best weights or None)`` when loaded, ``(why not, None)`` when the tensors do not fit (nothing
        changed then).
    """
    weights = model.state_dict()
    # states written before multi-layer drafts name layer 0 ``midlayer.*``: read in today's names
    model_part = {canonical_name(k[len("model."):]): v for k, v in tensors.items() if k.startswith("model.")}
    best_part = {canonical_name(k[len("best."):]): v for k, v in tensors.items() if k.startswith("best.")}
    if set(model_part) != set(weights) or (best_part and set(best_part) != set(weights)):
        return f"its weight names differ from the drafter's ({sorted(set(model_part) ^ set(weights))})", None
    bad = [k for part in (model_part, best_part) for k, v in part.items()
           if v.shape != weights[k].shape or v.dtype != weights[k].dtype]
    optim: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        if name.startswith("optim."):
            _, idx, key = name.split(".", 2)
            i = int(idx)
            if not 0 <= i < len(params) or (value.dim() and value.shape != params[i].shape):
                bad.append(name)
            optim.setdefault(i, {})[key] = value
    if bad or "rng.torch" not in tensors:
        return f"its tensors do not fit the drafter ({bad[:5] or 'no rng.torch'})", None
    model.load_state_dict(model_part, strict=True)
    optimizer.load_state_dict({"state": optim, "param_groups": optimizer.state_dict()["param_groups"]})
    torch.set_rng_state(tensors["rng.torch"])
    return None, (best_part or None)
