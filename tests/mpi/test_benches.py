"""Smoke runs of the MPI benchmarks (``python -m hpcsplit.bench transport|cpu``): they start their own
``mpiexec`` jobs, finish, and print every section and column they promise.  No timing is asserted."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.mpi.jobs import MPIEXEC

pytestmark = pytest.mark.mpi
if MPIEXEC is None:  # pragma: no cover
    pytest.skip("no mpiexec on PATH", allow_module_level=True)


def _bench(*args: str, timeout_s: float = 240.0) -> str:
    p = subprocess.run([sys.executable, "-m", "hpcsplit.bench", *args], check=False, capture_output=True,
                       text=True, timeout=timeout_s)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p.stdout


def test_transport_bench_prints_latency_and_bandwidth_against_raw_and_pickle() -> None:
    out = _bench("transport", "--sizes", "4K,1M", "--iters", "8")
    assert "## latency: ping-pong" in out and "## bandwidth:" in out
    for col in ("raw us", "bare us", "ours us", "pickle us", "raw GB/s", "rawW GB/s", "ours GB/s", "pickle GB/s"):
        assert col in out, col
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("4K", "1M"))]
    assert len(rows) == 4  # both sizes in both tables
    assert "ours/raw bandwidth at >= 1 MiB" in out


def test_cpu_bench_prints_idle_and_wake_up() -> None:
    out = _bench("cpu", "--only", "idle,wake", "--idle-s", "0.5")
    assert "## idle component rank CPU" in out and out.count("target:") >= 2
    assert "100 ms quiet sleeps" in out and "UDP doorbell (20 ms quiet sleeps)" in out
    assert "doorbell     p50" in out and "UDP doorbell p50" in out and "sleep only   p50" in out
    assert "cold wake on this machine" in out and "back to back" in out
