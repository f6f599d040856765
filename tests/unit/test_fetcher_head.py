"""What the limited claim takes from the head of the queue, and when it calls the head blocked
(fetcher.read_head: pure logic over lock_head_groups' rows; the SQL is tested against
PostgreSQL in tests/integration/test_limits.py)."""

from __future__ import annotations

from pgqueue.worker.fetcher import read_head


def test_each_groups_first_job_is_taken_when_its_group_is_locked_up_to_the_limit() -> None:
    rows = [
        (1, "t", "a", True, 1),
        (2, "t", "a", True, 1),  # group a's second job: never in the same claim
        (3, "t", "b", False, 1),  # another claimer holds group b
        (4, "t", "c", True, 1),
        (5, "t", "d", True, 1),
    ]
    assert read_head(rows, 10)[:2] == ([1, 4, 5], ["a", "c", "d"])
    assert read_head(rows, 2)[:2] == ([1, 4], ["a", "c"])


def test_what_the_walk_could_take_counts_each_groups_jobs_up_to_its_free_slots() -> None:
    rows = [
        (1, "t", "a", True, 3),
        (2, "t", "a", True, 3),
        (3, "t", "a", True, 3),
        (4, "t", "a", True, 3),  # a has 3 free slots: 3 of its 4 jobs
        (5, "t", "b", False, 0),  # full
        (6, "t", "c", False, -2),  # a limit lowered under what runs: nothing, not less
        (7, "u", "a", True, 1),  # another task's group with the same key
    ]
    ids, _, could, walks = read_head(rows, 10)
    assert ids == [1, 7]
    assert could == 4
    assert not walks


def test_jobs_for_the_walk_are_reported_and_not_taken() -> None:
    rows = [(1, "rated", "a", False, None), (2, "t", "a", True, 1)]
    assert read_head(rows, 10) == ([2], ["a"], 1, True)
    assert read_head([], 10) == ([], [], 0, False)
