"""Where the drafter trainer's target features come from: the catalog's ``training.features`` switch.

- ``local`` (:class:`LocalFeatures`, the default): the target is loaded with transformers in the trainer's process;
  :class:`~eagle_assets.drafter.features.local_cache.FeatureCache` runs it for the aux hidden states and final hidden
  states, and the teacher is the softmax of the target's lm_head rows of the draft vocab
  (:func:`~eagle_assets.drafter.ttt_loss.supervision`).
- ``served`` (:class:`ServedFeatures`): no target weights in this process except the input embedding (the drafter's
  frozen embedding, read from the safetensors shard that holds it) and ``config.json``. Each training and
  validation row's aux hidden states and teacher come from an SGLang server in aux-capture mode
  (:class:`~eagle_assets.drafter.features.served_client.ServedFeatureSource` +
  :class:`~eagle_assets.drafter.features.served_cache.ServedFeatureCache`); the learning curve's simulated acceptance
  reads the target's greedy ids from the same replies and asks the server for the exact re-runs (one
  ``max_new_tokens: 1`` request each). The ``acceptance_length`` check uses the same server
  (:meth:`ServedFeatures.acceptance_rows`, :class:`ServedAcceptanceFeatures`), and in a ``torchrun`` run each rank
  fetches only the rows it trains on (:meth:`ServedFeatures.admit`). docs/served_features.md describes the protocol
  and the costs.

Both give the trainer the same things: the target's depth, embedding and config, the rows it may train on
(``admit``: a served row whose reply was refused is left out and counted in the skip reasons as
``served_<reason>``), ``feature_cache(...)`` (per split, ``get(batch)``), ``supervision(...)`` (the teacher of a
batch, as :class:`~eagle_assets.drafter.ttt_loss.Supervision`), and what
:func:`~eagle_assets.drafter.acceptance.simulate_acceptance` needs. With ``teacher: topk`` and ``top_k`` >= the
target vocab, the served teacher is the local one and the trainer ends with the local drafter up to float rounding
(``eagle_assets_tests/test_served_training.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from eagle_assets.drafter.data.vocab import DraftVocab
from eagle_assets.drafter.features.local_cache import FeatureCache, PreparedRow
from eagle_assets.drafter.features.local_capture import decoder_parts
from eagle_assets.drafter.features.teacher import supervision
from eagle_assets.target_model.config import read_json_config


def feature_source(target_dir: Any, features: Any, load_target: Callable[[Any], nn.Module],
                   log: Callable[[str], None]) -> "LocalFeatures | ServedFeatures":
    """The feature source ``features`` (a ``catalog.FeaturesSpec``; None = local) asks for.

    Raises:
        ValueError: ``served`` with an already loaded target module instead of a model directory.
    """
    if features is None or features.source == "local":
        return LocalFeatures(load_target(target_dir))
    if isinstance(target_dir, nn.Module):
        raise ValueError("training.features.source = served needs the target's model directory (its config.json "
                         "and embedding), not a loaded model")
    return ServedFeatures(Path(target_dir), features, log)


class LocalFeatures:
    """Today's path: the loaded target computes every feature (see the module docstring).

    Attributes:
        target: the frozen target (a HF causal LM); num_layers, embedding: its decoder depth and input embedding.
    """

    served = False
    greedy_next = None  # re-runs of the acceptance simulation run the target itself
    feature_cache = FeatureCache  # the trainer's per-split features: computed by the target
    supervision = staticmethod(supervision)  # the teacher: softmax of the target's lm_head rows of the draft vocab

    def __init__(self, target: nn.Module):
        self.target = target
        _, layers, _, self.lm_head = decoder_parts(target)
        self.num_layers = len(layers)
        self.embedding = target.get_input_embeddings().weight

    def lm_head_weight(self) -> torch.Tensor:
        """The target's whole LM head, float32 ``[V, H]`` (a block drafter borrows it)."""
        return self.lm_head.weight.detach().float()

    def teacher(self, draft_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The lm_head rows (and bias) of the draft vocab: float32 ``[D, H]``, ``[D]`` or None."""
        bias = getattr(self.lm_head, "bias", None)
        return (self.lm_head.weight.detach()[draft_ids].float(),
                bias.detach()[draft_ids].float() if bias is not None else None)

    def admit(self, rows: list[PreparedRow], reasons: dict[str, int], split: str, capture: list[int],
              vocab: DraftVocab, **_parallel: Any) -> list[PreparedRow]:
        """Every row has local features."""
        return rows

    @staticmethod
    def final_teacher(teachers: Sequence[np.ndarray], feats: Sequence, shape: tuple[int, int]
                      ) -> dict[str, torch.Tensor]:
        """``{"target_hidden": float32 [b, T, H]}``: the target's post-norm final hidden state at every teacher
        position of each row (``teachers[b]``, int64), zeros elsewhere (``drafter.family.TrainBatch``)."""
        out = torch.zeros(*shape, feats[0][1].shape[-1])
        for b, (teacher, f) in enumerate(zip(teachers, feats)):
            out[b, torch.from_numpy(teacher)] = f[1].float()
        return {"target_hidden": out}

    def acceptance_features(self, split: str) -> dict[int, Any]:
        """Empty: :func:`simulate_acceptance` fills it on first use."""
        return {}

    def acceptance_rows(self, rows: Sequence, capture: list[int], vocab: DraftVocab):
        """``(rows, simulate_acceptance keyword arguments)``: the rows as given, the target runs."""
        return rows, {}

    def fingerprint(self) -> dict[str, Any]:
        """Nothing beyond the target's parameters (the fingerprint of today's states stays the same)."""
        return {}

    def describe(self, cached: bool) -> str:
        """Where the features come from, for the trainer's startup line."""
        return f"computed by the target in this process ({'cached' if cached else 'recomputed per batch'})"


