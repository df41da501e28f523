"""Where the pipeline's files live and how they are written: the storage root, per-asset partition folders,
atomic writes and numbered Parquet shards (``shards``); no symbolic link under the root is followed and one writer
holds a stage folder at a time (``guard``)."""
