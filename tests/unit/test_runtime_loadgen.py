"""Arrival schedules, level summaries and the improvement table (pure)."""

from __future__ import annotations

import numpy as np
import pytest

from hpcsplit.runtime.loadgen import arrival_times, format_table, improvement_rows, summarize


def test_constant_arrivals() -> None:
    a = arrival_times(10, 2.0, "constant")
    assert len(a) == 20 and a[1] == pytest.approx(0.1) and a[-1] < 2.0


def test_poisson_arrivals_rate_and_reproducible() -> None:
    a = arrival_times(200, 50.0, "poisson", seed=3)
    assert abs(len(a) / 50.0 - 200) < 10
    assert np.all(np.diff(a) >= 0) and a[0] == 0.0 and a[-1] < 50.0
    np.testing.assert_array_equal(a, arrival_times(200, 50.0, "poisson", seed=3))
    gaps = np.diff(a)
    assert 0.8 < gaps.std() / gaps.mean() < 1.2  # exponential gaps: coefficient of variation 1


def test_bad_arrival_kind() -> None:
    with pytest.raises(ValueError, match="poisson"):
        arrival_times(1, 1, "zipf")


def test_bursty_gaps_vary_twice_as_much_as_poisson_with_the_same_mean() -> None:
    a = arrival_times(200, 50.0, "bursty", seed=3)
    gaps = np.diff(a)
    assert 0.9 < len(a) / (200 * 50) < 1.1
    assert 1.7 < gaps.std() / gaps.mean() < 2.3


def test_summary_counts_failures_and_percentiles() -> None:
    arr = np.arange(10) * 0.1
    done = arr + 0.02
    done[3] = np.nan
    ok = ~np.isnan(done)
    s = summarize("split", 10, arr, done, ok)
    assert s.n_requests == 10 and s.n_ok == 9 and s.success_rate == pytest.approx(0.9)
    assert s.p50_ms == pytest.approx(20.0) and s.p99_ms == pytest.approx(20.0)
    assert s.achieved_qps == pytest.approx(9 / 0.92)
    none = summarize("split", 10, arr, np.full(10, np.nan), np.zeros(10, bool))
    assert none.n_ok == 0 and np.isnan(none.p50_ms)


def test_improvement_rows_and_table() -> None:
    arr = np.arange(4) * 0.5
    w = summarize("whole", 2, arr, arr + 0.100, np.ones(4, bool))
    s = summarize("split", 2, arr, arr + 0.050, np.ones(4, bool))
    rows = improvement_rows([w], [s])
    assert rows[0]["latency_improvement_pct"] == pytest.approx(50.0)
    assert rows[0]["throughput_improvement_pct"] == pytest.approx((1.6 / 1.55 - 1) * 100)
    text = format_table(rows)
    assert "Latency Improvement (%)" in text and "50.00" in text


def test_summary_reports_the_run_critical_path() -> None:
    arr = np.arange(3) * 1.0
    s = summarize("split", 1, arr, arr + 0.2, np.ones(3, bool), np.array([150.0, 160.0, np.nan]))
    assert s.path_p50_ms == pytest.approx(155.0)
    assert s.over_path_p50 == pytest.approx(np.median([200 / 150, 200 / 160]))
    assert np.isnan(summarize("split", 1, arr, arr + 0.2, np.ones(3, bool)).path_p50_ms)


def test_in_run_batch1_compute_keeps_the_window_and_the_variant() -> None:
    from hpcsplit.runtime.benchmark import in_run_batch1_ms

    batch1 = {("split", "vision"): [(10.0, 100.0), (11.0, 120.0), (50.0, 900.0),  # the 900 is outside the window
                                    (12.0, 140.0)],  # (replicas pooled)
              ("split", "text"): [(60.0, 30.0)],  # outside: text has none
              ("whole", "whole"): [(11.0, 500.0)]}
    got = in_run_batch1_ms(batch1, "split", (9.0, 20.0))
    assert got == {"vision": (120.0, 3)}  # replicas pooled, the median of 100, 120, 140
    assert in_run_batch1_ms(batch1, "whole", (9.0, 20.0)) == {"whole": (500.0, 1)}