class _NoRows:
    """Features of an empty split (no validation rows)."""

    rows: list = []
    cache = None

    def get(self, batch: list[int]) -> list:
        return []


class _Elsewhere:
    """The features of a split another rank holds (a data-parallel run's validation rows: rank 0 scores them)."""

    cache = None

    def __init__(self, why: str):
        self.why = why
        self.rows: list = []

    def get(self, batch: list[int]) -> list:
        raise ValueError(f"this rank holds no features for these rows: {self.why}")


class _OwnedRows:
    """A data-parallel rank's view of the kept training rows: ``get(batch)`` for the rows it owns (indices into
    the kept rows), read from the :class:`~eagle_assets.drafter.features.served_cache.ServedFeatureCache` of the round
    that fetched each (one ``get`` per cache a batch touches)."""

    cache = None

    def __init__(self, where: dict[int, tuple[Any, int]]):
        self.where = where
        self.rows: list = []

    def get(self, batch: Sequence[int]) -> list:
        missing = [i for i in batch if i not in self.where]
        if missing:
            raise KeyError(f"rows {missing} are not this rank's: it fetched only the rows it trains on")
        by_cache: dict[int, list[int]] = {}
        for i in batch:
            by_cache.setdefault(id(self.where[i][0]), []).append(i)
        got: dict[int, Any] = {}
        for members in by_cache.values():
            cache = self.where[members[0]][0]
            for i, f in zip(members, cache.get([self.where[i][1] for i in members])):
                got[i] = f
        return [got[i] for i in batch]


