"""Figure maths of the dashboard: windows, stacking, depth gap filling, late workers."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

from pgqueue import stats
from pgqueue.dashboard import figures
from pgqueue.dashboard.app import is_loopback
from pgqueue.dashboard.broadcast import Broadcaster
from pgqueue.dashboard.database import session_options
from pgqueue.dashboard.metrics import prometheus_buckets
from pgqueue.dashboard.security import credentials_match


def test_throughput_series_covers_two_minutes_and_splits_failures() -> None:
    end = 1000
    rows = [(end - 3, 4, 1, 0, 0), (end - 5, 6, 0, 2, 1), (end - 200, 99, 0, 0, 0),
            (end, 7, 1, 0, 0)]  # fmt: skip
    tp = figures.throughput(rows, end)
    assert tp["t"][0] == end - 119 and tp["t"][-1] == end and len(tp["t"]) == 120
    assert tp["succeeded"][-4] == 4 and tp["failed"][-4] == 1
    assert tp["succeeded"][-6] == 6 and tp["failed"][-6] == 2
    assert tp["succeeded"][-1] == 7 and tp["settled_until"] == end - 2
    assert sum(tp["succeeded"]) == 17  # the row outside the window is ignored
    assert tp["retries_60s"] == 2 and tp["failed_60s"] == 2


def test_throughput_rate_averages_the_settled_ten_seconds() -> None:
    end = 500
    rows = [(end - s, 10, 1, 0, 0) for s in range(0, 30)]
    # The last two seconds are not settled yet and do not count.
    assert figures.throughput(rows, end)["rate"] == 11.0
    assert figures.throughput([(end, 1000, 0, 0, 0)], end)["rate"] == 0.0


def test_latency_tiles_come_from_the_merged_histograms() -> None:
    fast, slow = stats.bin_of(0.002), stats.bin_of(0.5)
    hists = figures.histograms([("pickup", fast, 90), ("pickup", slow, 10), ("run", slow, 1)])
    tiles = figures.latency(hists)
    assert tiles["pickup_p50"] == stats.bin_value(fast)
    assert tiles["pickup_p95"] == stats.bin_value(slow)
    assert tiles["run_p50"] == stats.bin_value(slow)
    assert figures.latency(figures.histograms([]))["run_p95"] is None


def test_depth_prefers_worker_samples_and_fills_gaps_from_observations() -> None:
    end = 300
    sampled = [(end - 3, "a", 5, 0), (end - 2, "a", 6, 1)]
    observed = {end - 2: {"a": 99}, end - 1: {"a": 7}, end: {"a": 8, "b": 0}}
    depth = figures.depth_series(sampled, observed, end)
    assert depth["queues"]["a"][-4:] == [5, 6, 7, 8]
    assert "b" not in depth["queues"]  # nothing ever waited there
    assert figures.depth_series([], {}, end)["queues"] == {}


def test_a_deep_backlogs_sample_fills_the_seconds_it_holds_a_shallow_ones_does_not() -> None:
    end = 300
    # 10 waiting at 2 per second of holding: the 5 seconds after it carry it; then unknown.
    deep = figures.depth_series([(end - 10, "a", 10, 0)], {}, end, rows_per_second=2)
    assert deep["queues"]["a"][-12:] == [None, 10, 10, 10, 10, 10, 10] + [None] * 5
    shallow = figures.depth_series([(end - 3, "a", 1, 0)], {}, end, rows_per_second=2)
    assert shallow["queues"]["a"][-4:] == [1, None, None, None]
    # What the dashboard observed itself wins over a held sample.
    mixed = figures.depth_series([(end - 3, "a", 10, 0)], {end - 1: {"a": 4}}, end, 2)
    assert mixed["queues"]["a"][-4:] == [10, 10, 4, 10]


def test_depth_is_unknown_where_no_worker_sampled_and_the_dashboard_did_not_watch() -> None:
    """No worker ran before this dashboard started: the chart must not draw 0 for jobs that
    were waiting all along (it did, then jumped at its right edge)."""
    end = 300
    depth = figures.depth_series([], {end - 1: {"a": 5}, end: {"a": 5}}, end)
    assert depth["queues"]["a"][:-2] == [None] * 118 and depth["queues"]["a"][-2:] == [5, 5]
    # While a worker ran it sampled every second; a second without a row had nothing waiting.
    ran = figures.depth_series([(end - 50, "a", 3, 0)], {end: {"a": 2}}, end,
                               sampling=[(end - 60, end)])  # fmt: skip
    a = ran["queues"]["a"]
    assert a[-62] is None and a[-61:-51] == [0] * 10 and a[-51] == 3 and a[-50] == 0
    # Its samples for the last two seconds may still be on their way: unknown, not 0.
    assert a[-3:] == [0, None, 2]


def test_depth_counts_key_statuses_by_queue() -> None:
    rows = [("a", 3, 0, 1), ("b", 0, 2, 0)]
    assert figures.depth_counts(rows) == {
        "a": {"queued": 3, "retrying": 0, "running": 1},
        "b": {"queued": 0, "retrying": 2, "running": 0},
    }


def test_running_counts_are_replaced_by_live_ones() -> None:
    sampled = {
        "a": {"queued": 3, "retrying": 0, "running": 5},
        "b": {"queued": 0, "retrying": 0, "running": 1},
    }
    assert figures.with_running(sampled, [("a", 2), ("c", 4)]) == {
        "a": {"queued": 3, "retrying": 0, "running": 2},
        "c": {"queued": 0, "retrying": 0, "running": 4},
    }  # b ran its last job since the sample: gone


def test_a_worker_is_late_past_the_threshold() -> None:
    row = ("id", "host", 1, None, 4, 100.0, 16.0, 0, 2)
    assert figures.worker_row(row, late_after=15.0)["late"] is True
    assert figures.worker_row(row, late_after=20.0)["late"] is False


def test_prometheus_buckets_are_cumulative_and_end_with_inf() -> None:
    hist = {stats.bin_of(0.001): 3, stats.bin_of(10.0): 1}
    buckets, total = prometheus_buckets(hist)
    counts = [c for _, c in buckets]
    assert counts == sorted(counts) and buckets[-1] == ("+Inf", 4.0)
    assert 10.0 < total < 11.5


def test_basic_auth_compare() -> None:
    def header(user: str, password: str) -> str:
        return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()

    assert credentials_match(header("admin", "s3cret"), "admin", "s3cret")
    assert not credentials_match(header("admin", "wrong"), "admin", "s3cret")
    assert not credentials_match(header("root", "s3cret"), "admin", "s3cret")
    assert not credentials_match("Basic !!!", "admin", "s3cret")
    assert not credentials_match(None, "admin", "s3cret")
    assert not credentials_match("Bearer x", "admin", "s3cret")


def test_loopback_detection() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert is_loopback("127.8.0.1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.5")
    assert not is_loopback("example.com")


def test_sessions_send_no_startup_options_so_the_dsns_own_are_kept() -> None:
    # Read-only and the timeouts are set per transaction (PgBouncer refuses `options`).
    assert "options" not in session_options()


def test_one_publish_reaches_every_listener() -> None:
    async def scenario() -> list[bytes | None]:
        hub = Broadcaster()
        waiters = [asyncio.create_task(hub.next(0, 5.0)) for _ in range(10)]
        await asyncio.sleep(0)
        await hub.publish(b"snapshot-1")
        results = [payload for _, payload in await asyncio.gather(*waiters)]
        _, timed_out = await hub.next(hub.seq, 0.01)
        return [*results, timed_out]

    results = asyncio.run(scenario())
    assert results[:10] == [b"snapshot-1"] * 10 and results[10] is None


def _worker(**fields: Any) -> dict[str, Any]:
    base = {"id": "w", "host": "h", "pid": 1, "queues": None, "concurrency": 4, "leases": 0,
            "heartbeat_age": 1.0, "late": False, "live": True, "lease": 30.0}  # fmt: skip
    return {**base, **fields}


def test_the_health_strip_warns_of_dead_rows_past_the_ratio_and_the_minimum() -> None:
    def dead_rows(live: int, dead: int) -> Any:
        return figures.health(
            oldest_transaction=None, hidden_sessions=0, tuples=(live, dead, 12.0), workers=[],
            dead_tuple_ratio=0.2, dead_tuple_minimum=10_000, late_after=15.0,
        )["dead_rows"]  # fmt: skip

    assert dead_rows(100_000, 19_000) is None  # under 20 %
    assert dead_rows(10_000, 9_000) is None  # under the minimum
    assert dead_rows(100_000, 25_000) == {"live": 100_000, "dead": 25_000, "vacuumed_ago": 12.0}


def test_a_worker_is_behind_when_two_of_its_heartbeat_intervals_passed() -> None:
    """Workers record their lease, not their interval: the default interval is lease / 3."""
    workers = [
        _worker(id="ok", heartbeat_age=19.0),  # lease 30 s: a beat every 10 s, 20 s is late
        _worker(id="behind", heartbeat_age=21.0),
        _worker(id="no-lease", lease=None, heartbeat_age=14.0),  # then --late-after counts
        _worker(id="no-lease-late", lease=None, heartbeat_age=16.0),
    ]
    found = figures.health(
        oldest_transaction=None, hidden_sessions=0, tuples=None, workers=workers,
        dead_tuple_ratio=0.2, dead_tuple_minimum=10_000, late_after=15.0,
    )  # fmt: skip
    assert [w["id"] for w in found["workers"]] == ["behind", "no-lease-late"]
    assert found["workers"][0]["interval"] == 10.0
    assert found["transaction"] is None and found["dead_rows"] is None


def test_a_queue_whose_serving_workers_are_all_full_says_so() -> None:
    rows = figures.queue_table(
        {"q": {"queued": 3, "retrying": 0, "running": 0}}, dead={}, finished={}, pickup={},
        heads={"q": 5.0}, settings={},
        workers=[_worker(leases=4, concurrency=4), _worker(queues=["other"])],
    )  # fmt: skip
    assert rows[0]["why"]["code"] == "workers_busy"
    assert "4 slots" in rows[0]["why"]["text"]
    free = figures.queue_table(
        {"q": {"queued": 3, "retrying": 0, "running": 0}}, dead={}, finished={}, pickup={},
        heads={"q": 5.0}, settings={}, workers=[_worker()],
    )  # fmt: skip
    assert free[0]["why"]["code"] == "ready"
