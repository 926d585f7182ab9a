"""The shared call discipline: `Backoff` (capped, jittered, reset on success) and `clip`."""

from __future__ import annotations

import random

import pytest

from pagedkv.rpc import MAX_DETAIL_CHARS, Backoff, clip


class FixedRandom(random.Random):
    """`random()` returns `value`: the jitter factor becomes exactly `1 - jitter * value`."""

    def __init__(self, value: float) -> None:
        super().__init__(0)
        self.value = value

    def random(self) -> float:
        return self.value


def test_backoff_doubles_up_to_the_cap_and_stays_there() -> None:
    backoff = Backoff(initial_s=0.5, max_s=10.0, jitter=0.5, rng=FixedRandom(0.0))
    assert [backoff.next_delay() for _ in range(8)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]
    assert backoff.failures == 8


def test_backoff_jitter_scales_down_only() -> None:
    backoff = Backoff(initial_s=1.0, max_s=4.0, jitter=0.5, rng=FixedRandom(1.0))
    assert [backoff.next_delay() for _ in range(4)] == [0.5, 1.0, 2.0, 2.0]
    seeded = Backoff(initial_s=1.0, max_s=4.0, jitter=0.5, rng=random.Random(3))
    delays = [seeded.next_delay() for _ in range(50)]
    assert all(2.0 <= d <= 4.0 for d in delays[2:]) and len(set(delays)) > 40   # spread, capped


def test_backoff_reset_starts_over_and_never_overflows() -> None:
    backoff = Backoff(initial_s=0.1, max_s=2.0, rng=FixedRandom(0.0))
    for _ in range(5000):   # 2**5000 would overflow a float: the base stops growing at the cap
        backoff.next_delay()
    assert backoff.next_delay() == 2.0
    backoff.reset()
    assert (backoff.failures, backoff.next_delay()) == (0, 0.1)


@pytest.mark.parametrize(
    "kwargs", [{"initial_s": 0}, {"initial_s": 2, "max_s": 1}, {"jitter": 1.5}, {"multiplier": 0.5}]
)
def test_backoff_rejects_nonsense(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        Backoff(**kwargs)


def test_clip_keeps_short_text_and_both_ends_of_long_text() -> None:
    assert clip("short") == "short"
    long = "unknown node '" + "a" * 20_000 + "'"
    clipped = clip(long)
    assert len(clipped) == MAX_DETAIL_CHARS
    assert clipped.startswith("unknown node 'aaa") and clipped.endswith("aaa'") and "[20015 chars]" in clipped
    assert clip("x" * 100, 10) == "x" * 10