class ServedTarget(nn.Module):
    """What the trainer keeps of a target whose features are served: its ``config`` (the language model's, for a
    multimodal wrapper such as Kimi-K2.5) and its frozen input embedding ``[V, H]`` (the only parameter; the
    training state's fingerprint hashes it). A block drafter also borrows the target's LM head
    (:meth:`get_output_embeddings`), read from safetensors when first asked for and never a parameter here.

    Args:
        lm_head: ``() -> float32 [V, H]`` the LM head's weight, or None for a target whose LM head is its input
            embedding (``tie_word_embeddings``); None = the same.
    """

    def __init__(self, config: Any, embedding: torch.Tensor,
                 lm_head: Callable[[], torch.Tensor | None] | None = None):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding.from_pretrained(embedding.float(), freeze=True)
        self._read_lm_head = lm_head
        self._lm_head: list[nn.Module | None] = []  # a list: never registered as a submodule

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def get_output_embeddings(self) -> nn.Module | None:
        """The LM head as a frozen bias-free ``nn.Linear`` ``[V, H]``, or None when the target ties it to the input
        embedding (as transformers' models answer for a tied head that has no module of its own, the caller uses
        the embedding)."""
        if not self._lm_head:
            weight = self._read_lm_head() if self._read_lm_head is not None else None
            head = None
            if weight is not None:
                head = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
                head.weight = nn.Parameter(weight.float(), requires_grad=False)
            self._lm_head.append(head)
        return self._lm_head[0]


def target_text_config(model_dir: Path) -> Any:
    """The target's language-model config from ``config.json`` without its weights or remote code.

    transformers' own class when it knows the ``model_type`` (Qwen3, DeepSeek-V3, ...), else a plain
    ``PretrainedConfig`` of the JSON fields (Kimi-K2.5's ``text_config`` is DeepSeek-V3's layout).
    """
    from transformers import AutoConfig, PretrainedConfig

    raw = read_json_config(model_dir)
    text = raw.get("text_config") or raw
    try:
        config = AutoConfig.for_model(**text) if "model_type" in text else PretrainedConfig(**text)
    except (ValueError, KeyError, TypeError):
        config = PretrainedConfig(**{k: v for k, v in text.items() if k != "model_type"})
    for name in ("dtype", "torch_dtype"):  # the stored dtype is named at the top level of multimodal configs
        if raw.get(name) and not text.get(name):
            setattr(config, name, raw[name])
    # where the model lives, as from_pretrained records it: a block drafter's mask token rule reads its tokenizer
    config._name_or_path = str(model_dir)
    return config


