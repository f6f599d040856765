"""The job detail page's pure parts: ids as typed, durations, and the order of the reasons."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from pgqueue.dashboard.humanize import duration, relative, timestamp
from pgqueue.dashboard.job_page import JsonValue, parse_job_id
from pgqueue.dashboard.why import reasons

#: job_why's columns for a queued job that nothing holds back: due, one free worker.
FREE: dict[str, Any] = {
    "status": "queued", "due_in": -1.0, "live": 1, "live_queues": [], "serving": 1,
    "slots": 4, "busy": 0, "paused": False, "q_limit": None, "q_rate": None, "q_period": None,
    "q_running": None, "q_used": None, "t_limit": None, "t_rate": None, "t_period": None,
    "per_key": None, "limit_key": None, "t_running": None, "t_used": None, "waiting": None,
    "failed_parent": None, "after_failure": None, "unfinished": None, "task": "t", "known": True,
}  # fmt: skip


def codes(**changes: Any) -> list[str]:
    return [r.code for r in reasons(tuple({**FREE, **changes}.values()))]


@pytest.mark.parametrize(
    ("typed", "expected"),
    [("123", 123), ("#123", 123), (" # 42 ", 42), (str(2**63 - 1), 2**63 - 1), ("0", None),
     ("-1", None), ("1.5", None), ("abc", None), ("", None), (str(2**63), None), ("١٢", None)],
)  # fmt: skip
def test_job_ids_as_typed_or_pasted(typed: str, expected: int | None) -> None:
    assert parse_job_id(typed) == expected


def test_durations_read_like_the_live_panels() -> None:
    assert [duration(s) for s in (0.25, 3.21, 42, 180, 3725, 90000)] == [
        "250 ms", "3.2 s", "42 s", "3m 00s", "1h 02m", "1d 1h"
    ]  # fmt: skip
    now = datetime(2026, 12, 5, 9, 0, tzinfo=UTC)
    assert relative(now + timedelta(minutes=3), now) == "in 3m 00s"
    assert relative(now - timedelta(seconds=5), now) == "5.0 s ago"
    assert timestamp(now) == "2026-12-05 09:00:00.000 UTC" and timestamp(None) == ""


def test_nothing_holds_it_back() -> None:
    assert codes() == ["ready"]


def test_every_reason_that_applies_in_the_order_a_user_acts_on_them() -> None:
    everything = codes(
        status="blocked", waiting=2, live=0, serving=0, paused=True, due_in=60.0,
        q_limit=1, q_running=1, q_rate=5, q_period=60.0, q_used=[5, 12.0],
        t_limit=2, t_running=2, t_rate=1, t_period=60.0, t_used=[1, 30.0], limit_key="",
    )  # fmt: skip
    # A blocked job's run_at is not its due time (its release sets it): no "not due".
    assert everything == ["blocked", "no_worker", "paused", "queue_limit", "queue_rate",
                          "task_limit", "task_rate"]  # fmt: skip
    assert codes(due_in=60.0, serving=1, busy=4) == ["not_due", "workers_busy"]
    # No serving worker has its task: said after the workers' absence, before everything else.
    assert codes(known=False, due_in=60.0, paused=True) == ["unknown_task", "not_due", "paused"]
    assert codes(known=False, serving=0) == ["no_worker_for_queue"]
    assert codes(serving=0, live_queues=["a", "b"]) == ["no_worker_for_queue"]


def test_limits_and_rates_apply_only_when_reached() -> None:
    assert codes(q_limit=3, q_running=2) == ["ready"]
    assert codes(q_rate=5, q_period=60.0, q_used=[4, 10.0]) == ["ready"]
    assert codes(q_rate=5, q_period=60.0, q_used=[None, None]) == ["ready"]  # nothing logged
    (limit_zero,) = reasons(tuple({**FREE, "q_limit": 0, "q_running": 0}.values()))
    assert "limit of 0" in limit_zero.text


def test_a_blocked_jobs_reason_names_its_parents() -> None:
    (reason,) = reasons(
        tuple({**FREE, "status": "blocked", "waiting": 3, "failed_parent": 9,
               "after_failure": "run", "unfinished": [[7, "extract", "running"]]}.values())
    )  # fmt: skip
    assert reason.jobs == ((7, "extract", "running"),)
    assert reason.text.startswith("It runs after other jobs: 3 parents not finished yet.")
    assert "Job #9 failed; this one runs anyway" in reason.text


def test_json_values_are_pretty_or_say_why_not() -> None:
    assert JsonValue.of('{"a": [1, 2]}', 20).text == '{\n  "a": [\n    1,\n    2\n  ]\n}'
    assert JsonValue.of('{"é": "<b>"}', 20).text == '{\n  "é": "<b>"\n}'  # escaped by the page
    big = JsonValue.of(None, 70000)
    assert big.too_large and big.text is None
    assert not JsonValue.of(None, None).too_large
