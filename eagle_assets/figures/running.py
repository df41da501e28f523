"""Running figures in constant time per row: an exact histogram of integer token lengths, and a relative-error
sketch of durations (``DurationSketch``, for request latencies).

Why not a quantile sketch (KLL, t-digest): lengths are integers bounded by the request cap (``max_new_tokens``, at
most a few 10k), so one counter per length is a few 100 KB at most, exact, and answers the figures the blocking
checks compute (``qc.thresholds``: ``statistics.median`` with its mean of the two middle values, p10 by the
index rule ``sorted[int(0.1 * (n - 1))]``) bit for bit. A sketch would be approximate for no gain and a dependency
more. Adding a row is O(1) (amortised growth); a quantile is O(max length) vectorised, independent of the rows.
"""

from __future__ import annotations

import math

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


class DurationSketch:
    """Running quantiles of positive durations (seconds) in constant memory: counts in logarithmic bins of ratio
    ``GAMMA`` (DDSketch's relative-error scheme, Masson et al., VLDB 2019), from ``MIN_S`` to ``MIN_S *
    GAMMA ** BINS`` (1 us to ~3 h); shorter and longer values land in the end bins. A quantile is the bin's
    geometric middle, within ``(GAMMA - 1) / 2`` (0.5%) of the exact order statistic, clamped to the exact min
    and max. Unlike lengths, durations are not small integers, so an exact histogram does not apply.

    ``append`` and ``len`` as on the list of durations it replaces (client and generation statistics).
    """

    GAMMA = 1.01
    MIN_S = 1e-6
    BINS = 2_300

    def __init__(self) -> None:
        self._counts = np.zeros(self.BINS, dtype=np.int64)
        self._log_gamma = math.log(self.GAMMA)
        self.n = 0
        self.min = float("inf")
        self.max = float("-inf")

    def __len__(self) -> int:
        return self.n

    def append(self, seconds: float) -> None:
        s = float(seconds)
        i = 0 if s <= self.MIN_S else min(self.BINS - 1, int(math.log(s / self.MIN_S) / self._log_gamma) + 1)
        self._counts[i] += 1
        self.n += 1
        self.min, self.max = min(self.min, s), max(self.max, s)

    def at(self, k: int) -> float:
        """About the k-th smallest duration (0-based; ``sorted(values)[k]`` within 0.5%). ``IndexError`` outside
        [0, n)."""
        if not 0 <= k < self.n:
            raise IndexError(f"index {k} outside the {self.n} values counted")
        if k == 0 or k == self.n - 1:  # the ends are kept exactly
            return self.min if k == 0 else self.max
        i = int(np.searchsorted(np.cumsum(self._counts), k, side="right"))
        mid = self.MIN_S * self.GAMMA ** (i - 0.5) if i else self.MIN_S
        return min(max(mid, self.min), self.max)