class ServedFeatures:
    """Features from an SGLang server in aux-capture mode (see the module docstring).

    Args:
        model_dir: the target's directory (``config.json`` and the safetensors shard with the input embedding).
        spec: ``catalog.FeaturesSpec`` with ``source: served`` and ``url`` (the asset fills it from the pipeline's
            server resource when the catalog leaves it null) and, for ``cache: disk``, ``cache_dir``.

    Raises:
        ValueError: no URL, or ``cache: disk`` without a ``cache_dir``.
    """

    served = True

    def __init__(self, model_dir: Path, spec: Any, log: Callable[[str], None]):
        from eagle_assets.drafter.features.target_weights import read_target_tensor

        if not spec.urls:
            raise ValueError("training.features.source = served needs training.features.url (or the pipeline's "
                             "server resource) to name a server in aux-capture mode")
        if spec.cache == "disk" and not spec.cache_dir:
            raise ValueError("training.features.cache = disk needs training.features.cache_dir")
        self.model_dir, self.spec, self.log = model_dir, spec, log
        config = target_text_config(model_dir)
        self.num_layers = int(config.num_hidden_layers)
        self.embedding = read_target_tensor(model_dir, "embed_tokens.weight").float()
        self.target = ServedTarget(config, self.embedding, self._read_lm_head)
        self.source = None
        self.views: dict[str, Any] = {}
        self.draft_index: torch.Tensor | None = None

    def _source(self, capture: list[int]):
        from eagle_assets.drafter.features.served_client import ServedFeatureSource

        if self.source is None:
            self.source = ServedFeatureSource(self.model_dir, self.spec, capture_ids=capture,
                                              target_name=str(self.model_dir), log=self.log)
        return self.source

    def admit(self, rows: list[PreparedRow], reasons: dict[str, int], split: str, capture: list[int],
              vocab: DraftVocab, parallel: Any = None, batch_tokens: int | None = None) -> list[PreparedRow]:
        """Fetch (or read from the shard cache) the features of ``rows``; rows the server's replies were refused
        for are left out and counted in ``reasons`` as ``served_<reason>``. ``cache: none`` fetches nothing here
        (a refused row then stops training when its batch comes).

        In a data-parallel run (``parallel.world > 1``; every rank calls this with the same rows) each rank fetches
        only the rows it trains on (:meth:`_admit_parallel`) and only rank 0, which scores them, the validation rows;
        the ranks agree on the refused rows, so every rank keeps the same rows and builds the same batches."""
        from eagle_assets.drafter.features.served_cache import ServedFeatureCache

        if not rows:
            return rows
        if parallel is not None and parallel.world > 1 and self.spec.cache != "none":
            return self._admit_parallel(rows, reasons, split, capture, vocab, parallel, batch_tokens)
        cache = ServedFeatureCache(rows, self._source(capture), self.spec.cache, vocab.draft_token_ids,
                                   vocab.target_vocab_size, cache_dir=self.spec.cache_dir)
        self.draft_index = cache.draft_index
        usable = cache.usable()
        for i, reason in cache.refused.items():
            reasons[f"served_{reason}"] = reasons.get(f"served_{reason}", 0) + 1
        if len(usable) < len(rows):
            self.log(f"served features: {len(rows) - len(usable)} of {len(rows)} {split} rows refused "
                     f"({dict(self.source.stats.refused)}); they are left out")
        kept = [rows[i] for i in usable]
        view = cache.subset(usable)
        view.rows = kept  # the very list the trainer keeps, so feature_cache() finds this view by it
        self.views[split] = view
        return kept

    def _fetch(self, rows: list[PreparedRow], indices: list[int], capture: list[int], vocab: DraftVocab):
        """``(ServedFeatureCache of rows[indices], {index into rows: reason} of the refused ones)``."""
        from eagle_assets.drafter.features.served_cache import ServedFeatureCache

        cache = ServedFeatureCache([rows[i] for i in indices], self._source(capture), self.spec.cache,
                                   vocab.draft_token_ids, vocab.target_vocab_size, cache_dir=self.spec.cache_dir)
        self.draft_index = cache.draft_index
        return cache, {indices[pos]: why for pos, why in cache.refused.items()}

    def _admit_parallel(self, rows: list[PreparedRow], reasons: dict[str, int], split: str, capture: list[int],
                        vocab: DraftVocab, parallel: Any, batch_tokens: int | None) -> list[PreparedRow]:
        """:meth:`admit` on one rank of a data-parallel run.

        Training rows: which rows a rank trains on depends on the batches, and the batches on which rows are kept
        (``make_batches`` over the kept rows, then ``DataParallel.shard`` of each), so admission goes in rounds:
        every rank fetches the rows it owns under the batches of the rows kept so far and not fetched by it yet,
        the ranks exchange the rows refused in that round (``all_gather``), and when any was refused the batches
        are rebuilt without them and the round repeats. Without refusals that is one round in which each row is
        fetched once, by its owner; each refusal can move rows to another rank, which then fetches them too (a
        request more per moved row). Validation rows: rank 0 fetches them all and sends the refused ones.
        """
        from eagle_assets.drafter.features.local_cache import make_batches

        refused: dict[int, str] = {}
        if split != "train":
            cache = got = None
            if parallel.is_main:
                cache, got = self._fetch(rows, list(range(len(rows))), capture, vocab)
            refused = parallel.from_main(lambda: got)
            kept_idx = [i for i in range(len(rows)) if i not in refused]
            view: Any = (cache.subset([i for i in kept_idx]) if cache is not None
                         else _Elsewhere("validation rows are scored by rank 0"))
        else:
            if batch_tokens is None:
                raise ValueError("a data-parallel run's served admission needs batch_tokens")
            held: dict[int, tuple[Any, int]] = {}
            while True:
                kept_idx = [i for i in range(len(rows)) if i not in refused]
                batches = make_batches([rows[i] for i in kept_idx], batch_tokens)
                todo = [kept_idx[j] for j in parallel.owned_rows(batches) if kept_idx[j] not in held]
                new: dict[int, str] = {}
                if todo:
                    cache, new = self._fetch(rows, todo, capture, vocab)
                    held.update({i: (cache, pos) for pos, i in enumerate(todo) if i not in new})
                merged = {i: why for part in parallel.all_gather(new) for i, why in part.items()}
                if not merged:
                    break
                refused.update(merged)
            kept_idx = [i for i in range(len(rows)) if i not in refused]
            view = _OwnedRows({n: held[i] for n, i in enumerate(kept_idx) if i in held})
            fetched = int(parallel.all_sum([len(held)])[0])
            self.log(f"served features: {fetched} of {len(rows)} {split} rows fetched over {parallel.world} ranks, "
                     "each by the rank that trains on it")
        if self.draft_index is None:
            from eagle_assets.drafter.features.served_cache import target_to_draft_index

            self.draft_index = target_to_draft_index(vocab.draft_token_ids, vocab.target_vocab_size)
        for why in refused.values():
            reasons[f"served_{why}"] = reasons.get(f"served_{why}", 0) + 1
        if refused:
            self.log(f"served features: {len(refused)} of {len(rows)} {split} rows refused; they are left out")
        kept = [rows[i] for i in kept_idx]
        view.rows = kept  # the very list the trainer keeps, so feature_cache() finds this view by it
        self.views[split] = view
        return kept

    def _read_lm_head(self) -> torch.Tensor | None:
        """The target's LM head weight float32 ``[V, H]`` from its safetensors (the one tensor named
        ``lm_head.weight``, e.g. Kimi-K2.5's ``language_model.lm_head.weight``); None for a target that ties it to
        the input embedding (``tie_word_embeddings``).

        Raises:
            KeyError: an untied target without exactly one such tensor.
        """
        from eagle_assets.drafter.features.target_weights import read_target_tensor

        if getattr(self.target.config, "tie_word_embeddings", False):
            return None
        return read_target_tensor(self.model_dir, "lm_head.weight").float()

    def lm_head_weight(self) -> torch.Tensor | None:
        """The target's LM head float32 ``[V, H]``, which a block drafter borrows (read from safetensors: the target
        is not built), or None for a tied target (the drafter then uses the input embedding)."""
        head = self.target.get_output_embeddings()
        return None if head is None else head.weight.detach()

    def final_teacher(self, teachers: Sequence[np.ndarray], feats: Sequence, shape: tuple[int, int]) -> dict:
        """What a loss that reads the target's post-norm final hidden state (DSpark's L1 term) would need: a served
        target cannot give it (SGLang's aux-capture reply holds the captured layers' inputs and top-K
        log-probabilities only), so this refuses; the catalog refuses the combination first.

        Raises:
            ValueError: always.
        """
        raise ValueError("this drafter's loss reads the target's final hidden state, which served features do not "
                         "carry; train it with training.features: local")

    def teacher(self, draft_ids: torch.Tensor) -> tuple[None, None]:
        """No lm_head here: the teacher comes with the served features."""
        return None, None

    def feature_cache(self, target: Any, capture: list[int], rows: list[PreparedRow], cache: bool,
                      batch_tokens: int, **_parallel: Any):
        """The view :meth:`admit` fetched for ``rows`` (the same list object): a :class:`ServedFeatureCache` of
        every kept row, or in a data-parallel run of the rows this rank owns (``only`` is then already applied)."""
        for view in self.views.values():
            if view.rows is rows:
                return view
        if not rows:
            return _NoRows()
        raise ValueError("served features were asked for rows admit() did not fetch")

    def supervision(self, teachers: Sequence[np.ndarray], feats: Sequence, in_draft: torch.Tensor,
                    _teacher_w: Any = None, _teacher_b: Any = None):
        """``ttt_loss.supervision`` from served teachers (:func:`~eagle_assets.drafter.features.served_cache.
        served_supervision`)."""
        from eagle_assets.drafter.features.served_cache import served_supervision

        return served_supervision(teachers, [f[1] for f in feats], in_draft, self.draft_index)

    def acceptance_features(self, split: str) -> dict[int, tuple[torch.Tensor, np.ndarray]]:
        """``{row: (aux [1, T, W], target greedy ids [T])}`` of an admitted split, for ``simulate_acceptance``."""
        view = self.views.get(split)
        if view is None or isinstance(view, _Elsewhere):
            return {}
        return {i: (f.aux_hidden.unsqueeze(0), f.target_greedy)
                for i in range(len(view.rows)) for _aux, f, _g in view.get([i])}

    def acceptance_rows(self, rows: Sequence, capture: list[int], vocab: DraftVocab):
        """``(rows, simulate_acceptance keyword arguments)`` for evaluation rows (held-out test rows): their aux
        hidden states and the target's greedy ids come from the server as :class:`ServedAcceptanceFeatures`
        (fetched as the walk reaches them, a window at a time), the exact re-runs off a row are :meth:`greedy_next`
        requests, so the target never runs here. Rows the server refuses are skipped by the walk with a note (their
        reasons in the mapping's ``refused``)."""
        rows = list(rows)
        source = self._source(capture)
        window = self.spec.concurrency * max(1, len(source.urls))
        features = ServedAcceptanceFeatures(rows, source, vocab.target_vocab_size, window)
        return rows, {"features": features, "greedy_next": self.greedy_next}

    def greedy_next(self, prefix: np.ndarray) -> int:
        """The served target's greedy token after ``prefix`` (one ``max_new_tokens: 1`` request; called by the
        acceptance walk after :meth:`admit` or :meth:`acceptance_rows` created the source)."""
        from eagle_assets.serving.protocol import GenerateFailure, SamplingParams

        client = self.source.client
        reply = client.generate_all([("greedy-next", [int(t) for t in prefix])],
                                    SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True))[0]
        if isinstance(reply, GenerateFailure):
            raise RuntimeError(f"the served target gave no greedy token for a {len(prefix)}-token prefix "
                               f"({reply.kind}: {reply.last_error})")
        return int(reply.output_ids[0])

    def describe(self, cached: bool) -> str:
        """Where the features come from, for the trainer's startup line."""
        where = f" at {self.spec.cache_dir}" if self.spec.cache == "disk" else ""
        return (f"served by {', '.join(self.spec.urls)} (aux-capture mode, {self.spec.teacher} teacher, "
                f"cache {self.spec.cache}{where})")

    def fingerprint(self) -> dict[str, Any]:
        """What a resumed state must share besides the embedding: the served feature spec (layers, teacher, K)."""
        spec = self.source.spec if self.source is not None else None
        return {"features": {"source": "served", "teacher": self.spec.teacher,
                             "top_k": spec.top_k if spec else None,
                             "capture_ids": list(spec.capture_ids) if spec else None}}


