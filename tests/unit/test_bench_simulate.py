"""``python -m hpcsplit.bench simulate``'s stage runner: a stage past its timeout leaves no process behind."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from hpcsplit.bench import simulate as bench_simulate

# a launcher that starts a process in a session of its own (as mpiexec's proxies do) and waits for ever
LAUNCHER = """
import subprocess, sys, time
p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
open(sys.argv[1], "w").write(str(p.pid))
time.sleep(600)
"""


def test_a_stage_past_its_timeout_is_stopped_with_every_process_below_it(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_simulate, "STOP_GRACE_S", 0.5)
    pid_file = tmp_path / "grandchild.pid"
    cmd = [sys.executable, "-c", LAUNCHER, str(pid_file)]
    t0 = time.monotonic()
    with pytest.raises(SystemExit, match="timed out after 2 s"):
        bench_simulate._run(cmd, tmp_path / "log", dict(os.environ), 2.0)
    assert time.monotonic() - t0 < 30
    grandchild = int(pid_file.read_text())
    for _ in range(50):  # (SIGKILL is delivered at once; the process is reaped by init soon after)
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        stat = Path(f"/proc/{grandchild}/stat")
        if stat.exists() and stat.read_text().rsplit(")", 1)[-1].split()[0] == "Z":
            break  # a zombie: dead, waiting to be reaped
        time.sleep(0.1)
    else:
        os.kill(grandchild, 9)
        pytest.fail(f"process {grandchild}, in a session of its own below the stage, outlived it")


def test_benches_are_merged_by_level_not_by_row() -> None:
    def row(variant: str, qps: float, p50: float) -> dict[str, str]:
        return {"variant": variant, "offered_qps": str(qps), "saturated": "False", "predicted_p50_ms": "1.0",
                "predicted_p99_ms": "2.0", "predicted_qps": str(qps), "measured_p50_ms": str(p50),
                "measured_p99_ms": "2.0", "measured_qps": str(qps)}

    first = [row("whole", 4, 1.1), row("split", 4, 1.2), row("split", 32, 1.3)]
    second = [row("split", 4, 2.2), row("whole", 4, 2.1)]  # another order, and a level it did not reach
    rows = bench_simulate._merge("toy", [first, second])
    assert [r["meas_p50_ms"] for r in rows] == [[1.1, 2.1], [1.2, 2.2], [1.3]]
