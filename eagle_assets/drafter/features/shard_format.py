"""Served drafter features on disk: safetensors shards that say what they hold and refuse to load when they do not.

Speculators had to add exactly these checks after training on corrupted hidden states (vllm-project/speculators
PRs 966, 967, 994): a content hash, a finite check and the layer ids in the file. Here every shard carries, in its
safetensors metadata (``str -> str``):

- ``format``: :data:`SHARD_FORMAT`; ``spec``: JSON of what produced the features (:class:`FeatureSpec`: capture
  ids, the ``--return-aux-hidden-state-layer-ids`` value, hidden size, teacher kind and top-k, the target, the
  stored dtype); ``row_ids`` (JSON list) and ``row_keys`` (sha256 of each row's ``input_ids`` and loss mask);
  ``quarantined``: JSON ``{row_key: reason}`` for rows the server's reply was refused for (so a reused shard
  reports them again instead of losing them silently);
- ``content_sha256``: sha256 over every tensor's name, dtype, shape and bytes, in name order;
- ``finite``: ``"true"``: written only after checking every float tensor (non-finite rows never get in).

Tensors (``R`` rows, ``S`` = sum of row lengths, ``N`` = sum of teacher positions, ``W = k * H``, ``K`` teacher
entries per position, 1 for hard labels):

- ``aux_hidden`` ``[S, W]`` bfloat16 or float32 (``storage_dtype``; ``auto`` stores bfloat16 only when that is
  lossless, i.e. the server computed in bfloat16), ``input_ids`` int32 ``[S]``, ``target_greedy`` int32 ``[S]``
  (the target's greedy id at every position), ``row_offsets`` int64 ``[R + 1]``;
- ``teacher_positions`` int64 ``[N]``, ``teacher_ids`` int64 ``[N, K]``, ``teacher_logprobs`` float32 ``[N, K]``
  (0 for hard labels), ``greedy`` int64 ``[N]``, ``teacher_offsets`` int64 ``[R + 1]``.

:func:`verify_shard` checks format, spec (layer ids, width, teacher), hash and finiteness and raises
:class:`FeatureShardError` naming what is wrong; a caller treats such a shard as absent and recomputes it.
:func:`read_rows` then reads single rows through safetensors' memory map, so random access over many shards holds
only the asked rows in memory. Files are written to a temporary name and renamed, so a crash never leaves a
half-written shard under a valid name.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch

from eagle_assets.storage.shards import atomic_file

SHARD_FORMAT = "eagle-assets/served-features/1"
_FLOAT_TENSORS = ("aux_hidden", "teacher_logprobs")


class FeatureShardError(ValueError):
    """A shard that must not be trained on: wrong format, spec, hash, or non-finite values."""


@dataclass(frozen=True)
class FeatureSpec:
    """What produced a set of served features; two runs share shards only when their specs are equal.

    Attributes:
        capture_ids: ascending capture ids the ``W`` columns hold, ``k`` of them (the numbering of
            ``training.aux_layer_ids``: capture id ``c`` = input of decoder layer ``c``).
        flag_layer_ids: the server's ``--return-aux-hidden-state-layer-ids`` (None = the model default).
        hidden_size: the target's H; ``W = len(capture_ids) * H``.
        teacher: ``hard`` (the row's own next tokens) or ``topk`` (``input_top_logprobs``).
        top_k: entries per teacher position (1 for ``hard``).
        target: the target model's identity (its path or hub id and config digest; whatever the caller trusts).
        storage_dtype: ``auto`` | ``bfloat16`` | ``float32``.
    """

    capture_ids: tuple[int, ...]
    flag_layer_ids: tuple[int, ...] | None
    hidden_size: int
    teacher: str
    top_k: int
    target: str
    storage_dtype: str = "auto"

    @property
    def width(self) -> int:
        return len(self.capture_ids) * int(self.hidden_size)

    def to_json(self) -> str:
        d = asdict(self)
        d["capture_ids"] = list(self.capture_ids)
        d["flag_layer_ids"] = list(self.flag_layer_ids) if self.flag_layer_ids is not None else None
        return json.dumps(d, sort_keys=True)

    def key(self) -> str:
        """sha256 (hex) of the spec."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()


@dataclass
class RowFeatures:
    """One row's served features, in the trainer's shapes.

    Attributes:
        row_id: the caller's id of the row.
        input_ids: int64 ``[T]``.
        aux_hidden: float32 ``[T, W]``: the capture layers' inputs at every position, ascending capture id.
        teacher_positions: int64 ``[N]``: positions ``q`` whose next token is a completion token
            (:func:`~eagle_assets.drafter.ttt_loss.teacher_positions`).
        teacher_ids: int64 ``[N, K]`` target ids; teacher_logprobs: float32 ``[N, K]`` their target logprobs at
            ``q`` (``hard``: ``K = 1``, the row's token ``q + 1`` with logprob 0).
        greedy: int64 ``[N]``: the label's id at ``q`` (``topk``: the target's top-1; ``hard``: the row's token,
            exact for the target's own greedy generations).
        target_greedy: int64 ``[T]``: the target's greedy id at every position (the server's top-1; the last
            position's is its sampled token at temperature 0), what acceptance simulation compares drafts with.
    """

    row_id: str
    input_ids: np.ndarray
    aux_hidden: torch.Tensor
    teacher_positions: np.ndarray
    teacher_ids: torch.Tensor
    teacher_logprobs: torch.Tensor
    greedy: torch.Tensor
    target_greedy: np.ndarray


def row_key(input_ids: np.ndarray, loss_mask: np.ndarray) -> str:
    """sha256 (hex) of a row's ids (as int64) and loss mask (as int8): the identity its features depend on."""
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(input_ids, dtype=np.int64).tobytes())
    h.update(b"|")
    h.update(np.ascontiguousarray(loss_mask, dtype=np.int8).tobytes())
    return h.hexdigest()


