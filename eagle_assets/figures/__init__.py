"""Running figures and plots: exact length histograms and duration sketches updated in O(1) per row (``running``),
and the PNG plots the assets attach to their metadata (``plots``, matplotlib)."""
