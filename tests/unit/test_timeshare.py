"""CPU time-sharing: replicas of the bottleneck on an oversubscribed node (hpcsplit/allocation/timeshare.py)."""

from __future__ import annotations

import math

import pytest

from hpcsplit.allocation.results import Option, Replica
from hpcsplit.allocation.solve import allocate
from hpcsplit.allocation.synthetic import make_profile
from hpcsplit.allocation.timeshare import FRONTEND_S_PER_REQUEST, add_timeshared_replicas, pipeline_rate
from hpcsplit.allocation.to_plan import validate_plan
from hpcsplit.core.cluster import ClusterSpec

# a CLIP-like CPU profile: ms at batch 1 with one thread (vision ~0.7 of the whole, head almost free)
CLIP_MS = {"vision": 118.0, "text": 43.0, "head": 0.2}


def _opt(c: str, rps: float, threads: int = 1, mem: float = 1e8) -> Option:
    return Option(c, 1, float(threads), float(threads), rps, 1e3 / rps, mem, threads / 2)


def _cpu_cluster(cores: int, mem_gb: float = 16) -> ClusterSpec:
    return ClusterSpec.from_config(
        {"name": "vm", "nodes": 1, "gpus_per_node": 0, "cores_per_node": cores, "mem_gb_per_node": mem_gb,
         "cpu_threads": [1]}
    )


def _clip_profile(mem: float = 3e8):
    return make_profile(
        {c: {"latency_ms": [[ms]], "peak_mem_bytes": [[mem]], "utilization": [[0.5]]} for c, ms in CLIP_MS.items()},
        batch_sizes=(1,), slices=(1.0,), device_kind="cpu",
    )


def test_rate_is_the_lower_of_replicas_and_cores() -> None:
    w = {"a": 1.0, "b": 1.0}
    rate, bound, ceiling = pipeline_rate([("a", 10.0, 1), ("b", 1000.0, 1)], w, 2)
    assert bound == 10.0 and rate == 10.0
    assert ceiling == pytest.approx(2 / (0.1 + 0.001 + FRONTEND_S_PER_REQUEST))
    # one core: the cores are the limit, a second replica of "a" cannot help
    rate1, bound1, ceiling1 = pipeline_rate([("a", 10.0, 1), ("a", 10.0, 1), ("b", 1000.0, 1)], w, 1)
    assert bound1 == 20.0 and rate1 == ceiling1 < 10.0


def test_bottleneck_gets_replicas_until_the_cores_are_the_limit() -> None:
    reps = [Replica(0, None, i, _opt(c, 1e3 / ms)) for i, (c, ms) in enumerate(CLIP_MS.items())]
    w = dict.fromkeys(CLIP_MS, 1.0)
    out, ts = add_timeshared_replicas(reps, w, cores=2, mem_bytes=8e9)
    assert ts is not None and ts.added == {"vision": 1}
    assert [r.option.component for r in out].count("vision") == 2
    assert [r.slot for r in out] == [0, 1, 2, 3]
    # before: one vision replica, 8.5 req/s; after: the two cores (161 ms of work a request) are the limit
    assert ts.rate_before == pytest.approx(1e3 / 118.0)
    assert ts.rate_after == pytest.approx(ts.core_ceiling) and ts.rate_after > 12.0
    # with 8 cores the replicas stay the limit for longer: more vision replicas, then text ones
    out8, ts8 = add_timeshared_replicas(reps, w, cores=8, mem_bytes=8e9)
    n = {c: [r.option.component for r in out8].count(c) for c in CLIP_MS}
    assert n["vision"] >= 5 and n["text"] >= 2 and n["head"] == 1
    assert ts8 is not None and ts8.rate_after > 40


def test_memory_and_zero_weights_stop_the_pass() -> None:
    reps = [Replica(0, None, i, _opt(c, 1e3 / ms, mem=1e9)) for i, (c, ms) in enumerate(CLIP_MS.items())]
    w = dict.fromkeys(CLIP_MS, 1.0)
    out, ts = add_timeshared_replicas(reps, w, cores=2, mem_bytes=3.5e9)  # room for 3 replicas only
    assert ts is None and out == reps
    out, ts = add_timeshared_replicas(reps, {**w, "vision": 0.0}, cores=2, mem_bytes=8e9)
    assert "vision" not in (ts.added if ts else {})


def test_allocate_shares_an_oversubscribed_node_and_the_plan_validates() -> None:
    prof, cl = _clip_profile(), _cpu_cluster(cores=2)
    al = allocate(prof, cl)
    n = {c: sum(r.option.component == c for r in al.replicas) for c in CLIP_MS}
    assert n == {"vision": 2, "text": 1, "head": 1}
    assert al.throughput_rps["vision"] == pytest.approx(2 * 1e3 / 118.0)
    assert al.solve["timeshare"]["added"] == {"vision": 1}
    assert any("time-sharing" in s for s in al.solve["notes"])
    assert al.solve["oversubscribed_cores"] == 3  # 4 one-thread ranks where 1 core was left after the frontend
    plan = al.to_plan()
    assert plan.world_size == 5 and [r.replica for r in plan.ranks if r.component == "vision"] == [0, 1]
    validate_plan(plan, prof, cl)
    # switched off: one rank per component, as before
    off = allocate(prof, cl, cpu_timeshare=False)
    assert len(off.replicas) == 3 and "timeshare" not in off.solve
    assert math.isclose(off.throughput_rps["vision"], 1e3 / 118.0)


def test_a_node_with_enough_cores_is_left_to_the_milp() -> None:
    al = allocate(_clip_profile(), _cpu_cluster(cores=8))
    assert "timeshare" not in al.solve and al.solve["oversubscribed_cores"] == 0
