"""The histogram maths behind every latency figure: bins, percentiles, the stated error."""

from __future__ import annotations

import math
import random
import uuid

import pytest

from pgqueue import stats


def test_bins_cover_the_line_without_gaps() -> None:
    for index in range(1, stats.NBINS - 1):
        assert stats.bin_upper(index) == pytest.approx(stats.bin_lower(index + 1))
        assert stats.bin_of(stats.bin_lower(index) * 1.000001) == index
    assert stats.bin_of(0.0) == 0
    assert stats.bin_of(-1.0) == 0
    assert stats.bin_of(math.nan) == 0
    assert stats.bin_of(1e12) == stats.NBINS - 1


@pytest.mark.parametrize("seconds", [0.00015, 0.001, 0.0123, 0.5, 1.0, 7.3, 95.0, 3600.0])
def test_a_value_reads_back_within_the_stated_relative_error(seconds: float) -> None:
    value = stats.bin_value(stats.bin_of(seconds))
    assert abs(value - seconds) / seconds <= stats.RELATIVE_ERROR + 1e-12


def test_stated_error_is_about_nine_percent() -> None:
    assert 0.09 < stats.RELATIVE_ERROR < 0.091


def test_percentiles_of_a_known_sample_match_the_exact_ones_within_the_error() -> None:
    rng = random.Random(7)
    sample = [rng.lognormvariate(-3, 1.2) for _ in range(5000)]
    hist: dict[int, int] = {}
    for value in sample:
        stats.merge(hist, {stats.bin_of(value): 1})
    ordered = sorted(sample)
    for q in (0.5, 0.95, 0.99):
        exact = ordered[math.ceil(q * len(ordered)) - 1]
        got = stats.percentile(hist, q)
        assert got is not None
        assert abs(got - exact) / exact <= stats.RELATIVE_ERROR + 1e-9


def test_percentile_of_an_empty_histogram_is_none() -> None:
    assert stats.percentile({}, 0.5) is None
    assert stats.percentile({3: 0}, 0.5) is None


def test_percentile_picks_the_bin_holding_the_rank() -> None:
    hist = {10: 50, 20: 45, 30: 5}
    assert stats.percentile(hist, 0.5) == stats.bin_value(10)
    assert stats.percentile(hist, 0.95) == stats.bin_value(20)
    assert stats.percentile(hist, 0.96) == stats.bin_value(30)


def test_merge_accepts_the_string_keys_the_table_stores() -> None:
    assert stats.merge({1: 2}, {"1": 3, "4": 1}) == {1: 5, 4: 1}


def test_recorder_counts_outcomes_and_bins_latencies_per_queue() -> None:
    recorder = stats.StatsRecorder("public", uuid.uuid4())
    recorder.record("a", "succeeded", 0.01, 0.2)
    recorder.record("a", "retried", 0.01, None)
    recorder.record("b", "dead", None, 1.0)
    recorder.record("b", "lost", 0.5, 0.5)
    rows = {row["queue"]: row for row in recorder.rows()}
    assert rows["a"]["succeeded"] == 1 and rows["a"]["retried"] == 1
    assert rows["a"]["pickup_hist"] == {str(stats.bin_of(0.01)): 2}
    assert rows["a"]["run_hist"] == {str(stats.bin_of(0.2)): 1}
    assert rows["b"]["dead"] == 1 and rows["b"]["lost"] == 1
    assert sum(rows["b"]["run_hist"].values()) == 2


def test_recorder_refuses_an_unknown_outcome() -> None:
    recorder = stats.StatsRecorder("public", uuid.uuid4())
    with pytest.raises(ValueError, match="outcome"):
        recorder.record("a", "exploded", None, None)
