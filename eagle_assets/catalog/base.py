"""What every catalog section shares: the error that names the file, field and fix, and the strict base model."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict


class CatalogError(ValueError):
    """An invalid catalog: the message names the file, the field and what to do."""

    def __init__(self, file: str | Path, field: str, problem: str, fix: str = ""):
        self.file = str(file)
        self.field = field
        self.problem = problem
        self.fix = fix
        super().__init__(f"{file}: {field}: {problem}" + (f" -- {fix}" if fix else ""))


class StrictModel(BaseModel):
    """A catalog section: unknown keys are refused (a typo never passes silently), values are frozen."""


    model_config = ConfigDict(extra="forbid", frozen=True)
