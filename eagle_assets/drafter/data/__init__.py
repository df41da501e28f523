"""Which rows the drafter learns from and is tested on, and its draft vocab (no torch)."""