class ServedAcceptanceFeatures:
    """``{row index: (aux float32 [1, T, W], target greedy ids int64 [T]) | None}`` of evaluation rows for
    :func:`~eagle_assets.drafter.acceptance.simulate_acceptance`, fetched from the server as the walk reaches them.

    Reading row ``i`` fetches it together with the next rows the walk will read
    (:func:`~eagle_assets.drafter.acceptance.walkable`), ``window`` rows in one go (the source's concurrency x
    servers); rows already walked are dropped, so at most ``window`` rows' features are held (at Kimi-K2.5's
    3H = 21,504 float32 values, 86 KB per token), and a walk stopped by ``max_positions`` leaves later rows
    unfetched (at most ``window - 1`` fetched for nothing). A row whose reply was refused reads as None (the walk
    skips it) and is listed in :attr:`refused` (index -> reason). The greedy ids are the argmax of each position's
    served top-K (``RowFeatures.target_greedy``; K = 1 for the hard teacher is that argmax).

    Raises (on read):
        ServedFeaturesError: the server cannot give features at all.
    """

    def __init__(self, rows: Sequence, source: Any, vocab_size: int, window: int):
        self.rows, self.source, self.vocab_size, self.window = rows, source, vocab_size, max(1, int(window))
        self.refused: dict[int, str] = {}
        self.fetched = 0
        self._held: dict[int, Any] = {}

    def __contains__(self, index: object) -> bool:
        return isinstance(index, int) and 0 <= index < len(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, np.ndarray] | None:
        from eagle_assets.drafter.data.rows import walkable
        from eagle_assets.drafter.features.served_client import RefusedRow

        if index not in self:
            raise KeyError(index)
        if index in self.refused:
            return None
        if index not in self._held:
            self._held.clear()  # the walk goes forward: what it read before is not read again
            batch = [index] + [j for j in range(index + 1, len(self.rows))
                               if not isinstance(walkable(self.rows[j], self.vocab_size), str)][: self.window - 1]
            items = [(str(j), np.asarray(self.rows[j][0], dtype=np.int64), np.asarray(self.rows[j][1]))
                     for j in batch]
            for j, got in zip(batch, self.source.fetch(items)):
                self.fetched += 1
                if isinstance(got, RefusedRow):
                    self.refused[j] = f"{got.reason}: {got.detail}"
                else:
                    self._held[j] = (got.aux_hidden.unsqueeze(0), got.target_greedy)
            if index in self.refused:
                return None
        return self._held.pop(index)


