"""Dagster layer: thin assets that read a partition's catalog entry, call the domain code and report metadata."""
