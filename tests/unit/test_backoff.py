import random

import pytest

from pgqueue import Backoff


def test_ceiling_doubles_each_attempt_until_the_cap() -> None:
    backoff = Backoff(base=1.0, cap=3600.0)
    assert [backoff.ceiling(a) for a in range(1, 6)] == [1.0, 2.0, 4.0, 8.0, 16.0]
    assert backoff.ceiling(13) == 3600.0  # 2**12 = 4096 > cap
    assert backoff.ceiling(10_000) == 3600.0  # huge attempt numbers do not overflow


def test_ceiling_of_attempt_zero_or_negative_is_the_base() -> None:
    assert Backoff(base=2.0, cap=10.0).ceiling(0) == 2.0
    assert Backoff(base=2.0, cap=10.0).ceiling(-3) == 2.0


def test_delay_is_always_within_zero_and_the_ceiling() -> None:
    backoff = Backoff(base=0.5, cap=30.0)
    rng = random.Random(1234)
    for attempt in range(1, 40):
        ceiling = backoff.ceiling(attempt)
        delays = [backoff.delay(attempt, rng) for _ in range(200)]
        assert all(0.0 <= d <= ceiling for d in delays)
        # full jitter: the spread covers most of [0, ceiling], not a narrow band
        assert min(delays) < ceiling * 0.1
        assert max(delays) > ceiling * 0.9


@pytest.mark.parametrize(("base", "cap"), [(0.0, 1.0), (-1.0, 1.0), (2.0, 1.0)])
def test_invalid_backoff_is_refused(base: float, cap: float) -> None:
    with pytest.raises(ValueError, match="base > 0"):
        Backoff(base=base, cap=cap)
