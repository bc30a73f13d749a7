"""Thread share / OMP policy choice and runtime settings validation (pure)."""

from __future__ import annotations

import pytest

from hpcsplit.errors import ConfigError
from hpcsplit.runtime.threads import choose_threads, configure_rank
from hpcsplit.runtime.worker import runtime_settings


def test_thread_precedence() -> None:
    assert choose_threads(None, {}, None, 4, 16) == (4, "cores 16 / 4 ranks on the node")
    assert choose_threads(None, {}, None, 8, 2)[0] == 1
    assert choose_threads(None, {"SLURM_CPUS_PER_TASK": "6"}, None, 4, 64)[0] == 6
    assert choose_threads(None, {"SLURM_CPUS_PER_TASK": "6"}, 2, 4, 64) == (2, "plan")
    assert choose_threads(None, {"OMP_NUM_THREADS": "3"}, 2, 4, 64)[0] == 3
    assert choose_threads(5, {"OMP_NUM_THREADS": "3"}, 2, 4, 64) == (5, "runtime.threads")


def test_configure_rank_sets_env_and_respects_user_policy() -> None:
    env: dict[str, str] = {}
    c = configure_rank({"omp_wait_policy": "passive"}, 2, 4, env)
    assert env["OMP_NUM_THREADS"] == "2" and env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert env["MKL_NUM_THREADS"] == "2" and env["OPENBLAS_NUM_THREADS"] == "2"
    assert c.threads == 2 and "PASSIVE" in c.describe()
    env = {"OMP_WAIT_POLICY": "ACTIVE", "OPENBLAS_NUM_THREADS": "1"}
    c = configure_rank({"omp_wait_policy": "PASSIVE", "threads": 3}, None, 1, env)
    assert env["OMP_WAIT_POLICY"] == "ACTIVE" and c.wait_policy_source == "environment"
    assert env["OMP_NUM_THREADS"] == "3" and env["OPENBLAS_NUM_THREADS"] == "1"
    env = {}
    configure_rank({"omp_wait_policy": None}, 1, 1, env)
    assert "OMP_WAIT_POLICY" not in env


def test_runtime_settings_defaults_and_mode() -> None:
    rt = runtime_settings({"stage": "bench"})
    assert rt["mode"] == "bench" and rt["max_inflight"] == 64
    assert runtime_settings({"stage": "serve", "runtime": {"max_wait_ms": 0}})["mode"] == "batch"
    assert runtime_settings({"stage": "serve", "runtime": {"trace": {"start_step": 3}}})["trace"] == {
        "start_step": 3, "end_step": None}


def test_runtime_settings_lists_every_problem() -> None:
    with pytest.raises(ConfigError) as e:
        runtime_settings({"stage": "serve", "runtime": {"mode": "stream", "max_inflight": 0,
                                                        "request_timeout_s": 0, "doorbell": "udp"}})
    msg = str(e.value)
    assert "runtime.mode='stream'" in msg and "max_inflight=0" in msg and "request_timeout_s=0" in msg
    assert "runtime.doorbell='udp'" in msg and "local" in msg
    assert runtime_settings({"stage": "serve", "runtime": {"doorbell": "local"}})["doorbell"] == "local"


def test_doorbell_settings_are_checked() -> None:
    with pytest.raises(ConfigError) as e:
        runtime_settings({"stage": "serve", "runtime": {"doorbell": 1, "doorbell_network": "10.0.0.300/8"}})
    msg = str(e.value)
    assert "runtime.doorbell=1" in msg and "runtime.doorbell_network='10.0.0.300/8'" in msg and "hsn0" in msg
    ok = runtime_settings({"stage": "serve", "runtime": {"doorbell": False, "doorbell_network": "hsn0"}})
    assert ok["doorbell"] is False and ok["doorbell_network"] == "hsn0"
