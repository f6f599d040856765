"""The retry-delay formula: capped exponential backoff with full jitter.

    delay = uniform(0, min(cap, base * 2 ** (attempt - 1)))

Defaults base = 1 s, cap = 1 h: the first retry comes within a second (most transient errors
are), the tenth within ~8.5 min, and nothing waits longer than an hour. Full jitter spreads a
burst of failures (a database or API outage) so retries do not arrive in lockstep. The reaper
applies the same formula in SQL (``reap_expired_leases``) to jobs whose lease expired.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .jobs import MAX_DELAY_SECONDS


@dataclass(frozen=True, slots=True)
class Backoff:
    base: float = 1.0
    cap: float = 3600.0

    def __post_init__(self) -> None:
        if not (self.base > 0 and self.cap >= self.base):
            raise ValueError("backoff needs base > 0 and cap >= base")
        if not self.cap <= MAX_DELAY_SECONDS:  # also refuses infinity and NaN
            raise ValueError(
                f"backoff cap must be at most {MAX_DELAY_SECONDS:,.0f} seconds (100 years), "
                f"got {self.cap!r}"
            )

    def ceiling(self, attempt: int) -> float:
        """The largest delay after failed attempt number ``attempt`` (1-based)."""
        exponent = min(max(attempt - 1, 0), 64)
        return float(min(self.cap, self.base * 2.0**exponent))

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        return (rng or random).uniform(0.0, self.ceiling(attempt))
