"""The catalog's ``evaluation`` section: benchmark suites the trained drafter is measured on, the k values, the
position buckets and the gates per suite and thinking mode.

A suite is a dataset the drafter never trains on. It runs as the Dagster partition ``eval-<suite>``
(:func:`suite_partition_key`) through the same stages as a training dataset: its prompts rendered with the
serving chat template and its generation suffix, every turn answered on-policy by the target (``all_turns``: a
multi-turn suite such as MT-bench asks its later turns after the model's own replies), token-structure QC. The
``evaluation`` asset (``eagle_assets.drafter.evaluation.suites``) then reads its QC rows.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from eagle_assets.catalog.base import StrictModel
from eagle_assets.catalog.partitions import (
    PARTITION_KEY_RE,
    LiveSpec,
    PartitionSpec,
    SamplingSpec,
    SourceSpec,
    Thresholds,
)

#: a suite's Dagster partition key is this prefix and the suite's name
SUITE_PREFIX = "eval-"
#: thinking setting -> (the partition's ``enable_thinking``, the thinking modes its rows carry)
THINKING = {"on": (True, ("on",)), "off": (False, ("off",)), "both": ("both", ("on", "off")),
            "default": (None, ("default",))}


def suite_partition_key(suite: str) -> str:
    """The Dagster partition key of suite ``suite``: ``eval-<suite>``."""
    return f"{SUITE_PREFIX}{suite}"


class SuiteSpec(StrictModel):
    """One evaluation suite: prompts in any supported layout, how the target answers them and the gates.

    ``thinking``: ``on`` / ``off`` (the chat template's ``enable_thinking``), ``both`` (every conversation answered
    twice and measured apart), ``default`` (the template decides). ``sampling``: how the target answers (the
    suite's temperature is also the one its sampled acceptance is measured at; 0 = greedy only). ``tau_warn`` /
    ``min_tau_margin``: the gates of this suite's greedy tau at ``training.acceptance_k``, per thinking mode
    (null = the ``training`` section's). ``thresholds``: the suite partition's QC levels.
    """

    description: str = ""
    sources: list[SourceSpec] = Field(min_length=1)
    thinking: Literal["on", "off", "both", "default"] = "both"
    sampling: SamplingSpec = Field(default_factory=lambda: SamplingSpec(max_new_tokens=512, temperature=1.0))
    limit: int | None = Field(None, gt=0)
    max_turns: int = Field(8, gt=0)
    tool_result_match: Literal["arguments", "name"] = "arguments"
    seed: int = 0
    max_prompt_tokens: int | None = Field(2048, gt=0)
    thresholds: Thresholds = Field(default_factory=Thresholds)
    live: LiveSpec = Field(default_factory=LiveSpec)
    tau_warn: float | None = Field(None, ge=1)
    min_tau_margin: float | None = Field(None, ge=0)

    @field_validator("thinking", mode="before")
    @classmethod
    def _yaml_booleans(cls, v):
        # YAML 1.1 (PyYAML) reads an unquoted on / off as true / false
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v

    @property
    def modes(self) -> tuple[str, ...]:
        """The thinking modes this suite's rows carry (``tokenized_prompts.walk.thinking_modes`` names)."""
        return THINKING[self.thinking][1]

    def partition_spec(self) -> PartitionSpec:
        """The suite as a partition spec (``all_turns``: every row names its thinking mode and turn)."""
        return PartitionSpec(
            description=self.description, sources=self.sources, prompt_policy="all_turns",
            enable_thinking=THINKING[self.thinking][0], max_turns=self.max_turns,
            tool_result_match=self.tool_result_match, sampling=self.sampling, limit=self.limit, seed=self.seed,
            max_prompt_tokens=self.max_prompt_tokens, thresholds=self.thresholds, live=self.live)


#: blocks drawn per verification point for a drafter that samples its drafts (``evaluation.draft_samples``)
DRAFT_SAMPLES = 16


class EvaluationSpec(StrictModel):
    """``evaluation``: what the ``evaluation`` asset reports for the trained drafter.

    ``k``: drafts per verification to report tau at (a k curve; ``training.acceptance_k`` is always added: the
    gates read it). ``heldout``: also report the training partitions' held-out test rows (greedy; the rows of the
    ``acceptance_length`` check). ``position_buckets``: edges, in tokens from the row's start, of the
    position-in-sequence buckets acceptance is broken down by (``training.max_length`` is always one more: the
    buckets past it are marked ``past_training_length``). ``bootstrap``: resamples of each interval.
    ``draft_samples``: blocks drawn per verification point for a drafter that samples its drafts at a suite's
    temperature (DSpark: a seeded Monte Carlo whose standard error the report gives; exact figures need none).
    ``suites``: name -> :class:`SuiteSpec`.
    """

    k: list[int] = Field(default_factory=lambda: list(range(1, 9)), min_length=1)
    heldout: bool = True
    position_buckets: list[int] = Field(default_factory=lambda: [256, 512, 1024, 2048])
    bootstrap: int = Field(2000, gt=0)
    draft_samples: int = Field(DRAFT_SAMPLES, gt=0)
    suites: dict[str, SuiteSpec] = Field(default_factory=dict)

    @field_validator("k")
    @classmethod
    def _positive_k(cls, v: list[int]) -> list[int]:
        if any(k < 1 for k in v):
            raise ValueError(f"evaluation.k values must be >= 1 (drafts per verification), got {v}")
        return sorted(set(v))

    @field_validator("position_buckets")
    @classmethod
    def _ascending(cls, v: list[int]) -> list[int]:
        if any(b <= 0 for b in v) or v != sorted(set(v)):
            raise ValueError(f"evaluation.position_buckets must be ascending positive token positions, got {v}")
        return v

    @field_validator("suites")
    @classmethod
    def _suite_names(cls, v: dict[str, SuiteSpec]) -> dict[str, SuiteSpec]:
        for name in v:
            if not PARTITION_KEY_RE.match(name):
                raise ValueError(f"suite name {name!r} must match {PARTITION_KEY_RE.pattern} (it becomes the "
                                 f"partition key {suite_partition_key(name)!r})")
        return v

    def ks(self, acceptance_k: int) -> list[int]:
        """The k values reported: ``k`` and ``acceptance_k``, ascending."""
        return sorted(set(self.k) | {int(acceptance_k)})
