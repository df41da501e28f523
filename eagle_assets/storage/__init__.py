"""Where the pipeline's files live and how they are written: the storage root, per-asset partition folders,
atomic writes and numbered Parquet shards (``shards``)."""
