"""Running length figures in constant time per row: an exact histogram of integer token lengths.

Why not a quantile sketch (KLL, t-digest): lengths are integers bounded by the request cap (``max_new_tokens``, at
most a few 10k), so one counter per length is a few 100 KB at most, exact, and answers the figures the blocking
checks compute (``quality.thresholds``: ``statistics.median`` with its mean of the two middle values, p10 by the
index rule ``sorted[int(0.1 * (n - 1))]``) bit for bit. A sketch would be approximate for no gain and a dependency
more. Adding a row is O(1) (amortised growth); a quantile is O(max length) vectorised, independent of the rows.
"""

from __future__ import annotations

import numpy as np


class LengthHistogram:
    """Counts of non-negative integer lengths (tokens); negative values are counted as 0 (never produced)."""

    def __init__(self, size: int = 1024):
        self._counts = np.zeros(max(1, size), dtype=np.int64)
        self.n = 0

    def add(self, value: int) -> None:
        v = max(0, int(value))
        if v >= len(self._counts):
            grown = np.zeros(max(v + 1, 2 * len(self._counts)), dtype=np.int64)
            grown[: len(self._counts)] = self._counts
            self._counts = grown
        self._counts[v] += 1
        self.n += 1

    def add_many(self, values: np.ndarray) -> None:
        values = np.maximum(np.asarray(values, dtype=np.int64), 0)
        if not len(values):
            return
        top = int(values.max())
        if top >= len(self._counts):
            grown = np.zeros(max(top + 1, 2 * len(self._counts)), dtype=np.int64)
            grown[: len(self._counts)] = self._counts
            self._counts = grown
        self._counts += np.bincount(values, minlength=len(self._counts))
        self.n += len(values)

    def at(self, k: int) -> int:
        """The k-th smallest value (0-based), as ``sorted(values)[k]``. Raises ``IndexError`` outside [0, n)."""
        if not 0 <= k < self.n:
            raise IndexError(f"index {k} outside the {self.n} values counted")
        return int(np.searchsorted(np.cumsum(self._counts), k, side="right"))

    def median(self) -> float:
        """``statistics.median`` of the values (mean of the two middle ones for an even count); 0.0 when empty."""
        if not self.n:
            return 0.0
        if self.n % 2:
            return float(self.at(self.n // 2))
        return (self.at(self.n // 2 - 1) + self.at(self.n // 2)) / 2

    def index_quantile(self, q: float) -> float:
        """``sorted(values)[int(q * (n - 1))]`` (the checks' p10 / p90 rule); 0.0 when empty."""
        return float(self.at(int(q * (self.n - 1)))) if self.n else 0.0

    def below(self, limit: int) -> int:
        """How many values are < ``limit``."""
        return int(self._counts[: max(0, min(int(limit), len(self._counts)))].sum())