def content_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 (hex) over each tensor's name, dtype, shape and raw bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}|".encode())
        # bytes of any dtype (bfloat16 has no numpy dtype): view the storage as uint8
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _storage_tensor(aux: torch.Tensor, storage_dtype: str) -> torch.Tensor:
    if storage_dtype == "float32":
        return aux.to(torch.float32)
    as_bf16 = aux.to(torch.bfloat16)
    if storage_dtype == "bfloat16":
        return as_bf16
    if storage_dtype != "auto":
        raise ValueError(f"storage_dtype must be auto, bfloat16 or float32, got {storage_dtype!r}")
    # a bfloat16 server's values are exactly bfloat16: half the bytes, nothing lost
    return as_bf16 if torch.equal(as_bf16.to(aux.dtype), aux) else aux.to(torch.float32)


def write_shard(path: str | Path, spec: FeatureSpec, rows: Sequence[RowFeatures],
                loss_masks: Sequence[np.ndarray], quarantined: dict[str, str] | None = None) -> Path:
    """Write ``rows`` (with their loss masks, for the row keys) as one shard, atomically.

    Raises:
        FeatureShardError: a row whose aux width is not ``spec.width`` or whose floats are not finite (the caller
            should have refused it), or an empty ``rows`` without quarantined rows.
    """
    path = Path(path)
    if not rows and not quarantined:
        raise FeatureShardError("a shard needs at least one row (or quarantined rows to record)")
    for r in rows:
        if r.aux_hidden.ndim != 2 or r.aux_hidden.shape[1] != spec.width:
            raise FeatureShardError(
                f"row {r.row_id}: aux_hidden is {tuple(r.aux_hidden.shape)}, the spec says [T, {spec.width}]"
            )
        if not (torch.isfinite(r.aux_hidden).all() and not torch.isnan(r.teacher_logprobs).any()):
            raise FeatureShardError(f"row {r.row_id}: non-finite features must be refused before they are stored")
    k = max(1, spec.top_k if spec.teacher == "topk" else 1)
    w = spec.width
    lengths = [int(r.input_ids.size) for r in rows]
    counts = [int(r.teacher_positions.size) for r in rows]
    aux = torch.cat([r.aux_hidden for r in rows]) if rows else torch.zeros((0, w))
    tensors = {
        "aux_hidden": _storage_tensor(aux, spec.storage_dtype).contiguous(),
        "input_ids": torch.from_numpy(np.concatenate([r.input_ids for r in rows]).astype(np.int32)
                                      if rows else np.zeros(0, np.int32)),
        "target_greedy": torch.from_numpy(np.concatenate([r.target_greedy for r in rows]).astype(np.int32)
                                          if rows else np.zeros(0, np.int32)),
        "row_offsets": torch.tensor(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)),
        "teacher_positions": torch.from_numpy(np.concatenate([r.teacher_positions for r in rows]).astype(np.int64)
                                              if rows else np.zeros(0, np.int64)),
        "teacher_ids": torch.cat([r.teacher_ids for r in rows]).to(torch.int64) if rows
        else torch.zeros((0, k), dtype=torch.int64),
        "teacher_logprobs": torch.cat([r.teacher_logprobs for r in rows]).to(torch.float32) if rows
        else torch.zeros((0, k)),
        "greedy": torch.cat([r.greedy for r in rows]).to(torch.int64) if rows else torch.zeros(0, dtype=torch.int64),
        "teacher_offsets": torch.tensor(np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)),
    }
    metadata = {
        "format": SHARD_FORMAT,
        "spec": spec.to_json(),
        "row_ids": json.dumps([r.row_id for r in rows]),
        "row_keys": json.dumps([row_key(r.input_ids, m) for r, m in zip(rows, loss_masks)]),
        "quarantined": json.dumps(quarantined or {}, sort_keys=True),
        "content_sha256": content_sha256(tensors),
        "finite": "true",
    }
    from safetensors.torch import save_file

    with atomic_file(path) as tmp:
        save_file(tensors, tmp, metadata=metadata)
    return path


