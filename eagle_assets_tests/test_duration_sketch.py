"""``figures.running.DurationSketch`` (request latencies in client and generation statistics): constant memory,
quantiles within its stated 0.5% of the exact order statistics the lists gave, ``append``/``len`` as on a list."""

from __future__ import annotations

import random

import pytest

from eagle_assets.figures.running import DurationSketch
from eagle_assets.generations.run import GenerationStats
from eagle_assets.serving.client import ClientStats


@pytest.mark.parametrize("seed", [0, 1])
def test_quantiles_are_within_half_a_percent_of_the_sorted_values(seed):
    rng = random.Random(seed)
    values = [rng.lognormvariate(-3, 1.5) for _ in range(20_001)] + [0.0, 7_200.0]
    sketch = DurationSketch()
    for v in values:
        sketch.append(v)
    ordered = sorted(values)
    assert len(sketch) == len(values)
    for k in (1, 100, len(values) // 10, len(values) // 2, int(0.99 * len(values)), len(values) - 2):
        assert sketch.at(k) == pytest.approx(ordered[k], rel=0.005)
    assert sketch.at(0) == 0.0 and sketch.at(len(values) - 1) == 7_200.0  # the exact ends
    with pytest.raises(IndexError):
        sketch.at(len(values))


def test_stats_summaries_read_the_sketch():
    for stats in (ClientStats(), GenerationStats()):
        assert stats.summary()["latency_p50_ms"] == 0.0
        for v in (0.010, 0.020, 0.030, 0.040, 1.0):
            stats.latencies_s.append(v)
        got = stats.summary()
        assert got["latency_p50_ms"] == pytest.approx(30.0, rel=0.005)
        assert got["latency_p99_ms"] == pytest.approx(1000.0, rel=0.005)
