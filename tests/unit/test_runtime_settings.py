"""Thread share / OMP policy choice and the runtime and bench settings (pure)."""

from __future__ import annotations

import pytest

from hpcsplit.errors import ConfigError
from hpcsplit.runtime.settings import (
    BenchSettings,
    FaultSettings,
    RuntimeSettings,
    TraceSettings,
    stage_settings,
)
from hpcsplit.runtime.threads import choose_threads, configure_rank


def test_thread_precedence() -> None:
    assert choose_threads(None, {}, None, 4, 16) == (4, "cores 16 / 4 ranks on the node")
    assert choose_threads(None, {}, None, 8, 2)[0] == 1
    assert choose_threads(None, {"SLURM_CPUS_PER_TASK": "6"}, None, 4, 64)[0] == 6
    assert choose_threads(None, {"SLURM_CPUS_PER_TASK": "6"}, 2, 4, 64) == (2, "plan")
    assert choose_threads(None, {"OMP_NUM_THREADS": "3"}, 2, 4, 64)[0] == 3
    assert choose_threads(5, {"OMP_NUM_THREADS": "3"}, 2, 4, 64) == (5, "runtime.threads")


def test_configure_rank_sets_env_and_respects_user_policy() -> None:
    env: dict[str, str] = {}
    c = configure_rank(None, "passive", 2, 4, env)
    assert env["OMP_NUM_THREADS"] == "2" and env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert env["MKL_NUM_THREADS"] == "2" and env["OPENBLAS_NUM_THREADS"] == "2"
    assert c.threads == 2 and "PASSIVE" in c.describe()
    env = {"OMP_WAIT_POLICY": "ACTIVE", "OPENBLAS_NUM_THREADS": "1"}
    c = configure_rank(3, "PASSIVE", None, 1, env)
    assert env["OMP_WAIT_POLICY"] == "ACTIVE" and c.wait_policy_source == "environment"
    assert env["OMP_NUM_THREADS"] == "3" and env["OPENBLAS_NUM_THREADS"] == "1"
    env = {}
    configure_rank(None, None, 1, 1, env)
    assert "OMP_WAIT_POLICY" not in env


def _rt(stage: str = "serve", **runtime: object) -> RuntimeSettings:
    return RuntimeSettings.from_config({"stage": stage, "runtime": runtime})


def test_runtime_settings_defaults_and_mode() -> None:
    rt = RuntimeSettings.from_config({"stage": "bench"})
    assert rt.mode == "bench" and rt.max_inflight == 64 and rt.doorbell is True  # conf/runtime/default.yaml
    assert _rt(max_wait_ms=0).mode == "batch"
    assert _rt("bench", mode="batch").mode == "batch"
    assert _rt(trace={"start_step": 3}).trace == TraceSettings(start_step=3, end_step=None)
    assert _rt(threads=None).threads is None and _rt(threads=4).threads == 4
    assert _rt(max_inflight=None).max_inflight == 64  # null: the default, as before
    assert _rt(omp_wait_policy=None).omp_wait_policy is None  # null: OpenMP's own default
    assert _rt(omp_wait_policy="active").omp_wait_policy == "ACTIVE"
    assert _rt(fault={"component": "a", "kind": "sleep", "after_batches": 2}).fault == FaultSettings(
        component="a", kind="sleep", after_batches=2, sleep_s=1.0, times=1)


def test_runtime_settings_lists_every_problem() -> None:
    with pytest.raises(ConfigError) as e:
        _rt(mode="stream", max_inflight=0, request_timeout_s=0, doorbell="udp")
    msg = str(e.value)
    assert "runtime.mode = 'stream'" in msg and "max_inflight = 0" in msg and "request_timeout_s = 0" in msg
    assert "runtime.doorbell = 'udp'" in msg and "local" in msg
    assert _rt(doorbell="local").doorbell == "local"


def test_unknown_keys_are_refused_with_the_closest_one() -> None:
    with pytest.raises(ConfigError) as e:
        _rt(max_infligth=3, trace={"start": 1}, fault={"component": "a", "kind": "boom"})
    msg = str(e.value)
    assert "runtime.max_infligth is not a setting (did you mean 'max_inflight'?)" in msg
    assert "runtime.trace.start is not a setting" in msg and "runtime.fault.kind = 'boom'" in msg
    with pytest.raises(ConfigError, match=r"bench.duration is not a setting \(did you mean 'duration_s'\?\)"):
        BenchSettings.from_config({"bench": {"duration": 3}})


def test_doorbell_settings_are_checked() -> None:
    with pytest.raises(ConfigError) as e:
        _rt(doorbell=1, doorbell_network="10.0.0.300/8")
    msg = str(e.value)
    assert "runtime.doorbell = 1" in msg and "runtime.doorbell_network = '10.0.0.300/8'" in msg and "hsn0" in msg
    ok = _rt(doorbell=False, doorbell_network="hsn0")
    assert ok.doorbell is False and ok.doorbell_network == "hsn0"


def test_bench_settings() -> None:
    b = BenchSettings.from_config({"bench": {"qps": 5, "request_timeout_s": None}})
    assert b.qps == (5.0,) and b.request_timeout_s is None and b.arrival == "poisson"
    assert BenchSettings.from_config({"bench": {"qps": [1, 2.5]}}).qps == (1.0, 2.5)
    with pytest.raises(ConfigError) as e:
        BenchSettings.from_config({"bench": {"qps": [], "duration_s": 0, "arrival": "burst", "min_requests": -1}})
    msg = str(e.value)
    assert "bench.qps = []" in msg and "bench.duration_s = 0" in msg and "bench.arrival = 'burst'" in msg
    assert "bench.min_requests = -1" in msg


def test_both_groups_problems_come_together() -> None:
    with pytest.raises(ConfigError) as e:
        stage_settings({"stage": "bench", "runtime": {"max_inflight": 0}, "bench": {"qps": [-1]}})
    assert "runtime.max_inflight = 0" in str(e.value) and "bench.qps = [-1]" in str(e.value)


@pytest.mark.parametrize("threads", [0, -1, 100000, 2.5, "4", True])
def test_threads_must_be_a_real_count(threads: object) -> None:
    with pytest.raises(ConfigError, match=r"runtime.threads = .*needs an integer in \[1, 1024\] or null"):
        stage_settings({"stage": "serve", "runtime": {"threads": threads}})
