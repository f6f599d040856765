"""Per-second aggregates that workers write and the dashboard and ``/metrics`` read.

Workers never write a row per job: each keeps counts and latency histograms in memory and
flushes them with one INSERT per second. History therefore survives dashboard restarts, is the
same for every dashboard, and costs one small statement per worker per second.

Latency histograms use log-spaced bins, ``BINS_PER_DOUBLING`` (4) per doubling from
``BASE_SECONDS`` (100 µs). A percentile is reported as its bin's geometric midpoint, so it is
within ``RELATIVE_ERROR`` (2**(1/8) - 1, about ±9 %) of the true value; values under 100 µs
fall in bin 0 and read as 50 µs.

The worker records each written ack (``succeeded``, ``retried``, ``dead``) and each write
refused by fencing (``lost``) in a ``StatsRecorder``; ``worker/statistics.py`` flushes it.
"""

from __future__ import annotations

import json
import logging
import math
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import psycopg

from .db import validate_schema
from .sql import named

log = logging.getLogger("pgqueue.stats")

BASE_SECONDS = 1e-4
BINS_PER_DOUBLING = 4
NBINS = 128
RELATIVE_ERROR = 2 ** (1 / (2 * BINS_PER_DOUBLING)) - 1
OUTCOMES = ("succeeded", "retried", "dead", "lost")
#: A depth sample that found N jobs waiting holds for N / DEPTH_ROWS_PER_SECOND seconds (at
#: least one): counting is ~0.5 us per waiting job, so this keeps it near 2 % of a core.
DEPTH_ROWS_PER_SECOND = 50_000


def bin_of(seconds: float) -> int:
    """The histogram bin of a duration; bin i >= 1 covers [BASE·2^((i-1)/4), BASE·2^(i/4))."""
    if not seconds >= BASE_SECONDS:  # also catches NaN and negatives (clock quirks)
        return 0
    index = math.floor(BINS_PER_DOUBLING * math.log2(seconds / BASE_SECONDS)) + 1
    return min(index, NBINS - 1)


def bin_lower(index: int) -> float:
    return 0.0 if index <= 0 else BASE_SECONDS * 2 ** ((index - 1) / BINS_PER_DOUBLING)


def bin_upper(index: int) -> float:
    return math.inf if index >= NBINS - 1 else BASE_SECONDS * 2 ** (index / BINS_PER_DOUBLING)


def bin_value(index: int) -> float:
    """The value a bin stands for: its geometric midpoint (the overflow bin: its lower edge)."""
    if index <= 0:
        return BASE_SECONDS / 2
    if index >= NBINS - 1:
        return bin_lower(index)
    return BASE_SECONDS * 2 ** ((index - 0.5) / BINS_PER_DOUBLING)


def percentile(hist: Mapping[int, int], q: float) -> float | None:
    """The q-quantile (0 < q <= 1) of a histogram, or None when it is empty."""
    total = sum(c for c in hist.values() if c > 0)
    if total == 0:
        return None
    rank = max(1, math.ceil(q * total))
    seen = 0
    for index in sorted(hist):
        seen += max(hist[index], 0)
        if seen >= rank:
            return bin_value(index)
    return bin_value(max(hist))  # unreachable; keeps the type checker content


def merge(target: dict[int, int], other: Mapping[int, int] | Mapping[str, int]) -> dict[int, int]:
    """Add ``other`` into ``target`` (keys may be the JSON strings the table stores)."""
    for key, count in other.items():
        index = int(key)
        target[index] = target.get(index, 0) + int(count)
    return target


@dataclass
class QueueStats:
    """What one queue saw since the last flush."""

    succeeded: int = 0
    retried: int = 0
    dead: int = 0
    lost: int = 0
    pickup: dict[int, int] = field(default_factory=dict)
    run: dict[int, int] = field(default_factory=dict)

    def add(self, other: QueueStats) -> None:
        self.succeeded += other.succeeded
        self.retried += other.retried
        self.dead += other.dead
        self.lost += other.lost
        merge(self.pickup, other.pickup)
        merge(self.run, other.run)

    def as_row(self, queue: str) -> dict[str, Any]:
        return {
            "queue": queue,
            "succeeded": self.succeeded,
            "retried": self.retried,
            "dead": self.dead,
            "lost": self.lost,
            "pickup_hist": {str(k): v for k, v in sorted(self.pickup.items())},
            "run_hist": {str(k): v for k, v in sorted(self.run.items())},
        }


class StatsRecorder:
    """In-memory counts for one worker, flushed once per second in one statement.

    ``record`` is called from the worker's event loop only, so it needs no lock.
    """

    def __init__(self, schema: str, worker_id: uuid.UUID) -> None:
        self.schema = validate_schema(schema)
        self.worker_id = worker_id
        self._pending: dict[str, QueueStats] = {}

    def record(
        self,
        queue: str,
        outcome: str,
        pickup_seconds: float | None,
        run_seconds: float | None,
    ) -> None:
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {OUTCOMES}, not {outcome!r}")
        entry = self._pending.setdefault(queue, QueueStats())
        setattr(entry, outcome, getattr(entry, outcome) + 1)
        if pickup_seconds is not None:
            index = bin_of(pickup_seconds)
            entry.pickup[index] = entry.pickup.get(index, 0) + 1
        if run_seconds is not None:
            index = bin_of(run_seconds)
            entry.run[index] = entry.run.get(index, 0) + 1

    @property
    def pending(self) -> Mapping[str, QueueStats]:
        return self._pending

    def rows(self) -> list[dict[str, Any]]:
        return [stats.as_row(queue) for queue, stats in sorted(self._pending.items())]

    async def flush(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Write what was recorded since the last flush; on failure keep it for the next one."""
        if not self._pending:
            return
        taken, self._pending = self._pending, {}
        rows = [stats.as_row(queue) for queue, stats in sorted(taken.items())]
        try:
            await conn.execute(
                named("pgqueue", "stats.sql", self.schema)["record_stats"],
                {"worker_id": self.worker_id, "rows": json.dumps(rows)},
            )
        except BaseException:
            self._restore(taken.items())
            raise

    def _restore(self, taken: Iterable[tuple[str, QueueStats]]) -> None:
        # Whatever was recorded while the statement ran is merged back in, not overwritten.
        for queue, stats in taken:
            self._pending.setdefault(queue, QueueStats()).add(stats)


def depth_holds(waiting: int, rows_per_second: int = DEPTH_ROWS_PER_SECOND) -> int:
    """Seconds a depth sample that found ``waiting`` jobs stands for (as in sample_depth)."""
    return max(1, waiting // rows_per_second)


async def sample_depth(
    conn: psycopg.AsyncConnection[Any],
    schema: str,
    rows_per_second: int = DEPTH_ROWS_PER_SECOND,
) -> None:
    """Record per-queue depth for the current second, once across all workers, unless the
    previous sample still holds (see DEPTH_ROWS_PER_SECOND)."""
    await conn.execute(
        named("pgqueue", "stats.sql", validate_schema(schema))["sample_depth"],
        {"rows_per_second": rows_per_second},
    )


async def prune_stats(
    conn: psycopg.AsyncConnection[Any], schema: str, older_than_seconds: float
) -> None:
    """Drop aggregates and depth samples older than the retention window."""
    await conn.execute(
        named("pgqueue", "stats.sql", validate_schema(schema))["prune_stats"],
        {"older_than": float(older_than_seconds)},
    )
