"""Prometheus exposition from the refresh loop's last snapshot: a scrape runs no query.

Each app gets its own registry, so several dashboards in one process do not collide.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector

from .. import stats
from .refresh import Refresher

#: Histogram bucket bounds: every second doubling of the stats bins (factor 4), 100 µs to ~3 days.
BOUND_BINS = list(range(0, stats.NBINS - 1, 2 * stats.BINS_PER_DOUBLING))


def prometheus_buckets(hist: Mapping[int, int]) -> tuple[list[tuple[str, float]], float]:
    """Cumulative (le, count) pairs and an approximate sum (bin midpoints) of a stats histogram."""
    buckets: list[tuple[str, float]] = []
    for edge_bin in BOUND_BINS:
        bound = stats.bin_upper(edge_bin)
        count = sum(c for i, c in hist.items() if i <= edge_bin)
        buckets.append((repr(bound), float(count)))
    buckets.append(("+Inf", float(sum(hist.values()))))
    total = sum(stats.bin_value(i) * c for i, c in hist.items())
    return buckets, total if math.isfinite(total) else 0.0


class DashboardCollector(Collector):
    def __init__(self, refresher: Refresher) -> None:
        self.refresher = refresher

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        snap = self.refresher.snapshot
        up = GaugeMetricFamily(
            "pgqueue_dashboard_database_up", "1 when the last refresh reached the database."
        )
        up.add_metric([], 1.0 if snap is not None and self.refresher.healthy else 0.0)
        yield up
        yield from self._dashboard()
        if snap is None:
            return
        depth = GaugeMetricFamily(
            "pgqueue_jobs", "Jobs by queue and status (queued, retrying, running).",
            labels=["queue", "status"],
        )  # fmt: skip
        for row in snap["queues"]:
            for status in ("queued", "retrying", "running"):
                depth.add_metric([row["queue"], status], float(row[status]))
        yield depth
        finished = CounterMetricFamily(
            "pgqueue_jobs_finished",
            "Finished attempts by queue and outcome since this dashboard started.",
            labels=["queue", "outcome"],
        )
        for (queue, outcome), n in sorted(self.refresher.totals.finished.items()):
            finished.add_metric([queue, outcome], float(n))
        yield finished
        for name, hist, text in (
            ("pgqueue_pickup_latency_seconds", self.refresher.totals.pickup,
             "Due to claimed, since this dashboard started (log bins, about 9 % error)."),
            ("pgqueue_run_seconds", self.refresher.totals.run,
             "Handler run time, since this dashboard started (log bins, about 9 % error)."),
        ):  # fmt: skip
            buckets, total = prometheus_buckets(hist)
            family = HistogramMetricFamily(name, text)
            family.add_metric([], buckets, total)
            yield family
        workers = GaugeMetricFamily(
            "pgqueue_workers_alive", "Workers whose last heartbeat is not late."
        )
        workers.add_metric([], float(snap.get("workers_alive", 0)))
        yield workers
        registered = GaugeMetricFamily("pgqueue_workers", "Registered workers, late ones included.")
        registered.add_metric([], float(len(snap.get("workers", []))))
        yield registered

    def _dashboard(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """The dashboard's own cost: one refresh per interval, however many pages are open."""
        r = self.refresher
        refreshes = CounterMetricFamily(
            "pgqueue_dashboard_refreshes", "Refreshes of every panel (one database read each)."
        )
        refreshes.add_metric([], float(r.refreshes))
        yield refreshes
        failures = CounterMetricFamily(
            "pgqueue_dashboard_refresh_failures", "Refreshes that could not read the database."
        )
        failures.add_metric([], float(r.failures))
        yield failures
        pages = GaugeMetricFamily(
            "pgqueue_dashboard_open_pages", "Pages receiving the live stream right now."
        )
        pages.add_metric([], float(r.broadcaster.listeners))
        yield pages
        replica = (r.snapshot or {}).get("replica")
        if replica is not None and replica["lag"] is not None:
            lag = GaugeMetricFamily(
                "pgqueue_dashboard_replica_lag_seconds",
                "How far behind its primary the hot standby the dashboard reads is.",
            )
            lag.add_metric([], float(replica["lag"]))
            yield lag
        if r.last_duration is not None:
            duration = GaugeMetricFamily(
                "pgqueue_dashboard_refresh_seconds", "Wall time of the last refresh's queries."
            )
            duration.add_metric([], r.last_duration)
            yield duration


def registry_for(refresher: Refresher) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DashboardCollector(refresher))
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