def resolve_features(spec: Any, model_dir: Path, default_cache_dir: Path, capture_ids: Sequence[int] | None,
                     max_row_tokens: int, server_urls: Callable[[Any], list[str]],
                     server_api_key_env: str | None = None,
                     default_capture: Callable[[int], Sequence[int]] | None = None) -> Any:
    """The catalog's ``training.features`` ready for :func:`~eagle_assets.drafter.train.train_drafter`: for
    ``served`` without a ``url``, the pipeline's server (``server_urls(aux_capture)``: the ``sglang`` resource's
    URLs, or one it launches with SGLang's capture flags for ``capture_ids`` under the target's layer-id rule and a
    ``--chunked-prefill-size`` of at least ``max_row_tokens``) and its API key variable; for ``cache: disk``
    without a ``cache_dir``, ``default_cache_dir``. ``local`` is returned as is.

    Args:
        capture_ids: the catalog's ``training.aux_layer_ids`` (None = ``default_capture``'s, else SGLang's
            default ``[2, L//2, L-3]``).
        default_capture: ``(target layers)`` -> the drafter family's default capture ids
            (``DraftFamily.capture_ids`` with none requested: a block drafter's is SGLang's
            ``build_target_layer_ids`` for its depth); the server is launched to capture them.
    """
    from eagle_assets.serving.aux_capture import AuxCapture, num_layers_of

    if spec is None or spec.source != "served":
        return spec
    update: dict[str, Any] = {}
    if not spec.urls:
        config = read_json_config(model_dir)
        if capture_ids is None and default_capture is not None:
            # the family's default layers; EAGLE-3's are SGLang's own default, for which no flag is passed
            capture_ids = list(default_capture(num_layers_of(config)))
        update["url"] = list(server_urls(AuxCapture.for_target(config, capture_ids, max_row_tokens)))
        if spec.api_key_env is None and server_api_key_env:
            update["api_key_env"] = server_api_key_env
    if spec.cache == "disk" and not spec.cache_dir:
        update["cache_dir"] = str(default_cache_dir)
    return spec.model_copy(update=update)