@dataclass
class ShardIndex:
    """A verified shard's table of contents: where each row's tensors are (read them with :func:`read_rows`)."""

    path: Path
    row_ids: list[str]
    row_keys: list[str]
    row_offsets: list[int]
    teacher_offsets: list[int]
    quarantined: dict[str, str]
    stat: tuple[int, int]  # (size, mtime_ns) when verified: a file changed since is verified again


def _file_stat(path: Path) -> tuple[int, int]:
    st = path.stat()
    return int(st.st_size), int(st.st_mtime_ns)


def verify_shard(path: str | Path, spec: FeatureSpec) -> ShardIndex:
    """Verify a shard written by :func:`write_shard` for ``spec`` and return its index.

    Checks, in order: the file opens as safetensors with this format; its spec equals ``spec`` (a difference in
    layer ids is named as such); every expected tensor is there with consistent offsets; the recomputed
    ``content_sha256`` matches; every float is finite. Tensors are read one at a time, so memory stays at the
    largest tensor (the shard's ``aux_hidden``).

    Raises:
        FeatureShardError: naming the first failed check (the caller recomputes the shard).
    """
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    where = f"feature shard {path}"
    needed = ("aux_hidden", "input_ids", "target_greedy", "row_offsets", "teacher_positions", "teacher_ids",
              "teacher_logprobs", "greedy", "teacher_offsets")
    try:
        stat = _file_stat(path)
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            names = set(f.keys())
            if meta.get("format") != SHARD_FORMAT:
                raise FeatureShardError(f"{where} has format {meta.get('format')!r}, expected {SHARD_FORMAT!r}")
            try:
                stored = json.loads(meta["spec"])
                row_ids = [str(r) for r in json.loads(meta["row_ids"])]
                row_keys = json.loads(meta["row_keys"])
                quarantined = json.loads(meta.get("quarantined") or "{}")
            except (KeyError, ValueError) as exc:
                raise FeatureShardError(f"{where} has unreadable metadata ({exc})") from None
            want = json.loads(spec.to_json())
            if stored != want:
                if (stored.get("capture_ids") != want["capture_ids"]
                        or stored.get("flag_layer_ids") != want["flag_layer_ids"]):
                    raise FeatureShardError(
                        f"{where} holds aux hidden states of capture layers {stored.get('capture_ids')} (server "
                        f"flag {stored.get('flag_layer_ids')}), but this run uses {want['capture_ids']} (flag "
                        f"{want['flag_layer_ids']}); features of other layers would train a drafter that SGLang "
                        "then feeds different layers"
                    )
                diff = sorted(k for k in set(stored) | set(want) if stored.get(k) != want.get(k))
                raise FeatureShardError(f"{where} was written for a different feature spec (differs in {diff})")
            missing = [n for n in needed if n not in names]
            if missing:
                raise FeatureShardError(f"{where} lacks tensors {missing}")
            h = hashlib.sha256()
            shapes: dict[str, tuple[int, ...]] = {}
            small: dict[str, list[int]] = {}
            for name in sorted(names):
                t = f.get_tensor(name).contiguous()
                shapes[name] = tuple(t.shape)
                h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}|".encode())
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
                if name in _FLOAT_TENSORS:
                    bad = ~torch.isfinite(t) if name == "aux_hidden" else torch.isnan(t)
                    if bool(bad.any()):
                        raise FeatureShardError(f"{where}: {int(bad.sum())} non-finite values in {name}")
                if name in ("row_offsets", "teacher_offsets"):
                    small[name] = t.tolist()
                del t
    except FeatureShardError:
        raise
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise FeatureShardError(
            f"{where} cannot be read ({type(exc).__name__}: {exc}); it will be recomputed"
        ) from None
    if meta.get("content_sha256") != h.hexdigest():
        raise FeatureShardError(
            f"{where}: content hash mismatch (the file changed after it was written: a partial copy, disk or "
            "transfer corruption); it will be recomputed"
        )
    if meta.get("finite") != "true":
        raise FeatureShardError(f"{where} was not marked finite when written")
    offs, toffs = small["row_offsets"], small["teacher_offsets"]
    n_rows = len(row_ids)
    aux_shape = shapes["aux_hidden"]
    if (len(offs) != n_rows + 1 or len(toffs) != n_rows + 1 or len(row_keys) != n_rows
            or offs[-1] != aux_shape[0] or toffs[-1] != shapes["greedy"][0]
            or (n_rows and aux_shape[1] != spec.width)):
        raise FeatureShardError(f"{where}: offsets, row lists and tensor shapes disagree")
    return ShardIndex(path=path, row_ids=row_ids, row_keys=row_keys, row_offsets=offs, teacher_offsets=toffs,
                      quarantined={str(k): str(v) for k, v in quarantined.items()}, stat=stat)


