"""The catalog's ``training`` section: draft vocab, TTT steps, the training mix, the features source and the
acceptance evaluations."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from eagle_assets.catalog.base import StrictModel
from eagle_assets.catalog.partitions import SourceSpec, check_http_urls


class BucketCap(StrictModel):
    """At most ``max_share`` of the mix's completion tokens may come from rows with fewer than ``below_tokens``
    completion tokens."""

    below_tokens: int = Field(gt=0)
    max_share: float = Field(ge=0, le=1)


class MixSpec(StrictModel):
    """The ``training_mix`` asset: which QC rows the drafter trains on (see ``drafter.data.mix``).

    ``mode``: "balanced" (per-partition weights and length-bucket caps) or "concat" (rows of every partition in
    catalog order until the budget is spent: the unbalanced baseline). ``token_budget``: completion (loss) tokens
    of the mix; null = every training row's tokens. ``weights``: relative token share per partition key (missing
    keys weigh 1.0). ``bucket_caps``: caps on the share of tokens from short rows. ``seed``: row order.
    ``turn_weights``: {turn index: weight} for ``all_turns`` partitions (``drafter.data.turn_mix``).
    """

    mode: Literal["balanced", "concat"] = "balanced"
    token_budget: int | None = Field(None, gt=0)
    weights: dict[str, float] = Field(default_factory=dict)
    bucket_caps: list[BucketCap] = Field(default_factory=list)
    seed: int = 0
    # all_turns partitions: a partition's share split between its turn indexes by these weights (unlisted = 1.0)
    turn_weights: dict[int, float] = Field(default_factory=dict)

    @field_validator("weights", "turn_weights")
    @classmethod
    def _non_negative(cls, v: dict[str, float]) -> dict[str, float]:
        bad = {k: w for k, w in v.items() if w < 0}
        if bad:
            raise ValueError(f"weights must be >= 0 (got {bad}); 0 leaves a partition out of the mix")
        return v


class UnseenEvalSpec(StrictModel):
    """The legacy ``training.unseen_eval`` (prompts from a source the drafter never trains on), read only to turn it
    into the evaluation suite ``unseen`` (``catalog.load.unseen_eval_as_suite``): suites measure unseen prompts the
    honest way, through the same stages as training data (serving template, on-policy replies, QC)."""

    description: str = ""
    sources: list[SourceSpec] = Field(min_length=1)
    prompt_policy: Literal["last_user", "first_user"] = "last_user"
    enable_thinking: bool | None = None
    max_new_tokens: int = Field(256, gt=0)
    limit: int | None = Field(32, gt=0)
    max_prompt_tokens: int | None = Field(2048, gt=0)


class FeaturesSpec(StrictModel):
    """``training.features``: where the drafter's target features (aux hidden states, teacher) come from.

    ``local`` (the default) runs the target with transformers in the trainer's process
    (``eagle_assets.drafter.features.local_cache``); ``served`` fetches them from an SGLang server in aux-capture mode
    (``eagle_assets.drafter.features.served_client``; docs/served_features.md). ``features: served`` is short for
    ``features: {source: served}``.

    Fields (``served`` only):
        url: server(s) in aux-capture mode; null = the pipeline's ``sglang`` resource (its ``server.url``, or a
            server it launches with the capture flags).
        teacher: ``hard`` (the row's own next token) | ``topk`` (the target's top-``top_k`` logprobs, renormalized
            over the draft vocab; with ``top_k`` >= the vocab size it is the local teacher).
        cache: ``disk`` (verified shards under ``cache_dir``, reused across runs) | ``memory`` | ``none`` (fetched
            for every batch when trained on). cache_dir: null = beside the checkpoint.
        storage_dtype: ``auto`` (bfloat16 when lossless) | ``bfloat16`` | ``float32``; shard_mb: aux bytes
            (float32-equivalent) per shard.
        concurrency: requests in flight per server; timeout_s / max_attempts: per HTTP attempt / attempts per row
            (connection errors, timeouts, 5xx and unusable replies are retried); api_key_env: the server's key.
    """

    source: Literal["local", "served"] = "local"
    url: str | list[str] | None = None
    teacher: Literal["hard", "topk"] = "hard"
    top_k: int = Field(20, gt=0)
    cache: Literal["disk", "memory", "none"] = "disk"
    cache_dir: str | None = None
    storage_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    shard_mb: float = Field(512, gt=0)
    concurrency: int = Field(4, gt=0)
    timeout_s: float = Field(600.0, gt=0)
    max_attempts: int = Field(4, gt=0)
    api_key_env: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        return {"source": v} if isinstance(v, str) else v

    @field_validator("url")
    @classmethod
    def _urls_are_http(cls, v: Any) -> Any:
        return check_http_urls(v)

    @property
    def urls(self) -> list[str]:
        """The configured URLs (empty = the pipeline's server resource)."""
        if self.url is None:
            return []
        return [self.url] if isinstance(self.url, str) else list(self.url)


#: the block drafters (one forward drafts a block): their own settings, their own limits
BLOCK_DRAFTERS = ("dflash", "dspark")


class DrafterSpec(StrictModel):
    """``training.drafter``: which drafter is trained and exported (``drafter.family.DraftArchitecture``).

    ``architecture``: ``auto`` (``mla`` for a multi-latent-attention target: DeepSeek-V3/R1, Kimi-K2.x; ``llama``
    otherwise), ``llama`` (SGLang ``LlamaForCausalLMEagle3``) or ``mla`` (``Eagle3DeepseekV2ForCausalLM``, as the
    public ``lightseekorg/kimi-k2.5-eagle3-mla`` and ``kimi-k2.6-eagle3.1-mla`` drafts). ``fc_norm`` /
    ``norm_output``: the EAGLE-3.1 switches (null = on for mla, off for llama). ``norm_before_fc`` (llama),
    ``num_hidden_layers`` (mla: 1), ``window`` (sliding attention window in tokens, llama; null = full), and the MLA
    dims (null = the target's own). ``dflash``: SGLang's ``DFlashDraftModel`` block drafter (docs/drafters.md), with
    ``num_hidden_layers``, ``block_size`` (``B``: ``B - 1`` drafts per verification; null = 16) and ``mask_token_id``
    (null = ``drafter.dflash.family.mask_token_id``'s rule); its target layers are ``training.aux_layer_ids``
    (capture numbering; null = SGLang's default for the draft's depth). ``dspark``: SGLang's ``DSparkDraftModel``
    (DFlash's backbone with a Markov head and a confidence head), ``block_size`` its drafts per verification
    (null = 7).
    """

    architecture: Literal["auto", "llama", "mla", "dflash", "dspark"] = "auto"
    fc_norm: bool | None = None
    norm_output: bool | None = None
    norm_before_fc: bool = False
    num_hidden_layers: int = Field(1, gt=0)
    window: int | None = Field(None, gt=0)
    q_lora_rank: int | None = Field(None, gt=0)
    kv_lora_rank: int | None = Field(None, gt=0)
    qk_nope_head_dim: int | None = Field(None, gt=0)
    qk_rope_head_dim: int | None = Field(None, gt=0)
    v_head_dim: int | None = Field(None, gt=0)
    block_size: int | None = Field(None, ge=2)
    mask_token_id: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _what_sglang_serves(self) -> "DrafterSpec":
        eagle_only = [name for name in ("fc_norm", "norm_output", "window", "q_lora_rank", "kv_lora_rank",
                                        "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
                      if getattr(self, name) is not None] + (["norm_before_fc"] if self.norm_before_fc else [])
        block = self.architecture in BLOCK_DRAFTERS
        if block and eagle_only:
            raise ValueError(f"{eagle_only} are EAGLE-3 settings: leave them unset for architecture "
                             f"{self.architecture}")
        if not block and (self.block_size is not None or self.mask_token_id is not None):
            raise ValueError("block_size and mask_token_id are block-drafter settings: set architecture: dflash or "
                             "dspark, or leave them unset")
        if self.architecture == "mla":
            if self.num_hidden_layers != 1:
                raise ValueError("an mla drafter has exactly one layer (SGLang 0.5.23's Eagle3DeepseekV2ForCausalLM): "
                                 "set num_hidden_layers: 1")
            if self.window is not None or self.norm_before_fc:
                raise ValueError("window and norm_before_fc are read by SGLang's Llama draft only: leave them unset "
                                 "for architecture mla")
        return self


#: ``training.drafter``'s label in the comparison (the ``training.compare`` keys label the others)
DRAFTER_LABEL = "drafter"
#: labels ``training.compare`` cannot use: ``training.drafter``'s, and the comparison report's files
COMPARE_RESERVED = (DRAFTER_LABEL, "report.json", "report.md", "tau.png")


class ComparedDrafter(DrafterSpec):
    """One entry of ``training.compare``: a drafter trained beside ``training.drafter`` from the same rows, mix,
    draft vocab, features and recipe (the ``drafter_comparison`` asset), with the fields of ``training.drafter``
    and ``aux_layer_ids`` (null = ``training.aux_layer_ids``). ``architecture: auto`` is refused: an entry names
    what it measures."""

    aux_layer_ids: list[int] | None = None


class TrainingSpec(StrictModel):
    """Drafter training settings (EAGLE-3 defaults: 7 TTT steps, 32k draft vocab).

    The run length is ``train_tokens`` capped at ``epochs`` passes (see ``eagle_assets.drafter.training.recipe``, which
    also gives recommended values per target class). Held-out rows (``drafter.data.splits.row_splits``): per partition a
    ``holdout_fraction`` share by keyed hash, at most ``holdout_rows``, never trained on; ``validation_rows`` of them
    give the learning curve and early stopping, the rest are the ``acceptance_length`` check's test rows.
    """

    draft_vocab_size: int = Field(32000, gt=0)
    ttt_steps: int = Field(7, gt=0)
    epochs: float | None = Field(10, gt=0)  # at most this many passes (null = no cap)
    train_tokens: int | None = Field(None, gt=0)  # at most this many row tokens through the optimizer (null = no cap)
    lr: float = Field(1.0e-4, gt=0)
    max_length: int = Field(2048, gt=0)
    batch_tokens: int = Field(16384, gt=0)
    seed: int = 0
    holdout_fraction: float = Field(0.1, ge=0, lt=1)  # share of each partition never trained on (keyed hash)
    holdout_rows: int | None = Field(None, ge=0)  # at most this many held-out rows per partition (null = no cap)
    validation_rows: int = Field(0, ge=0)  # of the held-out rows per partition: these steer training (at most half)
    eval_every_tokens: int = Field(0, ge=0)  # learning-curve points every this many training tokens (0 = end only)
    patience: int = Field(0, ge=0)  # early stop after this many points without a val-tau gain of min_delta (0 = off)
    min_delta: float = Field(0.0, ge=0)
    # Acceptance-length check: simulated chain drafting of acceptance_k tokens (SGLang --speculative-num-steps).
    acceptance_k: int = Field(7, gt=0)
    acceptance_max_positions: int | None = Field(None, gt=0)  # verification points per partition (null = all rows)
    min_tau_margin: float = Field(0.05, ge=0)  # ERROR when mean held-out tau <= 1 + margin
    tau_warn: float = Field(1.5, ge=1)  # WARN under this mean held-out tau
    warmup_steps: int | None = Field(None, ge=0)  # linear warm-up steps; null = 5% of all steps, 0 = none
    schedule: Literal["cosine", "constant"] = "cosine"  # learning rate after warm-up
    # Resumable training: a state (weights, AdamW moments, position) every this many steps and at each epoch end.
    save_every_steps: int = Field(50, ge=0)
    # torch CPU threads for training and the acceptance simulations (null = torch's default: every core). A drafter
    # as small as the demo's runs its many small ops fastest on one thread, and two threads on two busy cores stall
    # each other at every op.
    threads: int | None = Field(None, gt=0)
    # How drafter_checkpoint runs the trainer: inline (in the step's process) or torchrun (the training command in
    # nproc_per_node data-parallel processes, through Dagster Pipes; eagle_assets.drafter.training.command). The weights
    # do not depend on it (up to float rounding: eagle_assets.drafter.training.distributed).
    launcher: Literal["inline", "torchrun"] = "inline"
    nproc_per_node: int = Field(1, gt=0)
    mix: MixSpec = Field(default_factory=MixSpec)
    features: FeaturesSpec = Field(default_factory=FeaturesSpec)  # local | served (docs/served_features.md)
    drafter: DrafterSpec = Field(default_factory=DrafterSpec)  # llama | mla | dflash | dspark (docs/drafters.md)
    # target features the drafter reads, capture numbering (c = output of target layer c - 1); declared after
    # drafter: how many a family takes is checked against it
    aux_layer_ids: list[int] | None = None
    # drafters trained beside `drafter` from the same rows and recipe, measured side by side on the same held-out
    # rows and suites (the drafter_comparison asset; docs/drafters.md): {label: drafter fields + aux_layer_ids}
    compare: dict[str, ComparedDrafter] = Field(default_factory=dict)

    @field_validator("aux_layer_ids")
    @classmethod
    def _capture_ids_fit_the_family(cls, v: list[int] | None, info: ValidationInfo) -> list[int] | None:
        drafter = info.data.get("drafter")
        if drafter is not None and drafter.architecture in BLOCK_DRAFTERS:
            if v is not None and (not v or any(i < 1 for i in v) or len(set(v)) != len(v)):
                raise ValueError("aux_layer_ids for a block drafter must be null (SGLang's default target layers) "
                                 "or distinct capture ids >= 1 (c = the output of target layer c - 1)")
        elif v is not None and (len(v) != 3 or any(i < 0 for i in v)):
            raise ValueError("aux_layer_ids must be null (SGLang default [2, L//2, L-3]) or three non-negative "
                             "layer ids (an EAGLE-3 drafter reads three target layers)")
        return v

    @model_validator(mode="after")
    def _dspark_trains_on_local_features(self) -> TrainingSpec:
        # Block drafters train on served features and under torchrun like EAGLE-3, except DSpark on served ones:
        # its L1 term reads the target's final hidden state, which no served reply carries.
        if self.drafter.architecture == "dspark" and self.features.source == "served":
            raise ValueError("a dspark drafter trains with features: local: its L1 term compares the draft with the "
                             "target's softmax computed from the target's post-norm final hidden state "
                             "(dspark.model.dspark_loss), and SGLang's aux-capture reply carries only the captured "
                             "layers' inputs (capture ids <= L - 1, before the final norm) and top-K "
                             "log-probabilities, never that state; use features: local for dspark, or train "
                             "architecture: dflash (hard labels and target layers only) on served features")
        return self

    @model_validator(mode="after")
    def _compared_drafters_train(self) -> TrainingSpec:
        for label in self.compare:
            if not label.replace("_", "").replace("-", "").replace(".", "").isalnum() or label.startswith("."):
                raise ValueError(f"training.compare label {label!r} names a folder: use letters, digits, '-', '_' "
                                 "and '.' (not first) only")
            if label in COMPARE_RESERVED:
                raise ValueError(f"training.compare label {label!r} is taken (training.drafter's label in the "
                                 "report, or a file of it): choose another")
            if self.compare[label].architecture == "auto":
                raise ValueError(f"training.compare.{label}: architecture auto is what training.drafter resolves; "
                                 "name the architecture this entry measures (llama, mla, dflash or dspark)")
            try:
                self.for_compared(label)
            except ValidationError as exc:
                problems = "; ".join(e["msg"] for e in exc.errors())
                raise ValueError(f"training.compare.{label} does not train with this training section: "
                                 f"{problems}") from None
        return self

    def for_compared(self, label: str) -> TrainingSpec:
        """This training section with ``training.compare[label]`` as its drafter (and its ``aux_layer_ids`` when
        set), every other setting the same: what ``drafter_comparison`` trains that entry with.

        Raises:
            KeyError: no such entry.
            pydantic.ValidationError: the entry does not fit this section (e.g. EAGLE-3 settings on a block
                drafter); the catalog refuses such an entry at load.
        """
        entry = self.compare[label].model_dump()
        aux = entry.pop("aux_layer_ids")
        fields = self.model_dump()
        fields.update(drafter=entry, compare={}, aux_layer_ids=aux if aux is not None else self.aux_layer_ids)
        return TrainingSpec.model_validate(fields)

    @model_validator(mode="after")
    def _run_length(self) -> TrainingSpec:
        if self.epochs is None and self.train_tokens is None:
            raise ValueError("set training.epochs or training.train_tokens (or both: the run stops at the first)")
        steps = max(self.ttt_steps, self.acceptance_k)
        if self.drafter.window is not None and self.drafter.window < steps:
            raise ValueError(f"training.drafter.window {self.drafter.window} is shorter than the {steps} draft steps "
                             "(ttt_steps, acceptance_k): a chain's own keys would fall out of it; use a window of at "
                             f"least {steps} tokens")
        return self
