"""Output segmentation with named drop reasons, length statistics (DuckDB), thresholds and plots."""
