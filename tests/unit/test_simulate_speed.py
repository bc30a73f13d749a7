"""The level's speed (``[Note: the level's speed]`` in ``launch/simulate.py``): the critical-path compute of the
requests alone in the system, measured against simulated, and the level simulated again at that speed."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from hpcsplit.core.load import alone, level_arrivals
from hpcsplit.core.simulator import ServePolicy
from hpcsplit.launch.simulate import (
    MIN_ALONE,
    Predicted,
    Schedule,
    compare_rows,
    measured_alone_paths,
)


def test_a_request_is_alone_when_no_other_is_in_the_system_from_its_arrival_to_its_answer() -> None:
    arr = np.array([0.0, 1.0, 1.5, 3.0, 4.0, 5.0, 5.1])
    done = np.array([0.5, 2.0, 2.2, 3.1, np.nan, 5.05, 5.2])  # request 4 never answered: in the system to the end
    assert alone(arr, done).tolist() == [True, False, False, True, False, False, False]
    assert alone(arr[::-1], done[::-1]).tolist() == [False, False, False, True, False, False, True]  # any order
    assert alone(np.zeros(0), np.zeros(0)).tolist() == []


def _levels(path: Path, levels: dict[str, dict[str, np.ndarray]]) -> None:
    import h5py

    with h5py.File(path, "w") as f:
        for name, cols in levels.items():
            g = f.create_group(name)
            for k, v in cols.items():
                g.create_dataset(k, data=v)


def test_a_benchs_requests_give_each_levels_compute_of_requests_alone_and_damaged_files_give_none(
        tmp_path: Path) -> None:
    sched = Schedule((2.0, 4.0), 5.0, 10, "constant", 0, ServePolicy(), "bench")
    arr = level_arrivals(2.0, 0, 5.0, 10, "constant", 0)
    assert len(arr) == 10
    done = arr + 0.2
    done[3] = arr[4] + 0.1  # 3 and 4 overlap
    path = np.arange(10) * 10.0 + 100.0
    status = np.ones(10, dtype=np.int8)
    status[7] = 2  # failed: not counted
    good = {"arrival_s": arr, "done_s": done, "critical_path_ms": path, "status": status}
    f = tmp_path / "requests.h5"
    _levels(f, {"split/qps_2": good, "whole/qps_2": {**good, "critical_path_ms": path * 2}})
    got = measured_alone_paths(f, sched)
    # alone: 0, 1, 2, 5, 6 -> 100, 110, 120, 150, 160 (7 failed: it counts as in the system to the end)
    assert got == {("split", 2.0): (120.0, 5), ("whole", 2.0): (240.0, 5)}
    assert measured_alone_paths(tmp_path / "none.h5", sched) == {}
    # another bench's requests (other arrivals, or another count) give that level no speed, the others theirs
    shifted = {**good, "arrival_s": arr + 0.01, "done_s": done + 0.01}
    longer = {k: np.concatenate([v, v[-1:]]) for k, v in good.items()}
    for other in (shifted, longer):
        _levels(f, {"split/qps_2": other, "whole/qps_2": good})
        assert measured_alone_paths(f, sched) == {("whole", 2.0): (120.0, 5)}
    for bad in ({**good, "done_s": done[:5]}, {**good, "critical_path_ms": np.array([b"x"] * 10)},
                {k: v for k, v in good.items() if k != "status"}, {**good, "arrival_s": np.zeros((10, 2))},
                {**good, "done_s": arr - 0.1}):
        _levels(f, {"split/qps_2": bad})
        assert measured_alone_paths(f, sched) == {}, bad
    f.write_bytes(b"not hdf5 at all")
    assert measured_alone_paths(f, sched) == {}


def _pred(**kw: float) -> Predicted:
    base = {"variant": "split", "arrival": "poisson", "offered_qps": 2.0, "n_requests": 30, "schedule_qps": 2.1,
            "success_rate": 1.0, "achieved_qps": 2.0, "p50_ms": 75.0, "p90_ms": 80.0, "p99_ms": 90.0, "sim_s": 0.1,
            "path_p50_ms": 70.0, "alone_path_p50_ms": 70.0, "alone_n": 20}
    return Predicted(**{**base, **kw})  # type: ignore[arg-type]


def test_the_levels_speed_is_measured_over_simulated_compute_of_requests_alone_when_both_have_enough() -> None:
    measured = [{"variant": "split", "offered_qps": 2.0, "achieved_qps": 1.9, "p50_ms": 80.0, "p99_ms": 100.0,
                 "success_rate": 1.0, "path_p50_ms": "90"}]
    row = compare_rows([_pred()], measured, "poisson", {("split", 2.0): (84.0, MIN_ALONE)})[0]
    assert row["compute_ratio"] == pytest.approx(1.2) and row["measured_path_p50_ms"] == 90.0
    third = [{**measured[0], "offered_qps": 1 / 3}]  # requests.h5 names the level qps_0.333333
    row = compare_rows([_pred(offered_qps=1 / 3)], third, "poisson", {("split", 0.333333): (84.0, MIN_ALONE)})[0]
    assert row["compute_ratio"] == pytest.approx(1.2)
    for few in (compare_rows([_pred()], measured, "poisson", {("split", 2.0): (84.0, MIN_ALONE - 1)})[0],
                compare_rows([_pred(alone_n=MIN_ALONE - 1)], measured, "poisson", {("split", 2.0): (84.0, 9)})[0],
                compare_rows([_pred()], measured, "poisson")[0]):
        assert math.isnan(few["compute_ratio"])
