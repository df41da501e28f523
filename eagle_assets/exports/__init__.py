"""Exports of the training mix for the trainers people already run: speculators and SpecForge.

Domain code only (no Dagster): :mod:`eagle_assets.exports.formats` says where each trainer reads pre-tokenized
rows (with the source files read), :mod:`eagle_assets.exports.pretokenized` writes them, exact, and checks them.
"""

from eagle_assets.exports.formats import FORMATS, SPECFORGE, SPECULATORS, TrainerFormat
from eagle_assets.exports.pretokenized import (
    REJECT_REASONS,
    ExportError,
    ExportReport,
    export_mixed_rows,
    verify_export,
)

__all__ = [
    "FORMATS",
    "REJECT_REASONS",
    "SPECFORGE",
    "SPECULATORS",
    "ExportError",
    "ExportReport",
    "TrainerFormat",
    "export_mixed_rows",
    "verify_export",
]
