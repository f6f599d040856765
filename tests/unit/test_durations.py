"""Every duration pgqueue takes in seconds is finite and at most MAX_DELAY_SECONDS (100 years),
refused where it is written: an infinite or huge one would overflow a timestamp in SQL or a
timeout in Python later, far from the mistake."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

import pgqueue
from pgqueue import Backoff, ConfigurationError, Retry
from pgqueue.jobs import MAX_DELAY_SECONDS

NOWHERE = "postgresql://nobody@127.0.0.1:1/never"
TOO_LONG = [float("inf"), float("nan"), 1e300, MAX_DELAY_SECONDS * 1.01, 10**400]


def test_max_delay_is_a_hundred_years() -> None:
    assert timedelta(seconds=MAX_DELAY_SECONDS) == timedelta(days=36525)


@pytest.mark.parametrize("after", [*TOO_LONG, -1, timedelta.max, timedelta(seconds=-1)])
def test_retry_refuses_a_delay_it_could_never_schedule(after: float | timedelta) -> None:
    with pytest.raises(ValueError, match=r"Retry\(after=...\) must be between 0 and 3,155,760,000"):
        Retry(after=after)


@pytest.mark.parametrize("after", [0, 0.5, 86400, MAX_DELAY_SECONDS, timedelta(days=36525)])
def test_retry_accepts_delays_up_to_the_bound(after: float | timedelta) -> None:
    assert Retry(after=after).after == pytest.approx(
        after.total_seconds() if isinstance(after, timedelta) else after
    )


@pytest.mark.parametrize("cap", [float("inf"), 1e300, MAX_DELAY_SECONDS * 2])
def test_backoff_cap_is_bounded(cap: float) -> None:
    with pytest.raises(ValueError, match="backoff cap must be at most 3,155,760,000 seconds"):
        Backoff(cap=cap)
    with pytest.raises(ValueError, match="backoff cap must be at most"):
        Backoff(base=cap, cap=cap)


def test_backoff_cap_of_exactly_the_bound_is_accepted() -> None:
    assert Backoff(cap=MAX_DELAY_SECONDS).ceiling(10_000) == MAX_DELAY_SECONDS


@pytest.mark.parametrize(
    "option",
    ["lease", "heartbeat_interval", "poll_interval", "grace_period", "reaper_interval",
     "retention", "flush_interval"],
)  # fmt: skip
@pytest.mark.parametrize("value", [*TOO_LONG, -1.0, "30", True])
def test_worker_refuses_durations_that_are_not_a_sane_number_of_seconds(
    option: str, value: Any
) -> None:
    options: dict[str, Any] = {option: value}
    if option == "heartbeat_interval":
        options["lease"] = MAX_DELAY_SECONDS
    with pytest.raises(ConfigurationError, match=option):
        pgqueue.App(NOWHERE).worker(**options)


@pytest.mark.parametrize("option", ["lease", "poll_interval", "reaper_interval"])
def test_worker_durations_that_must_be_positive_refuse_zero(option: str) -> None:
    with pytest.raises(ConfigurationError, match=f"{option} must be above 0"):
        pgqueue.App(NOWHERE).worker(**{option: 0})


def test_worker_accepts_zero_where_zero_means_at_once_and_the_bound_itself() -> None:
    app = pgqueue.App(NOWHERE)
    worker = app.worker(grace_period=0, retention=0, flush_interval=0)
    assert (worker.grace_period, worker.retention, worker.flush_interval) == (0, 0, 0)
    assert app.worker(lease=MAX_DELAY_SECONDS, retention=None).lease == MAX_DELAY_SECONDS


@pytest.mark.parametrize(
    ("queues", "message"),
    [
        ([" emails"], "queues: queue name ' emails' must not start or end with whitespace"),
        (["emails,sms"], "queues: queue name 'emails,sms' must not contain a comma"),
        ([""], "queues: queue name must not be empty"),
        ([42], "queues: queue name must be a string"),
        ("emails", "queues must be a list of queue names, not one string"),
        ([], "queues must name at least one queue"),
    ],
)
def test_worker_refuses_queue_names_no_producer_can_use(queues: Any, message: str) -> None:
    """It used to strip them silently, and then served a different queue than it was told."""
    with pytest.raises(ConfigurationError, match=message):
        pgqueue.App(NOWHERE).worker(queues=queues)


def test_worker_serves_the_queues_it_is_given() -> None:
    worker = pgqueue.App(NOWHERE).worker(queues=("emails", "daily reports"))
    assert worker.queues == ["emails", "daily reports"]
