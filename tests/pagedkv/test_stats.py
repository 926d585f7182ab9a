import math

import pytest

from pagedkv.stats import percentile


def test_nearest_rank_returns_an_observed_sample() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 5.0
    assert percentile(values, 20) == 1.0  # 20% of 5 samples: the 1st
    assert percentile(values, 21) == 2.0


def test_p99_of_100_samples_is_the_99th() -> None:
    assert percentile(range(1, 101), 99) == 99.0
    assert percentile(range(1, 1001), 99) == 990.0


def test_empty_and_bad_q() -> None:
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)
