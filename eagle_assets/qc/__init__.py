"""Stage 4, ``qc_shards``: generations -> quality-checked training rows (``qc_pass``, vectorised segmentation in
``segment_batch``), the blocking checks' thresholds (``thresholds``, ``dataset_checks``), the live monitor that
watches a partition while it generates (``live``), and the DuckDB length reports (``lengths``, ``turn_report``)."""
