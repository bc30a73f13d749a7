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