def read_rows(index: ShardIndex, positions: Sequence[int] | None = None) -> list[RowFeatures]:
    """Rows ``positions`` (indices into ``index.row_ids``; None = all) of a verified shard, reading only their
    slices (safetensors memory-maps the file).

    Raises:
        FeatureShardError: the file changed since :func:`verify_shard` (verify it again).
    """
    from safetensors import safe_open

    if _file_stat(index.path) != index.stat:
        raise FeatureShardError(f"feature shard {index.path} changed after it was verified; verify it again")
    positions = range(len(index.row_ids)) if positions is None else positions
    out = []
    with safe_open(str(index.path), framework="pt") as f:
        sl = {name: f.get_slice(name) for name in ("aux_hidden", "input_ids", "target_greedy", "teacher_positions",
                                                     "teacher_ids", "teacher_logprobs", "greedy")}
        for i in positions:
            a, b = index.row_offsets[i], index.row_offsets[i + 1]
            c, d = index.teacher_offsets[i], index.teacher_offsets[i + 1]
            out.append(RowFeatures(
                row_id=index.row_ids[i],
                input_ids=sl["input_ids"][a:b].numpy().astype(np.int64),
                aux_hidden=sl["aux_hidden"][a:b].to(torch.float32),
                teacher_positions=sl["teacher_positions"][c:d].numpy().astype(np.int64),
                teacher_ids=sl["teacher_ids"][c:d],
                teacher_logprobs=sl["teacher_logprobs"][c:d],
                greedy=sl["greedy"][c:d],
                target_greedy=sl["target_greedy"][a:b].numpy().astype(np.int64),
            ))
    return out


def shard_name(spec: FeatureSpec, keys: Iterable[str]) -> str:
    """File name of the shard holding the rows with these :func:`row_key` values, in order, for ``spec``."""
    h = hashlib.sha256(spec.key().encode())
    for k in keys:
        h.update(k.encode())
    return f"features-{h.hexdigest()[:32]}.safetensors"


def plan_shards(lengths: Sequence[int], width: int, shard_bytes: int, bytes_per_value: int = 4) -> list[range]:
    """Consecutive row ranges whose aux hidden states stay under ``shard_bytes`` each (a longer row gets a shard
    of its own): the unit that is fetched, written and held in memory at once."""
    shards: list[range] = []
    start, size = 0, 0
    for i, t in enumerate(lengths):
        row = int(t) * int(width) * bytes_per_value
        if i > start and size + row > shard_bytes:
            shards.append(range(start, i))
            start, size = i, 0
        size += row
    if start < len(lengths):
        shards.append(range(start, len(lengths)))
    return shards
