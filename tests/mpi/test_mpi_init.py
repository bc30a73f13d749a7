"""MPI_Init under a deadline (``hpcsplit.core.mpi.init_with_deadline``) and the launcher's reading of it.

A PMI server that accepts the rank's connection and never answers is what a lost PMI message looks like
to the rank (Slurm 22.05's pmi2 server misreading a long value): MPI_Init waits for ever.  The rank must
name itself and stop at its deadline, and record it for ``launcher=slurm``'s one retry.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.mpi

REPO = Path(__file__).resolve().parents[2]


def test_a_stuck_mpi_init_is_named_and_stopped_at_its_deadline(tmp_path: Path) -> None:
    pmi = socket.socket()
    pmi.bind(("127.0.0.1", 0))
    pmi.listen(4)  # accepts (the kernel does), never answers
    init_dir = tmp_path / "init"
    env = dict(os.environ, PMI_PORT=f"127.0.0.1:{pmi.getsockname()[1]}", PMI_RANK="1", PMI_SIZE="2",
               HPCSPLIT_MPI_INIT_TIMEOUT_S="3", HPCSPLIT_MPI_INIT_DIR=str(init_dir), PYTHONPATH=str(REPO))
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", "import hpcsplit.core.mpi"], env=env, capture_output=True, text=True,
                       timeout=60, check=False)
    took = time.monotonic() - t0
    pmi.close()
    assert p.returncode == -9, p.stderr[-2000:]
    assert 3 <= took < 30
    assert f"[rank 1] MPI_Init did not finish within 3 s on {socket.gethostname()}" in p.stderr
    assert (init_dir / "rank-1.txt").read_text().split()[0] == "timeout"


def test_a_world_records_ready_and_the_launcher_reads_both(tmp_path: Path) -> None:
    from hpcsplit.launch.local import find_mpiexec
    from hpcsplit.launch.slurm import SubmittedJob, startup_failed

    mpiexec = find_mpiexec()
    folder = tmp_path / "slurm"
    init_dir = folder / "init.42"
    env = dict(os.environ, HPCSPLIT_MPI_INIT_DIR=str(init_dir), PYTHONPATH=str(REPO))
    p = subprocess.run([mpiexec, "-n", "2", sys.executable, "-c",
                        "from hpcsplit.core.mpi import MPI; assert MPI.COMM_WORLD.Get_size() == 2"],
                       env=env, capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    job = SubmittedJob("42", folder, folder / "r.json", "serve", 2, 10, (2,))
    assert sorted(f.read_text().split()[0] for f in init_dir.glob("rank-*.txt")) == ["ready", "ready"]
    assert startup_failed(job) == ""
    (init_dir / "rank-1.txt").write_text("started node2 1.0\n")  # as a rank that aborted in MPI_Init leaves it
    assert startup_failed(job) == "task 1 on node2: MPI_Init did not finish"
