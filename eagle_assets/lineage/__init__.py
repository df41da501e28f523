"""Lineage without Dagster: the versions of a pipeline's inputs (``versions``: source files, settings, the target's
tokenizer and weights, generation fingerprints, content versions of stored files) and the identity of the code and
catalog a result was made by (``identity``). The Dagster layer (``assets``) reports them as data versions,
observations and provenance."""
